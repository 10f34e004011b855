"""toy_vit.data: the image folder, its split, the decoded cache and batches."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from toy.errors import BadInputError
from toy_vit import data as vdata
from toy_vit.data import (
    Augment,
    DataError,
    ImageBatchStream,
    ImageFolder,
    validation_batches,
)
from toy_vit.preprocess import load_image, preprocess, resize_uint8

MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def _img(seed: int, h: int = 14, w: int = 19) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def make_folder(root: Path, counts: dict[str, int], suffix: str = ".png", start: int = 0) -> Path:
    k = start
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(_img(k)).save(root / cls / f"{i:03d}{suffix}")
            k += 1
    return root


@pytest.fixture
def folder(tmp_path) -> Path:
    return make_folder(tmp_path / "data", {"cat": 12, "dog": 9, "eel": 7})


# -- layout -------------------------------------------------------------------------


def test_classes_labels_recursion_and_ignored_files(tmp_path):
    root = make_folder(tmp_path / "d", {"b": 3, "a": 2})
    (root / "b" / "deep" / "er").mkdir(parents=True)
    Image.fromarray(_img(99)).save(root / "b" / "deep" / "er" / "x.PNG")  # nested, upper-case suffix
    Image.fromarray(_img(98)).save(root / "a" / "y.JpEg")
    (root / "a" / "notes.txt").write_text("not an image")
    Image.fromarray(_img(97)).save(root / "a" / "z.gif")
    (root / "a" / ".hidden.png").write_bytes(b"skipped without a word")
    (root / ".git").mkdir()
    (root / "README.md").write_text("loose")
    f = ImageFolder(root, val_fraction=0)
    assert f.classes == ["a", "b"]
    rels = [s.rel for s in f.samples]
    assert rels == ["a/000.png", "a/001.png", "a/y.JpEg", "b/000.png", "b/001.png", "b/002.png", "b/deep/er/x.PNG"]
    assert f.labels.tolist() == [0, 0, 0, 1, 1, 1, 1] and f.labels.dtype == np.int32
    assert sorted(p.name for p in f.ignored) == ["README.md", "notes.txt", "z.gif"]
    assert f.n_train == 7 and f.n_val == 0 and f.class_counts() == [3, 4]


def _expected_val(f: ImageFolder, fraction: float, seed: int) -> set[str]:
    """The documented split rule, written out again."""
    out = set()
    for c in f.classes:
        rels = [s.rel for s in f.samples if f.classes[s.label] == c]
        rels.sort(key=lambda r: (hashlib.sha256(f"{seed}/{r}".encode()).digest(), r))
        out |= set(rels[: min(math.ceil(round(fraction * len(rels), 9)), len(rels) - 1)])
    return out


def test_split_follows_the_stated_rule(folder):
    f = ImageFolder(folder, val_fraction=0.25, seed=3)
    val = {f.samples[i].rel for i in f.val_indices}
    assert val == _expected_val(f, 0.25, 3)
    assert f.class_counts("val") == [3, 3, 2]  # ceil(0.25 * 12, 9, 7)
    assert f.n_train + f.n_val == 28 and not set(f.train_indices) & set(f.val_indices)
    # another seed, another split (of the same sizes)
    g = ImageFolder(folder, val_fraction=0.25, seed=4)
    assert {g.samples[i].rel for i in g.val_indices} != val and g.class_counts("val") == [3, 3, 2]
    # 0.1 * 30 is 3.0000000000000004 in floating point: still 3, not 4
    h = make_folder(folder.parent / "thirty", {"x": 30, "y": 2})
    assert ImageFolder(h, val_fraction=0.1).class_counts("val") == [3, 1]


def test_split_is_stable_when_another_class_grows(folder):
    before = ImageFolder(folder, val_fraction=0.3)
    make_folder(folder, {"dog": 0, "fox": 5}, start=500)
    for i in range(9, 20):
        Image.fromarray(_img(600 + i)).save(folder / "dog" / f"{i:03d}.png")
    after = ImageFolder(folder, val_fraction=0.3)

    def pick(f: ImageFolder, cls: str) -> set[str]:
        return {f.samples[i].rel for i in f.val_indices if f.classes[f.labels[i]] == cls}

    for cls in ("cat", "eel"):
        assert pick(before, cls) == pick(after, cls) and pick(before, cls)
    assert pick(before, "dog") != pick(after, "dog")
    assert after.classes == ["cat", "dog", "eel", "fox"]


def test_every_class_keeps_a_training_image(tmp_path):
    f = ImageFolder(make_folder(tmp_path / "d", {"a": 1, "b": 2}), val_fraction=0.9)
    assert f.class_counts("train") == [1, 1] and f.class_counts("val") == [0, 1]


def test_train_val_layout_is_detected(tmp_path):
    make_folder(tmp_path / "d" / "train", {"a": 3, "b": 4})
    make_folder(tmp_path / "d" / "val", {"b": 2}, start=100)
    make_folder(tmp_path / "d" / "test", {"a": 1}, start=200)
    f = ImageFolder(tmp_path / "d", val_fraction=0.5)
    assert f.train_root == tmp_path / "d" / "train" and f.val_root == tmp_path / "d" / "val"
    assert f.classes == ["a", "b"] and f.val_fraction == 0
    assert f.class_counts("train") == [3, 4] and f.class_counts("val") == [0, 2]
    assert [f.samples[i].path.parent.parent.name for i in f.val_indices] == ["val", "val"]
    assert f.ignored_dirs == [tmp_path / "d" / "test"]
    # "validation" works too, and val_dir= names any folder
    os.rename(tmp_path / "d" / "val", tmp_path / "d" / "validation")
    assert ImageFolder(tmp_path / "d").n_val == 2
    g = ImageFolder(tmp_path / "d" / "train", val_dir=tmp_path / "d" / "validation")
    assert g.n_val == 2 and g.n_train == 7


def _raises(match: str):
    return pytest.raises(DataError, match=match)


def test_folder_errors_name_the_folder(tmp_path):
    assert issubclass(DataError, BadInputError)
    with _raises(f"{tmp_path / 'none'}: no such folder"):
        ImageFolder(tmp_path / "none")
    (tmp_path / "file").write_text("x")
    with _raises(f"{tmp_path / 'file'}: not a folder"):
        ImageFolder(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with _raises(f"{tmp_path / 'empty'}: no class folders"):
        ImageFolder(tmp_path / "empty")
    (tmp_path / "flat").mkdir()
    Image.fromarray(_img(0)).save(tmp_path / "flat" / "a.png")
    with _raises(f"{tmp_path / 'flat'}: the images lie directly in the folder"):
        ImageFolder(tmp_path / "flat")
    for c in ("a", "b"):
        (tmp_path / "noimg" / c).mkdir(parents=True)
    (tmp_path / "noimg" / "a" / "x.txt").write_text("x")
    with _raises(f"{tmp_path / 'noimg'}: no images .* in any of its 2 class folder"):
        ImageFolder(tmp_path / "noimg")
    make_folder(tmp_path / "hole", {"a": 2})
    (tmp_path / "hole" / "b").mkdir()
    with _raises(f"{tmp_path / 'hole' / 'b'}: the class folder holds no images"):
        ImageFolder(tmp_path / "hole")
    make_folder(tmp_path / "one", {"only": 3})
    with _raises(f"{tmp_path / 'one'}: only one class folder \\(only\\); a classifier needs at least two"):
        ImageFolder(tmp_path / "one")
    with _raises(r"val_fraction must be in \[0, 1\), got 1"):
        ImageFolder(tmp_path / "hole", val_fraction=1)
    make_folder(tmp_path / "tv" / "train", {"a": 2, "b": 2})
    make_folder(tmp_path / "tv" / "val", {"c": 1})
    with _raises(f"{tmp_path / 'tv' / 'val' / 'c'}: the validation class 'c' has no training folder"):
        ImageFolder(tmp_path / "tv")


# -- the cache ----------------------------------------------------------------------


def test_cache_holds_the_processor_resize_and_is_reused(folder, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    f = ImageFolder(folder)
    calls = []
    d = f.decode(16, 3, cache_dir=cache, progress=lambda done, total: calls.append((done, total)))
    assert d.pixels.shape == (28, 16, 16, 3) and d.pixels.dtype == np.uint8 and not d.pixels.flags.writeable
    assert isinstance(d.pixels, np.memmap) and d.path == cache / d.key
    assert calls[-1] == (28, 28) and all(a <= b for (a, _), (b, _) in zip(calls, calls[1:]))
    for i in (0, 13, 27):
        np.testing.assert_array_equal(d.pixels[i], resize_uint8(load_image(f.samples[i].path, 3), 16))
    assert sorted(p.name for p in cache.iterdir()) == [d.key]
    assert sorted(p.name for p in d.path.iterdir()) == ["meta.json", "pixels.npy"]

    # a second folder object on the same files: no decoding at all
    monkeypatch.setattr(vdata, "load_image", lambda *a: pytest.fail("decoded again"))
    calls.clear()
    again = ImageFolder(folder).decode(16, 3, cache_dir=cache, progress=lambda *a: calls.append(a))
    assert again.key == d.key and calls == []
    np.testing.assert_array_equal(again.pixels, d.pixels)
    # a moved folder (same names, sizes and mtimes) still hits
    os.rename(folder, tmp_path / "moved")
    assert ImageFolder(tmp_path / "moved").decode(16, 3, cache_dir=cache).key == d.key


def test_cache_key_follows_files_size_and_channels(folder, tmp_path):
    cache = tmp_path / "cache"
    key = ImageFolder(folder).decode(8, 3, cache_dir=cache).key
    assert ImageFolder(folder).decode(9, 3, cache_dir=cache).key != key
    grey = ImageFolder(folder).decode(8, 1, cache_dir=cache)
    assert grey.key != key and grey.pixels.shape == (28, 8, 8, 1)
    np.testing.assert_array_equal(grey.pixels[5], resize_uint8(load_image(grey_path := folder / "cat/005.png", 1), 8))
    assert grey_path.exists()
    st = (folder / "cat/005.png").stat()
    os.utime(folder / "cat/005.png", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ImageFolder(folder).decode(8, 3, cache_dir=cache).key != key
    assert len(list(cache.iterdir())) == 4


def test_default_cache_dir_is_under_toy_home(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    d = ImageFolder(folder).decode(8, 3)
    assert d.path.parent == tmp_path / "home" / "cache" / "vit"


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_corrupt_image_leaves_nothing_in_the_cache(folder, tmp_path, how):
    bad = folder / "dog" / "004.png"
    raw = bad.read_bytes()
    bad.write_bytes(raw[: len(raw) // 2] if how == "truncated" else b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    cache = tmp_path / "cache"
    calls = []
    with _raises(f"{bad}: (corrupt|not a PNG)"):
        ImageFolder(folder).decode(8, 3, cache_dir=cache, progress=lambda *a: calls.append(a))
    assert list(cache.iterdir()) == []  # the temp folder went with the error
    assert len(calls) > 0 and calls[-1][0] < 28  # it got some way in before failing


def test_a_damaged_cache_is_rebuilt(folder, tmp_path):
    cache = tmp_path / "cache"
    d = ImageFolder(folder).decode(8, 3, cache_dir=cache)
    (d.path / "meta.json").unlink()  # as if the build had died before its last file
    e = ImageFolder(folder).decode(8, 3, cache_dir=cache)
    assert e.key == d.key and json.loads((e.path / "meta.json").read_text())["n"] == 28


def test_cache_dir_that_is_a_file(folder, tmp_path):
    (tmp_path / "c").write_text("x")
    with _raises(f"{tmp_path / 'c'}: cannot create the image cache folder"):
        ImageFolder(folder).decode(8, 3, cache_dir=tmp_path / "c")


# -- batches ------------------------------------------------------------------------


def _stream(folder_obj, cache, **kw) -> ImageBatchStream:
    args = dict(batch_size=5, seed=7, image_size=12, mean=MEAN, std=STD, cache_dir=cache)
    args.update(kw)
    return ImageBatchStream(folder_obj, **args)


def test_an_epoch_visits_every_training_image_once(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)
    assert f.n_train == 20
    s = _stream(f, tmp_path / "c", batch_size=6, augment=None)
    seen = np.concatenate([s.next().index for _ in range(3)])
    assert len(set(seen)) == 18 and set(seen) <= set(f.train_indices)
    b = s.next()  # 2 images left in epoch 0; it runs on into epoch 1: still a full batch
    assert b.pixels.shape == (6, 3, 12, 12) and b.pixels.dtype == np.float32 and b.labels.dtype == np.int32
    assert set(b.index[:2]) == set(f.train_indices) - set(seen)
    assert len(set(b.index[2:])) == 4  # epoch 1 starts afresh, in another order
    assert b.mask.tolist() == [1] * 6 and s.state()["epoch"] == 1 and s.state()["cursor"] == 4
    np.testing.assert_array_equal(b.labels, f.labels[b.index])
    assert math.isclose(s.epoch, 1 + 4 / 20)
    again = np.concatenate([s.next().index for _ in range(16 // 6)] + [s.next().index[:4]])
    assert sorted(np.concatenate([b.index[2:], again])) == sorted(f.train_indices)


def test_plain_training_pixels_are_the_processor_output(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)
    b = _stream(f, tmp_path / "c", augment=None).next()
    ref = preprocess([f.samples[i].path for i in b.index], 12, MEAN, STD)
    np.testing.assert_array_equal(b.pixels, ref)


def test_streams_are_seeded_and_resume_byte_identically(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)
    a = _stream(f, tmp_path / "c")
    first = [a.next() for _ in range(6)]  # crosses an epoch boundary (20 images, 5 a batch)
    b = _stream(f, tmp_path / "c")
    for x in first[:3]:
        y = b.next()
        assert x.pixels.tobytes() == y.pixels.tobytes() and np.array_equal(x.index, y.index)
    state = json.loads(json.dumps(b.state()))
    c = _stream(ImageFolder(folder, val_fraction=0.25), tmp_path / "c", state=state)
    for x in first[3:]:
        y = c.next()
        assert x.pixels.tobytes() == y.pixels.tobytes() and np.array_equal(x.index, y.index)
    # the same images and crops with another batch size: the randomness is per image, not per batch
    d = _stream(f, tmp_path / "c", batch_size=3)
    px = np.concatenate([d.next().pixels for _ in range(10)])
    np.testing.assert_array_equal(px, np.concatenate([x.pixels for x in first])[:30])
    # another seed: another order and other crops
    e = _stream(f, tmp_path / "c", seed=8).next()
    assert not np.array_equal(e.index, first[0].index)


def test_augmentation(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)
    cache = tmp_path / "c"
    plain = _stream(f, cache, augment=None).next()
    ident = _stream(f, cache, augment=Augment(scale=(1, 1), ratio=(1, 1), flip=0)).next()
    np.testing.assert_array_equal(ident.pixels, plain.pixels)  # a full crop is the plain resize
    flipped = _stream(f, cache, augment=Augment(scale=(1, 1), ratio=(1, 1), flip=1)).next()
    np.testing.assert_array_equal(flipped.pixels, plain.pixels[:, :, :, ::-1])
    aug = _stream(f, cache).next()
    assert np.array_equal(aug.index, plain.index) and not np.allclose(aug.pixels, plain.pixels)
    # the crops do not depend on the flip probability: flip=0 and flip=1 differ exactly by a mirror
    a0 = _stream(f, cache, augment=Augment(flip=0)).next().pixels
    a1 = _stream(f, cache, augment=Augment(flip=1)).next().pixels
    np.testing.assert_array_equal(a0[:, :, :, ::-1], a1)
    # a crop of a bigger cache is resized down to the image size
    big = _stream(f, cache, cache_size=24).next()
    assert big.pixels.shape == (5, 3, 12, 12)


def test_grey_models_get_one_channel(folder, tmp_path):
    f = ImageFolder(folder)
    b = _stream(f, tmp_path / "c", mean=[0.5], std=[0.5], augment=None).next()
    assert b.pixels.shape == (5, 1, 12, 12)
    np.testing.assert_array_equal(b.pixels, preprocess([f.samples[i].path for i in b.index], 12, 0.5, 0.5, 1))


def test_validation_batches_are_padded_and_unaugmented(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)  # 3 + 3 + 2 validation images
    batches = list(validation_batches(f, 3, 12, MEAN, STD, cache_dir=tmp_path / "c"))
    assert len(batches) == 3
    idx = np.concatenate([b.index for b in batches])
    assert idx[:8].tolist() == f.val_indices.tolist() and idx[8] == -1
    assert [b.mask.tolist() for b in batches][-1] == [1, 1, 0] and batches[-1].n == 2
    px = np.concatenate([b.pixels for b in batches])
    np.testing.assert_array_equal(px[:8], preprocess([f.samples[i].path for i in f.val_indices], 12, MEAN, STD))
    assert not px[8].any() and batches[-1].labels[-1] == 0
    assert len(list(validation_batches(f, 3, 12, MEAN, STD, cache_dir=tmp_path / "c", max_batches=2))) == 2
    every = list(validation_batches(f, 10, 12, MEAN, STD, split="all", cache_dir=tmp_path / "c"))
    assert sum(b.n for b in every) == 28
    # a validation image resized from a bigger cache is a double resize, not the processor's
    big = next(validation_batches(f, 3, 12, MEAN, STD, cache_size=20, cache_dir=tmp_path / "c"))
    assert big.pixels.shape == (3, 3, 12, 12) and not np.array_equal(big.pixels, batches[0].pixels)


def test_stream_errors(folder, tmp_path):
    f = ImageFolder(folder, val_fraction=0.25)
    c = tmp_path / "c"
    with _raises(f"{folder}: the training split has 20 image\\(s\\), fewer than a batch of 21"):
        _stream(f, c, batch_size=21)
    with _raises("batch size must be a positive integer, got 0"):
        _stream(f, c, batch_size=0)
    with _raises("the seed must be a non-negative integer, got -1"):
        _stream(f, c, seed=-1)
    s = _stream(f, c)
    s.next()
    with _raises("the image stream state is for 20 training images and seed 7, not 20 and 8"):
        _stream(f, c, seed=8, state=s.state())
    other = ImageFolder(folder, val_fraction=0.1)
    with _raises("state is for 20 training images and seed 7, not 24 and 7: the data or settings changed"):
        _stream(other, c, state=s.state())
    with _raises("bad image stream state"):
        _stream(f, c, state={"epoch": 0})
    with _raises("bad image stream state"):
        _stream(f, c, state={**s.state(), "cursor": 99})
    assert Augment(scale=[0.5, 1], flip=0) == Augment(scale=(0.5, 1.0), flip=0.0)
    with _raises("crop scale and ratio are \\(min, max\\) pairs"):
        Augment(scale=(0.5,))
    with _raises(r"crop scale \(0.0, 1.0\) must satisfy"):
        Augment(scale=(0, 1))
    with _raises(r"crop ratio \(2.0, 1.0\) must satisfy"):
        Augment(ratio=(2, 1))
    with _raises("flip probability 2.0 must be in"):
        Augment(flip=2)
    with _raises("split must be 'train', 'val' or 'all', got 'test'"):
        validation_batches(f, 2, 12, MEAN, STD, split="test", cache_dir=c)
    with _raises("channels must be 1 .* got 2"):
        _stream(f, c, channels=2)
