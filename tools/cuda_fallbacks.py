#!/usr/bin/env python3
"""Generate docs/reference/cuda-fallbacks.md: the nodes of toy's graphs that the CUDA backend would leave to the CPU.

For every graph toy builds (prefill, decode, batched decode, the exact-batching engine's, each training recipe's
step, GRPO's rollouts, perplexity, toy-vit's training step and inference) the tool asks the CUDA backend's own
``supports_op`` rules, node by node, which it would refuse: ggml's scheduler runs those nodes on the CPU and copies
their inputs and outputs between the devices. Nothing is written by hand: the graphs are the ones toy builds, and
the rules are the CUDA module's, asked through ggml's backend registry.

How:

- The rules: toy patch 0024 exposes the body of the CUDA backend's ``supports_op`` as a function of the node and a
  compute capability, ``toy_cuda_supports_op``, which the CUDA registry hands out through ``get_proc_address``
  (``toy_ggml._core.proc_address``). Built without VMM, the CUDA module loads on a machine without a GPU or a driver
  and registers no device, so the question is asked without one, for each compute capability in ``CCS``.
- The graphs: each workload (``WORKLOADS``) runs on tiny models on the CPU with ``toy_ggml.Runtime`` replaced by
  ``_RecordingRuntime``, which walks every graph it is asked to compute before computing it. It reports
  ``cpu_gemm`` False, as a runtime on a GPU does, so the graph builders build what they would build for the GPU
  (no toy-GEMM hints, patch 0011); everything else is the CPU's graph. The models are small but keep the shapes
  the rules look at: 64-wide attention heads, as SmolLM2-135M's (flash attention's rules depend on the head size).
- Each distinct graph of a workload (by its nodes' ops, types and shapes) is asked once. Besides the refused nodes,
  the page lists the nodes that carry toy's switches which the CUDA kernels ignore (patch 0004/0015's row-invariant
  products, patch 0020's row-invariant flash attention): they run on the GPU, without the promise.

What it assumes: every tensor lives on the GPU (the scheduler also runs a node on the CPU when its weight lives in
host memory and the batch is small: toy uploads weights to the device it runs on); the build has kernels for the
compute capability asked (``CCS`` is the default CMAKE_CUDA_ARCHITECTURES of the plugin).

Output is deterministic (no timestamps, no paths). ``--check`` regenerates in memory and exits 1 when the committed
page differs. ``--json PATH`` also writes the full record (every graph, every refused node).

Usage: ``python tools/cuda_fallbacks.py [--lib libggml-cuda.so] [--check] [--json out.json] [--only NAME ...]``.
The CUDA module: ``--lib``, else ``$TOY_CUDA_LIB``, else the installed ``toy_ggml_cuda`` package's, else
``build/cuda/ggml-cmake/bin/libggml-cuda.so`` of this checkout; exit 2 with the reason when none loads.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, or loaded by path in tests
from _pages import write_or_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs/reference/cuda-fallbacks.md")
BUILD_LIB = Path("build/cuda/ggml-cmake/bin/libggml-cuda.so")
ENV_LIB = "TOY_CUDA_LIB"
#: compute capabilities asked (ggml's encoding: 100 * major + 10 * minor), the plugin's default architectures
CCS = (800, 860, 890, 900)
#: the registry's name for toy patch 0024's query
PROC = "toy_cuda_supports_op"

#: ops that only describe memory (the scheduler never runs them)
VIEW_OPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})
#: ggml_op_hint values toy adds (include/ggml.h, patches 0004 and 0011), in a product's op_params[1]
HINT_ROW_INVARIANT = 2
HINT_TOY_GEMM = 3

#: a node -> whether the rules accept it for a compute capability: (node address, cc) -> bool
Rules = Callable[[int, int], bool]


class FallbackError(Exception):
    """A condition the tool cannot work around (no CUDA module, a module without patch 0024)."""


# -- the rules ---------------------------------------------------------------------------------------


def _cuda_lib_candidates(explicit: str | None) -> list[Path]:
    if explicit:
        return [Path(explicit)]
    if os.environ.get(ENV_LIB):
        return [Path(os.environ[ENV_LIB])]
    out = []
    if importlib.util.find_spec("toy_ggml_cuda") is not None:
        import toy_ggml_cuda  # the plugin package (packages/toy-ggml-cuda)

        out.append(Path(toy_ggml_cuda.library_path()))
    out.append(ROOT / BUILD_LIB)
    return out


def _preload_nvidia_libs() -> None:
    """Load the CUDA runtime and cuBLAS from NVIDIA's wheels (``nvidia/cu13/lib`` in site-packages), globally,
    so that a CUDA module whose run path does not reach them (one in a build folder) finds them loaded."""
    for entry in sys.path:
        lib = Path(entry) / "nvidia" / "cu13" / "lib"
        if lib.is_dir():
            for name in ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"):
                if (lib / name).is_file():
                    ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
            return


def cuda_rules(lib: str | None = None) -> tuple[Rules, str]:
    """The CUDA backend's supports_op rules (toy patch 0024) and where the module came from. A CUDA backend
    toy_ggml registered already (the installed plugin) is used as it is; otherwise the first module found
    (see the module docstring) is loaded. FallbackError with the reason when none can be."""
    from toy_ggml import GGMLError, _core

    try:
        addr = _core.proc_address("CUDA", PROC)
        where = "the CUDA backend toy_ggml registered"
        if addr == 0:
            raise FallbackError(
                f"the CUDA plugin toy_ggml loaded has no {PROC} (built without toy patch 0024); rebuild it "
                "(`just cuda`), or name a module with --lib (TOY_GGML_CUDA=0 keeps toy_ggml from loading the plugin)"
            )
    except GGMLError:
        tried = []
        addr, where = 0, ""
        for path in _cuda_lib_candidates(lib):
            if not path.is_file():
                tried.append(f"{path} (no such file)")
                continue
            _preload_nvidia_libs()
            try:
                name = _core.load_backend(str(path))
            except GGMLError as e:
                tried.append(f"{path} ({e})")
                continue
            addr = _core.proc_address(name, PROC)
            where = path.name
            if addr == 0:
                raise FallbackError(f"{path} has no {PROC}: it was built without toy patch 0024") from None
            break
        else:
            raise FallbackError("no CUDA module could be loaded: " + "; ".join(tried)) from None
    fn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int)(addr)

    def rules(node: int, cc: int) -> bool:
        return bool(fn(node, cc))

    return rules, where


# -- walking a graph ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One node of a graph, as the rules see it."""

    index: int
    address: int
    op: str  # ggml_op_name, "UNARY:<name>" or "GLU:<name>"
    dtype: str
    ne: tuple[int, ...]
    contiguous: bool
    srcs: tuple[tuple[str, tuple[int, ...], bool], ...]  # (type, ne, contiguous) of each source
    op_params: tuple[int, ...]

    def describe(self) -> str:
        """``OP TYPE[ne] <- (TYPE[ne], ...)``; a source that is not contiguous is marked ``~``."""

        def one(dtype: str, ne: tuple[int, ...], contiguous: bool) -> str:
            return f"{dtype}[{','.join(map(str, _trim(ne)))}]{'' if contiguous else '~'}"

        args = ", ".join(one(*s) for s in self.srcs)
        return f"{self.op} {one(self.dtype, self.ne, self.contiguous)} <- ({args})"

    def toy_switch(self) -> str | None:
        """The toy switch this node carries that the CUDA kernels ignore, or None."""
        if self.op in ("MUL_MAT", "MUL_MAT_ID") and self.op_params[1] == HINT_ROW_INVARIANT:
            return f"{self.op} row-invariant hint (patch {'0004' if self.op == 'MUL_MAT' else '0015'})"
        if self.op == "MUL_MAT" and self.op_params[1] == HINT_TOY_GEMM:
            return "MUL_MAT toy-GEMM hint (patch 0011)"
        if self.op == "FLASH_ATTN_EXT" and self.op_params[4] == 1:
            return "FLASH_ATTN_EXT row-invariant switch (patch 0020)"
        return None


