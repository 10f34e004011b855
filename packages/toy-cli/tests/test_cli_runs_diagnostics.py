"""`toy runs show` and `toy runs plot --diagnostics` on a hand-written run
bundle with training-diagnostics events (``diag_*``, toy.train.diagnostics):
the summary lines, --json, the figure's axes and lines (counted on the
figure, the image read back), and the errors for a run without them."""

from __future__ import annotations

import json

import pytest

from toy_testsupport.cli_helpers import run

R = "train-20260201-000000-dddd"
P = "train-20260202-000000-eeee"  # no diagnostics


def _write(root, run_id, lines):
    d = root / run_id
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"steps": 4}))
    (d / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _start(run_id):
    return {"kind": "run_start", "t": 0.0, "schema": "toy/v1", "run_id": run_id, "run_kind": "train",
            "started_at": "2026-02-01T00:00:00+00:00", "config": {"steps": 4}}  # fmt: skip


def _step(n):
    return {"kind": "step", "t": float(n), "step": n, "loss": 5.0 - n / 2, "lr": 1e-3, "grad_norm": 1.0 + n}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    r = tmp_path / "runs"
    lines = [_start(R)]
    for n in (1, 2, 3, 4):
        lines.append(_step(n))
        if n % 2 == 0:
            lines.append(
                {
                    "kind": "diag_grads",
                    "t": n + 0.1,
                    "step": n,
                    "layers": [0.5 * n, 0.25 * n, 0.125 * n],
                    "kinds": {"matrix": 0.9, "norm": 0.01},
                    "other": {"token_embd.weight": 0.3},
                    "total": 1.5,
                }
            )
            lines.append(
                {
                    "kind": "diag_updates",
                    "t": n + 0.2,
                    "step": n,
                    "layers": [1e-3, 2e-3, 4e-3],
                    "kinds": {"matrix": 2e-3},
                    "other": {},
                }
            )
            lines.append(
                {
                    "kind": "diag_drift",
                    "t": n + 0.3,
                    "step": n,
                    "reference": "initial",
                    "total": 0.01 * n,
                    "layers": [0.01 * n, 0.02 * n, 0.03 * n],
                    "kinds": {},
                    "other": {},
                }
            )
            lines.append({"kind": "diag_activations", "t": n + 0.4, "step": n, "mean": [0.0, 0.1, 0.2],
                          "rms": [1.0, 2.0, 3.5], "max_abs": [4.0, 8.0, 16.0]})  # fmt: skip
    lines.append({"kind": "run_end", "t": 9.0, "reason": "completed", "final_step": 4, "final_loss": 3.0})
    _write(r, R, lines)
    _write(r, P, [_start(P), _step(1), {"kind": "run_end", "t": 2.0, "reason": "completed", "final_step": 1}])
    return r


def test_show_summarizes_the_last_diagnostics(root, capsys):
    code, out, err = run(capsys, "runs", "show", R, "--runs-dir", root)
    assert code == 0, err
    text = out[out.index("diagnostics") :]
    assert "grads" in text and "norm total 1.5; blocks 2 1 0.5" in text
    assert "ratio per block 0.001 0.002 0.004" in text
    assert "from initial, total 0.04; ratio per block 0.04 0.08 0.12" in text
    assert "rms 1 2 3.5" in text and "max|x| 4 8 16" in text
    code, out, _ = run(capsys, "runs", "show", R, "--runs-dir", root, "--json")
    doc = json.loads(out)
    assert doc["diagnostics"]["diag_drift"]["step"] == 4
    assert set(doc["diagnostics"]) == {"diag_grads", "diag_updates", "diag_drift", "diag_activations"}
    code, out, _ = run(capsys, "runs", "show", P, "--runs-dir", root)
    assert code == 0 and "diagnostics" not in out


def test_plot_diagnostics_figure(root, capsys, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from toy.runs.plot import build_diagnostics_figure
    from toy.runs.reader import load_run

    fig, info = build_diagnostics_figure(load_run(root / R))
    assert info == {"axes": ["diag_grads", "diag_updates", "diag_drift", "diag_activations"], "blocks": 3,
                    "nonfinite": []}  # fmt: skip
    axes = fig.get_axes()
    assert [len(ax.get_lines()) for ax in axes] == [3, 3, 3, 3]
    # block 2's gradient norm line: steps 2 and 4
    xs, ys = axes[0].get_lines()[2].get_data()
    assert list(xs) == [2, 4] and list(ys) == [0.25, 0.5]
    assert axes[0].get_yscale() == "log" and axes[3].get_yscale() == "linear"

    out_png = tmp_path / "diag.png"
    code, out, err = run(capsys, "runs", "plot", R, "--diagnostics", "-o", out_png, "--runs-dir", root, "--json")
    assert code == 0, err
    assert json.loads(out)["axes"][0] == "diag_grads"
    assert image.imread(out_png).shape[:2] == (800, 900)


def test_plot_diagnostics_errors(root, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = run(capsys, "runs", "plot", P, "--diagnostics", "-o", tmp_path / "x.png", "--runs-dir", root)
    assert code == 2 and "no diagnostics events" in err and "hint: " in err and "--diagnostics all" in err
    code, _, err = run(capsys, "runs", "plot", R, P, "--diagnostics", "-o", tmp_path / "x.png", "--runs-dir", root)
    assert code == 2 and "--diagnostics plots one run" in err
