"""The PEFT adapter commands (``toy_cli.commands.convert_peft``): ``toy
convert PEFT_FOLDER --base M.gguf -o A.gguf`` (``toy convert`` hands a folder
with adapter_config.json to it) and ``toy export peft``. The values are
checked against PEFT in packages/toy-core/tests/test_convert_peft.py; here:
the paths printed, the files written, and clean errors (exit 2, hint, nothing
at the output)."""

from __future__ import annotations

import json

import pytest

from toy_cli.commands import convert_peft as cmd
from toy_cli.ui import CLIError
from toy_testsupport import gpt2_ref
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.train_helpers import seeded_adapter


@pytest.fixture(scope="module")
def gpt2_adapter(tmp_path_factory):
    gguf = gpt2_ref.gguf_path("tiny")
    tmp = tmp_path_factory.mktemp("cli")
    ad = seeded_adapter(
        gguf, tmp / "a.gguf", seed=1, rank=2, alpha=4.0, targets=["qkv", "up"], std=0.1, base_name="tiny.gguf"
    )
    return gguf, ad


def test_export_then_convert_round_trip(gpt2_adapter, tmp_path, capsys):
    gguf, ad = gpt2_adapter
    code, out, err = run(capsys, "export", "peft", ad, "-o", tmp_path / "peft")
    assert code == 0, err
    assert out.split() == [
        str(tmp_path / "peft" / "adapter_config.json"),
        str(tmp_path / "peft" / "adapter_model.safetensors"),
    ]
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["c_attn", "c_fc"] and cfg["r"] == 2 and cfg["lora_alpha"] == 4.0
    code, out, err = run(capsys, "convert", tmp_path / "peft", "--base", gguf, "-o", tmp_path / "back.gguf")
    assert code == 0, err
    assert out.strip() == str(tmp_path / "back.gguf")
    assert (tmp_path / "back.gguf").read_bytes() == ad.read_bytes()


def test_toy_export_peft_through_the_cli(gpt2_adapter, tmp_path, capsys):
    gguf, ad = gpt2_adapter
    code, out, err = run(capsys, "export", "peft", ad, "--base", gguf, "-o", tmp_path / "peft")
    assert code == 0, err
    assert out.split()[0] == str(tmp_path / "peft" / "adapter_config.json")
    code, out, err = run(capsys, "export", "peft", tmp_path / "nope.gguf", "-o", tmp_path / "p2")
    assert_clean_error(code, err, 2, "nope.gguf", hint=True)
    assert not (tmp_path / "p2").exists()


def test_refused_adapter_exits_2_with_a_hint_and_writes_nothing(gpt2_adapter, tmp_path, capsys):
    gguf, ad = gpt2_adapter
    assert run(capsys, "export", "peft", ad, "-o", tmp_path / "peft")[0] == 0
    p = tmp_path / "peft" / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "use_dora": True}))
    code, _, err = run(capsys, "convert", tmp_path / "peft", "--base", gguf, "-o", tmp_path / "o.gguf")
    assert_clean_error(code, err, 2, "use_dora", hint=True)
    assert list(tmp_path.glob("*o.gguf*")) == []
    # a PEFT folder without --base, and --base with a folder that is not a PEFT adapter
    code, _, err = run(capsys, "convert", tmp_path / "peft", "-o", tmp_path / "o.gguf")
    assert_clean_error(code, err, 2, "needs the model it adapts", "--base", hint=True)
    (tmp_path / "model").mkdir()
    code, _, err = run(capsys, "convert", tmp_path / "model", "--base", gguf, "-o", tmp_path / "o.gguf")
    assert_clean_error(code, err, 2, "not one", hint=True)
    assert list(tmp_path.glob("*o.gguf*")) == []


def test_convert_without_base_and_export_into_a_full_folder(gpt2_adapter, tmp_path, capsys):
    _, ad = gpt2_adapter
    with pytest.raises(CLIError, match="needs the model it adapts") as e:
        cmd.convert_peft(tmp_path, None, tmp_path / "o.gguf")
    assert e.value.code == 2 and "--base" in e.value.hint
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = run(capsys, "export", "peft", ad, "-o", tmp_path / "full")
    assert_clean_error(code, err, 2, "not an empty folder", hint=True)
