"""What toy trains goes to Hugging Face and comes back: a from-scratch model and a LoRA adapter trained by
toy's own recipes, exported with ``export_hf`` / ``export_peft``.

References, independent of the exporters: transformers' forward on the exported folder (logits within 1e-4
of toy's, F32), ``AutoTokenizer`` (the ids toy's trained BPE gives), PEFT's ``PeftModel`` on the exported
adapter (logits within the tolerance below of toy's with the adapter applied). The way back is toy's own
importer: the exported folder imported again gives the trained file's tensors, byte for byte.
"""

from __future__ import annotations

import numpy as np
import pytest

from toy.convert import export_hf, export_peft, import_hf, import_peft
from toy.gguf import GGUFFile
from toy.tokenizer import Tokenizer
from toy.train import config as C
from toy.train.lmrun import train
from toy_testsupport.train_helpers import TINY_SCRATCH, python_docs_corpus, recipe_config, write_examples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

TEXTS = ["def add(a, b):\n    return a + b\n", "Hello world", "  spaces\tand tabs"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step from-scratch llama run (toy's BPE trained on the corpus) and its final checkpoint."""
    d = tmp_path_factory.mktemp("scratch")
    corpus = python_docs_corpus(d / "corpus", 4)
    values = {**TINY_SCRATCH, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values.update(out=str(d / "runs"), steps=6, save_every=6)
    r = train(C.override(C.TrainConfig(), **values))
    assert r.reason == "completed" and r.checkpoint is not None
    return r.checkpoint


def _ids(path, text: str) -> list[int]:
    with GGUFFile(path) as gf:
        return Tokenizer.from_gguf(gf.metadata).encode(text)


def _toy_logits(path, ids, lora=None) -> np.ndarray:
    import toy

    with toy.load(path, threads=1, lora=lora, kv_type="f32") as m:
        return np.asarray(m.logits(ids), dtype=np.float32)


def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_a_toy_trained_model_exports_to_transformers_and_imports_back(trained, tmp_path):
    folder = tmp_path / "hf"
    report = export_hf(trained, folder)
    assert report.dequantized == []
    ids = _ids(trained, TEXTS[0])
    want = _toy_logits(trained, ids)
    got = _hf_logits(_hf_model(folder), ids)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == _ids(trained, text), text

    back = tmp_path / "back.gguf"
    import_hf(folder, back, type="f32")
    with GGUFFile(trained) as a, GGUFFile(back) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, t in a.tensors.items():
            assert (t.shape, t.dtype) == (b.tensors[name].shape, b.tensors[name].dtype), name
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name
    assert _ids(back, TEXTS[0]) == ids


def test_a_toy_trained_lora_adapter_gives_peft_toys_logits(trained, tmp_path):
    data = write_examples(tmp_path / "data.jsonl", 24, ["prompt_completion", "text"])
    cfg = recipe_config(
        "lora", trained, data, tmp_path / "runs", steps=4, context=32, eval_every=0, sample_tokens=0, save_every=4
    )
    cfg = C.override(cfg, **{"lora.targets": ["q", "k", "v", "o", "gate", "up", "down"], "lora.rank": 4})
    r = train(cfg)
    assert r.reason == "completed" and r.checkpoint is not None
    adapter = r.checkpoint
    hf = tmp_path / "hf"
    export_hf(trained, hf)
    out = export_peft(adapter, tmp_path / "peft", base=trained)

    ids = _ids(trained, TEXTS[1] + " " + TEXTS[0])[:30]  # the model's context is 32
    base = _toy_logits(trained, ids)
    want = _toy_logits(trained, ids, lora=adapter)
    model = peft.PeftModel.from_pretrained(_hf_model(hf), str(out)).eval()
    got = _hf_logits(model, ids)
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    assert np.abs(want - base).max() > 10 * tol  # the trained adapter changes the logits
    assert np.abs(got - want).max() <= tol, np.abs(got - want).max()
    # and PEFT's folder imports back to the adapter toy trained, byte for byte
    back = import_peft(out, trained, tmp_path / "back.gguf")
    assert back.read_bytes() == adapter.read_bytes()