def _trim(ne: Sequence[int]) -> tuple[int, ...]:
    ne = tuple(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


def walk(graph: Any) -> list[Node]:
    """The nodes of a toy_ggml.Graph in compute order (ggml_graph_node), views included."""
    out = []
    for i, t in enumerate(graph.nodes):
        srcs = tuple((s.dtype.name, tuple(s.ne), bool(s.is_contiguous)) for s in t.sources)
        out.append(Node(i, t.address, t.op, t.dtype.name, tuple(t.ne), bool(t.is_contiguous), srcs, tuple(t.op_params)))
    return out


def signature(nodes: Sequence[Node]) -> tuple:
    """What makes two graphs the same for the rules: each node's op, types, shapes and op parameters."""
    return tuple((n.op, n.dtype, n.ne, n.srcs, n.op_params) for n in nodes)


@dataclass
class GraphReport:
    """One distinct graph of a workload and what the rules say of it."""

    workload: str
    role: str
    n_nodes: int  # nodes the scheduler runs (views and leaves left out)
    computes: int = 1  # how many times the workload computed a graph like it
    variants: int = 1  # distinct graphs merged into this row (same ops and answers, other shapes: a longer cache)
    # cc -> op -> (count, first node's description)
    refused: dict[int, dict[str, tuple[int, str]]] = field(default_factory=dict)
    switches: dict[str, int] = field(default_factory=dict)  # toy switch -> count

    def counts(self) -> dict[int, dict[str, int]]:
        """cc -> op -> refused nodes (without the examples)."""
        return {cc: {op: c for op, (c, _) in ops.items()} for cc, ops in self.refused.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "role": self.role,
            "nodes": self.n_nodes,
            "computes": self.computes,
            "variants": self.variants,
            "refused": {
                str(cc): {op: {"count": c, "example": ex} for op, (c, ex) in sorted(ops.items())}
                for cc, ops in self.refused.items()
            },
            "toy_switches_ignored": dict(sorted(self.switches.items())),
        }


def role_of(nodes: Sequence[Node]) -> str:
    """What a graph does, from its ops: a training step (an optimizer node), gradients (backward ops), or a
    forward pass (logits)."""
    ops = {n.op for n in nodes}
    if ops & {"OPT_STEP_ADAMW", "OPT_STEP_ADAMW_SCALED", "OPT_STEP_SGD"}:
        return "step (forward, backward, AdamW)"
    if any(n.op.endswith("_BACK") or n.op == "OUT_PROD" for n in nodes):
        return "gradients (forward, backward)"
    return "forward"


def ask(nodes: Sequence[Node], rules: Rules, ccs: Sequence[int], workload: str, role: str) -> GraphReport:
    """Ask the rules about every node the scheduler would run."""
    run = [n for n in nodes if n.op not in VIEW_OPS]
    rep = GraphReport(workload, role, len(run))
    for cc in ccs:
        refused: dict[str, tuple[int, str]] = {}
        for n in run:
            if not rules(n.address, cc):
                c, ex = refused.get(n.op, (0, n.describe()))
                refused[n.op] = (c + 1, ex)
        rep.refused[cc] = refused
    rep.switches = dict(Counter(s for n in run if (s := n.toy_switch()) is not None))
    return rep


# -- recording the graphs toy computes ----------------------------------------------------------------


class Recorder:
    """Collects the distinct graphs computed while ``phase`` names a workload."""

    def __init__(self, rules: Rules, ccs: Sequence[int]):
        self.rules, self.ccs = rules, tuple(ccs)
        self.phase = ""
        self.reports: list[GraphReport] = []
        self._seen: dict[tuple[str, tuple], GraphReport] = {}

    def see(self, graph: Any) -> None:
        if not self.phase:
            return
        nodes = walk(graph)
        key = (self.phase, signature(nodes))
        if key in self._seen:
            self._seen[key].computes += 1
            return
        rep = ask(nodes, self.rules, self.ccs, self.phase, role_of(nodes))
        for old in self.reports:  # the same graph at another length: one row
            if (old.workload, old.role, old.n_nodes, old.counts(), old.switches) == (
                rep.workload,
                rep.role,
                rep.n_nodes,
                rep.counts(),
                rep.switches,
            ):
                old.computes += 1
                old.variants += 1
                self._seen[key] = old
                return
        self._seen[key] = rep
        self.reports.append(rep)


@contextmanager
def recording(rec: Recorder) -> Iterator[None]:
    """``toy_ggml.Runtime`` replaced by a subclass that shows every graph to ``rec`` before computing it and
    answers ``cpu_gemm`` as a runtime on a GPU does (False)."""
    import toy_ggml

    base = toy_ggml.Runtime

    class _RecordingRuntime(base):  # type: ignore[misc, valid-type]
        @property
        def cpu_gemm(self) -> bool:
            return False

        def compute(self, graph, profile=False):
            rec.see(graph)
            return super().compute(graph, profile)

    toy_ggml.Runtime = _RecordingRuntime
    try:
        yield
    finally:
        toy_ggml.Runtime = base


# -- the workloads ----------------------------------------------------------------------------------

#: the tiny models' shape: 64-wide heads (as SmolLM2-135M), two layers, grouped-query attention
SHAPE = {"model.d_model": 128, "model.n_layer": 2, "model.n_head": 2, "model.n_head_kv": 1, "model.d_ff": 256}
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "pixel", "quartz", "ember")


