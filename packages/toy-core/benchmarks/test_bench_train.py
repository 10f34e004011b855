"""Training speed and memory: toy's ``TrainEngine`` side by side with a
float32 PyTorch llama of the same shape, in the same run, same threads
(2, or ``$TOY_BENCH_THREADS``), same batch, same starting weights.

Shapes (``SHAPES``): the ``tiny`` preset (vocabulary 1024) and the ``small``
preset (8192) at B=8, T=128, and full-parameter training at SmolLM2-135M's
shape (preset ``smollm2-135m``, vocabulary 49152) at T=128 and T=256, each
with B=1 and B=4.
``TOY_BENCH_QUICK=1`` skips the 135M shapes and times fewer steps.

Each side runs in a process of its own (this file run as a script with
``--side toy|torch``), so each one's peak RSS is its own; the protocol is the
inference benchmark's: one JSON object per stdout line, commands on stdin.
A side imports its framework, notes its RSS (the start), draws the
starting weights with ``toy.train.model.init_params(cfg, 0)`` (the torch side
copies the same NumPy arrays into its module, then both drop them), builds
its model and optimizer, runs ``WARMUP`` (2) untimed steps (toy builds its
step graph on the first) and prints ``ready``. Per shape the toy side is
started and warmed up, then the torch side; then ``ROUNDS`` (2) rounds of
``K / ROUNDS`` timed steps alternate (toy, torch, toy, torch) with a 0.5 s
pause before each, so both see the same machine noise. A figure is the
median over a side's K step times.

- toy: ``TrainEngine(ArchTrain(cfg), params, toy_ggml.Runtime("cpu",
  threads=N), OptimConfig(lr=1e-3), batch=B, context=T)``, the config built
  as ``toy.train.lmrun`` does (RoPE "normal" over the whole head, tied output,
  RMS eps 1e-5); a step is ``engine.train_step([batch], 1e-3)`` (batch
  uploads, one graph: forward, cross-entropy, backward, global-norm clip at
  1.0, ggml's AdamW; the loss and the norm read back).
- torch: an ``nn.Module`` llama (``nn.Embedding``, ``nn.RMSNorm``,
  bias-free ``nn.Linear`` projections, RoPE on pairs (2i, 2i+1) as toy's
  "normal" mode, GQA by ``repeat_interleave`` of K/V heads and
  ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU FFN, head tied to
  the embedding), ``F.cross_entropy``, ``torch.optim.AdamW(lr=1e-3,
  betas=(0.9, 0.95), weight_decay=0.1, fused=True)`` (the fused kernel: the
  default multi-tensor AdamW frees and maps its temporaries every step, which
  cost it seconds per step at 135M on this kind of VM, a cost of the default
  and not of PyTorch at its best) with weight decay on the matrices
  only as toy's default (norm gains and the embedding in a group with 0),
  ``clip_grad_norm_(..., 1.0)``, ``torch.set_num_threads(N)``; a step is
  zero_grad, forward, loss, backward, clip, optimizer step, ``loss.item()``.
  Both sides have the same parameter count (asserted).

Both train on the same seeded random token batches (tokens, targets one
ahead, ``loss_mask`` ones, ``pos`` 0..T-1 per row, ``doc`` zeros), a new one
per step; the records carry both sides' first and last losses (the same
weights and data: they should agree to float32 noise, a check that both
train the same model).

Figures per shape: step time (ms; ratio toy / torch, target <= 1), training
tokens/s (B*T / step time) and peak RSS growth (the process's peak,
``VmHWM``, minus its RSS after the imports: weights, optimizer state,
activations, graphs, and the NumPy starting weights while they are copied
in; target toy <= torch). ``VmHWM`` rather than ``ru_maxrss``: a child's
``ru_maxrss`` starts at its parent's (pytest's) peak, carried over fork and
exec. The step-time record also splits each step: toy's ggml compute
(``Runtime.compute``), scheduler allocation and the rest (batch upload: the
dense one-hot label matrix (B*T, V) and the (B, 1, T, T) mask; Python), the
size of toy's step graph (ggml synchronizes its threads after every node)
and its most frequent ops; torch's forward + loss, backward, clip and
optimizer step; and each side's minor page faults per step (memory freed
and mapped again every step: each fault costs a kernel entry, a lot more in
some virtual machines). The RSS record adds each side's peak over the timed
steps alone (``VmHWM`` reset through ``/proc/self/clear_refs`` after the
warm-up, minus the RSS at the start) when the kernel allows it. The step-time
record also carries toy's per-op profile of one more step, taken after the
memory figures (``toy_profile_top``: the 12 costliest ops with their node
counts, milliseconds and shares; ``TrainEngine.profile_step`` runs the nodes one
at a time, so ``toy_profile_total_ms`` is above a timed step's compute and the
shares are the point). Targets are recorded
with ``met``; a missed target does not fail the benchmark, an error does.
The whole run takes about 10 minutes on 2 idle cores (about 1 minute with
``TOY_BENCH_QUICK=1``); on a busy machine much longer: both sides slow down
a lot when other processes compete for the cores (toy's and torch's thread
pools spin at every barrier), which the alternation spreads over both sides
but does not remove.

GPT-2 (``test_train_step_gpt2``, shapes ``GPT2_SHAPES``): the same protocol,
figures and records (names prefixed ``gpt2``) for ``toy.models.gpt2``'s
``tiny`` (vocabulary 1024) and ``small`` (8192) presets at B=8, T=128, the
config built as ``toy train from-scratch --arch gpt2`` does
(``model_config(ModelShape(arch="gpt2", preset=...))``: as many learned
positions as the context, tied head, LayerNorm eps 1e-5). toy trains
``TrainEngine(ArchTrain(cfg), ...)`` as above; the torch side is the plain
float32 ``nn.Module`` GPT-2 of ``bench_gpt2_torch.py`` (next to this file:
``nn.LayerNorm``, fused biased QKV ``nn.Linear``,
``scaled_dot_product_attention(is_causal=True)``, tanh GELU, tied head)
with the same fused AdamW, decay on toy's decayed tensors only (the matrix
and residual weights; not embeddings, positions, norms or biases), clip
and step. Here the first warm-up losses (the same weights and batch, before
any update) are asserted equal within ``GPT2_LOSS_RTOL`` (float32
arithmetic, and ggml's GELU reads a float16 table), which proves both sides
start from the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import pytest

from toy_testsupport.bench_side import Side, alternate

pytestmark = pytest.mark.bench

THIS = Path(__file__).resolve()
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
QUICK = os.environ.get("TOY_BENCH_QUICK", "") not in ("", "0")
WARMUP = 2
ROUNDS = 2  # toy, torch, toy, torch
LR = 1e-3
SEED = 0
SETTLE_S = 0.5
SIDE_TIMEOUT_S = 1800  # a side still running after this is killed (the test then fails)

# (preset, vocabulary, batch, context, timed steps per side (K))
SHAPES = [
    ("tiny", 1024, 8, 128, 6 if QUICK else 20),
    ("small", 8192, 8, 128, 4 if QUICK else 10),
]
if not QUICK:
    SHAPES += [
        ("smollm2-135m", 49152, 1, 128, 8),
        ("smollm2-135m", 49152, 1, 256, 6),
        ("smollm2-135m", 49152, 4, 128, 4),
        ("smollm2-135m", 49152, 4, 256, 4),
    ]
# GPT-2 (toy.models.gpt2.PRESETS): (preset, vocabulary, batch, context, timed steps per side)
GPT2_SHAPES = [
    ("tiny", 1024, 8, 128, 6 if QUICK else 12),
    ("small", 8192, 8, 128, 4 if QUICK else 8),
]
GPT2_LOSS_RTOL = 1e-4  # first losses, toy vs torch (float32; ggml's GELU reads a float16 table)


# ---------------------------------------------------------------- shared by both sides


def llama_config(preset: str, vocab: int, context: int):
    """The LlamaConfig of a preset, as ``toy train`` builds it."""
    from toy.train.config import ModelShape
    from toy.train.model import model_config

    return model_config(ModelShape(preset=preset), vocab, context)


def arch_config(arch: str, preset: str, vocab: int, context: int):
    """The training config of ``arch``'s preset (llama: ``llama_config``)."""
    if arch == "llama":
        return llama_config(preset, vocab, context)
    from toy.train.config import ModelShape
    from toy.train.model import model_config

    return model_config(ModelShape(arch=arch, preset=preset), vocab, context)


