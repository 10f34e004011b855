"""Mirroring runs to TensorBoard and MLflow (``toy.runs.report``): a real short training run with
``report.to = ["tensorboard", "mlflow"]``, read back with the libraries' own readers (TensorBoard's
EventAccumulator, MLflow's client) and compared with the run's events.jsonl; the export of the
finished run writes the same; a resumed run goes on in the same places; a failing sink never
stops a run; a missing library is a one-line error with the install command."""

from __future__ import annotations

import builtins
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from toy.runs import report
from toy.runs.writer import RunWriter
from toy.train import config as C
from toy.train.lmrun import resume, train
from toy_testsupport.train_helpers import TINY_SCRATCH, python_docs_corpus

EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator
MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def tb(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def tb_series(ea: EventAccumulator) -> dict[str, list[tuple[int, float, float]]]:
    return {tag: [(e.step, e.value, e.wall_time) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def tb_text(ea: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors(f"{tag}/text_summary")]


def ml_run(uri: str, run_id: str):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("toy")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`toy.run_id` = '{run_id}'")
    return client, run


def ml_series(client, run) -> dict[str, list[tuple[int, float, int]]]:
    return {
        k: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, k))
        for k in run.data.metrics
    }


def expected(evs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The scalars the events say, built here from the schema (not with toy.runs.report)."""
    want: dict[str, list[tuple[int, float]]] = {}
    for e in evs:
        if e["kind"] == "step":
            for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
                want.setdefault(f"train/{k}", []).append((e["step"], e[k]))
        elif e["kind"] == "eval":
            want.setdefault("eval/val_loss", []).append((e["step"], e["loss"]))
            want.setdefault("eval/val_ppl", []).append((e["step"], e["ppl"]))
    return want


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 6-step from-scratch run mirrored live to both backends (evals at 3 and 6, samples at the saves)."""
    d = tmp_path_factory.mktemp("report")
    corpus = python_docs_corpus(d / "corpus", 4)
    values = {**TINY_SCRATCH, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values = {
        **values,
        "out": str(d / "runs"),
        "steps": 6,
        "eval_every": 3,
        "save_every": 3,
        "sample_tokens": 4,
        "report.to": ["tensorboard", "mlflow"],
    }
    cfg = C.override(C.TrainConfig(), **values)
    r = train(cfg)
    assert r.reason == "completed"
    return r.run_dir


def test_a_live_run_reads_back_as_its_events(finished):
    evs = events(finished)
    want = expected(evs)
    assert len(want["train/loss"]) == 6 and len(want["eval/val_loss"]) == 2
    got = tb_series(tb(finished / "tensorboard"))
    assert set(got) == set(want)
    for tag, pts in want.items():  # TensorBoard keeps float32
        assert [s for s, _, _ in got[tag]] == [s for s, _ in pts], tag
        np.testing.assert_allclose([v for _, v, _ in got[tag]], [v for _, v in pts], rtol=1e-6, err_msg=tag)
    samples = [e for e in evs if e["kind"] == "sample"]
    assert samples and tb_text(tb(finished / "tensorboard"), "samples") == [
        (e["step"], e["prompt"] + e["text"]) for e in samples
    ]

    client, run = ml_run(report.default_mlflow_uri(finished.parent), evs[0]["run_id"])
    ml = ml_series(client, run)
    assert {k: [(s, v) for s, v, _ in pts] for k, pts in ml.items()} == want  # MLflow keeps doubles: exact
    assert run.info.status == "FINISHED" and run.info.run_name == evs[0]["run_id"]
    assert run.data.params["optim.lr"] == json.dumps(evs[0]["config"]["optim"]["lr"])
    assert run.data.params["model.n_layer"] == "2" and run.data.tags["toy.recipe"] == "from-scratch"
    arts = client.list_artifacts(run.info.run_id, "samples")
    assert len(arts) == len(samples)
    text = Path(client.download_artifacts(run.info.run_id, arts[-1].path, str(finished.parent / "dl"))).read_text()
    assert text == samples[-1]["prompt"] + samples[-1]["text"]


def test_export_of_the_finished_run_writes_what_the_live_run_wrote(finished, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing is written here (MLflow's default artifact folder is ./mlruns)
    uri = f"sqlite:///{tmp_path / 'other.db'}"
    out = report.export_run(finished, ["tensorboard", "mlflow"], tensorboard_dir=tmp_path / "tb", mlflow_uri=uri)
    assert out["tensorboard"] == str(tmp_path / "tb" / finished.name) and out["mlflow"] == uri
    assert tb_series(tb(tmp_path / "tb" / finished.name)) == tb_series(tb(finished / "tensorboard"))
    rid = events(finished)[0]["run_id"]
    live = ml_series(*ml_run(report.default_mlflow_uri(finished.parent), rid))
    assert ml_series(*ml_run(uri, rid)) == live  # values, steps and timestamps
    # a second export is refused unless asked to replace
    with pytest.raises(report.ReportError, match="already has run"):
        report.export_run(finished, ["mlflow"], mlflow_uri=uri)
    with pytest.raises(report.ReportError, match="already holds TensorBoard events"):
        report.export_run(finished, ["tensorboard"], tensorboard_dir=tmp_path / "tb")
    report.export_run(
        finished, ["tensorboard", "mlflow"], tensorboard_dir=tmp_path / "tb", mlflow_uri=uri, replace=True
    )
    assert ml_series(*ml_run(uri, rid)) == live
    assert tb_series(tb(tmp_path / "tb" / finished.name)) == tb_series(tb(finished / "tensorboard"))
    assert list(cwd.iterdir()) == [] and (tmp_path / "mlartifacts").is_dir()


def test_a_resumed_run_goes_on_in_the_same_places(finished, tmp_path):
    import shutil

    runs = tmp_path / "runs"
    runs.mkdir()
    run_dir = Path(shutil.copytree(finished, runs / finished.name, symlinks=True))
    shutil.copy(finished.parent / "mlflow.db", runs / "mlflow.db")  # the MLflow run the live run made
    r = resume(run_dir, steps=8)
    assert r.reason == "completed" and r.final_step == 8
    want = expected(events(run_dir))
    assert [s for s, _ in want["train/loss"]] == list(range(1, 9))
    got = tb_series(tb(run_dir / "tensorboard"))
    assert [s for s, _, _ in got["train/loss"]] == list(range(1, 9))
    np.testing.assert_allclose([v for _, v, _ in got["train/loss"]], [v for _, v in want["train/loss"]], rtol=1e-6)
    client, run = ml_run(report.default_mlflow_uri(runs), r.run_id)
    assert [(s, v) for s, v, _ in ml_series(client, run)["train/loss"]] == want["train/loss"]
    assert run.info.status == "FINISHED"


def test_a_resume_drops_the_points_after_its_checkpoint_in_tensorboard(tmp_path):
    start = {"kind": "run_start", "t": 0.0, "run_id": "r1", "started_at": "2026-01-01T00:00:00+00:00", "config": {}}
    sink = report.TensorBoardSink(start, tmp_path / "tb")
    for step in (1, 2, 3, 4):
        sink({"kind": "step", "t": float(step), "step": step, "loss": 10.0 - step})
    sink({"kind": "resume", "t": 5.0, "from_step": 2})
    for step in (3, 4, 5):
        sink({"kind": "step", "t": 5.0 + step, "step": step, "loss": 1.0 * step})
    sink.close()
    got = tb_series(tb(tmp_path / "tb"))["train/loss"]
    assert [(s, v) for s, v, _ in got] == [(1, 9.0), (2, 8.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    assert [w for _, _, w in got][:2] == [1767225601.0, 1767225602.0]  # started_at + t


def test_diagnostics_events_become_scalars_per_layer():
    ev = {"kind": "diag_grads", "t": 1.0, "step": 10, "layers": [0.5, None, 2.0], "total": 3.0, "name": "x"}
    assert report.scalars(ev) == [("diag/grads/layer_00", 0.5), ("diag/grads/layer_02", 2.0), ("diag/grads/total", 3.0)]
    ev = {"kind": "diag_updates", "t": 1.0, "step": 10, "ratio": [1, 2], "flag": True}
    assert report.scalars(ev) == [("diag/updates/ratio/layer_00", 1.0), ("diag/updates/ratio/layer_01", 2.0)]


def test_a_failing_sink_is_dropped_with_one_warning_and_a_note(tmp_path, caplog):
    w = RunWriter("train", {}, root=tmp_path)
    seen = []

    def bad(ev):
        raise RuntimeError("store is gone")

    w.add_listener(bad, "mlflow")
    w.add_listener(seen.append, "good")
    with caplog.at_level(logging.WARNING, logger="toy.runs"):
        w.event("step", step=1, loss=1.0)
        w.event("step", step=2, loss=0.5)
        w.end()
    kinds = [e["kind"] for e in events(w.dir)]
    assert kinds == ["run_start", "step", "note", "step", "run_end"]
    note = events(w.dir)[2]["text"]
    assert note == "mlflow: stopped mirroring this run (RuntimeError: store is gone)"
    assert [r.getMessage() for r in caplog.records] == [f"run {w.run_id}: {note}"]
    assert [e["kind"] for e in seen] == ["step", "note", "step", "run_end"]  # the others go on


@pytest.mark.parametrize(
    ("backend", "module", "extra"), [("tensorboard", "tensorboardX", "tensorboard"), ("mlflow", "mlflow", "mlflow")]
)
def test_a_missing_library_is_a_one_line_error_with_the_install_command(backend, module, extra, monkeypatch):
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named '{module}'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    monkeypatch.setattr(report, "install_command", lambda e: f"pip install 'toy-cli[{e}]'")
    with pytest.raises(report.ReportUnavailableError) as ei:
        report.check_available([backend])
    what = {"tensorboard": "writing TensorBoard events", "mlflow": "logging to MLflow"}[backend]
    assert str(ei.value) == f"{what} needs {module} (No module named '{module}')"
    assert "\n" not in str(ei.value) and ei.value.hint == f"pip install 'toy-cli[{extra}]'"


def test_the_install_hint_for_the_new_extras(monkeypatch, tmp_path):
    from toy import extras

    root = tmp_path / "checkout"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "dev.txt").write_text("tensorboardX>=2.6\n")
    monkeypatch.chdir(root)
    monkeypatch.setattr(extras, "_pip", lambda: "pip")
    monkeypatch.setattr(extras, "_origin", lambda: ("editable", root))
    assert extras.install_command("tensorboard") == "just setup"  # a dev requirement
    assert extras.install_command("mlflow") == "pip install 'toy-cli[mlflow]'"  # not one
    monkeypatch.setattr(extras, "_origin", lambda: ("checkout", root))  # tools/install.py has no flag for them
    assert extras.install_command("mlflow") == "pip install 'toy-cli[mlflow]'"
    assert extras.install_command("plot").startswith("just install")


def test_a_backend_that_cannot_be_opened_leaves_the_run_going(tmp_path, caplog):
    w = RunWriter("train", {}, root=tmp_path)
    cfg = C.ReportConfig(to=["mlflow", "tensorboard"], mlflow_uri="nosuchscheme://nowhere")
    with caplog.at_level(logging.WARNING, logger="toy.runs"):
        sinks = report.attach(w, cfg)
    assert [s.name for s in sinks] == ["tensorboard"]
    w.event("step", step=1, loss=2.5)
    w.end()
    evs = events(w.dir)
    assert [e["kind"] for e in evs] == ["run_start", "note", "step", "run_end"]
    assert evs[1]["text"].startswith("mlflow: not mirroring this run (") and len(caplog.records) == 1
    assert [(s, v) for s, v, _ in tb_series(tb(w.dir / "tensorboard"))["train/loss"]] == [(1, 2.5)]