def _common(out: Path, steps: int = 2) -> dict[str, Any]:
    return {
        "steps": steps,
        "batch_size": 2,
        "context": 32,
        "eval_every": 0,
        "save_every": 0,
        "sample_tokens": 0,
        "out": str(out),
        "threads": 1,
        "seed": 3,
    }


@dataclass
class Files:
    """What the workloads share: a from-scratch base (F32, with its tokenizer), its Q4_0 copy, data files."""

    tmp: Path
    base: Path | None = None
    q4: Path | None = None


def _run(recipe: str, base: Path, data: Path, out: Path, **kw) -> None:
    from toy.train.config import defaults, override
    from toy.train.lmrun import train

    values = {"base": str(base), "data.paths": [str(data)], **_common(out), **kw}
    res = train(override(defaults(recipe), **values))
    if res.reason != "completed":
        raise FallbackError(f"the {recipe} run stopped early: {res.reason}")


def w_pretrain(rec: Recorder, f: Files) -> None:
    import random

    from toy.gguf import quantize_model
    from toy.train.config import defaults, override
    from toy.train.lmrun import train

    rng = random.Random(0)
    corpus = f.tmp / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(300)))
    rec.phase = "pretrain (from-scratch)"
    values = {"data.paths": [str(corpus)], "tokenizer.vocab_size": 300, **SHAPE, **_common(f.tmp / "scratch")}
    f.base = Path(train(override(defaults(), **values)).checkpoint)
    rec.phase = ""
    f.q4 = f.tmp / "base-q4_0.gguf"
    quantize_model(f.base, f.q4, "q4_0")
    rows = []
    for i in range(24):
        a, b = WORDS[i % len(WORDS)], WORDS[(i * 5 + 1) % len(WORDS)]
        rows.append({"prompt": f"say {a} twice:", "completion": f" {a} {a}.", "chosen": f" {a} {a}."})
        rows[-1]["rejected"] = f" {b} {a} {b}."
    (f.tmp / "sft.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("prompt", "completion")}) + "\n" for r in rows)
    )
    (f.tmp / "pairs.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows)
    )
    (f.tmp / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n" for w in WORDS)
    )