def Batch(vocab: int, batch: int, context: int, step: int):
    """One (B, T) training batch as toy's engine reads it: the seeded random
    tokens of ``toy_testsupport.bench_models.RandomTokenBatch`` (seed [SEED, step])."""
    from toy_testsupport.bench_models import RandomTokenBatch

    assert SEED == 0  # RandomTokenBatch draws from default_rng([0, step])
    return RandomTokenBatch(step, vocab, batch, context)


def maxrss_bytes() -> int:
    """``ru_maxrss`` (Linux: KiB). Not the figure: a child inherits its
    parent's peak through fork and exec, so this starts at pytest's RSS."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- the toy side


class _Timed:
    """Stands in for the engine's runtime: times ``allocate`` and ``compute``."""

    def __init__(self, runtime):
        self._runtime = runtime
        self.compute_s = 0.0
        self.allocate_s = 0.0

    def allocate(self, graph) -> None:
        t0 = time.perf_counter()
        self._runtime.allocate(graph)
        self.allocate_s += time.perf_counter() - t0

    def compute(self, graph, **kw):
        t0 = time.perf_counter()
        out = self._runtime.compute(graph, **kw)
        self.compute_s += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._runtime, name)


class ToySide:
    name = "toy"

    def __init__(self, cfg, params, batch: int, context: int, threads: int):
        import toy_ggml
        from toy.train.model import ArchTrain
        from toy.train.optim import OptimConfig
        from toy.train.stepgraph import TrainEngine

        runtime = toy_ggml.Runtime("cpu", threads=threads)
        self.engine = TrainEngine(ArchTrain(cfg), params, runtime, OptimConfig(lr=LR), batch=batch, context=context)
        self.runtime = self.engine.runtime = _Timed(runtime)  # the engine's steps go through it
        self.n_params = int(sum(_prod(s.shape) for s in self.engine.specs))
        self.version = _version("toy-core")

    def step(self, b: Batch) -> tuple[float, dict]:
        c0, a0 = self.runtime.compute_s, self.runtime.allocate_s
        t0 = time.perf_counter()
        res = self.engine.train_step([b], LR)
        total = time.perf_counter() - t0
        compute = self.runtime.compute_s - c0
        alloc = self.runtime.allocate_s - a0
        split = {"ggml_compute": compute, "sched_allocate": alloc, "upload_and_python": total - compute - alloc}
        return res.loss, split

    def profile(self, b: Batch) -> dict:
        """One more step with every node timed (``TrainEngine.profile_step``):
        the ops ranked by time. Nodes then run one at a time, so the total is
        above a timed step's compute; the shares show where the step goes."""
        from toy.train.stepgraph import profile_summary

        _, nodes = self.engine.profile_step([b], LR)
        return {
            "profile_top": profile_summary(nodes, top=12),
            "profile_nodes": len(nodes),
            "profile_total_ms": round(1e3 * sum(sec for *_, sec in nodes), 2),
        }

    def describe(self) -> dict:
        """The step graph's size: ggml synchronizes its threads after every node."""
        graph = self.engine._graphs["single"].graph
        ops: dict[str, int] = {}
        for t in graph.nodes:
            ops[str(t.op)] = ops.get(str(t.op), 0) + 1
        top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
        return {"graph_nodes": graph.n_nodes, "graph_top_ops": top}


