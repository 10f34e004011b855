"""toy_vit.digits: the bundled npz against scikit-learn, and the demo folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from toy_vit import digits as vdigits
from toy_vit.data import ImageFolder
from toy_vit.digits import N_IMAGES, digits_path, load_digits, write_demo_data
from toy_vit.preprocess import DataError

REPO = Path(__file__).resolve().parents[3]


def _open(path) -> Image.Image:
    """The file's image, loaded, its file closed."""
    with Image.open(path) as im:
        im.load()
        return im.copy()


@pytest.mark.slow  # importing scikit-learn takes seconds
def test_bundled_digits_equal_scikit_learn():
    datasets = pytest.importorskip("sklearn.datasets")
    ref = datasets.load_digits()
    d = load_digits()
    assert d.images.dtype == np.uint8 and d.images.shape == (1797, 8, 8)
    expected = np.round(ref.images * 255 / 16).astype(np.uint8)
    np.testing.assert_array_equal(d.images, expected)
    np.testing.assert_array_equal(d.labels, ref.target)
    assert {0, 128, 255} <= set(np.unique(d.images).tolist())  # 0, 8 and 16 scaled
    assert np.bincount(d.labels).tolist() == np.bincount(ref.target).tolist()


def test_npz_is_small_and_says_where_it_came_from():
    assert digits_path().stat().st_size < 60_000
    p = load_digits().provenance
    for word in ("scikit-learn", "load_digits", "BSD-3-Clause", "UCI", "CC BY 4.0", "round(v * 255 / 16)"):
        assert word in p


@pytest.mark.slow
def test_make_digits_reproduces_the_committed_file():
    pytest.importorskip("sklearn")
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_digits.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matches" in r.stdout


def test_write_demo_data_and_read_it_back(tmp_path):
    calls = []
    out = write_demo_data(tmp_path / "digits", progress=lambda *a: calls.append(a))
    assert out == tmp_path / "digits" and calls[-1] == (N_IMAGES, N_IMAGES)
    assert sorted(os.listdir(out)) == [*map(str, range(10)), "README.txt"]
    files = sorted(out.glob("*/*.png"))
    assert len(files) == 1797
    d = load_digits()
    # every file: its folder is its label, its name its index, its pixels the 8x8 image in 4x4 blocks
    for f in files[::97]:
        i = int(f.stem)
        assert int(f.parent.name) == d.labels[i]
        im = _open(f)
        assert im.mode == "L" and im.size == (32, 32)
        a = np.asarray(im)
        np.testing.assert_array_equal(a[::4, ::4], d.images[i])
        np.testing.assert_array_equal(a, np.kron(d.images[i], np.ones((4, 4), np.uint8)))
    folder = ImageFolder(out, val_fraction=0.1)
    assert folder.classes == [str(k) for k in range(10)]
    assert len(folder.samples) == 1797 and [p.name for p in folder.ignored] == ["README.txt"]
    idx = np.array([int(s.path.stem) for s in folder.samples])
    np.testing.assert_array_equal(folder.labels, d.labels[idx])
    assert folder.class_counts("val") == [int(np.ceil(n * 0.1)) for n in np.bincount(d.labels)]
    assert not list(tmp_path.glob(".digits*"))  # no temp folder left


def test_scale_one_and_overwrite(tmp_path):
    out = write_demo_data(tmp_path / "d1", scale=1)
    a = np.asarray(_open(out / "0" / "0000.png"))
    np.testing.assert_array_equal(a, load_digits().images[0])
    with pytest.raises(DataError, match=f"{out}: the folder is not empty") as e:
        write_demo_data(out)
    assert "overwrite" in e.value.hint
    write_demo_data(out, scale=2, overwrite=True)  # overwrite replaces our own output
    assert _open(out / "0" / "0000.png").size == (16, 16)
    assert len(list(out.glob("*/*.png"))) == 1797
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d1"]  # no temp or old folder left


def test_refusals(tmp_path):
    out = tmp_path / "mine"
    (out / "3").mkdir(parents=True)
    (out / "3" / "0001.png").write_bytes(b"")
    (out / "README.txt").write_text("ours")
    (out / "mine.txt").write_text("precious")
    (out / "3" / "notes.md").write_text("precious")
    with pytest.raises(DataError, match=f"{out}: the folder is not empty"):
        write_demo_data(out)
    # overwrite never replaces a folder holding anything write_demo_data does not write
    with pytest.raises(DataError, match=r"holds files that write_demo_data does not write \(3/notes.md, mine.txt\)"):
        write_demo_data(out, overwrite=True)
    assert (out / "mine.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match=f"{tmp_path / 'f'}: exists and is not a folder"):
        write_demo_data(tmp_path / "f")
    with pytest.raises(DataError, match="scale must be an integer from 1 to 64, got 0"):
        write_demo_data(tmp_path / "x", scale=0)
    assert not (tmp_path / "x").exists()


def test_an_empty_folder_is_fine_without_overwrite(tmp_path):
    (tmp_path / "empty").mkdir()
    assert len(list(write_demo_data(tmp_path / "empty", scale=1).glob("*/*.png"))) == 1797


def test_a_failed_write_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vdigits.Image.Image, "save", boom)
    with pytest.raises(DataError, match=f"{tmp_path / 'd'}: cannot write the demo data: No space left on device"):
        write_demo_data(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_keeps_the_old_folder(tmp_path, monkeypatch):
    out = write_demo_data(tmp_path / "d", scale=1)
    real = os.rename

    def rename(src, dst):
        if Path(dst) == out and str(src).endswith(".tmp"):  # the new folder cannot move in
            raise OSError(13, "Permission denied")
        return real(src, dst)

    monkeypatch.setattr(vdigits.os, "rename", rename)
    with pytest.raises(DataError, match="Permission denied"):
        write_demo_data(out, scale=2, overwrite=True)
    assert _open(out / "0" / "0000.png").size == (8, 8)  # the old one, put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
