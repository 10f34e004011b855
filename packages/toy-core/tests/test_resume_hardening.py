"""Resuming from a checkpoint whose state is wrong as written (issue 42,
item 7): hand-edited, or copied from another run. The checksums catch
accidental damage only, so each bad checkpoint here is built by editing a
real one and recomputing its checksums the way the writer does
(``toy_testsupport.checkpoint_edit``); what refuses it is the validation on
resume (``checkpoint.check_state`` and ``load``'s type checks): a
``CheckpointStateError`` naming the file and the tensor or key, exit 2 with
an ``error:`` line at the command line, no fallback to an earlier checkpoint,
nothing appended to the run's events.

Before the validation these resumed (an unknown tensor, an F16 moment, a
negative counter), diverged a step later (NaN, a negative second moment),
or failed with an internal message (``KeyError``, numpy's shape error,
``AttributeError``); a nested config was a ``ConfigError`` that did not say
it came from the checkpoint. The lora and full recipes share the check
(one case each). Runs use a tiny model: each takes well under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from toy.errors import BadInputError
from toy.train import checkpoint
from toy.train import config as C
from toy.train.lmrun import Hooks, resume, train
from toy_testsupport import train_helpers as th
from toy_testsupport.checkpoint_edit import edit_checkpoint
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.train_helpers import TINY_SCRATCH, python_docs_corpus

SMALL = TINY_SCRATCH
P = "blk.1.ffn_up.weight"  # a trained matrix
NORM = "blk.0.attn_norm.weight"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A from-scratch run of 4 of its 12 steps: one checkpoint, step 4."""
    d = tmp_path_factory.mktemp("resume-hardening")
    corpus = python_docs_corpus(d / "corpus", 8)
    values = {**SMALL, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    r = train(C.override(C.TrainConfig(), **values, out=str(d / "runs"), steps=4, save_every=0))
    ckpt = r.run_dir / "checkpoints"
    assert checkpoint.list_steps(ckpt) == [4]
    edit_checkpoint(ckpt, 4, state=lambda s: s["config"].update(steps=12))  # 8 steps left to resume
    return r.run_dir


@pytest.fixture
def run_dir(stopped, tmp_path) -> Path:
    return Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))


def _set(where: str, key: str, value):
    def edit(s):
        s[where][key] = value

    return edit


