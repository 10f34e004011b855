"""toy_vit.evaluate: the figures against scikit-learn's on the same
predictions, folders against logits computed image by image, the class
mapping, batches, the text and JSON, the plot, and a training run's own
validation figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn import metrics

import toy_vit
from toy.errors import BadInputError
from toy_testsupport.vit_images import write_folder
from toy_vit.config import ViTConfig
from toy_vit.data import ImageBatch, ImageFolder
from toy_vit.evaluate import (
    PlotUnavailableError,
    check_plot_path,
    evaluate,
    plot_confusion,
    report_from_logits,
)
from toy_vit.gguf_io import write_gguf
from toy_vit.preprocess import DataError, preprocess
from toy_vit.train import init_params


def write_model(path: Path, labels=("a", "b", "c"), seed: int = 1, **dims) -> Path:
    cfg = ViTConfig.preset("vit-micro", labels=tuple(labels), **dims)
    return write_gguf(path, cfg, init_params(cfg, seed))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    return write_folder(d / "data"), write_model(d / "m.gguf"), d / "cache"


def sk_reference(z: np.ndarray, y: np.ndarray, K: int) -> dict:
    labels = list(range(K))
    pred = z.argmax(axis=1)
    p, r, f, s = metrics.precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    present = sorted(set(y.tolist()))
    macro = metrics.precision_recall_fscore_support(y, pred, labels=present, average="macro", zero_division=0)
    weighted = metrics.precision_recall_fscore_support(y, pred, labels=present, average="weighted", zero_division=0)
    prob = np.exp(z.astype(np.float64) - z.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    k = min(5, K)
    return {
        "accuracy": metrics.accuracy_score(y, pred),
        "top": metrics.top_k_accuracy_score(y, z, k=k, labels=labels) if K > k else 1.0,
        "nll": metrics.log_loss(y, prob, labels=labels),
        "confusion": metrics.confusion_matrix(y, pred, labels=labels),
        "p": p, "r": r, "f": f, "s": s, "macro": macro[:3], "weighted": weighted[:3],
    }  # fmt: skip


def assert_matches(rep, ref):
    assert rep.accuracy == pytest.approx(ref["accuracy"], abs=1e-12)
    assert rep.top_k_accuracy == pytest.approx(ref["top"], abs=1e-12)
    assert rep.nll == pytest.approx(ref["nll"], rel=1e-9)
    np.testing.assert_array_equal(rep.confusion, ref["confusion"])
    stats = rep.per_class()
    np.testing.assert_allclose([s.precision for s in stats], ref["p"], atol=1e-12)
    np.testing.assert_allclose([s.recall for s in stats], ref["r"], atol=1e-12)
    np.testing.assert_allclose([s.f1 for s in stats], ref["f"], atol=1e-12)
    assert [s.support for s in stats] == list(ref["s"])
    av = rep.averages()
    np.testing.assert_allclose([av["macro"][k] for k in ("precision", "recall", "f1")], ref["macro"], atol=1e-12)
    np.testing.assert_allclose([av["weighted"][k] for k in ("precision", "recall", "f1")], ref["weighted"], atol=1e-12)


@pytest.mark.parametrize("K", [2, 7, 12])
def test_figures_equal_sklearn(K):
    rng = np.random.default_rng(K)
    n = 300
    y = rng.integers(0, K, n)
    if K > 2:
        y[y == K - 1] = 0  # one class absent from the data: recall 0, not in the macro average
    z = (rng.standard_normal((n, K)) + 1.5 * np.eye(K)[y] * rng.uniform(0, 2, (n, 1))).astype(np.float32)
    rep = report_from_logits(z, y, [f"c{i}" for i in range(K)])
    assert rep.n == n and rep.top_k == min(5, K)
    assert_matches(rep, sk_reference(z, y, K))
    assert rep.confusion.trace() / n == pytest.approx(rep.accuracy)


def test_folder_equals_logits_of_each_image(setup):
    data, model, cache = setup
    folder = ImageFolder(data)
    with toy_vit.load(model, threads=1) as clf:
        rep = evaluate(clf, data, split="all", batch_size=5, cache_dir=cache)
        files = [s.path for s in folder.samples]
        c = clf.config
        z = np.concatenate([clf.logits(preprocess([f], c.image_size, c.image_mean, c.image_std, 3)) for f in files])
    y = folder.labels.astype(np.int64)
    assert rep.n == len(files) == 24 and rep.split == "all" and rep.data == str(data)
    assert_matches(rep, sk_reference(z, y, 3))
    np.testing.assert_array_equal(rep.targets, y)
    np.testing.assert_array_equal(rep.predictions, z.argmax(axis=1))


def test_val_split_and_batch_size_do_not_change_figures(setup):
    data, model, cache = setup
    folder = ImageFolder(data, seed=3)
    with toy_vit.load(model, threads=1) as clf:
        a = evaluate(clf, data, split="val", batch_size=1, seed=3, cache_dir=cache)
        b = evaluate(clf, folder, split="val", batch_size=64, cache_dir=cache)
    assert a.n == folder.n_val == 3  # ceil(0.1 * 8) per class
    np.testing.assert_array_equal(a.confusion, b.confusion)
    assert a.nll == pytest.approx(b.nll, rel=1e-5)


def test_subset_of_the_model_classes_is_mapped_by_name(tmp_path, setup):
    _, model, cache = setup
    data = write_folder(tmp_path / "bc", classes=("b", "c"), per_class=4)
    with toy_vit.load(model, threads=1) as clf:
        rep = evaluate(clf, data, split="all", cache_dir=cache)
    assert rep.support.tolist() == [0, 4, 4]  # folder class 0 ("b") is the model's class 1
    assert set(rep.targets.tolist()) == {1, 2}


def test_classes_that_are_not_the_models_are_refused(tmp_path, setup):
    _, model, cache = setup
    data = write_folder(tmp_path / "xy", classes=("a", "x", "y"), per_class=3)
    with toy_vit.load(model, threads=1) as clf, pytest.raises(DataError) as e:
        evaluate(clf, data, split="all", cache_dir=cache)
    assert "x, y not among the model's labels" in str(e.value) and str(data) in str(e.value)
    assert "--labels" in e.value.hint


def test_empty_val_split_and_bad_arguments(tmp_path, setup):
    _, model, cache = setup
    data = write_folder(tmp_path / "one", per_class=1)
    with toy_vit.load(model, threads=1) as clf:
        with pytest.raises(DataError, match="no val images") as e:
            evaluate(clf, data, cache_dir=cache)
        assert "--split all" in e.value.hint
        with pytest.raises(BadInputError, match="batch_size"):
            evaluate(clf, data, batch_size=0)
        with pytest.raises(BadInputError, match="split"):
            evaluate(clf, data, split="test")


def test_batches(setup):
    _, model, _ = setup
    rng = np.random.default_rng(0)
    px = rng.standard_normal((6, 3, 16, 16)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2])
    with toy_vit.load(model, threads=1) as clf:
        z = clf.logits(px)
        a = evaluate(clf, [(px[:4], y[:4]), (px[4:], y[4:])])
        mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)  # two padding rows
        padded = np.concatenate([px, np.zeros((2, 3, 16, 16), np.float32)])
        b = evaluate(clf, [ImageBatch(padded, np.r_[y, 0, 0].astype(np.int32), np.arange(8), mask)])
        with pytest.raises(BadInputError, match=r"\(B, 3, 16, 16\)"):  # a grey batch for an RGB model
            evaluate(clf, [(px[:, :1], y)])
        with pytest.raises(BadInputError, match="label 3"):
            evaluate(clf, [(px, np.r_[y[:5], 3])])
        with pytest.raises(BadInputError, match="no images"):
            evaluate(clf, [])
    assert a.split is None and a.n == b.n == 6
    assert_matches(a, sk_reference(z, y, 3))
    np.testing.assert_array_equal(a.confusion, b.confusion)


def test_text_and_json(setup):
    data, model, cache = setup
    with toy_vit.load(model, threads=1) as clf:
        rep = evaluate(clf, data, split="all", cache_dir=cache)
    text = rep.to_text()
    assert f"accuracy  {100 * rep.accuracy:.2f}%" in text and "top-3" in text
    assert "confusion matrix (rows: true class, columns: predicted)" in text
    rows = text.splitlines()[-3:]
    assert [r.split()[0] for r in rows] == ["a", "b", "c"]
    assert [[int(v) for v in r.split()[1:]] for r in rows] == rep.confusion.tolist()
    d = json.loads(rep.to_json())
    assert d["confusion"] == rep.confusion.tolist() and d["labels"] == ["a", "b", "c"]
    assert d["images"] == 24 and d["top_k"] == 3 and len(d["per_class"]) == 3
    assert set(d["per_class"][0]) == {"label", "precision", "recall", "f1", "support"}
    assert set(d["macro"]) == {"precision", "recall", "f1"}


def test_many_classes_list_the_confusions():
    K = 30
    y = np.arange(K).repeat(2)
    z = np.eye(K, dtype=np.float32)[y]
    z[0] = np.eye(K)[5]  # one image of class 0 predicted as 5
    labels = [f"class_{i}" for i in range(K)]
    text = report_from_logits(z, y, labels).to_text()
    assert "most frequent confusions (30 classes" in text
    assert "       1  class_0 -> class_5" in text
    long = report_from_logits(z[:8], y[:8], labels).to_text()  # 4 classes shown, long names: indices as columns
    assert "0 class_0" in long and "confusion matrix" in long


def test_plot(tmp_path, setup):
    data, model, cache = setup
    with toy_vit.load(model, threads=1) as clf:
        rep = evaluate(clf, data, split="all", cache_dir=cache)
    out = plot_confusion(rep, tmp_path / "cm.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cm.png"]  # no temporary file left
    with pytest.raises(BadInputError, match="suffix"):
        check_plot_path(tmp_path / "cm.jpg")
    with pytest.raises(BadInputError, match="no such folder"):
        check_plot_path(tmp_path / "nope" / "cm.png")


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    rep = report_from_logits(np.eye(2, dtype=np.float32), np.arange(2), ["a", "b"])
    with pytest.raises(PlotUnavailableError) as e:
        plot_confusion(rep, tmp_path / "cm.png")
    assert "matplotlib" in str(e.value) and e.value.hint.endswith("just setup")  # the dev environment's (toy.extras)
    assert not list(tmp_path.iterdir())


def test_plot_and_data_errors_are_toys_own():
    """toy_vit raises toy's PlotUnavailableError and DataError, not look-alike classes of its own."""
    import toy.errors
    import toy.runs.plot

    assert PlotUnavailableError is toy.errors.PlotUnavailableError is toy.runs.plot.PlotUnavailableError
    assert DataError is toy.errors.DataError


def test_equals_the_training_runs_validation(tmp_path):
    from toy_vit.train import train
    from toy_vit.trainconfig import ViTTrainConfig

    data = write_folder(tmp_path / "data", per_class=10)
    cfg = ViTTrainConfig(
        data=str(data), preset="vit-micro", steps=6, batch_size=8, lr=3e-3, eval_every=0, save_every=0,
        out=str(tmp_path / "runs"), cache_dir=str(tmp_path / "cache"), threads=1, seed=2, val_fraction=0.3,
    )  # fmt: skip
    res = train(cfg)
    events = [json.loads(x) for x in (res.run_dir / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["kind"] == "eval"][-1]
    folder = ImageFolder(data, seed=2, val_fraction=0.3)
    with toy_vit.load(res.checkpoint, threads=1) as clf:
        rep = evaluate(clf, folder, batch_size=8, cache_dir=tmp_path / "cache")
    assert rep.n == last["images"] == 9
    assert rep.accuracy == pytest.approx(last["accuracy"])
    assert rep.nll == pytest.approx(last["loss"], rel=1e-5)