def _need(f: Files) -> tuple[Path, Path]:
    if f.base is None or f.q4 is None:
        raise FallbackError("the fine-tuning workloads need the pretrain workload's base (run it first)")
    return f.base, f.q4


def w_lora(rec: Recorder, f: Files) -> None:
    base, _ = _need(f)
    rec.phase = "SFT, LoRA"
    _run("lora", base, f.tmp / "sft.jsonl", f.tmp / "lora")


def w_qlora(rec: Recorder, f: Files) -> None:
    _, q4 = _need(f)
    rec.phase = "SFT, QLoRA (Q4_0 base)"
    _run("lora", q4, f.tmp / "sft.jsonl", f.tmp / "qlora")


def w_full(rec: Recorder, f: Files) -> None:
    base, _ = _need(f)
    rec.phase = "full fine-tune"
    _run("full", base, f.tmp / "sft.jsonl", f.tmp / "full")


def w_dpo(rec: Recorder, f: Files) -> None:
    base, _ = _need(f)
    rec.phase = "DPO (LoRA)"
    _run("dpo", base, f.tmp / "pairs.jsonl", f.tmp / "dpo", **{"data.val_fraction": 0.0})


def w_grpo(rec: Recorder, f: Files) -> None:
    base, _ = _need(f)
    rec.phase = "GRPO (LoRA; rollouts and step)"
    kw = {"batch_size": 4, "grpo.group": 4, "grpo.max_new_tokens": 4, "grpo.iterations": 1}
    _run("grpo", base, f.tmp / "prompts.jsonl", f.tmp / "grpo", **kw, **{"grpo.rewards": ["length=12"]})