def _poke(name: str, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = value

    return edit


CASES = {
    "nan in a first moment": (
        dict(optimizer=_poke(f"adam_m.{P}", np.nan)),
        f"adam_m.{P}",
        f"tensor adam_m.{P} holds 1 non-finite value(s) (nan at flat index 3), expected finite",
    ),
    "inf in a parameter": (
        dict(params=_poke(P, -np.inf)),
        P,
        f"tensor {P} holds 1 non-finite value(s) (-inf at flat index 3)",
    ),
    "negative second moment": (
        dict(optimizer=_poke(f"adam_v.{P}", -1e-3)),
        f"adam_v.{P}",
        f"tensor adam_v.{P} holds 1 negative value(s)",
    ),
    "moment of another shape": (
        dict(optimizer=lambda t: t.update({f"adam_v.{NORM}": np.zeros((4, 8), np.float32)})),
        f"adam_v.{NORM}",
        f"tensor adam_v.{NORM} has shape (4, 8), expected (32,) (the shape of parameter {NORM})",
    ),
    "moment missing": (
        dict(optimizer=lambda t: t.__delitem__(f"adam_m.{NORM}")),
        f"adam_m.{NORM}",
        f"it lacks tensor adam_m.{NORM}, the AdamW first moment of parameter {NORM}",
    ),
    "moment of no parameter": (
        dict(optimizer=lambda t: t.update({"adam_m.blk.9.ffn_up.weight": np.zeros(4, np.float32)})),
        "adam_m.blk.9.ffn_up.weight",
        "tensor adam_m.blk.9.ffn_up.weight is not an AdamW moment of a parameter this run trains",
    ),
    "moment in F16": (
        dict(types={f"adam_m.{NORM}": "F16"}),
        f"adam_m.{NORM}",
        f"tensor adam_m.{NORM} is F16, expected F32",
    ),
    "nested config": (
        dict(state=lambda s: s["config"]["optim"].update(lr={"value": 1e-3})),
        "config",
        "the run config it records (config in toy.state.json) is invalid: optim.lr: expected a number",
    ),
    "config of another type": (
        dict(state=_set("config", "batch_size", "2")),
        "config",
        "invalid: batch_size: expected an integer",
    ),
    "config not an object": (
        dict(state=lambda s: s.update(config=[1, 2])),
        "config",
        "invalid: config: expected a table",
    ),
    "negative counter": (
        dict(state=lambda s: s.update(tokens_seen=-5)),
        "tokens_seen",
        "tokens_seen in toy.state.json is the number -5, expected a whole number >= 0",
    ),
    "rng state of another generator": (
        dict(state=lambda s: s.update(rng={"bit_generator": "MT19937", "state": 1})),
        "rng",
        "rng in toy.state.json is not a state of numpy's PCG64 generator",
    ),
    "state not an object": (
        dict(state=lambda s: [s]),
        "toy.state.json",
        "the training state (toy.state.json) is an array, expected an object",
    ),
    "step of another type": (
        dict(metadata=lambda m: m.update({"toy.state.step": "4"})),
        "toy.state.step",
        "toy.state.step is a string, expected the step number 4",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_state_is_refused_naming_the_tensor_or_key(run_dir, case):
    edits, field, fragment = CASES[case]
    ckpt = run_dir / "checkpoints"
    edit_checkpoint(ckpt, 4, **edits)
    before = (run_dir / "events.jsonl").read_bytes()
    with pytest.raises(BadInputError) as ei:
        resume(run_dir)
    e = ei.value
    state_file = ckpt / ("step_4.gguf" if case == "inf in a parameter" else "step_4.state.gguf")
    assert str(e).startswith(f"checkpoint {state_file}: ") and fragment in str(e), str(e)
    assert e.field == field and e.path == state_file and e.hint
    assert type(e).__name__ == "CheckpointStateError"
    assert not isinstance(e, checkpoint.DamagedCheckpointError)  # the checksums matched: validation refused it
    assert (run_dir / "events.jsonl").read_bytes() == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_4.gguf", "step_4.state.gguf"]


def test_the_edits_pass_the_checksums(run_dir):
    """The helper's checkpoints verify: what the test above refuses is not caught as damage."""
    ckpt = run_dir / "checkpoints"
    edit_checkpoint(ckpt, 4, optimizer=_poke(f"adam_m.{P}", np.nan), params=_poke(P, np.inf))
    ck = checkpoint.load(ckpt)
    assert ck.verified and np.isnan(ck.optimizer[f"adam_m.{P}"].flat[3]) and np.isinf(ck.params[P].flat[3])


def test_an_intact_state_still_resumes(run_dir):
    edit_checkpoint(ckpt := run_dir / "checkpoints", 4)  # rewritten, unchanged
    assert checkpoint.load(ckpt).verified
    r = resume(run_dir, steps=5)
    assert r.reason == "completed" and r.final_step == 5


def test_cli_resume_of_a_wrong_state_exits_2(run_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    edit_checkpoint(run_dir / "checkpoints", 4, optimizer=_poke(f"adam_v.{P}", np.nan))
    code, _, err = run(capsys, "train", "--resume", run_dir)
    assert_clean_error(code, err, 2, f"tensor adam_v.{P} holds 1 non-finite value(s)", hint=True)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    rows = [{"prompt": f"say {w}:", "completion": f" {w} {w}."} for w in th.RECIPE_WORDS * 2]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_fine_tuning_recipes_check_the_state_too(stopped, jsonl, tmp_path, recipe):
    base = stopped / "checkpoints" / "step_4.gguf"
    cfg = th.recipe_config(recipe, base, jsonl, tmp_path / "runs", 3, 32, eval_every=0, sample_tokens=0, save_every=0)
    stop = th.StopAt(2)
    r = train(cfg, Hooks(progress=stop.progress, should_stop=stop.should_stop))
    assert r.final_step == 2
    ckpt = r.run_dir / "checkpoints"
    name = sorted(n for n in checkpoint.load(ckpt).optimizer if n.startswith("adam_m."))[0]
    edit_checkpoint(ckpt, 2, optimizer=lambda t: t.update({name: np.zeros((2, 3), np.float32)}))
    with pytest.raises(BadInputError, match=f"tensor {name} has shape \\(2, 3\\), expected ") as ei:
        resume(r.run_dir)
    assert ei.value.field == name
