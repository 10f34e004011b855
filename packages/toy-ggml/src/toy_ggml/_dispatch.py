"""Which CPU backend variant this process runs, chosen once at import.

The CPU backend of ggml is built once per x86-64 level (``libggml-cpu-<tag>.so``
beside ``libggml``; the levels are meson's ``cpu_variants`` option). When
``toy_ggml`` is imported, ``load()`` asks every variant for ggml's own score of
this CPU (``ggml_backend_score``: 0 when the CPU lacks an instruction the
variant was compiled for, higher for a later level), loads the best-scoring
one, and registers any other backend module it finds (CUDA, Metal). Exactly one
CPU variant is loaded per process; ``cpu_variant()`` says which and why.

``TOY_GGML_CPU_VARIANT=<tag>`` picks a variant by name instead (for tests and
comparisons); naming one that is not built, or one this CPU cannot run, is an
error at import rather than a silent fallback. A native build (meson option
``native=true``) carries a single ``libggml-cpu.so`` (tag ``native``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toy_ggml import _build_config as build_config
from toy_ggml import _core
from toy_ggml.errors import GGMLError

log = logging.getLogger("toy_ggml")

ENV = "TOY_GGML_CPU_VARIANT"

# The instruction sets each x86-64 variant is compiled for (ggml's table in
# src/CMakeLists.txt), as /proc/cpuinfo names them: used only to explain why a
# variant scored 0. The choice itself is ggml's score.
_AVX2 = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
_AVX512 = _AVX2 + ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
_X86_NEEDS = {
    "x64": (),
    "sse42": ("sse4_2",),
    "sandybridge": ("sse4_2", "avx"),
    "haswell": _AVX2,
    "skylakex": _AVX512,
    "icelake": _AVX512 + ("avx512vbmi", "avx512_vnni"),
    "cooperlake": _AVX512 + ("avx512_vnni", "avx512_bf16"),
    "zen4": _AVX512 + ("avx512vbmi", "avx512_vnni", "avx512_bf16"),
}


@dataclass(frozen=True)
class Candidate:
    tag: str
    path: str
    score: int  # ggml's score for this CPU; 0: cannot run here
    missing: tuple[str, ...] = ()  # instruction sets this CPU lacks (x86 variants)


@dataclass(frozen=True)
class VariantChoice:
    tag: str
    path: str
    score: int
    reason: str
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "path": self.path,
            "score": self.score,
            "reason": self.reason,
            "candidates": [{"tag": c.tag, "score": c.score, "missing": list(c.missing)} for c in self.candidates],
        }


_choice: VariantChoice | None = None


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def _tag(path: Path) -> str:
    stem = path.name.split(".")[0]  # libggml-cpu-haswell
    tag = stem[len("libggml-cpu") :].lstrip("-")
    return tag or ("native" if build_config.NATIVE else "default")


def _order(tag: str) -> int:
    variants = list(getattr(build_config, "CPU_VARIANTS", ()))
    return variants.index(tag) if tag in variants else len(variants)


def candidates(lib_dir: Path | None = None) -> list[Candidate]:
    """Every CPU variant this build carries, with ggml's score for this CPU."""
    lib_dir = lib_dir or Path(_core.library_path()).resolve().parent
    flags = _cpu_flags()
    out = []
    for p in lib_dir.glob("libggml-cpu*.so"):
        tag = _tag(p)
        score = _core.backend_score(p)
        missing: tuple[str, ...] = ()
        if flags is not None and tag in _X86_NEEDS:
            missing = tuple(f for f in _X86_NEEDS[tag] if f not in flags)
        out.append(Candidate(tag, str(p), score, missing))
    out.sort(key=lambda c: (_order(c.tag), c.tag))
    return out


def _choose(cands: list[Candidate], forced: str | None) -> tuple[Candidate, str]:
    if not cands:
        raise GGMLError("this toy_ggml build carries no CPU backend (no libggml-cpu*.so beside libggml)")
    if forced:
        by_tag = {c.tag: c for c in cands}
        if forced not in by_tag:
            raise GGMLError(f"{ENV}={forced!r} is not a CPU variant of this build; built: {', '.join(by_tag)}")
        c = by_tag[forced]
        if c.score == 0:
            lacks = f" (it lacks {', '.join(c.missing)})" if c.missing else ""
            raise GGMLError(f"{ENV}={forced!r}: this CPU cannot run that variant{lacks}")
        return c, f"chosen by {ENV}"
    usable = [c for c in cands if c.score != 0]
    if not usable:
        raise GGMLError(
            "this CPU runs none of the CPU variants built: "
            + "; ".join(f"{c.tag} lacks {', '.join(c.missing) or '?'}" for c in cands)
        )
    best = max(usable, key=lambda c: c.score)  # the first of equal scores (build order)
    if len(cands) == 1:
        return best, "the only CPU backend in this build"
    skipped = [c for c in cands if c.score == 0]
    why = f"the highest ggml score ({best.score}) of the {len(usable)} variants this CPU runs"
    if skipped:
        why += "; not runnable here: " + "; ".join(
            f"{c.tag} (lacks {', '.join(c.missing)})" if c.missing else c.tag for c in skipped
        )
    return best, why


def load() -> VariantChoice:
    """Load the CPU variant (once per process) and any other backend module."""
    global _choice
    if _choice is not None:
        return _choice
    lib_dir = Path(_core.library_path()).resolve().parent
    cands = candidates(lib_dir)
    best, reason = _choose(cands, os.environ.get(ENV) or None)
    _core.load_backend(best.path)
    for p in sorted(lib_dir.glob("libggml-*.so")):
        if p.name.startswith(("libggml-cpu", "libggml-base")):
            continue
        try:  # a GPU backend whose driver is missing must not stop the CPU
            _core.load_backend(p)
        except GGMLError as e:
            log.warning("%s", e)
    _choice = VariantChoice(best.tag, best.path, best.score, reason, tuple(cands))
    return _choice


def cpu_variant() -> VariantChoice:
    """The CPU backend variant this process loaded, with the reason."""
    return load()


def sum_step() -> int:
    """How many elements ggml's F32/F16 dot products of the loaded CPU variant
    take per SIMD step (GGML_F32_STEP / GGML_F16_STEP; a whole multiple of
    both): 32 with AVX/AVX2 (and on other CPUs), 64 with AVX-512, 128 for a
    native build on a CPU with AVX512-FP16. A dot product of length n sums
    its first n - n % step elements in SIMD lanes and the rest one by one, so
    two lengths that are both multiples of the step give the same sum when
    one only adds zeros: the engine pads attention lengths to a multiple of
    this so that a sequence's logits do not depend on its batch."""
    from toy_ggml._core import cpu_features

    feats = cpu_features()
    if not feats.get("avx512"):
        return 32
    flags = _cpu_flags() or set()
    if build_config.NATIVE and "avx512_fp16" in flags:
        return 128
    return 64