def _infer(rec: Recorder, f: Files, name: str, **kw) -> None:
    import toy

    base, _ = _need(f)
    with toy.load(base, device="cpu", threads=1, n_ctx=32, n_slot=2, n_batch=32, **kw) as m:
        e = m.engine
        ids = [int(t) for t in m.tokenize("alpha beta gamma delta river stone cloud maple orbit")]
        rec.phase = f"{name}: prefill"
        e.prefill(0, ids)
        e.prefill(1, ids[:5])
        rec.phase = f"{name}: decode (1 sequence)"
        e.decode([0], [ids[0]])
        rec.phase = f"{name}: batched decode (2 sequences)"
        e.decode([0, 1], [ids[1], ids[2]])
        rec.phase = ""


def w_infer(rec: Recorder, f: Files) -> None:
    _infer(rec, f, "inference")


def w_infer_fa(rec: Recorder, f: Files) -> None:
    _infer(rec, f, "inference, flash attention", flash_attn=True)


def w_exact(rec: Recorder, f: Files) -> None:
    _infer(rec, f, "exact batching (toy serve)", exact_batching=True)


def w_exact_fa(rec: Recorder, f: Files) -> None:
    _infer(rec, f, "exact batching, flash attention", exact_batching=True, flash_attn=True)


def w_perplexity(rec: Recorder, f: Files) -> None:
    import toy
    from toy.eval.score import perplexity

    base, _ = _need(f)
    with toy.load(base, device="cpu", threads=1, n_ctx=32) as m:
        ids = m.tokenize(" ".join(WORDS * 4))
        rec.phase = "perplexity"
        perplexity(m, ids, context=32, max_chunks=1)
        rec.phase = ""


def w_vit(rec: Recorder, f: Files) -> None:
    import numpy as np

    import toy_vit
    from toy_testsupport.vit_images import write_folder
    from toy_vit.train import train
    from toy_vit.trainconfig import ViTTrainConfig

    data = write_folder(f.tmp / "images", per_class=6, size=16)
    cfg = ViTTrainConfig(
        data=str(data), preset="vit-micro", steps=2, batch_size=4, lr=1e-3, warmup=0, eval_every=0, save_every=0,
        out=str(f.tmp / "vit"), cache_dir=str(f.tmp / "vit-cache"), threads=1, val_fraction=0.0, flip=False,
    )  # fmt: skip
    rec.phase = "toy-vit: training step"
    ckpt = train(cfg).checkpoint
    rec.phase = "toy-vit: inference"
    with toy_vit.load(ckpt, threads=1, device="cpu") as clf:
        c = clf.config
        clf.logits(np.zeros((2, c.n_channels, c.image_size, c.image_size), np.float32))
    rec.phase = ""


