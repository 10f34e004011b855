"""toy_ggml.x86_variants holds ggml's x86-64 variant table and score in Python.

tools/install.py uses it to build only the CPU variants a machine can use,
before toy_ggml exists; toy_ggml._dispatch uses it to say why a variant scored
0. Both tables are written by hand; these tests read them back out of the
patched ggml tree toy is built from (packages/toy-ggml/subprojects/ggml):

- the variant table, from ``ggml_add_cpu_backend_variant(<tag> <features>)``
  in src/CMakeLists.txt (its x86 block);
- each feature's weight and the cpuid checks behind it, from
  ``ggml_backend_cpu_x86_score`` in src/ggml-cpu/arch/x86/cpu-feats.cpp; the
  checks' names become /proc/cpuinfo's by lower-casing, with Linux's two
  spellings that differ (``sse4_2``, ``avx512vbmi``) named here;

and compare the Python score with ggml's own (``ggml_backend_score`` of each
variant this build carries) on the running CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import toy_ggml as tg
from toy_ggml import x86_variants

GGML_DIR = Path(__file__).resolve().parents[1] / "subprojects" / "ggml"
CMAKELISTS = GGML_DIR / "src" / "CMakeLists.txt"
CPU_FEATS = GGML_DIR / "src" / "ggml-cpu" / "arch" / "x86" / "cpu-feats.cpp"
# cpuid_x86's method names whose /proc/cpuinfo flag is not the name lower-cased
# (Linux's arch/x86/include/asm/cpufeatures.h spells these two differently)
LINUX_NAMES = {"SSE42": "sse4_2", "AVX512_VBMI": "avx512vbmi"}


def _require(path: Path) -> str:
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: the patched ggml tree is not laid out. Run `python tools/fetch_ggml.py` "
            "from the repository root (CI always has it)."
        )
    return path.read_text(encoding="utf-8", errors="replace")


def ggml_x86_variants() -> dict[str, tuple[str, ...]]:
    src = _require(CMAKELISTS)
    start = src.index('if (GGML_SYSTEM_ARCH STREQUAL "x86")', src.index("if (GGML_CPU_ALL_VARIANTS)"))
    block = src[start : src.index("elseif", start)]
    found = re.findall(r"^\s*ggml_add_cpu_backend_variant\((\w+)([^)]*)\)", block, re.M)
    return {tag: tuple(feats.split()) for tag, feats in found}


def ggml_x86_score() -> dict[str, tuple[tuple[str, ...], int]]:
    """feature -> (the cpuid checks ggml's score makes for it, as /proc/cpuinfo flags; its weight)."""
    src = _require(CPU_FEATS)
    body = src[src.index("static int ggml_backend_cpu_x86_score()") :]
    body = body[: body.index("return score;")]
    out = {}
    for feat, text in re.findall(r"#ifdef GGML_(\w+)\n(.*?)#endif", body, re.S):
        checks = re.findall(r"if \(!is\.(\w+)\(\)\)", text)
        (weight,) = re.findall(r"score \+= (1<<\d+|1);", text)  # FMA's is a plain 1
        out[feat] = (tuple(LINUX_NAMES.get(c, c.lower()) for c in checks), 1 << int(weight.partition("<<")[2] or 0))
    return out


def test_the_variant_table_is_ggmls():
    ggml = ggml_x86_variants()
    assert {"x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids"} <= set(ggml)  # the parse found them
    assert x86_variants.X86_VARIANTS == ggml


def test_the_feature_weights_and_checks_are_ggmls():
    ggml = ggml_x86_score()
    assert ggml["AVX512"] == (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7)
    # AMX_TILE is compiled in (sapphirerapids) but not scored: ggml's function has no block for it
    scored = {f: v for f, v in x86_variants.X86_FEATURES.items() if f != "AMX_TILE"}
    assert scored == ggml
    assert "AMX_TILE" not in ggml and x86_variants.X86_FEATURES["AMX_TILE"] == (("amx_tile",), 0)
    used = {f for feats in x86_variants.X86_VARIANTS.values() for f in feats}
    assert used <= set(x86_variants.X86_FEATURES)


def test_the_haswell_row_is_ggmls_avx2_set():
    assert x86_variants.X86_NEEDS["haswell"] == ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")


@pytest.mark.skipif(x86_variants.read_flags() is None, reason="needs /proc/cpuinfo with a flags line (x86 Linux)")
def test_the_score_is_ggmls_on_this_cpu():
    """ggml scores each variant of this build for this CPU (cpuid); the Python score from
    /proc/cpuinfo's flags gives the same number, so it picks the variant ggml loads."""
    flags = x86_variants.read_flags()
    assert flags is not None
    choice = tg.cpu_variant()
    x86 = [c for c in choice.candidates if c.tag in x86_variants.X86_VARIANTS]
    if not x86:
        pytest.skip("this build carries no x86-64 variant (a native build)")
    for c in x86:
        assert x86_variants.score(c.tag, flags) == c.score, c
    assert x86_variants.best([c.tag for c in x86], flags) == choice.tag


def test_parse_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2\nbugs\t\t: \n\nprocessor\t: 1\n"
    assert x86_variants.parse_cpuinfo(text) == {"fpu", "sse2", "avx2"}
    assert x86_variants.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\n") is None  # ARM: no x86 flags
    assert x86_variants.read_flags("/nonexistent/cpuinfo") is None


def test_score_and_best():
    haswell = set(x86_variants.X86_NEEDS["haswell"])
    # ggml's weights: FMA 1, F16C 2, SSE42 4, BMI2 8, AVX 16, AVX2 32, plus the 1 every runnable variant has
    assert x86_variants.score("haswell", haswell) == 1 + 1 + 2 + 4 + 8 + 16 + 32
    assert x86_variants.score("x64", set()) == 1
    assert x86_variants.score("skylakex", haswell) == 0
    assert x86_variants.missing("skylakex", haswell | {"avx512f"}) == ("avx512cd", "avx512vl", "avx512dq", "avx512bw")
    assert x86_variants.best(["x64", "haswell", "skylakex"], haswell) == "haswell"
    assert x86_variants.best(["haswell", "skylakex"], {"sse4_2"}) is None
    assert x86_variants.best(["native", "x64"], set()) == "x64"  # a tag outside the table is passed over
