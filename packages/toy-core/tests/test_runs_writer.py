"""RunWriter: the bundle layout and the toy/v1 event rules (docs/concepts/architecture.md, "Runs")."""

from __future__ import annotations

import json
import threading

import pytest

from toy.runs import SCHEMA, RunWriter


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bundle_layout_and_events(tmp_path):
    w = RunWriter("serve", {"model": "m.gguf", "parallel": 4}, root=tmp_path, model_dims={"d_model": 8})
    assert w.dir.parent == tmp_path and w.run_id.startswith("serve-")
    assert json.loads((w.dir / "config.json").read_text()) == {"model": "m.gguf", "parallel": 4}
    w.event("request", request_id="r1", ttft_s=0.5, tok_s=float("inf"), nan=float("nan"))
    w.end("completed", requests=1)
    w.end("completed")  # once only
    ev = read(w.dir / "events.jsonl")
    assert [e["kind"] for e in ev] == ["run_start", "request", "run_end"]
    start = ev[0]
    assert start["schema"] == SCHEMA == "toy/v1"
    assert start["run_id"] == w.run_id and start["config"]["parallel"] == 4 and start["model_dims"] == {"d_model": 8}
    for key in ("started_at", "host", "backend", "git"):
        assert key in start
    assert ev[1]["tok_s"] is None and ev[1]["nan"] is None  # non-finite floats become null
    assert all(isinstance(e["t"], float) and e["t"] >= 0 for e in ev)
    assert [e["t"] for e in ev] == sorted(e["t"] for e in ev)
    assert ev[2]["reason"] == "completed" and ev[2]["requests"] == 1
    with pytest.raises(RuntimeError, match="has ended"):
        w.event("request")


def test_bad_reason_and_unique_ids(tmp_path):
    a = RunWriter("eval", {}, root=tmp_path)
    b = RunWriter("eval", {}, root=tmp_path)
    assert a.run_id != b.run_id
    with pytest.raises(ValueError, match="reason"):
        a.end("finished")


def test_threads_write_whole_lines(tmp_path):
    w = RunWriter("serve", {}, root=tmp_path)

    def spam(k):
        for i in range(200):
            w.event("request", worker=k, i=i, text="x" * 500)

    threads = [threading.Thread(target=spam, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.end("interrupted")
    ev = read(w.dir / "events.jsonl")  # every line parses: no interleaving
    assert len(ev) == 2 + 800 and ev[-1]["reason"] == "interrupted"


def test_runs_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_RUNS_DIR", str(tmp_path / "elsewhere"))
    w = RunWriter("train", {})
    assert w.dir.parent == tmp_path / "elsewhere"
    w.end()
