"""`toy runs list|show|compare|plot` on hand-written run bundles: tables and
--json on stdout, warnings on stderr, exit codes (2 with error:/hint: for bad
input), and plots checked by reading the image back and by counting the
lines on the figure's axes.

Driven through ``toy_cli.main.main`` with captured stdout/stderr; every runs
folder is a tmp folder.
"""

from __future__ import annotations

import json
import sys

import pytest

from toy_testsupport.cli_helpers import run

A = "train-20260101-000000-aaaa"  # completed, 4 steps
B = "train-20260103-000000-bbbb"  # interrupted, 2 steps, one malformed line (line 3)
S = "serve-20260102-000000-cccc"  # serve, 2 requests


def assert_error(code, err, want_code, *fragments):
    assert code == want_code, err
    assert err.startswith("error: ") or "\nerror: " in err, err
    assert "hint: " in err, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


def write(root, run_id, lines, config):
    d = root / run_id
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    (d / "events.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def start(run_id, kind, started, config, **kw):
    ev = {"kind": "run_start", "t": 0.0, "schema": "toy/v1", "run_id": run_id, "run_kind": kind}
    return {**ev, "started_at": started, "host": {"name": "elsewhere"}, "config": config, **kw}


def step(n, loss, lr, tps):
    return {"kind": "step", "t": float(n), "step": n, "loss": loss, "lr": lr, "tokens_per_s": tps}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    r = tmp_path / "runs"
    cfg_a = {"steps": 4, "optim": {"lr": 0.001, "schedule": "cosine"}, "seed": 0}
    write(
        r,
        A,
        [
            start(A, "train", "2026-01-01T00:00:00+00:00", cfg_a, recipe="from-scratch", n_params=869504),
            step(1, 4.0, 1e-3, 100.0),
            step(2, 3.0, 8e-4, 300.0),
            {"kind": "eval", "t": 2.5, "step": 2, "name": "val", "loss": 3.25, "ppl": 25.8, "tokens": 64},
            {"kind": "checkpoint", "t": 2.6, "step": 2, "path": "checkpoints/step_2.gguf"},
            step(3, 2.5, 5e-4, 200.0),
            step(4, 2.0, 1e-4, 1000.0),
            {"kind": "eval", "t": 4.5, "step": 4, "name": "val", "loss": 2.75, "ppl": 15.6, "tokens": 64},
            {"kind": "sample", "t": 4.7, "step": 4, "prompt": "Once", "text": " upon\na time", "greedy": True},
            {"kind": "checkpoint", "t": 4.8, "step": 4, "path": "checkpoints/step_4.gguf"},
            {"kind": "run_end", "t": 5.0, "reason": "completed", "final_step": 4, "final_loss": 2.0},
        ],
        cfg_a,
    )
    cfg_b = {"steps": 10, "optim": {"lr": 0.002, "schedule": "cosine"}, "data": {"paths": ["corpus"]}}
    write(
        r,
        B,
        [
            start(B, "train", "2026-01-03T00:00:00+00:00", cfg_b, recipe="from-scratch", n_params=1500),
            step(1, 5.0, 2e-3, 600.0),
            "{this line is broken",
            step(2, 1.5, 1e-3, 800.0),
            {"kind": "run_end", "t": 3.0, "reason": "interrupted", "final_step": 2, "final_loss": 1.5},
        ],
        cfg_b,
    )
    cfg_s = {"model": "/m/tiny.gguf", "port": 8000}
    req = {"kind": "request", "endpoint": "/v1/completions", "completion_tokens": 8, "ttft_s": 0.1}
    write(
        r,
        S,
        [
            start(S, "serve", "2026-01-02T00:00:00+00:00", cfg_s, model={"path": "/m/tiny.gguf", "alias": "tiny"}),
            {**req, "t": 1.0, "request_id": "r1", "status": 200, "tok_s": 40.0},
            {**req, "t": 2.0, "request_id": "r2", "status": 400, "tok_s": 60.0},
            {"kind": "run_end", "t": 3.0, "reason": "completed", "requests": 2},
        ],
        cfg_s,
    )
    return r


# -- list


def test_list_table(root, capsys):
    code, out, err = run(capsys, "runs", "list", "--runs-dir", root)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "KIND", "MODEL", "STEPS", "LOSS", "BEST", "VAL", "TOK/S", "STATUS"]
    assert [ln.split()[0] for ln in lines[1:]] == [B, S, A]  # newest first
    row_a = lines[3].split()
    assert row_a == [A, "train", "from-scratch", "0.87M", "4", "2.0000", "2.7500", "250", "completed"]
    assert lines[1].split()[-1] == "interrupted" and "tiny.gguf" in lines[2]
    # the malformed line is a warning naming the run and the line; the listing goes on
    assert f"warning: run {B}: events.jsonl line 3: bad JSON" in err


