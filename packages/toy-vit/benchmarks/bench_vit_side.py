"""One side of toy-vit's benchmarks (``test_bench_vit.py``), run as a
script in a process of its own, so its peak RSS is its own.

``prepare --preset P --dir D``: a seeded random Hugging Face
``ViTForImageClassification`` of preset P's shape (``toy_vit.config.PRESETS``;
Hugging Face's own initialisation after ``torch.manual_seed(SEED)``, exact
erf GELU, LayerNorm eps 1e-12) saved with ``save_pretrained`` in ``D/hf``
and converted with ``toy_vit.convert.convert_hf`` to ``D/model.gguf``: both
sides load the same weights from these.

``--side toy|torch --mode infer|train --preset P --dir D --batch B
--threads N``: the protocol of toy-core's ``bench_side.Side`` (one JSON
object per stdout line, commands on stdin). The side imports its framework,
notes its RSS (the start), loads the model, warms up (untimed), prints
``ready`` and then answers ``steps K`` (K timed calls or steps) and ``done``
(its peak RSS, ``VmHWM``).

- infer, toy: ``toy_vit.load(D/model.gguf, threads=N)``; a call is
  ``clf.logits(pixels)`` (patchify, upload, one compute, read back).
- infer, torch: ``ViTForImageClassification.from_pretrained(D/hf,
  attn_implementation=ATTN)`` (SDPA: PyTorch's fastest attention), float32,
  eval, ``torch.set_num_threads(N)``; a call is ``model(pixel_values=
  torch.from_numpy(pixels)).logits`` under ``torch.inference_mode()``.
  Both sides run the same seeded pixels (``pixels(cfg, B)``) on every call;
  the warm-up's logits are written to ``D/<side>-infer-B<B>.npy`` (the
  parent compares them).
- train, toy: ``TrainEngine(ViTTrainModel(cfg), weights of the GGUF,
  Runtime("cpu", threads=N), OptimConfig(lr=LR), batch=B, context=1,
  label_smoothing=LABEL_SMOOTHING)``; a step is ``engine.train_step([batch],
  LR)`` (upload, one graph: forward, cross-entropy, backward, global-norm
  clip at 1.0, ggml's AdamW, loss and norm read back).
- train, torch: the Hugging Face model above in train mode (its dropouts
  are 0), ``F.cross_entropy(logits, labels, label_smoothing=...)``,
  ``clip_grad_norm_(..., 1.0)``, ``torch.optim.AdamW(lr=LR, betas=(0.9,
  0.95), eps=1e-8, fused=True)`` with toy's weight decay 0.1 on toy's
  decayed tensors only (the matrices: patch embedding, projections, head;
  not the class token, positions, norms or biases); a step is zero_grad,
  forward, loss, backward, clip, step, ``loss.item()``.
  Both train on the same seeded batches (``train_batch(cfg, B, step)``: random
  pixels, random labels, a new batch per step, made outside the timing).

The RSS helpers and the compute/allocate timer are toy-core's training
benchmark's (``packages/toy-core/benchmarks/test_bench_train.py``), imported
from there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

THIS = Path(__file__).resolve()
ROOT = THIS.parents[3]
sys.path.insert(0, str(ROOT / "packages" / "toy-core" / "benchmarks"))  # test_bench_train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 0
LR = 1e-3
LABEL_SMOOTHING = 0.0
ATTN = "sdpa"  # the peer's attention: PyTorch's scaled_dot_product_attention
WARMUP = {"infer": 3, "train": 2}


# ---------------------------------------------------------------- shared by both sides


def vit_config(preset: str):
    from toy_vit.config import ViTConfig

    return ViTConfig.preset(preset)


def pixels(cfg, batch: int, seed: int = SEED):
    """Normalised-looking pixels F32 (B, C, S, S), seeded by (seed, batch)."""
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    S, C = cfg.image_size, cfg.n_channels
    return rng.standard_normal((batch, C, S, S)).astype(np.float32)


class TrainBatch:
    """One training batch as toy's engine reads it (``toy_vit.train.ClassBatch``'s fields)."""

    def __init__(self, cfg, batch: int, step: int):
        import numpy as np

        rng = np.random.default_rng([SEED, 1, step])
        S, C = cfg.image_size, cfg.n_channels
        self.pixels = rng.standard_normal((batch, C, S, S)).astype(np.float32)
        self.targets = rng.integers(0, cfg.n_classes, batch).astype(np.int32)
        self.loss_mask = np.ones(batch, np.float32)


def prepare(preset: str, folder: Path) -> dict:
    """The seeded random HF model (``folder/hf``) and its GGUF (``folder/model.gguf``)."""
    import torch
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification

    from toy_vit.convert import convert_hf

    cfg = vit_config(preset)
    hf_cfg = HFConfig(
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        num_channels=cfg.n_channels,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        intermediate_size=cfg.d_ff,
        num_labels=cfg.n_classes,
        hidden_act="gelu",
        layer_norm_eps=cfg.norm_eps,
        qkv_bias=True,
    )
    torch.manual_seed(SEED)
    model = ViTForImageClassification(hf_cfg).eval()
    model.save_pretrained(folder / "hf", safe_serialization=True)
    path = convert_hf(folder / "hf", folder / "model.gguf")
    return {"preset": preset, "n_params": int(sum(p.numel() for p in model.parameters())), "gguf": str(path)}


# ---------------------------------------------------------------- inference


class ToyInfer:
    name = "toy"

    def __init__(self, folder: Path, threads: int):
        from test_bench_train import _Timed

        import toy_vit

        self.clf = toy_vit.load(folder / "model.gguf", threads=threads)
        self._runtime = self.clf.runtime
        self.timed = _Timed(self._runtime)  # logits() computes through it once its graph is built
        self.cfg = self.clf.config
        self.version = _version("toy-vit")

    def call(self, x):
        if self.clf.runtime is self._runtime and self.clf._graphs:  # the graph is built (it allocates on the
            self.clf.runtime = self.timed  # real runtime): time the computes from here on
        c0 = self.timed.compute_s
        t0 = time.perf_counter()
        out = self.clf.logits(x)
        total = time.perf_counter() - t0
        compute = self.timed.compute_s - c0
        return out, {"ggml_compute": compute, "patchify_upload_read": total - compute}

    def describe(self) -> dict:
        (_cin, _ops, graph, *_rest) = next(iter(self.clf._graphs.values()))
        return _graph_info(graph)


class TorchInfer:
    name = "torch"

    def __init__(self, folder: Path, threads: int):
        import torch
        from transformers import ViTForImageClassification

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = ViTForImageClassification.from_pretrained(
            folder / "hf", attn_implementation=ATTN, dtype=torch.float32
        ).eval()
        self.version = torch.__version__

    def call(self, x):
        torch = self.torch
        with torch.inference_mode():
            out = self.model(pixel_values=torch.from_numpy(x)).logits.numpy()
        return out, {}

    def describe(self) -> dict:
        return {"attn_implementation": self.model.config._attn_implementation}


# ---------------------------------------------------------------- training


class ToyTrain:
    name = "toy"

    def __init__(self, folder: Path, batch: int, threads: int):
        from test_bench_train import _Timed

        import toy_ggml
        from toy.train.optim import OptimConfig
        from toy.train.stepgraph import TrainEngine
        from toy_vit.gguf_io import read_gguf
        from toy_vit.train import ViTTrainModel

        self.cfg, weights = read_gguf(folder / "model.gguf")
        runtime = toy_ggml.Runtime("cpu", threads=threads)
        model = ViTTrainModel(self.cfg)
        self.engine = TrainEngine(
            model,
            {s.name: weights[s.name] for s in model.param_specs()},
            runtime,
            OptimConfig(lr=LR),
            batch=batch,
            context=1,
            label_smoothing=LABEL_SMOOTHING,
        )
        del weights
        self.runtime = self.engine.runtime = _Timed(runtime)
        self.n_params = int(sum(_prod(s.shape) for s in self.engine.specs))
        self.version = _version("toy-vit")

    def step(self, b: TrainBatch):
        c0, a0 = self.runtime.compute_s, self.runtime.allocate_s
        t0 = time.perf_counter()
        res = self.engine.train_step([b], LR)
        total = time.perf_counter() - t0
        compute = self.runtime.compute_s - c0
        alloc = self.runtime.allocate_s - a0
        return res.loss, {
            "ggml_compute": compute,
            "sched_allocate": alloc,
            "upload_and_python": total - compute - alloc,
        }

    def describe(self) -> dict:
        return _graph_info(self.engine._graphs["single"].graph)


class TorchTrain:
    name = "torch"

    def __init__(self, folder: Path, batch: int, threads: int):
        import torch
        from transformers import ViTForImageClassification

        torch.set_num_threads(threads)
        self.torch = torch
        model = ViTForImageClassification.from_pretrained(
            folder / "hf", attn_implementation=ATTN, dtype=torch.float32
        ).train()
        named = list(model.named_parameters())
        # toy's decayed kinds ("matrix", "residual"): every weight matrix (and the patch kernel), not
        # the class token, position table, norms or biases
        decay = [p for n, p in named if n.endswith(".weight") and p.ndim >= 2]
        no_decay = [p for n, p in named if not (n.endswith(".weight") and p.ndim >= 2)]
        self.model = model
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=True,
        )
        self.n_params = int(sum(p.numel() for p in self.params))
        self.n_decay = len(decay)
        self.version = torch.__version__

    def step(self, b: TrainBatch):
        torch = self.torch
        F = torch.nn.functional
        t0 = time.perf_counter()
        x = torch.from_numpy(b.pixels)
        y = torch.from_numpy(b.targets).long()
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(pixel_values=x).logits
        loss = F.cross_entropy(logits, y, label_smoothing=LABEL_SMOOTHING)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        t3 = time.perf_counter()
        self.opt.step()
        value = loss.item()
        t4 = time.perf_counter()
        return value, {"forward_loss": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "optimizer": t4 - t3}

    def describe(self) -> dict:
        return {"attn_implementation": self.model.config._attn_implementation, "decayed_tensors": self.n_decay}


# ---------------------------------------------------------------- helpers


def _graph_info(graph) -> dict:
    """The graph's size (ggml synchronizes its threads after every node) and its most frequent ops."""
    ops: dict[str, int] = {}
    for t in graph.nodes:
        ops[t.op] = ops.get(t.op, 0) + 1
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
    return {"graph_nodes": graph.n_nodes, "graph_top_ops": top}


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


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def side_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("toy", "torch"), required=True)
    ap.add_argument("--mode", choices=("infer", "train"), required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args(argv)

    import numpy as np
    from test_bench_train import maxrss_bytes, proc_status_bytes, reset_hwm

    if args.side == "torch":
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import ViTForImageClassification  # noqa: F401
    else:
        import toy_ggml  # noqa: F401
        import toy_vit  # noqa: F401
        from toy.train.stepgraph import TrainEngine  # noqa: F401

    rss_start = proc_status_bytes("VmRSS")
    cfg = vit_config(args.preset)
    t0 = time.perf_counter()
    if args.mode == "infer":
        side = (ToyInfer if args.side == "toy" else TorchInfer)(args.dir, args.threads)
    else:
        side = (ToyTrain if args.side == "toy" else TorchTrain)(args.dir, args.batch, args.threads)
    gc.collect()
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    ready: dict = {"ready": True, "side": side.name, "version": side.version, "setup_s": setup_s}
    step_no = 0
    if args.mode == "infer":
        x = pixels(cfg, args.batch)
        for i in range(WARMUP["infer"]):
            out, _ = side.call(x)
            if i == 0:
                np.save(args.dir / f"{side.name}-infer-B{args.batch}.npy", out)
    else:
        ready["n_params"] = side.n_params
        losses = []
        for _ in range(WARMUP["train"]):
            loss, _ = side.step(TrainBatch(cfg, args.batch, step_no))
            losses.append(loss)
            step_no += 1
        ready["warmup_losses"] = losses
    ready["warmup_s"] = time.perf_counter() - t0
    setup_hwm = proc_status_bytes("VmHWM")
    hwm_reset = reset_hwm()
    emit({**ready, **side.describe()})

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "steps":
            times, splits, losses, faults = [], [], [], []
            for _ in range(int(cmd[1])):
                b = TrainBatch(cfg, args.batch, step_no) if args.mode == "train" else None  # not timed
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                if b is None:
                    _, split = side.call(x)
                else:
                    loss, split = side.step(b)
                    losses.append(loss)
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                splits.append(split)
                step_no += 1
            emit({"times": times, "losses": losses, "splits": splits, "page_faults": faults})
        elif cmd[0] == "done":
            steps_hwm = proc_status_bytes("VmHWM")
            emit(
                {
                    "rss_start": rss_start,
                    "peak": max(setup_hwm, steps_hwm),
                    "steps_peak": steps_hwm if hwm_reset else None,
                    "rss_end": proc_status_bytes("VmRSS"),
                    "maxrss": maxrss_bytes(),
                    "steps_done": step_no,
                }
            )
            return


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("--preset", required=True)
        ap.add_argument("--dir", type=Path, required=True)
        a = ap.parse_args(sys.argv[2:])
        emit(prepare(a.preset, a.dir))
    else:
        side_main(sys.argv[1:])
