"""The registry's plugin base types (``toy.models.protocol``) and what the
model card reads from them.

- Every registered architecture is an ``Architecture`` and, built in, a
  ``LanguageModel``; toy-vit's ``vit`` (installed) is an ``Architecture``
  only; an object that lacks a member is neither.
- ``families`` / ``language_models`` are the built-in families, one each.
- ``toy.models.card`` keeps no family table: the defaults of a file that
  does not name its norm or positions, the RoPE pairing and the MoE choices
  come from the architecture's ``traits``, and its card from its ``card``;
  a plugin that declares traits and uses ``decoder_card`` gets the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from toy import models
from toy.models import Architecture, LanguageModel, Traits, card


@pytest.mark.parametrize("name", models.registered())
def test_every_built_in_is_a_language_model(name):
    arch = models.get(name)
    assert isinstance(arch, Architecture) and isinstance(arch, LanguageModel)
    assert arch in models.language_models()
    assert set(arch.traits) <= set(arch.names)  # traits are keyed by names the family runs


def test_families_are_the_language_models():
    archs = models.language_models()
    assert models.families() == tuple(a.family for a in archs) == ("llama", "gpt2", "gemma")
    assert {n for a in archs for n in a.names} == set(models.registered())
    for a in archs:
        assert models.get(a.family) is a


class _NotAnArchitecture:  # no params
    family = "broken"
    names = ("broken",)

    def config_from_metadata(self, metadata, tensors):
        return None


class _Vision:  # the least a non-LM plugin gives
    family = "vision"
    names = ("vision",)
    language_model = False

    def config_from_metadata(self, metadata, tensors):
        return None

    def params(self, cfg):
        return {}


def test_the_protocols_check_the_members():
    assert not isinstance(_NotAnArchitecture(), Architecture)
    assert isinstance(_Vision(), Architecture) and not isinstance(_Vision(), LanguageModel)


def test_the_installed_vit_conforms():
    pytest.importorskip("toy_vit")
    arch = models.get("vit")
    assert isinstance(arch, Architecture) and not isinstance(arch, LanguageModel)
    assert not models.language_model("vit")


@dataclass
class _T:  # what summary_from reads of a tensor info
    shape: tuple[int, ...]

    @property
    def dtype(self):
        return type("D", (), {"name": "F32"})


def _silent(arch: str, **extra) -> dict:
    """Metadata without norm epsilon or rope keys: the traits decide."""
    return {
        "general.architecture": arch,
        f"{arch}.block_count": 1,
        f"{arch}.embedding_length": 8,
        f"{arch}.attention.head_count": 2,
        f"{arch}.feed_forward_length": 12,
        **{f"{arch}.{k}": v for k, v in extra.items()},
    }


@pytest.mark.parametrize(
    ("arch", "norm", "positions", "pairs"),
    [
        ("llama", "rms", "rope", "pairs (2i, 2i+1)"),  # llama.cpp: LLAMA_ROPE_TYPE_NORM
        ("qwen3", "rms", "rope", "NeoX pairs (i, i+n/2)"),  # LLAMA_ROPE_TYPE_NEOX
        ("gpt2", "layer", None, None),  # learned positions come from position_embd.weight, absent here
        ("mamba", None, None, None),  # unknown: only what the file says
    ],
)
def test_a_silent_file_gets_its_architectures_traits(arch, norm, positions, pairs):
    s = card.summary_from(_silent(arch), {})
    assert (s.norm, s.positions) == (norm, positions)
    text = card.algorithm_card(s)
    if pairs:
        assert pairs in text, text
    if positions is None:
        assert "RoPE" not in text


@pytest.mark.parametrize(
    ("arch", "d_ff_expert", "renormalised"),
    [("olmoe", 12, False), ("qwen2moe", 6, False), ("qwen3moe", 6, True)],
)
def test_moe_choices_come_from_the_traits(arch, d_ff_expert, renormalised):
    # olmoe's experts are feed_forward_length wide; the others' default is d_ff / k
    s = card.summary_from(_silent(arch, expert_count=4, expert_used_count=2), {})
    assert (s.mlp, s.d_ff_expert, s.expert_weights_norm) == ("moe", d_ff_expert, renormalised)
    assert ("renormalised to sum 1" in card.algorithm_card(s)) == renormalised


PLUGIN = """
from toy.models import Traits
from toy.models.card import decoder_card

class _Arch:
    family = "fakeneox"
    names = ("fakeneox",)
    config_from_metadata = staticmethod(lambda metadata, tensors: None)
    params = staticmethod(lambda cfg: {})
    traits = {"fakeneox": Traits(norm="rms", rope=True, rope_pairs="neox", qk_norm_full=True)}
    card = staticmethod(decoder_card)

ARCH = _Arch()
"""


def test_a_plugin_with_traits_gets_the_decoder_card(tmp_path, monkeypatch):
    (tmp_path / "fake_neox_arch.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(models, "_entry_points", lambda: {"fakeneox": "fake_neox_arch"})
    tensors = {"blk.0.attn_q_norm.weight": _T((4,)), "blk.0.ffn_gate.weight": _T((12, 8))}
    s = card.summary_from(_silent("fakeneox"), tensors)
    assert isinstance(models.get("fakeneox"), Architecture)
    assert (s.norm, s.positions, s.rope_base, s.qk_norm) == ("rms", "rope", 10000.0, True)
    text = card.algorithm_card(s)
    assert text.startswith("Algorithm: P ← fakeneox(x | θ)")
    assert "NeoX pairs (i, i+n/2)" in text and "over the whole projection, before the head split" in text


def test_traits_default_to_what_the_file_says():
    t = Traits()
    assert (t.norm, t.rope, t.rope_pairs, t.qk_norm_full) == (None, False, "normal", False)
    assert not t.expert_width_is_ff and not t.expert_weights_norm