def test_list_json_filters_and_env_root(root, capsys, monkeypatch):
    monkeypatch.setenv("TOY_RUNS_DIR", str(root))
    code, out, _ = run(capsys, "runs", "list", "--json")
    assert code == 0
    runs = json.loads(out)
    assert [r["id"] for r in runs] == [B, S, A]
    a = runs[2]
    assert (a["steps"], a["final_loss"], a["best_val"], a["tokens_per_s"]) == (4, 2.0, 2.75, 250.0)
    assert runs[0]["problems"] == [{"line": 3, "reason": runs[0]["problems"][0]["reason"], "file": "events.jsonl"}]
    assert runs[1]["tokens_per_s"] == 50.0  # median of the requests' 40 and 60
    code, out, _ = run(capsys, "runs", "list", "--json", "--kind", "train", "--sort", "loss")
    assert [r["id"] for r in json.loads(out)] == [B, A]  # 1.5 before 2.0
    code, out, _ = run(capsys, "runs", "list", "--json", "--status", "completed", "--limit", "1")
    assert [r["id"] for r in json.loads(out)] == [S]


def test_list_bad_input_and_empty(root, capsys, tmp_path):
    code, _, err = run(capsys, "runs", "list", "--runs-dir", root, "--sort", "size")
    assert_error(code, err, 2, "unknown sort key 'size'", "steps")
    code, _, err = run(capsys, "runs", "list", "--runs-dir", tmp_path / "nope")
    assert_error(code, err, 2, "not a folder")
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "runs", "list", "--runs-dir", tmp_path / "empty")
    assert code == 0 and out == "" and "no runs in" in err
    code, out, _ = run(capsys, "runs", "list", "--runs-dir", tmp_path / "empty", "--json")
    assert code == 0 and json.loads(out) == []


# -- show


def test_show_text(root, capsys):
    code, out, err = run(capsys, "runs", "show", "train-20260101", "--runs-dir", root)
    assert code == 0, err
    assert f"run        {A}" in out
    assert "status     completed at step 4" in out
    assert "optim.lr = 0.001" in out
    loss = next(ln for ln in out.splitlines() if ln.startswith("loss "))
    assert "█▅▃▁" in loss  # 4.0, 3.0, 2.5, 2.0 over [2, 4]: 7, 3.5, 1.75, 0 -> █ ▅ ▃ ▁
    assert "first 4.0000 @1, last 2.0000 @4, min 2.0000 @4" in loss
    evals = [ln.split() for ln in out.splitlines() if ln.lstrip().startswith(("2 ", "4 "))]
    assert ["2", "val", "3.2500", "25.80", "64"] in evals and ["4", "val", "2.7500", "15.60", "64"] in evals
    assert 'step 4: "Once" -> " upon\\na time"' in out  # escaped onto one line
    assert "step 2  checkpoints/step_2.gguf  (no longer on disk)" in out
    assert err == ""


