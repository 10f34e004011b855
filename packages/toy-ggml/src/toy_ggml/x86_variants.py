"""Which of ggml's x86-64 CPU variants a CPU can run, read from its /proc/cpuinfo flags.

ggml compiles its CPU backend once per x86-64 level, a *variant* (its table in
``src/CMakeLists.txt``: ``ggml_add_cpu_backend_variant(haswell SSE42 AVX F16C
FMA AVX2 BMI2)``), and scores each variant for the running CPU
(``src/ggml-cpu/arch/x86/cpu-feats.cpp``): 0 when the CPU lacks a feature the
variant was compiled for, else 1 plus a fixed weight per feature, so a later
level scores higher. The loader keeps the best-scoring one.

This module holds those two tables in Python, ggml's feature names translated
to the flag names Linux prints in /proc/cpuinfo, so that code which cannot ask
ggml makes the same choice:

- ``tools/install.py`` runs with the machine's Python before toy_ggml exists
  (it loads this file by its path) and builds only the variants this CPU can
  use: its best and the baseline ``x64``;
- ``toy_ggml._dispatch`` names the instruction sets a CPU lacks when ggml
  scores a variant 0 (its choice itself is ggml's own score).

So it imports nothing but the standard library: no toy_ggml, no extension
module. ``packages/toy-ggml/tests/test_x86_variants.py`` reads both tables back
out of ggml's sources and compares.

ggml's score reads cpuid and does not ask whether the OS enables the wider
registers (a FIXME there); /proc/cpuinfo leaves such a feature out. Where the
two disagree the flags are the safer reading.
"""

from __future__ import annotations

from collections.abc import Iterable

# ggml's x86 features (its GGML_<feature> options) -> the /proc/cpuinfo flags its
# cpuid check asks for, and the weight the feature adds to a variant's score. ggml
# compiles AMX_TILE in but does not score it (0 here; sapphirerapids alone has it).
X86_FEATURES: dict[str, tuple[tuple[str, ...], int]] = {
    "FMA": (("fma",), 1),
    "F16C": (("f16c",), 1 << 1),
    "SSE42": (("sse4_2",), 1 << 2),
    "BMI2": (("bmi2",), 1 << 3),
    "AVX": (("avx",), 1 << 4),
    "AVX2": (("avx2",), 1 << 5),
    "AVX_VNNI": (("avx_vnni",), 1 << 6),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7),
    "AVX512_VBMI": (("avx512vbmi",), 1 << 8),
    "AVX512_BF16": (("avx512_bf16",), 1 << 9),
    "AVX512_VNNI": (("avx512_vnni",), 1 << 10),
    "AMX_TILE": (("amx_tile",), 0),
    "AMX_INT8": (("amx_int8",), 1 << 11),
}

_HASWELL = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2")

# ggml's x86-64 variant table: tag -> the features it is compiled for, in ggml's order.
X86_VARIANTS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": _HASWELL,
    "skylakex": _HASWELL + ("AVX512",),
    "cannonlake": _HASWELL + ("AVX512", "AVX512_VBMI"),
    "cascadelake": _HASWELL + ("AVX512", "AVX512_VNNI"),
    "icelake": _HASWELL + ("AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": _HASWELL + ("AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": _HASWELL + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    "alderlake": _HASWELL + ("AVX_VNNI",),
    "sapphirerapids": _HASWELL + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}

BASELINE = "x64"  # runs on every x86-64 CPU

# tag -> the /proc/cpuinfo flags a CPU needs to run that variant
X86_NEEDS: dict[str, tuple[str, ...]] = {
    tag: tuple(flag for feat in feats for flag in X86_FEATURES[feat][0]) for tag, feats in X86_VARIANTS.items()
}


def parse_cpuinfo(text: str) -> set[str] | None:
    """The flags of the first processor in /proc/cpuinfo's text (x86's ``flags`` line); None without one."""
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def read_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """This CPU's flags; None where the file cannot be read or has no flags line (not Linux, not x86)."""
    try:
        with open(path) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return None


def missing(tag: str, flags: Iterable[str]) -> tuple[str, ...]:
    """The flags variant ``tag`` needs that ``flags`` lack (KeyError for a tag not in X86_VARIANTS)."""
    have = set(flags)
    return tuple(f for f in X86_NEEDS[tag] if f not in have)


def score(tag: str, flags: Iterable[str]) -> int:
    """ggml's score of variant ``tag`` on a CPU with these flags: 0 when it cannot run there."""
    have = set(flags)
    if missing(tag, have):
        return 0
    return 1 + sum(X86_FEATURES[feat][1] for feat in X86_VARIANTS[tag])


def best(tags: Iterable[str], flags: Iterable[str]) -> str | None:
    """The variant of ``tags`` ggml would load on a CPU with these flags (the highest score, the
    first of equals); None when none of them runs there. Tags not in X86_VARIANTS are passed over."""
    have = set(flags)
    scored = [(score(t, have), t) for t in tags if t in X86_VARIANTS]
    top = max((s for s, _ in scored), default=0)
    return next((t for s, t in scored if s == top), None) if top > 0 else None