# ---------------------------------------------------------------- the torch side


def torch_model(cfg):
    """A plain float32 llama ``nn.Module`` of ``cfg`` (toy's LlamaConfig)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, Hkv, D, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model

    class Rope(nn.Module):
        """Pairs (2i, 2i+1) turned by pos * base^(-2i/D) (toy's "normal" mode)."""

        def __init__(self, context: int):
            super().__init__()
            theta = cfg.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            ang = torch.arange(context, dtype=torch.float64)[:, None] * theta  # (T, D/2)
            self.register_buffer("cos", torch.cos(ang).float()[None, :, None, :], persistent=False)
            self.register_buffer("sin", torch.sin(ang).float()[None, :, None, :], persistent=False)

        def forward(self, x):  # (B, T, heads, D)
            T = x.shape[1]
            c, s = self.cos[:, :T], self.sin[:, :T]
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self, rope: Rope):
            super().__init__()
            self.rope = rope
            self.attn_norm = nn.RMSNorm(d, eps=cfg.rms_eps)
            self.q = nn.Linear(d, H * D, bias=False)
            self.k = nn.Linear(d, Hkv * D, bias=False)
            self.v = nn.Linear(d, Hkv * D, bias=False)
            self.o = nn.Linear(H * D, d, bias=False)
            self.ffn_norm = nn.RMSNorm(d, eps=cfg.rms_eps)
            self.gate = nn.Linear(d, cfg.d_ff, bias=False)
            self.up = nn.Linear(d, cfg.d_ff, bias=False)
            self.down = nn.Linear(cfg.d_ff, d, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = self.rope(self.q(h).view(B, T, H, D)).transpose(1, 2)  # (B, H, T, D)
            k = self.rope(self.k(h).view(B, T, Hkv, D)).transpose(1, 2)
            v = self.v(h).view(B, T, Hkv, D).transpose(1, 2)
            if H != Hkv:  # query head h reads kv head h // (H / Hkv)
                k = k.repeat_interleave(H // Hkv, dim=1)
                v = v.repeat_interleave(H // Hkv, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(B, T, H * D))
            h = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.n_vocab, d)
            rope = Rope(cfg.context_length)
            self.blocks = nn.ModuleList(Block(rope) for _ in range(cfg.n_layer))
            self.norm = nn.RMSNorm(d, eps=cfg.rms_eps)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.norm(x), self.embed.weight)  # tied head

    return Llama()


def gguf_to_torch_names(cfg) -> dict[str, str]:
    """toy's (GGUF) parameter names -> the torch module's."""
    out = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight"}
    per = {
        "attn_norm": "attn_norm",
        "attn_q": "q",
        "attn_k": "k",
        "attn_v": "v",
        "attn_output": "o",
        "ffn_norm": "ffn_norm",
        "ffn_gate": "gate",
        "ffn_up": "up",
        "ffn_down": "down",
    }
    for i in range(cfg.n_layer):
        for g, t in per.items():
            out[f"blk.{i}.{g}.weight"] = f"blocks.{i}.{t}.weight"
    return out


class TorchSide:
    name = "torch"

    def __init__(self, cfg, params, batch: int, context: int, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        gpt2 = getattr(cfg, "architecture", "llama") == "gpt2"
        if gpt2:
            import bench_gpt2_torch  # this folder: the side runs this file as a script
        with torch.no_grad():
            model = bench_gpt2_torch.torch_model(cfg) if gpt2 else torch_model(cfg)
            names = bench_gpt2_torch.gguf_to_torch_names(cfg) if gpt2 else gguf_to_torch_names(cfg)
            own = dict(model.named_parameters())
            if sorted(names.values()) != sorted(own):
                raise AssertionError(f"parameter names differ: {sorted(set(own) ^ set(names.values()))[:4]}")
            for g, t in names.items():
                own[t].copy_(torch.from_numpy(params[g]))
        if gpt2:  # toy's rule: matrix and residual weights (not embeddings, positions, norms, biases)
            decayed = bench_gpt2_torch.decayed_names(cfg)
            decay = [p for n, p in model.named_parameters() if n in decayed]
            no_decay = [p for n, p in model.named_parameters() if n not in decayed]
        else:
            decay = [p for n, p in model.named_parameters() if p.ndim == 2 and n != "embed.weight"]
            no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n != "embed.weight")]
        self.model = model
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=True,  # PyTorch's fastest CPU AdamW: the peer at its best (see the module docstring)
        )
        self.n_params = int(sum(p.numel() for p in self.params))
        self.version = torch.__version__

    def describe(self) -> dict:
        return {}

    def step(self, b: Batch) -> tuple[float, dict]:
        torch = self.torch
        F = torch.nn.functional
        t0 = time.perf_counter()
        tokens = torch.from_numpy(b.tokens).long()
        targets = torch.from_numpy(b.targets).long()
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        t3 = time.perf_counter()
        self.opt.step()
        value = loss.item()
        t4 = time.perf_counter()
        return value, {"forward_loss": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "optimizer": t4 - t3}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def side_main(argv: list[str]) -> None:
    """One side's process: build, warm up, then serve ``steps K`` / ``done``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("toy", "torch"), required=True)
    ap.add_argument("--arch", default="llama", help="an architecture family of toy.models (llama, gpt2)")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args(argv)

    import gc

    import numpy as np  # noqa: F401 - imported before the start figure, as both sides use it

    if args.side == "torch":
        import torch  # noqa: F401
    else:
        import toy_ggml  # noqa: F401
        from toy.train.stepgraph import TrainEngine  # noqa: F401
    from toy.train.model import init_params

    rss_start = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    cfg = arch_config(args.arch, args.preset, args.vocab, args.context)
    params = init_params(cfg, SEED)
    cls = ToySide if args.side == "toy" else TorchSide
    side = cls(cfg, params, args.batch, args.context, args.threads)
    del params
    gc.collect()
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step_no = 0
    warm_losses = []
    for _ in range(WARMUP):
        loss, _ = side.step(Batch(args.vocab, args.batch, args.context, step_no))
        warm_losses.append(loss)
        step_no += 1
    warmup_s = time.perf_counter() - t0
    setup_hwm = proc_status_bytes("VmHWM")  # peak of the imports, setup and warm-up
    hwm_reset = reset_hwm()

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    emit(
        {
            "ready": True,
            "side": side.name,
            "version": side.version,
            "n_params": side.n_params,
            "setup_s": setup_s,
            "warmup_s": warmup_s,
            "warmup_losses": warm_losses,
            **side.describe(),
        }
    )
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "steps":
            times, losses, splits, faults = [], [], [], []
            for _ in range(int(cmd[1])):
                b = Batch(args.vocab, args.batch, args.context, step_no)  # not timed
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                loss, split = side.step(b)
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                losses.append(loss)
                splits.append(split)
                step_no += 1
            emit({"times": times, "losses": losses, "splits": splits, "page_faults": faults})
        elif cmd[0] == "done":
            steps_hwm = proc_status_bytes("VmHWM")
            figures = {
                "rss_start": rss_start,
                "peak": max(setup_hwm, steps_hwm),
                "steps_peak": steps_hwm if hwm_reset else None,
                "rss_end": proc_status_bytes("VmRSS"),
                "maxrss": maxrss_bytes(),
                "steps_done": step_no,
            }
            if hasattr(side, "profile"):  # after the memory figures: a profiled step is not a timed one
                figures.update(side.profile(Batch(args.vocab, args.batch, args.context, step_no)))
            emit(figures)
            return


# ---------------------------------------------------------------- the benchmark


def side_env() -> dict:
    """The environment of a side: BLAS/OpenMP pools sized to the benchmark's threads."""
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(THREADS)
    return env