def w_moe(rec: Recorder, f: Files) -> None:
    import toy
    from toy_testsupport import moe_ref

    base = moe_ref.gguf_path("qwen2moe-tiny", 0, "f32")  # 8 experts, top 2, a shared expert (cached once built)
    rec.phase = "MoE: full fine-tune"
    _run("full", base, f.tmp / "sft.jsonl", f.tmp / "moe-full")
    with toy.load(base, device="cpu", threads=1, n_ctx=32, n_slot=2) as m:
        ids = [int(t) for t in m.tokenize("alpha beta gamma delta river stone")]
        rec.phase = "MoE inference: prefill"
        m.engine.prefill(0, ids)
        m.engine.prefill(1, ids[:3])
        rec.phase = "MoE inference: batched decode (2 sequences)"
        m.engine.decode([0, 1], [ids[1], ids[2]])
    rec.phase = ""


#: name -> workload, in the page's order; the fine-tuning and inference workloads use pretrain's base
WORKLOADS: dict[str, Callable[[Recorder, Files], None]] = {
    "pretrain": w_pretrain,
    "lora": w_lora,
    "qlora": w_qlora,
    "full": w_full,
    "dpo": w_dpo,
    "grpo": w_grpo,
    "infer": w_infer,
    "infer-fa": w_infer_fa,
    "exact": w_exact,
    "exact-fa": w_exact_fa,
    "perplexity": w_perplexity,
    "vit": w_vit,
    "moe": w_moe,
}


def collect(rules: Rules, ccs: Sequence[int] = CCS, only: Sequence[str] = ()) -> list[GraphReport]:
    """Run the workloads (``only``: those names, plus pretrain, whose base the others use) and return a report
    per distinct graph."""
    names = list(WORKLOADS) if not only else ["pretrain", *[n for n in only if n != "pretrain"]]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise FallbackError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    rec = Recorder(rules, ccs)
    with tempfile.TemporaryDirectory(prefix="toy-cuda-fallbacks-") as tmp, recording(rec):
        files = Files(Path(tmp))
        for name in names:
            WORKLOADS[name](rec, files)
            rec.phase = ""
    return rec.reports


# -- the page ---------------------------------------------------------------------------------------


def _cc_name(cc: int) -> str:
    return f"sm_{cc // 10}"


