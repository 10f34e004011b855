"""What evaluation harnesses need offline: the server's tokenizer endpoints, an exported tokenizer folder,
and an F32 KV cache for scoring.

lm-evaluation-harness 0.4.13's ``local-completions`` (``lm_eval/utils.py``: ``check_remote_tokenizer_support``
and ``RemoteTokenizer``) asks ``GET /tokenizer_info`` and wants ``eos_token`` in it, then ``POST /tokenize``
with ``{"prompt", "add_special_tokens": false}`` and reads ``tokens``, ``POST /detokenize`` and reads
``prompt``, and renders chats with the ``chat_template`` it was given. Those exact requests are replayed
here (the harness itself is not part of toy's environment), and their answers are checked against the
library's tokenizer.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

TEXTS = ["Hello world", " leading space", "héllo <|im_end|> x", "123 456\n\n  tabs\t", "日本語のテキスト"]


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving):
    with serving(serve_settings(), serve_model) as s:
        yield s


def test_tokenizer_info_and_the_harness_requests(live, ref_model):
    http, tok = live.http, ref_model.tokenizer
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.token_to_piece(tok.eos_id).decode()
    assert info["bos_token"] == tok.token_to_piece(tok.bos_id).decode()
    assert info["chat_template"] == ref_model.chat_template.source
    assert info["add_bos_token"] is tok.add_bos and info["model_max_length"] == ref_model.n_ctx
    for text in TEXTS:
        r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert r["tokens"] == ref_model.tokenize(text, add_special=False)
        back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
        assert back["prompt"] == back["content"] == ref_model.detokenize(r["tokens"])
    # the harness's eos id: the first token of its text
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos[0] == tok.eos_id
    # add_special_tokens true adds what the file says to add (SmolLM2: nothing; the flag is still read)
    r = http.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": True}).json()
    assert r["tokens"] == ref_model.tokenize("Hi", add_special=True)


def test_exported_tokenizer_folder_equals_toy(tmp_path, smollm2_path, ref_model, capsys):
    """``toy export-tokenizer``: transformers loads the folder offline, encodes every text as toy does and
    renders the chat template as toy does."""
    transformers = pytest.importorskip("transformers")
    from toy_cli.main import main

    out = tmp_path / "tok"
    assert main(["export-tokenizer", str(smollm2_path), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ref_model.tokenize(text), text
        assert hf.decode(ref_model.tokenize(text)) == ref_model.detokenize(ref_model.tokenize(text))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = ref_model.render_chat(msgs, add_generation_prompt=True)
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["model_max_length"] == 8192
    # a file where a folder should be: exit 2, nothing written
    f = tmp_path / "file"
    f.write_text("x")
    capsys.readouterr()
    assert main(["export-tokenizer", str(smollm2_path), str(f)]) == 2
    assert "not a folder" in capsys.readouterr().err and f.read_text() == "x"


def test_kv_type_reaches_the_engine(smollm2_path, serve_settings):
    """``toy serve --kv-type f32`` loads the model with an F32 cache (the default stays F16); anything else is
    refused before loading."""
    import toy_ggml
    from toy.errors import BadInputError
    from toy_serve.server import Server

    srv = Server(serve_settings(kv_type="f32", ctx=64, parallel=1), None)
    m = srv._load()
    try:
        assert m.engine.cache.kv_type == toy_ggml.GGMLType.F32
    finally:
        m.close()
    with pytest.raises(BadInputError, match="kv_type"):
        serve_settings(kv_type="q4_0")
