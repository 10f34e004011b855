"""``toy vit``: every command, its flags and its errors.

Most tests run ``toy`` in this process (``cli_helpers.run``); the stop
signals run it as a real process. Models are ``vit-micro`` (16 px) on tiny
generated folders; eval and classify are checked against the Python API on
the same model file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import toy_vit
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.vit_images import write_folder
from toy_vit.config import ViTConfig
from toy_vit.evaluate import evaluate
from toy_vit.gguf_io import read_gguf, write_gguf
from toy_vit.train import init_params

MICRO = ["--preset", "vit-micro", "--batch-size", "4", "--threads", "1", "--eval-every", "0", "--save-every", "0"]


def write_model(path: Path, labels=("a", "b", "c"), seed: int = 1, **dims) -> Path:
    cfg = ViTConfig.preset("vit-micro", labels=tuple(labels), **dims)
    return write_gguf(path, cfg, init_params(cfg, seed))


def no_bundle(runs: Path) -> bool:
    """No run bundle in the runs folder (the folder itself may have been made by the up-front check)."""
    return not runs.exists() or not list(runs.iterdir())


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "events.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("vitcli")
    return write_folder(d / "data"), write_model(d / "m.gguf")


# -- the group ---------------------------------------------------------------------


def test_help_lists_every_command(capsys):
    code, out, _ = run(capsys, "vit", "--help")
    assert code == 0
    for cmd in ("demo-data", "convert", "train", "eval", "classify"):
        assert cmd in out
    code, out, err = run(capsys, "vit")  # no subcommand: the help, and no empty error line
    assert code == 2 and "demo-data" in out and "error" not in err
    code, out, _ = run(capsys, "--help")
    assert "Image classification with a Vision Transformer" in out and "not installed" not in out
    code, out, _ = run(capsys, "vit", "train", "--help")
    for flag in ("--preset", "--image-size", "--patch-size", "--channels", "--d-model", "--layers", "--heads",
                 "--ffn", "--steps", "--epochs", "--batch-size", "--lr", "--warmup", "--label-smoothing", "--seed",
                 "--threads", "--device", "--out", "--from", "--freeze", "--no-flip", "--crop-scale", "--eval-every",
                 "--save-every", "--json", "--quiet", "--resume"):  # fmt: skip
        assert flag in out, flag


# -- demo-data ---------------------------------------------------------------------


def test_demo_data(capsys, tmp_path):
    code, out, err = run(capsys, "vit", "demo-data", "digits")
    assert code == 0, err
    assert out == "digits\n" and "wrote 1797 images" in err
    assert sorted(p.name for p in (tmp_path / "digits").iterdir()) == [*map(str, range(10)), "README.txt"]
    with Image.open(tmp_path / "digits" / "3" / "0003.png") as im:
        assert im.size == (32, 32) and im.mode == "L"
    code, out, err = run(capsys, "vit", "demo-data", "digits")
    assert_clean_error(code, err, 2, "digits: the folder is not empty", "--overwrite", hint=True)
    assert out == ""
    code, out, err = run(capsys, "vit", "demo-data", "digits", "--overwrite")
    assert code == 0, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep")
    code, _, err = run(capsys, "vit", "demo-data", "other", "--overwrite")
    assert_clean_error(code, err, 2, "other")
    assert (tmp_path / "other" / "mine.txt").read_text() == "keep"


# -- convert -----------------------------------------------------------------------


def test_convert(capsys, tmp_path, hf_vit):
    model, hf_dir, ref = hf_vit("rgb32")
    code, out, err = run(capsys, "vit", "convert", hf_dir, "out.gguf")
    assert code == 0, err
    assert out == "out.gguf\n" and "converted" in err and "parameters" in err
    assert (tmp_path / "out.gguf").read_bytes() == Path(ref).read_bytes()
    n = read_gguf(ref)[0].n_classes
    names = ",".join(f"k{i}" for i in range(n))
    code, out, err = run(capsys, "vit", "convert", hf_dir, "named.gguf", "--labels", names)
    assert code == 0, err
    assert read_gguf(tmp_path / "named.gguf")[0].labels == tuple(names.split(","))


def test_convert_errors(capsys, tmp_path, hf_vit):
    _, hf_dir, ref = hf_vit("rgb32")
    n = read_gguf(ref)[0].n_classes
    cases = [
        (["nope", "o.gguf"], "nope: not a folder"),
        ([tmp_path, "o.gguf"], "no config.json"),
        ([hf_dir, "o.gguf", "--labels", "a,,b"], "--labels"),
        ([hf_dir, "o.gguf", "--labels", "a,a"], "given twice"),
        ([hf_dir, "o.gguf", "--labels", ",".join(f"k{i}" for i in range(n + 1))], "labels"),
        ([hf_dir, tmp_path, ], "is a folder"),
    ]  # fmt: skip
    for args, want in cases:
        code, out, err = run(capsys, "vit", "convert", *args)
        assert_clean_error(code, err, 2, want)
        assert out == ""
        assert not (tmp_path / "o.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.gguf")]  # no temporary file left


# -- train -------------------------------------------------------------------------


def test_train_json_progress_and_every_flag_recorded(capsys, tmp_path, shared):
    data, _ = shared
    code, out, err = run(
        capsys, "vit", "train", data, "--preset", "vit-micro", "--image-size", "12", "--patch-size", "3",
        "--channels", "1", "--d-model", "24", "--layers", "1", "--heads", "2", "--ffn", "32", "--steps", "5",
        "-b", "4", "--lr", "2e-3", "--warmup", "1", "--label-smoothing", "0.1", "--seed", "3", "--threads", "1",
        "--device", "cpu", "--out", "myruns", "--no-flip", "--crop-scale", "0.6,0.9", "--eval-every", "2",
        "--save-every", "4", "--json",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads(out)
    assert res["reason"] == "completed" and res["final_step"] == 5
    assert set(res) >= {"run_id", "run_dir", "final_loss", "val_loss", "val_accuracy", "val_top5", "checkpoint"}
    assert 0 <= res["val_accuracy"] <= res["val_top5"] <= 1
    assert "img/s" in err and "tok/s" not in err and "validation loss" in err and "accuracy" in err
    cfg = json.loads((Path(res["run_dir"]) / "config.json").read_text())
    want = dict(preset="vit-micro", image_size=12, patch_size=3, n_channels=1, d_model=24, n_layer=1, n_head=2,
                d_ff=32, steps=5, batch_size=4, lr=2e-3, warmup=1, label_smoothing=0.1, seed=3, threads=1,
                device="cpu", flip=False, crop_scale=[0.6, 0.9], eval_every=2, save_every=4)  # fmt: skip
    assert {k: cfg[k] for k in want} == want
    assert Path(res["run_dir"]).absolute().parent == tmp_path / "myruns"
    ckpts = sorted(p.name for p in (Path(res["run_dir"]) / "checkpoints").glob("step_*[0-9].gguf"))
    assert ckpts == ["step_4.gguf", "step_5.gguf"]
    with toy_vit.load(res["checkpoint"], threads=1) as clf:
        assert clf.config.n_channels == 1 and clf.config.image_size == 12 and clf.labels == ("a", "b", "c")
    evs = [e for e in events(res["run_dir"]) if e["kind"] == "eval"]
    assert [e["step"] for e in evs] == [2, 4, 5] and evs[-1]["accuracy"] == res["val_accuracy"]


def test_train_text_output_epochs_and_quiet(capsys, shared):
    data, _ = shared
    code, out, err = run(capsys, "vit", "train", data, *MICRO, "--epochs", "1")
    assert code == 0, err
    run_dir = Path(out.strip())
    assert run_dir.parent.name == "runs" and (run_dir / "events.jsonl").is_file()
    assert "1 epoch(s) of 21 training images = 6 steps of 4 images" in err
    assert "completed at step 6" in err and "validation accuracy" in err
    code, out, err = run(capsys, "vit", "train", data, *MICRO, "--steps", "1", "--quiet")
    assert code == 0 and err == "" and Path(out.strip()).is_dir()


@pytest.mark.parametrize(
    "args,want",
    [
        ([], "give the image folder"),
        (["DATA"], "--steps N or --epochs E"),
        (["DATA", "--steps", "2", "--epochs", "1"], "exclude each other"),
        (["DATA", "--steps", "2", "--freeze"], "--freeze: needs a base model"),
        (["DATA", "--steps", "2", "--lr", "-1"], "--lr: -1.0 must be a positive number"),
        (["DATA", "--steps", "2", "--preset", "vit-huge"], "--preset: unknown ViT preset 'vit-huge'"),
        (["DATA", "--steps", "2", "--label-smoothing", "1"], "--label-smoothing: 1.0 must be in [0, 1)"),
        (["DATA", "--steps", "2", "--crop-scale", "0.5"], "--crop-scale '0.5': give two numbers"),
        (["DATA", "--steps", "2", "--crop-scale", "0.9,0.5"], "--crop-scale: (0.9, 0.5) must satisfy"),
        (["DATA", "--steps", "2", "--channels", "2"], "--channels 2: 1 (grey) or 3 (RGB)"),
        (["DATA", "--steps", "-1"], "--steps: -1 must be >= 0"),
        (["DATA", "--steps", "2", "--from", "nope.gguf"], "nope.gguf: no such file"),
        (["DATA", "--steps", "2", "--from", "MODEL", "--preset", "vit-micro"], "--preset and --from exclude"),
        (["DATA", "--steps", "2", "--from", "MODEL", "--image-size", "32"], "--image-size 32 differs from the base"),
        (["DATA", "--steps", "2", "--from", "MODEL", "--channels", "1"], "--channels 1 differs from the base"),
        (["DATA", "--steps", "2", "--from", "LLAMA"], "vit"),
        (["DATA", "--steps", "2", "--out", "FILE"], "FILE"),
        (["missing", "--steps", "2"], "missing: no such folder"),
    ],
)
def test_train_bad_input(capsys, tmp_path, shared, args, want):
    from toy_testsupport.toy_test_models import write_tiny_model

    data, model = shared
    (tmp_path / "FILE").write_text("x")
    subs = {"DATA": str(data), "MODEL": str(model), "LLAMA": str(write_tiny_model(tmp_path / "llama.gguf"))}
    argv = [subs.get(a, a) for a in args]
    code, out, err = run(capsys, "vit", "train", *argv, "--threads", "1", "-b", "4")
    assert_clean_error(code, err, 2, want)
    assert out == ""
    assert no_bundle(tmp_path / "runs")


def _bad_folder(tmp_path: Path, kind: str) -> Path:
    root = write_folder(tmp_path / kind, per_class=4)
    if kind == "corrupt":
        (root / "b" / "02.png").write_bytes((root / "b" / "02.png").read_bytes()[:60])  # truncated mid-file
    elif kind == "not-an-image":
        (root / "c" / "01.png").write_text("not a png")
    elif kind == "empty-class":
        (root / "d").mkdir()
    elif kind == "one-class":
        for c in ("b", "c"):
            for p in (root / c).iterdir():
                p.unlink()
            (root / c).rmdir()
    return root


BAD_DATA = {
    "corrupt": "b/02.png: corrupt or truncated image",
    "not-an-image": "c/01.png: not a PNG, JPEG, WebP or BMP image",
    "empty-class": "d: the class folder holds no images",
    "one-class": "only one class folder (a)",
}


@pytest.mark.parametrize("kind", list(BAD_DATA))
def test_train_bad_data_names_the_file_and_writes_nothing(capsys, tmp_path, kind):
    root = _bad_folder(tmp_path, kind)
    code, out, err = run(capsys, "vit", "train", root, *MICRO, "--steps", "2")
    assert_clean_error(code, err, 2, BAD_DATA[kind])
    assert out == "" and no_bundle(tmp_path / "runs")
    cache = tmp_path / "home" / "cache" / "vit"
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.startswith(".")]


def test_fine_tune_from_a_model_with_other_classes(capsys, tmp_path, shared):
    data, _ = shared
    base = write_model(tmp_path / "base.gguf", labels=[f"x{i}" for i in range(10)])
    code, out, err = run(capsys, "vit", "train", data, "--from", base, "--freeze", "--steps", "2", "-b", "4",
                         "--threads", "1", "--eval-every", "1", "--json")  # fmt: skip
    assert code == 0, err
    res = json.loads(out)
    assert "is replaced by a new one for the data's 3 classes" in err
    assert "step 0: validation loss" in err  # a fine-tune evaluates its base first
    start = events(res["run_dir"])[0]
    assert start["fine_tune"] == "freeze" and start["head"] == "replaced"
    with toy_vit.load(res["checkpoint"], threads=1) as clf:
        assert clf.labels == ("a", "b", "c")


def test_resume_through_toy_vit_and_toy_train(capsys, shared):
    data, _ = shared
    code, out, err = run(capsys, "vit", "train", data, *MICRO, "--steps", "3", "--json")
    assert code == 0, err
    run_dir = json.loads(out)["run_dir"]
    code, out, err = run(capsys, "vit", "train", "--resume", run_dir)
    assert_clean_error(code, err, 2, "already at step 3 of 3", "--steps", hint=True)
    code, out, err = run(capsys, "vit", "train", "--resume", run_dir, "--steps", "5", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["final_step"] == 5 and res["reason"] == "completed" and "val_accuracy" in res
    assert "step 5/5" in err and "img/s" in err
    # toy train --resume hands a vit run to toy-vit (toy.train_tasks) and shows images/s
    code, out, err = run(capsys, "train", "--resume", run_dir, "--steps", "6", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["final_step"] == 6 and "val_accuracy" in res and "step 6/6" in err and "img/s" in err
    code, out, err = run(capsys, "train", "--resume", run_dir, "--steps", "7")
    assert code == 0, err
    assert out.strip() == run_dir and "completed at step 7" in err and "validation accuracy" in err
    kinds = [e["kind"] for e in events(run_dir)]
    assert kinds.count("resume") == 3 and kinds[-1] == "run_end"


def test_resume_errors(capsys, tmp_path, shared):
    data, _ = shared
    code, out, err = run(capsys, "vit", "train", "--resume", tmp_path, "--lr", "1e-3")
    assert_clean_error(code, err, 2, "--lr cannot go with it", "only --steps", hint=True)
    code, out, err = run(capsys, "vit", "train", data, "--resume", tmp_path)
    assert_clean_error(code, err, 2, "DATA cannot go with it")
    lm = tmp_path / "lm-run"
    lm.mkdir()
    (lm / "events.jsonl").write_text(json.dumps({"kind": "run_start", "schema": "toy/v1", "t": 0}) + "\n")
    code, out, err = run(capsys, "vit", "train", "--resume", lm)
    assert_clean_error(code, err, 2, "not a toy vit run", "toy train --resume", hint=True)
    code, out, err = run(capsys, "vit", "train", "--resume", tmp_path / "nope")
    assert_clean_error(code, err, 2, "nope")


def _wait_for_step(run_root: Path, proc, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dirs = list(run_root.glob("train-*")) if run_root.exists() else []
        if dirs and any(e["kind"] == "step" for e in events(dirs[0])):
            return dirs[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("no step event in time")


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_stop_signal_saves_a_checkpoint_and_resume_finishes(tmp_path, shared, sig, code):
    data, _ = shared
    env = {**os.environ, "TOY_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    toy = [sys.executable, "-m", "toy_cli", "vit", "train"]
    p = subprocess.Popen([*toy, str(data), *MICRO, "--steps", "100000"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        run_dir = _wait_for_step(tmp_path / "runs", p)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert "stopping after this step" in err and "interrupted at step" in err
    assert out.strip() == str(Path("runs") / run_dir.name)
    end = events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted"
    step = end["final_step"]
    with toy_vit.load(run_dir / "checkpoints" / f"step_{step}.gguf", threads=1) as clf:
        assert clf.labels == ("a", "b", "c")
    r = subprocess.run([*toy, "--resume", str(run_dir), "--steps", str(step + 2), "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["final_step"] == step + 2


# -- eval --------------------------------------------------------------------------


def test_eval_equals_the_python_api(capsys, tmp_path, shared):
    data, model = shared
    with toy_vit.load(model, threads=1) as clf:
        want_val = evaluate(clf, data, split="val", batch_size=32)
        want_all = evaluate(clf, data, split="all", batch_size=3, seed=5)
    code, out, err = run(capsys, "vit", "eval", model, data, "--threads", "1")
    assert code == 0, err
    assert out == want_val.to_text() + "\n"
    assert "run: " in err
    code, out, err = run(capsys, "vit", "eval", model, data, "--split", "all", "-b", "3", "--seed", "5", "--json")
    assert code == 0, err
    got = json.loads(out)
    run_id = got.pop("run_id")
    assert run_id.startswith("eval-")
    assert got == json.loads(want_all.to_json())
    assert got["images"] == 24 and got["split"] == "all"
    assert set(got) >= {"accuracy", "top_k", "top_k_accuracy", "nll", "per_class", "macro", "weighted", "confusion"}
    assert len(list((tmp_path / "runs").glob("eval-*"))) == 2
    bundle = tmp_path / "runs" / run_id
    ev = [e for e in events(bundle) if e["kind"] == "eval"][0]
    assert ev["name"] == "all" and ev["images"] == 24
    assert ev["accuracy"] == want_all.accuracy and ev["loss"] == pytest.approx(want_all.nll)
    assert ev["top5"] == want_all.top_k_accuracy and ev["top_k"] == 3 and events(bundle)[-1]["reason"] == "completed"


def test_eval_plot(capsys, tmp_path, shared, monkeypatch):
    data, model = shared
    code, out, err = run(capsys, "vit", "eval", model, data, "--plot", "cm.png", "--runs-dir", "evals")
    assert code == 0, err
    assert (tmp_path / "cm.png").read_bytes()[:4] == b"\x89PNG" and "confusion matrix drawn to cm.png" in err
    for args, want in [(["--plot", "cm.jpg"], "suffix"), (["--plot", "no/cm.png"], "no such folder")]:
        code, out, err = run(capsys, "vit", "eval", model, data, *args, "--runs-dir", "bad")
        assert_clean_error(code, err, 2, want)
        assert not (tmp_path / "bad").exists()
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    code, out, err = run(capsys, "vit", "eval", model, data, "--plot", "x.png", "--runs-dir", "bad")
    assert_clean_error(code, err, 2, "needs matplotlib", "just setup", hint=True)  # the dev environment's (toy.extras)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("kind", list(BAD_DATA))
def test_eval_bad_data(capsys, tmp_path, shared, kind):
    _, model = shared
    root = _bad_folder(tmp_path, kind)
    code, out, err = run(capsys, "vit", "eval", model, root, "--split", "all")
    assert_clean_error(code, err, 2, BAD_DATA[kind])
    assert out == "" and no_bundle(tmp_path / "runs")


def test_eval_bad_input(capsys, tmp_path, shared):
    from toy_testsupport.toy_test_models import write_tiny_model

    data, model = shared
    ten = write_model(tmp_path / "ten.gguf", labels=[str(i) for i in range(10)])
    llama = write_tiny_model(tmp_path / "llama.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
    one = write_folder(tmp_path / "one", per_class=1)
    cases = [
        ([ten, data], "the data's 3 classes (a, b, c) do not match the model's 10"),
        ([llama, data], "vit"),
        ([tmp_path / "junk.gguf", data], "junk.gguf"),
        ([tmp_path / "nope.gguf", data], "nope.gguf: no such file"),
        ([tmp_path, data], "not a file"),
        ([model, tmp_path / "nodata"], "nodata: no such folder"),
        ([model, one], "no val images"),
        ([model, data, "--split", "test"], "--split 'test'"),
        ([model, data, "-b", "0"], "--batch-size 0 must be >= 1"),
        ([model, data, "--runs-dir", data / "a" / "00.png"], "00.png"),
    ]
    for args, want in cases:
        code, out, err = run(capsys, "vit", "eval", *args)
        assert_clean_error(code, err, 2, want)
        assert out == ""
    assert no_bundle(tmp_path / "runs")


# -- classify ----------------------------------------------------------------------


def test_classify_equals_the_python_api(capsys, tmp_path, shared):
    data, model = shared
    files = sorted(data.rglob("*.png"))[::3]
    grey = tmp_path / "grey.png"
    Image.fromarray(np.full((20, 24), 200, np.uint8)).save(grey)  # grey and not square: converted and resized
    files.append(grey)
    with toy_vit.load(model, threads=1) as clf:
        want = clf.classify([str(f) for f in files], top_k=2)
    code, out, err = run(capsys, "vit", "classify", model, *files, "--top-k", "2", "--threads", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == len(files)
    for f, line, w in zip(files, lines, want):
        assert line == f"{f}: " + ", ".join(f"{lab} {100 * p:.2f}%" for lab, p in w)
    code, out, err = run(capsys, "vit", "classify", model, *files, "-k", "9", "-b", "2", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["model"] == str(model) and got["top_k"] == 3 and len(got["images"]) == len(files)
    for f, item, w in zip(files, got["images"], want):
        assert item["image"] == str(f) and len(item["predictions"]) == 3
        assert [p["label"] for p in item["predictions"]][:2] == [lab for lab, _ in w]
        assert item["predictions"][0]["probability"] == pytest.approx(w[0][1], abs=1e-5)  # batch of 2 vs 32
        assert sum(p["probability"] for p in item["predictions"]) == pytest.approx(1.0)


def test_classify_bad_input(capsys, tmp_path, shared):
    from toy_testsupport.toy_test_models import write_tiny_model

    data, model = shared
    good = sorted(data.rglob("*.png"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(good[0].read_bytes()[:50])
    llama = write_tiny_model(tmp_path / "llama.gguf")
    cases = [
        ([model, *good[:5], bad, *good[5:9]], f"{bad}: corrupt or truncated image"),
        ([model, good[0], tmp_path / "nope.png"], "nope.png: no such file"),
        ([model, good[0], "--top-k", "0"], "--top-k 0 must be >= 1"),
        ([model, good[0], "-b", "0"], "--batch-size 0 must be >= 1"),
        ([llama, good[0]], "vit"),
        ([tmp_path / "none.gguf", good[0]], "none.gguf: no such file"),
        ([model, tmp_path], "not a file"),
    ]
    for args, want in cases:
        code, out, err = run(capsys, "vit", "classify", *args)
        assert_clean_error(code, err, 2, want)
        assert out == ""  # nothing printed for the images before the bad one
    code, out, err = run(capsys, "vit", "classify", model)
    assert code == 2 and "Missing argument 'images'" in err