def render(reports: Sequence[GraphReport], ccs: Sequence[int] = CCS) -> str:
    """The markdown page."""
    lines = [
        "# CUDA fallbacks: the nodes of toy's graphs that the CUDA backend leaves to the CPU",
        "",
        "<!-- generated by tools/cuda_fallbacks.py (just cuda-fallbacks); do not edit by hand -->",
        "",
        "For every graph toy builds, the nodes that ggml's CUDA backend does not support, as its own `supports_op`",
        "rules say (asked through ggml's backend registry, toy patch 0024, without a GPU). The scheduler runs such a",
        "node on the CPU and copies its inputs and outputs across. The graphs come from running each workload on a",
        "tiny model (two layers, width 128, 64-wide heads as SmolLM2-135M's) with a runtime that builds them as for a",
        "GPU (no toy-GEMM hints); each distinct graph of a workload is one row. *Nodes*: the nodes the scheduler runs",
        "(views left out). *Refused*: per compute capability, how many nodes the CUDA backend refuses.",
        "*Toy switches ignored*: nodes carrying a toy switch the CUDA kernels do not implement (they run on the GPU",
        "without that switch's promise). *Computed*: how many times the workload computed such a graph (the same ops",
        "at other lengths count as one row).",
        "",
        "Toy's own ops on a GPU: a runtime whose backends are not all toy's CPU kernels (`Runtime.toy_ops` False)",
        "has its graphs built with the standard ops that patch 0017's SUM_SQR and OPT_STEP_ADAMW_SCALED equal",
        "(`sum(sqr(g))`, `opt_step_adamw(mul(g, factor))`: the same bits on the CPU) and a backward of standard ops",
        "only (patch 0025: the input gradient through a frozen quantized weight from the weight dequantized by",
        "GET_ROWS and OUT_PROD, MUL_MAT_ID's expert gradient from one OUT_PROD masked by the one-hot routing instead",
        "of OUT_PROD_ID, the 3-D GET_ROWS gradient from a product with that routing); patch 0024 gives patch 0010's",
        "ERF a CUDA kernel; the products drop patch 0011's toy-GEMM hint (`Runtime.cpu_gemm`). The row-invariant",
        "switches (patches 0004, 0015, 0020) have no CUDA counterpart: on CUDA a sequence's logits may depend on",
        "the batch it was decoded in.",
        "",
    ]
    same = all(r.refused[cc] == r.refused[ccs[0]] for r in reports for cc in ccs)
    cc_cols = [_cc_name(cc) for cc in ccs]
    lines += [
        "| workload | graph | nodes | computed | "
        + " | ".join(f"refused {c}" for c in cc_cols)
        + " | toy switches ignored |",
        "|---|---|---:|---:|" + "---:|" * len(ccs) + "---|",
    ]
    for r in reports:
        counts = [str(sum(c for c, _ in r.refused[cc].values())) for cc in ccs]
        sw = "; ".join(f"{k} ×{v}" for k, v in sorted(r.switches.items())) or "—"
        lines.append(f"| {r.workload} | {r.role} | {r.n_nodes} | {r.computes} | " + " | ".join(counts) + f" | {sw} |")
    by_op: dict[tuple[str, tuple[int, ...]], list[tuple[GraphReport, int, str]]] = {}
    for r in reports:
        ops = set().union(*(r.refused[cc] for cc in ccs))
        for op in sorted(ops):
            where = tuple(cc for cc in ccs if op in r.refused[cc])
            c, ex = next(r.refused[cc][op] for cc in where)
            by_op.setdefault((op, where), []).append((r, c, ex))
    lines += ["", "## Refused nodes by op", ""]
    if not by_op:
        lines.append(
            f"None: for {', '.join(cc_cols)}, the CUDA backend takes every node of every graph above; the "
            "scheduler leaves none of them to the CPU."
        )
    else:
        if same:
            lines.append(f"The rules give the same answer for {', '.join(cc_cols)}; the table is theirs.")
        else:
            lines.append("The rules differ between compute capabilities; each row names those it holds for.")
        lines += [
            "",
            "| op | compute capabilities | nodes | graphs | example (type[shape], ~ not contiguous) |",
            "|---|---|---:|---:|---|",
        ]
        for (op, where), rows in sorted(by_op.items()):
            total = sum(c for _, c, _ in rows)
            lines.append(
                f"| {op} | {', '.join(_cc_name(cc) for cc in where)} | {total} | {len(rows)} | `{rows[0][2]}` |"
            )
        lines += ["", "## Where", ""]
        for (op, _where), rows in sorted(by_op.items()):
            lines.append(f"- **{op}**: " + "; ".join(f"{r.workload} ({r.role}) ×{c}" for r, c, _ in rows))
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="the CUDA module (libggml-cuda.so) to ask")
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    ap.add_argument("--json", help="also write the full record here")
    ap.add_argument("--only", nargs="+", default=(), help=f"only these workloads ({', '.join(WORKLOADS)})")
    args = ap.parse_args(argv)
    if args.lib and "toy_ggml" not in sys.modules:
        os.environ.setdefault("TOY_GGML_CUDA", "0")  # toy_ggml would load the installed plugin first
    try:
        rules, _where = cuda_rules(args.lib)
    except FallbackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        reports = collect(rules, CCS, args.only)
    except FallbackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        rec = {"ccs": list(CCS), "graphs": [r.to_dict() for r in reports]}
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    if args.only:  # a partial list is not the page
        print(render(reports))
        return 0
    return write_or_check(root, PAGE, render(reports), args.check, "cuda_fallbacks", "cuda-fallbacks")


if __name__ == "__main__":
    sys.exit(main())
