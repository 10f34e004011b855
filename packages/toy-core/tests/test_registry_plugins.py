"""Architectures other distributions add (entry-point group
``toy.architectures``): resolved only for names that are not built in, an
unknown name still one clear ``UnsupportedModelError``, a non-LM plugin
refused by ``toy.load`` with its usage as the hint, and ``toy describe`` /
the model card asking the plugin for its rows and card. A fake plugin module
written here stands in for toy-vit; the real one is checked when installed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from toy import models
from toy.errors import BadInputError
from toy.gguf import GGUFFile, GGUFWriter
from toy.models import card

PLUGIN = """
from dataclasses import dataclass

@dataclass(frozen=True)
class Cfg:
    width: int
    architecture: str = "fakevision"

def config_from_metadata(metadata, tensors):
    return Cfg(int(metadata["fakevision.embedding_length"]))

class _Arch:
    family = "fakevision"
    names = ("fakevision",)
    language_model = False
    usage = "use fakevision.run(path)"
    config_from_metadata = staticmethod(config_from_metadata)
    params = staticmethod(lambda cfg: {})
    summary = staticmethod(lambda metadata, tensors: {"pixels": int(metadata["fakevision.pixels"])})
    describe_rows = staticmethod(lambda extra: [("pixels", f"{extra['pixels']} px")])
    card = staticmethod(lambda s: f"CARD of {s.architecture}: d = {s.d_model}, {s.extra['pixels']} px")

ARCH = _Arch()
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A ``fakevision`` plugin module on sys.path and in the entry points."""
    (tmp_path / "fake_vision_arch.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(models, "_entry_points", lambda: {"fakevision": "fake_vision_arch", "broken": "no_such_mod"})
    return tmp_path


def _file(path, arch="fakevision"):
    w = GGUFWriter(path)
    w.add("general.architecture", arch)
    w.add("general.name", "fake")
    w.add(f"{arch}.embedding_length", 8)
    w.add(f"{arch}.block_count", 2)
    w.add(f"{arch}.attention.head_count", 2)
    w.add(f"{arch}.pixels", 32)
    w.add_tensor("v.patch_embd.weight", np.zeros((8, 4), np.float32))
    return w.write()


def test_unknown_architecture_is_still_one_clear_error(monkeypatch):
    monkeypatch.setattr(models, "_entry_points", lambda: {})
    with pytest.raises(models.UnsupportedModelError, match="'mamba' is not supported") as e:
        models.get("mamba")
    assert isinstance(e.value, BadInputError)
    assert "llama" in e.value.hint and "gpt2" in e.value.hint and "plugins" not in e.value.hint
    monkeypatch.setattr(models, "_entry_points", lambda: {"vit": "toy_vit.arch"})
    with pytest.raises(models.UnsupportedModelError) as e:
        models.get("mamba")
    assert "installed plugins: vit" in e.value.hint


def test_built_in_names_never_read_entry_points(monkeypatch, tmp_path):
    def boom():
        raise AssertionError("entry points read for a built-in name")

    monkeypatch.setattr(models, "_entry_points", boom)
    assert models.get("llama").family == "llama" and models.language_model("gpt2")
    models.require_language_model("qwen2")
    assert "vit" not in models.registered()  # --arch and the LM protocol test see built-ins only


def test_a_plugin_resolves_and_a_broken_one_is_clear(plugin):
    arch = models.get("fakevision")
    assert arch.family == "fakevision" and not models.language_model("fakevision")
    assert models.plugins() == ("fakevision", "broken")
    cfg = models.config_from_metadata({"general.architecture": "fakevision", "fakevision.embedding_length": 4}, {})
    assert models.of(cfg) is arch
    with pytest.raises(models.UnsupportedModelError, match="'no_such_mod' does not load") as e:
        models.get("broken")
    assert "reinstall" in e.value.hint


def test_toy_load_refuses_a_non_language_model_with_its_usage(plugin):
    import toy

    with pytest.raises(models.UnsupportedModelError, match="'fakevision' is not a language model") as e:
        toy.load(_file(plugin / "f.gguf"), threads=1)
    assert e.value.hint == "use fakevision.run(path)"


def test_card_and_summary_ask_the_plugin(plugin):
    with GGUFFile(_file(plugin / "f.gguf")) as gf:
        s = card.summarize(gf)
    assert s.language_model is False and s.tied_output is None and s.vocab is None
    assert (s.d_model, s.n_layer, s.n_head, s.n_params) == (8, 2, 2, 32)
    assert s.extra == {"pixels": 32} and s.to_dict()["extra"] == {"pixels": 32}
    assert card.extra_rows(s) == [("pixels", "32 px")]
    assert card.algorithm_card(s) == "CARD of fakevision: d = 8, 32 px"


def test_describe_prints_the_plugin_rows_and_no_lm_rows(plugin, capsys):
    from toy_cli.main import main

    code = main(["describe", str(_file(plugin / "f.gguf"))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pixels         32 px" in out and "CARD of fakevision" in out
    for lm_only in ("vocab", "tokenizer", "chat template", "output head", "qk-norm"):
        assert lm_only not in out


def test_an_unknown_architecture_file_still_gets_the_generic_card(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_entry_points", lambda: {})
    with GGUFFile(_file(tmp_path / "m.gguf", arch="mamba")) as gf:
        s = card.summarize(gf)
    assert s.language_model is True and s.extra == {}
    assert "no algorithm card" in card.algorithm_card(s)


def test_the_installed_vit_plugin():
    pytest.importorskip("toy_vit")
    arch = models.get("vit")
    assert arch.family == "vit" and not models.language_model("vit")

    @dataclass
    class _Cfg:  # models.of reads only .architecture
        architecture: str = "vit"

    assert models.of(_Cfg()) is arch
