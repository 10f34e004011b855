"""llama.cpp on toy's imports: the files ``import_hf`` writes from the reference Hugging Face folders are the
very files llama.cpp ran when the GPT-2, Gemma and MoE fixtures were recorded (same sha256), so llama.cpp's
recorded greedy tokens are its tokens on toy's imports, and toy's own tokens on them are compared with
those records by test_gpt2_llamacpp_files.py, test_gemma_llamacpp.py and test_moe_llamacpp.py (under the
AVX2 variant they were recorded on). Here: the sha256 of each import against the fixture, and toy's greedy
tokens on the import against the record for the prompts whose margin is wide enough to survive a change of
CPU kernels (the fixtures' ``min_margin`` above 1e-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toy.convert import import_hf
from toy_testsupport import gemma_ref, gpt2_ref, moe_ref
from toy_testsupport.llamacpp_parity import sha256_file

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
REFS = {"gpt2_llamacpp.json": gpt2_ref, "gemma_llamacpp.json": gemma_ref, "moe_llamacpp.json": moe_ref}
WIDE = 1e-2  # a greedy margin no kernel's rounding moves


def _cases():
    for fixture, ref in REFS.items():
        for m in json.loads((FIXTURES / fixture).read_text())["models"]:
            r = m["recipe"]
            if r.get("quantizer", "convert_hf_to_gguf.py") != "convert_hf_to_gguf.py" or r["outtype"] not in (
                "f32",
                "f16",
                "q8_0",
            ):
                continue
            yield pytest.param(ref, m, id=f"{ref.__name__.rsplit('.', 1)[-1]}-{r['shape']}-{r['outtype']}")


@pytest.mark.parametrize(("ref", "model"), list(_cases()))
def test_the_import_is_the_file_llamacpp_ran(tmp_path, ref, model):
    r = model["recipe"]
    out = tmp_path / "import.gguf"
    import_hf(ref.hf_dir(r["shape"], r["seed"]), out, type=r["outtype"], name=ref.MODEL_NAME)
    assert sha256_file(out) == model["sha256"]
    wide = [p for p in model["prompts"] if p.get("min_margin", 0.0) > WIDE]
    if not wide:
        return
    import toy

    with toy.load(out, threads=1, kv_type="f16", flash_attn=False) as m:  # llama.cpp's defaults, as the records
        for p in wide:
            ids = m.tokenize(p["text"])
            assert list(ids) == p["ids"], p["text"]
            got = m.generate(ids, max_tokens=len(p["greedy"]), temperature=0, ignore_eos=True).tokens
            assert list(got) == p["greedy"], p["text"]
