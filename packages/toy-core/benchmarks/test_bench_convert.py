"""Importing a Hugging Face folder: ``toy convert`` (``toy.convert.import_hf``)
side by side with llama.cpp's ``convert_hf_to_gguf.py`` (the pinned
llama-cpp-python sdist's) on the same folder, in the same run.

Folders: seeded random llama models written by transformers
(``toy_testsupport.hf_llama_ref``, GPT-2's tokenizer, F32, shards of 200 MB):

- ``135m``: SmolLM2-135M's shape (d 576, 30 layers, 9 heads, 3 KV heads,
  FFN 1536, tied), about 0.1 B parameters with GPT-2's vocabulary;
- ``500m``: d 1024, 24 layers, 16 heads, 4 KV heads, FFN 4096, untied,
  about 0.5 B parameters (a 2 GB F32 output; ``TOY_BENCH_CONVERT_SIZES=135m``
  leaves it out).

Each side runs in a fresh interpreter that converts the folder to F32 and
reports its own peak resident set (``VmHWM`` of ``/proc/self/status``: the
whole process, Python and imports included) and wall time; the two files
must be equal byte for byte. Targets (issue 37): toy's time <= 1.0x the
converter's, toy's peak RSS <= 0.5x the converter's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.bench

SIZES = {
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie=True,
    ),
    "500m": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie=False,
    ),
}
WANTED = [s.strip() for s in os.environ.get("TOY_BENCH_CONVERT_SIZES", "135m,500m").split(",") if s.strip()]

# each side prints one JSON line: its peak resident set and wall time
_PEAK = """
import atexit, json, re, sys, time
t0 = time.perf_counter()
def _report():
    status = open("/proc/self/status").read()
    hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
    sys.stderr.write("PEAK " + json.dumps({"peak_kb": hwm, "seconds": time.perf_counter() - t0}) + "\\n")
atexit.register(_report)
"""
TOY = _PEAK + textwrap.dedent(
    """
    from toy.convert import import_hf
    import_hf(sys.argv[1], sys.argv[2], "f32", name=sys.argv[3])
    """
)
CONVERTER = _PEAK + textwrap.dedent(
    """
    import runpy
    script, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")
    """
)


def _side(argv: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[1:3]} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    line = [x for x in proc.stderr.splitlines() if x.startswith("PEAK ")][-1]
    return json.loads(line[5:])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
@pytest.mark.parametrize("size", [s for s in SIZES if s in WANTED])
def test_convert_against_llama_cpp(size, tmp_path, record):
    from toy_testsupport import gpt2_ref, hf_llama_ref

    dims = dict(SIZES[size])
    tie = dims.pop("tie")
    t0 = time.perf_counter()
    folder = hf_llama_ref.make_hf_llama(
        tmp_path / "hf", arch="llama", tie=tie, max_position_embeddings=2048, shards="200MB", **dims
    )
    made_s = time.perf_counter() - t0

    lcpp = gpt2_ref.llama_cpp_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env["PYTHONPATH"] = os.pathsep.join([str(lcpp / "gguf-py"), str(lcpp)])
    env.pop("NO_LOCAL_GGUF", None)
    theirs_path, ours_path = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    name = hf_llama_ref.MODEL_NAME
    theirs = _side(
        [CONVERTER, str(lcpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(theirs_path),
         "--outtype", "f32", "--model-name", name],
        env,
    )  # fmt: skip
    ours = _side([TOY, str(folder), str(ours_path), name])
    size_out = ours_path.stat().st_size
    same = ours_path.read_bytes() == theirs_path.read_bytes()
    assert same, "toy's file differs from the converter's"
    common = {
        "size": size,
        "output_mb": round(size_out / 1e6, 1),
        "folder_made_s": round(made_s, 1),
        "same_bytes": same,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    t_ratio = ours["seconds"] / theirs["seconds"]
    record(
        "convert",
        figure=f"toy convert time / convert_hf_to_gguf.py time, {size} F32",
        value=round(t_ratio, 3),
        unit="ratio",
        target="<= 1.0",
        met=t_ratio <= 1.0,
        better="lower",
        toy_s=round(ours["seconds"], 2),
        llama_cpp_s=round(theirs["seconds"], 2),
        **common,
    )
    r_ratio = ours["peak_kb"] / theirs["peak_kb"]
    record(
        "convert",
        figure=f"toy convert peak RSS / convert_hf_to_gguf.py peak RSS, {size} F32",
        value=round(r_ratio, 3),
        unit="ratio",
        target="<= 0.5",
        met=r_ratio <= 0.5,
        better="lower",
        toy_peak_mb=round(ours["peak_kb"] * 1024 / 1e6, 1),
        llama_cpp_peak_mb=round(theirs["peak_kb"] * 1024 / 1e6, 1),
        toy_peak_vs_output=round(ours["peak_kb"] * 1024 / size_out, 3),
        **common,
    )
