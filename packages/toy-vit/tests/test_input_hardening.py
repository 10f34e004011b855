"""Decompression bombs and files that are not files in ``toy vit`` (issue 42, items 3 and 4).

A bomb is a small file whose header declares a huge image: a PNG whose IHDR says
12000 x 12000 over an 8 x 8 image's data, and a ~900-byte JPEG whose SOF0 says
the same over a 16 x 16 image's scan (the issue's case: classified, exit 0,
after 35 s and 1.15 GB, with Pillow's ``DecompressionBombWarning``; the code
before this change decodes it whole here too, 1.1 GB). Both are built here. ``classify``,
``eval`` and ``train`` (data loading) run in a child under an address-space
limit and a timeout: each must refuse the file from its header, naming it and
its size, within seconds and a small peak RSS, and without Pillow's warning.
The limit is ``toy_vit.preprocess.MAX_PIXELS`` (50 MP), changed by
``TOY_VIT_MAX_PIXELS``.
"""

from __future__ import annotations

import io
import os
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.limited import run_limited
from toy_vit.config import ViTConfig
from toy_vit.gguf_io import write_gguf
from toy_vit.preprocess import MAX_PIXELS, PIXELS_ENV, DataError, decode_file
from toy_vit.train import init_params

AS_LIMIT = 1536 << 20  # the old code needed ~1.15 GB of RSS for a 12000 x 12000 bomb
PEAK_MB = 400  # a refused bomb costs what the command costs without it
SECONDS = 20  # generous on a loaded machine; the old code took ~35 s


def png_bomb(w: int, h: int) -> bytes:
    """An 8 x 8 PNG whose IHDR declares ``w`` x ``h`` (its CRC fixed, so only the size is wrong)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, "PNG")
    b = bytearray(buf.getvalue())
    i = b.index(b"IHDR")
    b[i + 4 : i + 12] = struct.pack(">II", w, h)
    b[i + 17 : i + 21] = struct.pack(">I", zlib.crc32(bytes(b[i : i + 17])))
    return bytes(b)


def jpeg_bomb(w: int, h: int) -> bytes:
    """A 16 x 16 JPEG whose SOF0 declares ``w`` x ``h``: its scan ends long before the declared image
    does (libjpeg fills the rest, so Pillow decodes it whole: the issue's case)."""
    px = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=50)
    b = bytearray(buf.getvalue())
    i = b.index(b"\xff\xc0")
    b[i + 5 : i + 9] = struct.pack(">HH", h, w)
    return bytes(b)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A vit-micro model, a small class folder per split kind, and the two bombs."""
    d = tmp_path_factory.mktemp("bombs")
    cfg = ViTConfig.preset("vit-micro", labels=("a", "b"))
    model = write_gguf(d / "m.gguf", cfg, init_params(cfg, 1))
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (d / "data" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(d / "data" / c / f"{i}.png")
    (d / "bomb.png").write_bytes(png_bomb(12000, 12000))
    (d / "bomb.jpg").write_bytes(jpeg_bomb(12000, 12000))
    assert len((d / "bomb.jpg").read_bytes()) < 1000
    return d, model


def refused_quickly(args, *, env=None):
    t0 = time.monotonic()
    r = run_limited(["vit", *args], as_limit=AS_LIMIT, timeout=120, env=env)
    secs = time.monotonic() - t0
    assert not r.timed_out, "ran past 120 s"
    assert r.code == 2, r.err[-2000:]
    assert secs < SECONDS and 0 < r.peak_mb < PEAK_MB, (secs, r.peak_mb)
    assert "DecompressionBomb" not in r.err and "Traceback" not in r.err, r.err
    return r


@pytest.mark.parametrize("name", ["bomb.png", "bomb.jpg"])
def test_classify_refuses_a_bomb_from_its_header(world, name):
    d, model = world
    r = refused_quickly(["classify", model, d / "data" / "a" / "0.png", d / name, "--threads", "1"])
    want = f"error: {d / name}: the image declares 12000 x 12000 = 144,000,000 pixels, more than the 50,000,000 allowed"
    assert want in r.err and PIXELS_ENV in r.err


@pytest.mark.parametrize("command", ["eval", "train"])
def test_eval_and_training_data_refuse_a_bomb_in_the_folder(world, tmp_path, command):
    d, model = world
    data = tmp_path / "data"
    for c in ("a", "b"):
        (data / c).mkdir(parents=True)
        for f in (d / "data" / c).iterdir():
            (data / c / f.name).write_bytes(f.read_bytes())
    (data / "b" / "9.jpg").write_bytes((d / "bomb.jpg").read_bytes())
    if command == "eval":
        args = ["eval", model, data, "--split", "all", "--runs-dir", tmp_path / "runs", "--threads", "1"]
    else:
        args = ["train", data, "--preset", "vit-micro", "--steps", "1", "--batch-size", "2", "--threads", "1",
                "--eval-every", "0", "--save-every", "0", "--out", tmp_path / "runs"]  # fmt: skip
    r = refused_quickly(args, env={"TOY_HOME": str(tmp_path / "home")})
    assert f"{data / 'b' / '9.jpg'}: the image declares 12000 x 12000" in r.err


def test_the_limit_is_configurable_and_checked(world, tmp_path, capsys, monkeypatch):
    d, model = world
    img = d / "data" / "a" / "0.png"  # 16 x 16 = 256 pixels
    assert MAX_PIXELS == 50_000_000
    monkeypatch.setenv(PIXELS_ENV, "255")
    code, out, err = run(capsys, "vit", "classify", model, img)
    assert_clean_error(code, err, 2, f"{img}: the image declares 16 x 16 = 256 pixels, more than the 255 allowed")
    monkeypatch.setenv(PIXELS_ENV, "256")
    assert decode_file(img).size == (16, 16)
    huge = tmp_path / "huge.png"
    huge.write_bytes(png_bomb(20000, 20000))  # 400 MP: over Pillow's own bound (2 x 89.5 MP)
    monkeypatch.setenv(PIXELS_ENV, "500_000_000")  # ours allows it: Pillow's error, in our words, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match=f"{huge}: the image declares more pixels than Pillow decodes"):
            decode_file(huge)
    monkeypatch.setenv(PIXELS_ENV, "many")
    code, out, err = run(capsys, "vit", "classify", model, img)
    assert_clean_error(code, err, 2, f"{PIXELS_ENV}='many' must be a positive number of pixels")


def test_a_fifo_or_dev_zero_image_is_refused(world, tmp_path):
    d, model = world
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    for name in ("fifo.png", "zero.png"):  # classify's own check (the CLI's) or decode_file's
        r = run_limited(["vit", "classify", model, tmp_path / name], as_limit=AS_LIMIT, timeout=60)
        assert not r.timed_out and r.code == 2, r.err[-2000:]
        assert f"error: {tmp_path / name}: not a" in r.err
    for name, kind in [("fifo.png", "a FIFO"), ("zero.png", "a character device, through a symbolic link")]:
        with pytest.raises(DataError, match=rf"{name}: not a regular file \({kind}\)"):
            decode_file(tmp_path / name)  # what eval and training data reach (the library)