def run_shape(preset: str, vocab: int, batch: int, context: int, k: int, logdir: Path, arch: str = "llama") -> dict:
    args = ["--preset", preset, "--vocab", str(vocab), "--batch", str(batch), "--context", str(context)]
    args += ["--threads", str(THREADS)]
    if arch != "llama":
        args += ["--arch", arch]
    sides: dict[str, Side] = {}
    out: dict = {"ready": {}, "runs": {"toy": [], "torch": []}, "done": {}}
    per_round = [k // ROUNDS + (1 if r < k % ROUNDS else 0) for r in range(ROUNDS)]
    try:
        for name in ("toy", "torch"):  # one after the other: the warm-ups do not overlap
            sides[name] = Side(
                name,
                [sys.executable, str(THIS), "--side", name, *args],
                logdir,
                timeout_s=SIDE_TIMEOUT_S,
                env=side_env(),
            )
            out["ready"][name] = sides[name].read()
        alternate(sides, per_round, SETTLE_S, out)
    finally:
        for side in sides.values():
            side.close()
    return out


def _collect(runs: list[dict]) -> tuple[list[float], list[float], dict[str, float], float]:
    """A side's step times, losses, median split (ms) and median minor page faults per step."""
    times = [t for r in runs for t in r["times"]]
    losses = [v for r in runs for v in r["losses"]]
    keys = runs[0]["splits"][0].keys()
    split = {f"{key}_ms": 1e3 * statistics.median([s[key] for r in runs for s in r["splits"]]) for key in keys}
    faults = statistics.median([f for r in runs for f in r["page_faults"]])
    return times, losses, split, faults


@pytest.mark.parametrize(
    "preset,vocab,batch,context,k",
    SHAPES,
    ids=[f"{p}-B{b}-T{t}" for p, _, b, t, _ in SHAPES],
)
def test_train_step(record, tmp_path, preset, vocab, batch, context, k):
    report(record, tmp_path, preset, vocab, batch, context, k)


@pytest.mark.parametrize(
    "preset,vocab,batch,context,k",
    GPT2_SHAPES,
    ids=[f"gpt2-{p}-B{b}-T{t}" for p, _, b, t, _ in GPT2_SHAPES],
)
def test_train_step_gpt2(record, tmp_path, preset, vocab, batch, context, k):
    ready = report(record, tmp_path, preset, vocab, batch, context, k, arch="gpt2")
    # the same weights and batch before any update: the same loss, to float32 noise
    first = {side: ready[side]["warmup_losses"][0] for side in ("toy", "torch")}
    assert first["toy"] == pytest.approx(first["torch"], rel=GPT2_LOSS_RTOL), first


def _rel_diff(ready: dict) -> float:
    """|toy - torch| / |torch| of the first warm-up losses (the records round them to 4 digits)."""
    a, b = ready["toy"]["warmup_losses"][0], ready["torch"]["warmup_losses"][0]
    return abs(a - b) / abs(b)


def report(record, tmp_path, preset, vocab, batch, context, k, arch: str = "llama") -> dict:
    """Run both sides on one shape and print its records; returns the sides'
    ``ready`` answers. ``arch`` other than llama prefixes the figure names."""
    res = run_shape(preset, vocab, batch, context, k, tmp_path, arch)
    ready, done = res["ready"], res["done"]
    n_params = ready["toy"]["n_params"]
    assert n_params == ready["torch"]["n_params"], (n_params, ready["torch"]["n_params"])

    toy_t, toy_loss, toy_split, toy_faults = _collect(res["runs"]["toy"])
    torch_t, torch_loss, torch_split, torch_faults = _collect(res["runs"]["torch"])
    assert all(t > 0 for t in toy_t + torch_t)
    toy_ms, torch_ms = 1e3 * statistics.median(toy_t), 1e3 * statistics.median(torch_t)
    tokens = batch * context
    peer = f"PyTorch {ready['torch']['version']} (float32 nn.Module, AdamW)"
    shape_name = f"{preset}, B={batch}, T={context}" if arch == "llama" else f"{arch} {preset}, B={batch}, T={context}"
    context_ = {
        "threads": THREADS,
        **({} if arch == "llama" else {"arch": arch}),
        "preset": preset,
        "vocab": vocab,
        "batch": batch,
        "context": context,
        "tokens_per_step": tokens,
        "n_params": n_params,
        "steps": k,
        "warmup_steps": WARMUP,
        "rounds": ROUNDS,
        "quick": QUICK,
        "loadavg_1m": [res["loadavg_before"], res["loadavg_after"]],
        "cpus": os.cpu_count(),
    }
    record(
        "train",
        figure=f"train step time, {shape_name}",
        value=toy_ms,
        unit="ms",
        **context_,
        peer=peer,
        peer_value=torch_ms,
        ratio=toy_ms / torch_ms,
        better="lower",
        target="toy / torch <= 1.0",
        met=toy_ms / torch_ms <= 1.0,
        toy_split_ms=toy_split,
        torch_split_ms=torch_split,
        toy_page_faults_per_step=toy_faults,
        torch_page_faults_per_step=torch_faults,
        toy_runs_ms=[1e3 * t for t in toy_t],
        torch_runs_ms=[1e3 * t for t in torch_t],
        toy_setup_s=ready["toy"]["setup_s"],
        torch_setup_s=ready["torch"]["setup_s"],
        toy_warmup_s=ready["toy"]["warmup_s"],
        torch_warmup_s=ready["torch"]["warmup_s"],
        loss_first={"toy": ready["toy"]["warmup_losses"][0], "torch": ready["torch"]["warmup_losses"][0]},
        **({} if arch == "llama" else {"loss_first_rel_diff": _rel_diff(ready)}),
        loss_last={"toy": toy_loss[-1], "torch": torch_loss[-1]},
        toy_graph_nodes=ready["toy"].get("graph_nodes"),
        toy_graph_top_ops=ready["toy"].get("graph_top_ops"),
        toy_profile_top=done["toy"].get("profile_top"),
        toy_profile_total_ms=done["toy"].get("profile_total_ms"),
    )
    toy_tps, torch_tps = 1e3 * tokens / toy_ms, 1e3 * tokens / torch_ms
    record(
        "train",
        figure=f"training tokens/s, {shape_name}",
        value=toy_tps,
        unit="tokens/s",
        **context_,
        peer=peer,
        peer_value=torch_tps,
        ratio=toy_tps / torch_tps,
        better="higher",
    )

    def steps_growth(d: dict) -> int | None:
        return d["steps_peak"] - d["rss_start"] if d["steps_peak"] is not None else None

    toy_rss, torch_rss = (
        done["toy"]["peak"] - done["toy"]["rss_start"],
        done["torch"]["peak"] - done["torch"]["rss_start"],
    )
    record(
        "train",
        figure=f"peak RSS growth, {shape_name}",
        value=toy_rss,
        unit="bytes",
        **context_,
        peer=peer,
        peer_value=torch_rss,
        ratio=toy_rss / torch_rss if torch_rss > 0 else None,
        better="lower",
        target="toy <= torch",
        met=toy_rss <= torch_rss,
        f32_params_bytes=4 * n_params,
        toy_steps_peak_growth=steps_growth(done["toy"]),
        torch_steps_peak_growth=steps_growth(done["torch"]),
        toy_peak=done["toy"]["peak"],
        torch_peak=done["torch"]["peak"],
        toy_rss_start=done["toy"]["rss_start"],
        torch_rss_start=done["torch"]["rss_start"],
        note="growth: the process's peak (VmHWM) minus its RSS after the imports; steps_peak_growth: the peak "
        "over the timed steps alone (VmHWM reset after the warm-up) minus the same start",
    )
    return ready


if __name__ == "__main__":
    side_main(sys.argv[1:])
