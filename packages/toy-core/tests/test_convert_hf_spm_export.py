"""GGUF -> Hugging Face export of a SentencePiece vocabulary (``tokenizer.ggml.model`` "llama"):
``tokenizer.model`` (``toy.tokenizer.export.sentencepiece_model``).

References: llama.cpp's converter's GGUF files of Gemma 2 / Gemma 3 folders with a real
SentencePiece ``tokenizer.model`` (``gemma_ref``); llama.cpp's ``convert_hf_to_gguf.py`` and
toy's import run on the exported folder alone (no reference file copied in) give the original
``tokenizer.*`` metadata back; ``sentencepiece`` itself encodes with the exported model as with the
reference folder's.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from toy.convert.hf_export import export_hf
from toy.gguf import GGUFFile
from toy_testsupport import gemma_ref, hf_llama_ref
from toy_testsupport.cli_helpers import run

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")

SHAPES = ["gemma2-tiny", "gemma3-tiny"]
TEXTS = [
    *gemma_ref.CORPUS[::4],
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "Two  spaces and a tab\there, digits 12345 and 3.14",
    "unseen characters: \u0416\u0437 \U0001f999 \u00ff",
    " leading space",
]


def _tokenizer_keys(path) -> dict[str, object]:
    with GGUFFile(path) as gf:
        return {k: v for k, v in gf.metadata.items() if k.startswith("tokenizer.")}


def _assert_same_tokenizer(want: dict[str, object], got: dict[str, object]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, str | bool | int):
            assert got[k] == v, k
        elif k == "tokenizer.ggml.tokens":
            assert list(got[k]) == list(v), k
        else:
            a, b = np.asarray(v), np.asarray(got[k])
            assert a.dtype == b.dtype and np.array_equal(a, b), k


def _same_tensor_bytes(a_path, b_path) -> None:
    with GGUFFile(a_path) as a, GGUFFile(b_path) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, t in a.tensors.items():
            assert (t.shape, t.dtype) == (b.tensors[name].shape, b.tensors[name].dtype), name
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name


@pytest.fixture(scope="module", params=SHAPES)
def exported(request, tmp_path_factory):
    shape = request.param
    src = gemma_ref.gguf_path(shape, 0, "f32")
    folder = tmp_path_factory.mktemp(shape) / "hf"
    report = export_hf(src, folder)
    return shape, src, folder, report


def test_the_export_writes_tokenizer_model(exported):
    _, src, folder, report = exported
    assert folder / "tokenizer.model" in report.files and report.notes == []
    from sentencepiece import sentencepiece_model_pb2 as pb2

    m = pb2.ModelProto()
    m.ParseFromString((folder / "tokenizer.model").read_bytes())
    with GGUFFile(src) as gf:
        meta = gf.metadata
        assert [p.piece for p in m.pieces] == list(meta["tokenizer.ggml.tokens"])
        assert np.array_equal(np.array([p.score for p in m.pieces], np.float32), meta["tokenizer.ggml.scores"])
        t = m.trainer_spec
        assert t.model_type == pb2.TrainerSpec.BPE and t.byte_fallback
        assert (t.unk_id, t.bos_id, t.eos_id, t.pad_id) == tuple(
            int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("unknown", "bos", "eos", "padding")
        )
        assert m.normalizer_spec.name == "identity"
        assert m.normalizer_spec.add_dummy_prefix == bool(meta["tokenizer.ggml.add_space_prefix"])


def test_toys_import_of_the_exported_folder_alone_gives_the_same_tokenizer_and_tensors(exported, tmp_path):
    from toy.convert import import_hf

    _, src, folder, _ = exported
    import_hf(folder, tmp_path / "back.gguf", "f32")
    _assert_same_tokenizer(_tokenizer_keys(src), _tokenizer_keys(tmp_path / "back.gguf"))
    _same_tensor_bytes(src, tmp_path / "back.gguf")


def test_llamacpps_converter_on_the_exported_folder_gives_the_same_tokenizer(exported, tmp_path):
    _, src, folder, _ = exported
    back = hf_llama_ref.convert(folder, tmp_path / "back.gguf", "f32")
    _assert_same_tokenizer(_tokenizer_keys(src), _tokenizer_keys(back))


def test_sentencepiece_encodes_with_the_exported_model_as_with_the_reference(exported):
    shape, _, folder, _ = exported
    got = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    want = spm.SentencePieceProcessor(model_file=str(gemma_ref.hf_dir(shape, 0) / "tokenizer.model"))
    assert got.vocab_size() == want.vocab_size()
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.decode(ids) == want.decode(ids), text


def test_without_sentencepiece_the_export_succeeds_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` raises ImportError
    src = gemma_ref.gguf_path("gemma2-tiny", 0, "f32")
    report = export_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert all(p.name != "tokenizer.model" for p in report.files)
    assert len(report.notes) == 1 and "tokenizer.model" in report.notes[0]
    assert "toy-core[sentencepiece]" in report.notes[0]
    code, _, err = run(capsys, "export", "hf", src, "-o", tmp_path / "cli")
    assert code == 0, err
    assert "tokenizer.model" in err and "toy-core[sentencepiece]" in err


def test_a_bpe_vocabulary_gets_no_tokenizer_model(tmp_path):
    from toy_testsupport import tiny_archs

    src = tiny_archs.write(tmp_path / "llama.gguf", "llama")
    report = export_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.model").exists() and report.notes == []