def test_show_json_and_problems(root, capsys):
    code, out, err = run(capsys, "runs", "show", root / B, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["run"]["id"] == B and doc["run"]["status"] == "interrupted"
    assert doc["curves"]["loss"] == [[1, 5.0], [2, 1.5]] and doc["curves"]["lr"] == [[1, 2e-3], [2, 1e-3]]
    assert doc["config"]["optim"]["lr"] == 0.002 and "config" not in doc["start"]
    assert "events.jsonl line 3" in err
    code, out, _ = run(capsys, "runs", "show", B, "--runs-dir", root)
    assert "problems\n  events.jsonl line 3: bad JSON" in out
    code, out, _ = run(capsys, "runs", "show", S, "--runs-dir", root, "--json")
    assert json.loads(out)["requests"] == {
        "count": 2,
        "ok": 1,
        "failed": 1,
        "completion_tokens": 16,
        "median_ttft_s": 0.1,
        "median_tok_s": 50.0,
    }


def test_show_unknown_and_ambiguous(root, capsys):
    code, _, err = run(capsys, "runs", "show", "nope", "--runs-dir", root)
    assert_error(code, err, 2, "no run 'nope'", "toy runs list")
    code, _, err = run(capsys, "runs", "show", "train-", "--runs-dir", root)
    assert_error(code, err, 2, "ambiguous", A, B)


# -- compare


def test_compare(root, capsys):
    code, out, err = run(capsys, "runs", "compare", A, B, "--runs-dir", root)
    assert code == 0, err
    config, figures = out.split("figures (delta against the first run)")
    assert config.startswith("config differences (4)")
    rows = {ln.split()[0]: ln.split()[1:] for ln in config.splitlines()[1:] if ln.strip()}
    assert rows["KEY"] == [A, B]
    assert rows["optim.lr"] == ["0.001", "0.002"]
    assert rows["data.paths"] == ["(absent)", '["corpus"]']
    assert rows["steps"] == ["4", "10"] and rows["seed"] == ["0", "(absent)"]
    assert "optim.schedule" not in rows
    figs = {ln.split()[0]: ln.split()[1:] for ln in figures.splitlines() if ln.strip()}
    assert figs["final_loss"] == ["2.0000", "1.5000", "(-0.5000)"]  # with the delta against the first run
    assert figs["steps"] == ["4", "2", "(-2)"] and figs["status"] == ["completed", "interrupted"]
    code, out, _ = run(capsys, "runs", "compare", A, B, "--runs-dir", root, "--json")
    c = json.loads(out)
    assert c["runs"] == [A, B]
    assert [d["key"] for d in c["config"]] == ["data.paths", "optim.lr", "seed", "steps"]
    figs = {f["name"]: f for f in c["figures"]}
    assert figs["final_loss"]["deltas"] == [0.0, -0.5] and figs["tokens_per_s"]["deltas"] == [0.0, 450.0]


def test_compare_needs_two_runs(root, capsys):
    code, _, err = run(capsys, "runs", "compare", A, "--runs-dir", root)
    assert_error(code, err, 2, "two or more runs")


# -- plot


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_png(root, capsys, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    out_png = tmp_path / "loss.png"
    code, out, err = run(capsys, "runs", "plot", A, B, S, "-o", out_png, "--runs-dir", root, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["runs"] == [A, B] and info["skipped"] == [S]
    assert info["loss_axis"] == {"train": 2, "eval": 1} and info["lr_axis"] == 2
    assert f"note: run {S} has no step or eval events" in err
    data = out_png.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert image.imread(out_png).shape[:2] == (600, 900)  # 9 x 6 inches at 100 dpi
    code, out, _ = run(capsys, "runs", "plot", A, "-o", tmp_path / "one.png", "--runs-dir", root)
    assert code == 0 and out.strip() == str(tmp_path / "one.png") and (tmp_path / "one.png").stat().st_size > 1000


def test_plot_figure_lines(root):
    pytest.importorskip("matplotlib")
    from toy.runs.plot import build_figure
    from toy.runs.reader import load_run

    fig, info = build_figure([load_run(root / A), load_run(root / B)])
    ax_loss, ax_lr = fig.axes
    lines = ax_loss.get_lines()
    assert len(lines) == 3 and len(ax_lr.get_lines()) == 2
    train_a = next(ln for ln in lines if ln.get_label() == A)
    assert list(train_a.get_xdata()) == [1, 2, 3, 4] and list(train_a.get_ydata()) == [4.0, 3.0, 2.5, 2.0]
    val_a = next(ln for ln in lines if ln.get_label() == f"{A} val")
    assert list(val_a.get_ydata()) == [3.25, 2.75] and val_a.get_marker() == "o"
    assert val_a.get_color() == train_a.get_color()
    assert list(ax_lr.get_lines()[1].get_ydata()) == [2e-3, 1e-3]


def test_plot_errors(root, capsys, tmp_path, monkeypatch):
    code, _, err = run(capsys, "runs", "plot", S, "-o", tmp_path / "x.png", "--runs-dir", root)
    assert_error(code, err, 2, "nothing to plot")
    code, _, err = run(capsys, "runs", "plot", A, "-o", tmp_path / "x.gif", "--runs-dir", root)
    assert_error(code, err, 2, "unknown image type")
    code, _, err = run(capsys, "runs", "plot", A, "--runs-dir", root)
    assert code == 2 and "--out" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run(capsys, "runs", "plot", A, "-o", tmp_path / "x.png", "--runs-dir", root)
    assert_error(code, err, 2, "needs matplotlib", "just setup")  # the dev environment's hint (toy.extras)
    assert not (tmp_path / "x.png").exists()
