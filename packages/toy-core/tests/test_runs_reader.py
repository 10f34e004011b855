"""toy.runs.reader: tolerant event reading, run summaries and statuses,
listing, RUN resolution, curves, config comparison and sparklines.

Bundles are written by hand (JSON lines) in tmp folders, so every expected
figure below comes from the data written here; one test reads back a bundle
written by the real RunWriter.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from toy.errors import BadInputError
from toy.runs import RunWriter
from toy.runs.reader import (
    compare,
    flatten,
    list_runs,
    load_run,
    loss_curve,
    lr_curve,
    read_events,
    resolve_run,
    sparkline,
    val_curves,
)


def write_bundle(root, run_id, lines, config=None, tail=""):
    """A bundle folder: ``lines`` are dicts (dumped) or raw strings, each
    ending with a newline; ``tail`` is appended without one (a torn line)."""
    d = root / run_id
    d.mkdir(parents=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines) + tail
    (d / "events.jsonl").write_text(text)
    return d


def start(run_id, kind="train", started="2026-01-01T00:00:00+00:00", **kw):
    ev = {"kind": "run_start", "t": 0.0, "schema": "toy/v1", "run_id": run_id, "run_kind": kind}
    ev.update(started_at=started, host={"name": "some-other-host"}, config={})
    ev.update(kw)
    return ev


def step(n, loss, lr=1e-3, tps=1000.0, t=None):
    return {
        "kind": "step",
        "t": t if t is not None else float(n),
        "step": n,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tps,
    }


def end(reason="completed", t=10.0, **kw):
    return {"kind": "run_end", "t": t, "reason": reason, **kw}


TRAIN_ID = "train-20260101-000000-aaaa"


def completed_train(root, run_id=TRAIN_ID, started="2026-01-01T00:00:00+00:00", config=None):
    lines = [
        start(run_id, started=started, recipe="from-scratch", n_params=869504, tokenizer="trained-bpe"),
        step(1, 4.0, lr=1e-3, tps=100.0),
        step(2, 3.0, lr=8e-4, tps=300.0),
        {"kind": "eval", "t": 2.5, "step": 2, "name": "val", "loss": 3.2, "ppl": 24.5, "tokens": 64},
        {"kind": "checkpoint", "t": 2.6, "step": 2, "path": "checkpoints/step_2.gguf"},
        step(3, 2.5, lr=5e-4, tps=200.0),
        step(4, 2.0, lr=1e-4, tps=1000.0),
        {"kind": "eval", "t": 4.5, "step": 4, "name": "val", "loss": 2.9, "ppl": 18.2, "tokens": 64},
        {"kind": "eval", "t": 4.6, "step": 4, "name": "train_subset", "loss": 1.0, "ppl": 2.7, "tokens": 64},
        {"kind": "sample", "t": 4.7, "step": 4, "prompt": "Once", "text": " upon", "greedy": True},
        {"kind": "checkpoint", "t": 4.8, "step": 4, "path": "checkpoints/step_4.gguf"},
        end("completed", t=5.25, final_step=4, final_loss=2.0, val_loss=2.9),
    ]
    cfg = config if config is not None else {"steps": 4, "optim": {"lr": 1e-3, "schedule": "cosine"}}
    return write_bundle(root, run_id, lines, config=cfg)


# -- read_events


def test_clean_file_reads_every_event(tmp_path):
    d = completed_train(tmp_path)
    events, problems = read_events(d / "events.jsonl")
    assert problems == []
    assert len(events) == 12
    assert events[0]["kind"] == "run_start" and events[-1]["kind"] == "run_end"


def test_torn_last_line_is_skipped_silently(tmp_path):
    d = write_bundle(tmp_path, "train-x", [start("train-x"), step(1, 2.0)], tail='{"kind": "step", "t": 2.0, "st')
    events, problems = read_events(d / "events.jsonl")
    assert [e["kind"] for e in events] == ["run_start", "step"]
    assert problems == []


def test_complete_last_line_without_newline_is_kept(tmp_path):
    d = write_bundle(tmp_path, "train-x", [start("train-x")], tail=json.dumps(step(1, 2.0)))
    events, problems = read_events(d / "events.jsonl")
    assert [e["kind"] for e in events] == ["run_start", "step"] and problems == []


def test_malformed_lines_are_reported_with_line_numbers(tmp_path):
    lines = [start("train-x"), step(1, 3.0), "this is not json", "[1, 2]", '{"t": 1.0}', step(2, 2.0), "{oops"]
    d = write_bundle(tmp_path, "train-x", lines)
    events, problems = read_events(d / "events.jsonl")
    assert [e.get("step") for e in events] == [None, 1, 2]  # the rest is still read
    assert [p.line for p in problems] == [3, 4, 5, 7]  # a bad last line that ends with a newline is not torn
    assert "bad JSON" in problems[0].reason
    assert "not an object" in problems[1].reason
    assert problems[2].reason == "no kind"
    run = load_run(d)
    assert run.steps == 2 and run.final_loss == 2.0 and [p.line for p in run.problems] == [3, 4, 5, 7]
    assert str(run.problems[0]).startswith("events.jsonl line 3: bad JSON")


def test_unknown_kinds_and_keys_are_ignored(tmp_path):
    lines = [
        start("train-x", future_field={"a": 1}),
        {"kind": "mystery", "t": 0.5, "payload": [1, 2, 3]},
        {**step(1, 3.0), "new_metric": 7},
        end("completed", final_step=1, final_loss=3.0, shiny=True),
    ]
    run = load_run(write_bundle(tmp_path, "train-x", lines))
    assert run.problems == []
    assert (run.status, run.steps, run.final_loss) == ("completed", 1, 3.0)


def test_nan_literals_and_wrong_types_read_as_missing(tmp_path):
    lines = [start("train-x"), '{"kind": "step", "t": 1, "step": 1, "loss": NaN, "lr": "fast"}', step(2, 1.5)]
    run = load_run(write_bundle(tmp_path, "train-x", lines))
    assert run.problems == []
    assert loss_curve(run) == [(1, None), (2, 1.5)]
    assert lr_curve(run) == [(1, None), (2, 1e-3)]


# -- summaries and statuses


def test_completed_train_summary(tmp_path):
    run = load_run(completed_train(tmp_path))
    assert run.id == TRAIN_ID and run.kind == "train"
    assert run.model == "from-scratch 0.87M"
    assert run.status == "completed"
    assert run.steps == 4 and run.final_loss == 2.0
    assert run.best_val == 2.9  # the "train_subset" eval (1.0) is not validation
    assert run.tokens_per_s == 250.0  # median of 100, 300, 200, 1000 (the mean would be 400)
    assert run.wall_s == 5.25 and run.n_events == 12
    assert run.started_at == "2026-01-01T00:00:00+00:00"
    assert loss_curve(run) == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]
    assert lr_curve(run) == [(1, 1e-3), (2, 8e-4), (3, 5e-4), (4, 1e-4)]
    assert val_curves(run) == {"val": [(2, 3.2), (4, 2.9)], "train_subset": [(4, 1.0)]}
    d = run.to_dict()
    assert d["status"] == "completed" and d["problems"] == [] and json.dumps(d)


@pytest.mark.parametrize("reason", ["interrupted", "errored"])
def test_run_end_reason_is_the_status(tmp_path, reason):
    lines = [start("train-x"), step(1, 3.0), step(2, 2.5), end(reason, final_step=2)]
    run = load_run(write_bundle(tmp_path, "train-x", lines))
    assert run.status == reason
    assert run.steps == 2 and run.final_loss == 2.5  # no final_loss in run_end: the last step's


def test_without_run_end_running_or_unfinished(tmp_path):
    me = {"name": platform.node()}
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    cases = {
        "train-alive": ({"pid": os.getpid(), "host": me}, "running"),
        "train-elsewhere": ({"pid": os.getpid(), "host": {"name": "not-" + platform.node()}}, "unfinished"),
        "train-dead": ({"pid": dead, "host": me}, "unfinished"),
        "train-nopid": ({"host": me}, "unfinished"),
    }
    for rid, (fields, _) in cases.items():
        ev = start(rid)
        ev.update(fields)
        write_bundle(tmp_path, rid, [ev, step(1, 3.0)])
    for rid, (_, want) in cases.items():
        assert load_run(tmp_path / rid).status == want, rid


def test_a_training_run_holding_its_lock_is_running(tmp_path):
    # Before: a resumed session writes no pid, so a resumed run in progress read "unfinished". A training run
    # holds its folder's lock (toy.runs.folder.RunLock) while it runs; the reader asks who holds it.
    lines = [start("train-r", host={"name": platform.node()}), step(1, 3.0), end("interrupted")]
    d = write_bundle(tmp_path, "train-r", lines + [{"kind": "resume", "t": 5.0, "from_step": 1}, step(2, 2.0)])
    code = "import sys; from toy.runs.folder import RunLock; RunLock(sys.argv[1]); print('held', flush=True); input()"
    child = subprocess.Popen([sys.executable, "-c", code, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"held"
        assert load_run(d).status == "running"
    finally:
        child.kill()  # SIGKILL: the pid stays in the lock file, the lock itself goes with the process
        child.wait()
    assert (d / ".lock").read_text().strip() == str(child.pid)
    assert load_run(d).status == "unfinished"


def test_resume_rules(tmp_path):
    lines = [
        start("train-x"),
        step(1, 4.0),
        step(2, 3.0),
        {"kind": "eval", "t": 2.1, "step": 2, "name": "val", "loss": 3.5},
        step(3, 9.0),
        {"kind": "eval", "t": 3.1, "step": 3, "name": "val", "loss": 1.0},
        '{"kind": "step", "t": 3.5, "st',  # the killed session's torn line, completed by RunWriter.reopen
        {"kind": "resume", "t": 3.6, "from_step": 2, "checkpoint": "step_2.gguf"},
        step(3, 2.5),
        step(4, 2.0),
    ]
    run = load_run(write_bundle(tmp_path, "train-x", lines))
    assert run.problems == []
    assert loss_curve(run) == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]  # the later step 3
    assert run.best_val == 3.5  # the eval after the dropped step 3 is gone
    assert run.status == "unfinished" and run.steps == 4
    lines2 = [start("train-y"), step(1, 3.0), end("interrupted"), {"kind": "resume", "from_step": 1}, step(2, 2.0)]
    lines2.append(end("completed", final_step=2, final_loss=2.0))
    assert load_run(write_bundle(tmp_path, "train-y", lines2)).status == "completed"
    lines3 = [start("train-z"), step(1, 3.0), end("interrupted"), {"kind": "resume", "from_step": 1}]
    assert load_run(write_bundle(tmp_path, "train-z", lines3)).status == "unfinished"


def test_eval_run_summary(tmp_path):
    cfg = {"command": "perplexity", "model": "/models/tiny.Q8_0.gguf"}
    lines = [
        start("eval-20260101-000000-0001", kind="eval", config=cfg),
        {"kind": "eval", "t": 1.0, "name": "wikitext", "loss": 3.5, "ppl": 33.1, "windows": 10},
        {"kind": "eval", "t": 2.0, "name": "other", "loss": 1.5, "ppl": 4.5},
        end("completed", t=2.5),
    ]
    run = load_run(write_bundle(tmp_path, "eval-20260101-000000-0001", lines, config=cfg))
    assert (run.kind, run.model, run.status) == ("eval", "perplexity: tiny.Q8_0.gguf", "completed")
    assert run.best_val == 3.5  # the headline: the first eval event
    assert run.steps is None and run.final_loss is None and run.tokens_per_s is None
    cfg2 = {"command": "compare", "model": "a/one.gguf", "model_b": "b/two.gguf"}
    run2 = load_run(write_bundle(tmp_path, "eval-two", [start("eval-two", kind="eval", config=cfg2)], config=cfg2))
    assert run2.model == "compare: one.gguf vs two.gguf"
    # what `toy eval` writes: model info dicts in run_start; the headline skips evals without a loss
    a, b = {"path": "/m/a.Q8_0.gguf", "n_vocab": 10}, {"path": "/m/b.F16.gguf", "n_vocab": 10}
    lines3 = [
        start("eval-three", kind="eval", config={"command": "lmc"}, model=a, model_b=b),
        {"kind": "eval", "t": 1.0, "name": "lmc", "barrier": 0.3},
        {"kind": "eval", "t": 2.0, "name": "lmc@0", "loss": 2.25, "alpha": 0.0},
    ]
    run3 = load_run(write_bundle(tmp_path, "eval-three", lines3, config={"command": "lmc"}))
    assert run3.model == "lmc: a.Q8_0.gguf vs b.F16.gguf" and run3.best_val == 2.25


def test_serve_run_summary(tmp_path):
    info = {"path": "/models/m.gguf", "alias": "m", "n_ctx": 512, "n_slot": 2}
    reqs = [
        {"kind": "request", "t": float(i), "request_id": f"r{i}", "endpoint": "/v1/completions", "status": 200}
        | {"tok_s": v, "completion_tokens": 5}
        for i, v in enumerate([10.0, 30.0, None, 80.0])
    ]
    lines = [start("serve-1", kind="serve", model=info), *reqs, end("completed", t=9.0, requests=4)]
    run = load_run(write_bundle(tmp_path, "serve-1", lines))
    assert (run.kind, run.model, run.status) == ("serve", "m.gguf", "completed")
    assert run.tokens_per_s == 30.0  # median of 10, 30, 80 (None skipped)
    assert run.steps is None and run.best_val is None


def test_missing_events_and_bad_config(tmp_path):
    d = tmp_path / "train-broken"
    d.mkdir()
    (d / "config.json").write_text("{nope")
    run = load_run(d)
    assert run.kind == "train"  # from the id
    assert run.status == "unfinished" and run.n_events == 0
    assert [(p.file, p.line) for p in run.problems] == [("events.jsonl", None), ("config.json", None)]
    d2 = write_bundle(tmp_path, "x", [step(1, 2.0)])
    run2 = load_run(d2)
    assert run2.kind == "unknown" and "not run_start" in run2.problems[0].reason


def test_real_writer_round_trip(tmp_path):
    w = RunWriter("train", {"steps": 2, "optim": {"lr": 0.01}}, root=tmp_path, recipe="from-scratch", n_params=1500)
    w.event("step", step=1, loss=5.0, lr=0.01, tokens_per_s=50.0)
    w.event("step", step=2, loss=float("nan"), lr=0.005, tokens_per_s=70.0)
    w.event("eval", step=2, name="val", loss=4.5, ppl=90.0, tokens=10)
    running = load_run(w.dir)
    assert running.status == "running"  # this process, this host
    assert running.start["pid"] == os.getpid()
    w.end("completed", final_step=2, final_loss=None)
    run = load_run(w.dir)
    assert run.id == w.run_id and run.status == "completed" and run.problems == []
    assert run.model == "from-scratch 1.5K"
    assert run.config == {"steps": 2, "optim": {"lr": 0.01}}
    assert loss_curve(run) == [(1, 5.0), (2, None)]
    assert run.final_loss is None and run.best_val == 4.5 and run.tokens_per_s == 60.0


# -- listing and resolving


@pytest.fixture
def many(tmp_path):
    completed_train(tmp_path, "train-20260101-000000-aaaa", started="2026-01-01T00:00:00+00:00")
    write_bundle(
        tmp_path,
        "train-20260101-000000-aabb",
        [start("b", started="2026-01-03T00:00:00+00:00"), step(1, 5.0), step(2, 1.5), end("interrupted")],
    )
    write_bundle(
        tmp_path,
        "serve-20260102-000000-cccc",
        [start("c", kind="serve", started="2026-01-02T00:00:00+00:00", model={"path": "m.gguf"})],
    )
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    return tmp_path


def test_list_sort_and_filter(many):
    ids = lambda runs: [r.id[-4:] for r in runs]  # noqa: E731
    assert ids(list_runs(many)) == ["aabb", "cccc", "aaaa"]  # newest first
    assert ids(list_runs(many, sort="loss")) == ["aabb", "aaaa", "cccc"]  # 1.5, 2.0, none last
    assert ids(list_runs(many, sort="steps")) == ["aaaa", "aabb", "cccc"]  # 4, 2, none
    assert ids(list_runs(many, sort="id")) == ["cccc", "aaaa", "aabb"]
    assert ids(list_runs(many, kind="train")) == ["aabb", "aaaa"]
    assert ids(list_runs(many, status="completed")) == ["aaaa"]
    assert ids(list_runs(many, kind="serve", status="unfinished")) == ["cccc"]
    assert list_runs(many / "missing") == []
    for bad in ({"sort": "size"}, {"kind": "fine-tune"}, {"status": "done"}):
        with pytest.raises(BadInputError) as e:
            list_runs(many, **bad)
        assert e.value.hint


def test_list_uses_the_env_root(many, monkeypatch):
    monkeypatch.setenv("TOY_RUNS_DIR", str(many))
    assert len(list_runs()) == 3


def test_resolve_run(many):
    assert resolve_run("serve", many) == many / "serve-20260102-000000-cccc"
    assert resolve_run("train-20260101-000000-aaaa", many) == many / "train-20260101-000000-aaaa"
    assert resolve_run("train-20260101-000000-aab", many) == many / "train-20260101-000000-aabb"
    folder = many / "train-20260101-000000-aabb"
    assert resolve_run(str(folder), "/nonexistent") == folder
    assert resolve_run(folder / "events.jsonl", "/nonexistent") == folder
    with pytest.raises(BadInputError, match="ambiguous") as e:
        resolve_run("train-20260101-000000-aa", many)
    assert "train-20260101-000000-aaaa" in str(e.value) and "train-20260101-000000-aabb" in str(e.value)
    with pytest.raises(BadInputError, match="no run 'eval'") as e:
        resolve_run("eval", many)
    assert "serve-20260102-000000-cccc" in str(e.value) and "toy runs list" in e.value.hint
    with pytest.raises(BadInputError):
        resolve_run("not-a-run", many)  # a folder without a bundle is not a run


# -- compare and sparkline


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
        "f": None,
    }


def test_compare_config_and_figures(tmp_path):
    a = load_run(completed_train(tmp_path, "train-a", config={"optim": {"lr": 1e-3, "wd": 0.1}, "steps": 4, "s": None}))
    cfg_b = {"optim": {"lr": 2e-3, "wd": 0.1}, "steps": 4, "data": {"paths": ["x"]}}
    lines = [start("train-b", config=cfg_b), step(1, 3.0, tps=500.0), step(2, 1.5, tps=700.0), end("errored")]
    b = load_run(write_bundle(tmp_path, "train-b", lines, config=cfg_b))
    c = compare([a, b])
    assert c["runs"] == ["train-a", "train-b"]
    diffs = {d["key"]: (d["values"], d["present"]) for d in c["config"]}
    assert diffs == {
        "data.paths": ([None, ["x"]], [False, True]),
        "optim.lr": ([1e-3, 2e-3], [True, True]),
        "s": ([None, None], [True, False]),  # null in one, absent in the other: a difference
    }
    figs = {f["name"]: f for f in c["figures"]}
    assert figs["final_loss"]["values"] == [2.0, 1.5] and figs["final_loss"]["deltas"] == [0.0, -0.5]
    assert figs["steps"]["deltas"] == [0, -2]
    assert figs["tokens_per_s"]["deltas"] == [0.0, 350.0]  # 600 - 250
    assert figs["best_val"]["values"] == [2.9, None] and figs["best_val"]["deltas"] == [0.0, None]
    assert figs["status"]["values"] == ["completed", "errored"] and figs["status"]["deltas"] == [None, None]
    assert json.dumps(c)
    assert compare([a, a])["config"] == []


@pytest.mark.parametrize(
    ("values", "width", "want"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], None, "▁▂▃▄▅▆▇█"),
        ([7, 0], None, "█▁"),
        ([5.0, 5.0, 5.0], None, "▄▄▄"),  # constant: flat, mid-height
        ([1.0, None, 3.0], None, "▁ █"),
        ([1.0, float("nan"), float("inf"), 3.0], None, "▁  █"),
        ([None, None], None, "  "),
        ([], 10, ""),
        ([1, 2], 0, ""),
        ([0, 0, 10, 10], 2, "▁█"),  # each cell is the mean of its slice
        ([0, 2, 6, 8, 10, 10], 3, "▁▆█"),  # means 1, 7, 10: (7 - 1) / 9 * 7 = 4.67 -> 5
        ([0, 1], 4, "▁▁██"),  # a shorter series is stretched
        ([None, None, 4, 8], 2, " ▄"),  # one finite cell (the mean 6) is a constant series
    ],
)
def test_sparkline(values, width, want):
    assert sparkline(values, width) == want
