"""`toy train ... --report-to tensorboard,mlflow` and `toy runs export --to tensorboard|mlflow RUN...`:
a real short run mirrored live, exported again elsewhere, both read back with TensorBoard's
EventAccumulator and MLflow's client and compared with events.jsonl; bad --to, a second export and
a missing library are clean `error:`/`hint:` lines."""

from __future__ import annotations

import builtins
import json

import numpy as np
import pytest

from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.train_helpers import python_docs_corpus

EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator
MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient


def tb_series(logdir) -> dict:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def ml_series(uri: str, toy_run: str) -> tuple[dict, object]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("toy")
    (r,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`toy.run_id` = '{toy_run}'")
    hist = {
        k: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(r.info.run_id, k)] for k in r.data.metrics
    }
    return {k: sorted(v) for k, v in hist.items()}, r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import os

    d = tmp_path_factory.mktemp("export")
    corpus = python_docs_corpus(d / "corpus", 3)["small"]
    old = {k: os.environ.get(k) for k in ("TOY_THREADS", "TOY_DEVICE")}
    os.environ.update(TOY_THREADS="1", TOY_DEVICE="cpu")
    try:
        from toy_cli.main import main

        args = ["train", "from-scratch", str(corpus), "--preset", "tiny", "--vocab-size", "300", "-b", "2"]
        args += ["--context", "32", "--steps", "4", "--eval-every", "2", "--out", str(d / "runs"), "-q"]
        assert main([*args, "--report-to", "tensorboard,mlflow"]) == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    (run_dir,) = [p for p in (d / "runs").iterdir() if p.name.startswith("train-")]
    return run_dir


def test_the_live_mirror_and_the_export_match_the_events(trained, tmp_path, capsys):
    evs = [json.loads(line) for line in (trained / "events.jsonl").read_text().splitlines()]
    steps = [e for e in evs if e["kind"] == "step"]
    evals = [e for e in evs if e["kind"] == "eval"]
    assert len(steps) == 4 and [e["step"] for e in evals] == [2, 4]

    live_tb = tb_series(trained / "tensorboard")
    assert [s for s, _, _ in live_tb["train/loss"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v, _ in live_tb["train/loss"]], [e["loss"] for e in steps], rtol=1e-6)
    np.testing.assert_allclose([v for _, v, _ in live_tb["train/lr"]], [e["lr"] for e in steps], rtol=1e-6)
    np.testing.assert_allclose([v for _, v, _ in live_tb["eval/val_ppl"]], [e["ppl"] for e in evals], rtol=1e-6)
    live_uri = f"sqlite:///{trained.parent / 'mlflow.db'}"
    live_ml, r = ml_series(live_uri, trained.name)
    assert [(s, v) for s, v, _ in live_ml["train/grad_norm"]] == [(e["step"], e["grad_norm"]) for e in steps]
    assert [(s, v) for s, v, _ in live_ml["eval/val_loss"]] == [(e["step"], e["loss"]) for e in evals]
    assert r.info.status == "FINISHED"

    uri = f"sqlite:///{tmp_path / 'exported.db'}"
    tbdir = tmp_path / "tb"
    code, out, err = run(
        capsys, "runs", "export", trained, "--to", "tensorboard,mlflow", "--tensorboard-dir", tbdir,
        "--mlflow-uri", uri, "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out) == [
        {"run": trained.name, "events": len(evs), "tensorboard": str(tbdir / trained.name), "mlflow": uri}
    ]
    assert tb_series(tbdir / trained.name) == live_tb
    assert ml_series(uri, trained.name)[0] == live_ml

    # exporting again: refused with a hint, then done with --replace
    code, out, err = run(capsys, "runs", "export", trained, "--to", "mlflow", "--mlflow-uri", uri)
    assert_clean_error(code, err, 1, f"already has run {trained.name}", hint=True)
    code, out, err = run(capsys, "runs", "export", trained.name, "--to", "tensorboard", "--runs-dir", trained.parent)
    assert_clean_error(code, err, 1, "already holds TensorBoard events", "--replace", hint=True)
    code, out, err = run(capsys, "runs", "export", trained, "--to", "mlflow", "--mlflow-uri", uri, "--replace")
    assert code == 0 and out.startswith(f"{trained.name}: {len(evs)} events -> mlflow {uri}"), err
    assert ml_series(uri, trained.name)[0] == live_ml


def test_bad_to_is_bad_input(trained, capsys):
    code, _, err = run(capsys, "runs", "export", trained, "--to", "wandb")
    assert_clean_error(code, err, 2, "--to 'wandb'", hint=True)


def test_a_missing_library_is_one_error_line_and_the_install_hint(trained, capsys, monkeypatch):
    real = builtins.__import__

    def no_tensorboardx(name, *a, **k):
        if name.split(".")[0] == "tensorboardX":
            raise ImportError("No module named 'tensorboardX'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    code, out, err = run(capsys, "runs", "export", trained, "--to", "tensorboard", "--tensorboard-dir", "unused")
    assert_clean_error(code, err, 2, "writing TensorBoard events needs tensorboardX", hint=True)
    assert len(err.strip().splitlines()) == 2, err  # error: and hint:
    assert "toy-cli[tensorboard]" in err or "just setup" in err, err
    assert out == ""
