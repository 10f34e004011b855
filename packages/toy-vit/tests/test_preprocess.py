"""toy_vit.preprocess against transformers' ViTImageProcessor (the reference)
and against independently computed conversions (alpha, palette, 16-bit, luma)."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from toy.errors import BadInputError
from toy_vit.digits import load_digits
from toy_vit.preprocess import DataError, crop_box, load_image, preprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MEAN3, STD3 = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
MEAN1, STD1 = [0.5], [0.25]


def _open(path) -> Image.Image:
    """The file's image, loaded, its file closed."""
    with Image.open(path) as im:
        im.load()
        return im.copy()


def _smooth(h: int, w: int, c: int, seed: int) -> np.ndarray:
    """A photo-like uint8 image: gradients plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    chans = [
        np.sin(x / (5 + 3 * k) + k) * np.cos(y / (7 + k)) * 100 + 128 + rng.normal(0, 12, (h, w)) for k in range(c)
    ]
    return np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (path, channels the image is meant for) for files of every format and mode."""
    d = tmp_path_factory.mktemp("imgs")
    out = {}
    rgb = _smooth(30, 45, 3, 0)
    big = _smooth(300, 200, 3, 1)
    grey = _smooth(40, 27, 1, 2)[:, :, 0]
    rgba = np.concatenate([_smooth(33, 50, 3, 3), _smooth(33, 50, 1, 4)], -1)
    Image.fromarray(rgb).save(d / "rgb.png")
    Image.fromarray(big).save(d / "big.jpg", quality=90)
    Image.fromarray(grey).save(d / "grey.png")
    Image.fromarray(grey).save(d / "grey.jpeg")
    Image.fromarray(rgba).save(d / "rgba.png")
    Image.fromarray(rgba).save(d / "rgba.webp", lossless=True)
    Image.fromarray(rgb).save(d / "rgb.webp", quality=80)
    Image.fromarray(big).save(d / "big.bmp")
    Image.fromarray(rgb).quantize(16).save(d / "palette.png")
    Image.fromarray(grey).save(d / "grey.bmp")
    for name in ["rgb.png", "big.jpg", "rgba.png", "rgba.webp", "rgb.webp", "big.bmp", "palette.png"]:
        out[name] = d / name
    for name in ["grey.png", "grey.jpeg", "grey.bmp"]:
        out[name] = d / name
    return out


def _hf(images: list[Image.Image], size: int, mean, std) -> np.ndarray:
    transformers = pytest.importorskip("transformers")
    proc = transformers.ViTImageProcessor(size={"height": size, "width": size}, image_mean=mean, image_std=std)
    # grey PIL images become 2-D arrays, which the processor cannot place: give it (H, W, 1)
    arrays = [np.asarray(im)[:, :, None] if im.mode == "L" else np.asarray(im) for im in images]
    return proc(images=arrays, input_data_format="channels_last", return_tensors="np")["pixel_values"]


@pytest.mark.parametrize("size", [32, 224])
@pytest.mark.parametrize("channels", [3, 1])
def test_files_match_vit_image_processor(files, size, channels):
    mean, std = (MEAN3, STD3) if channels == 3 else (MEAN1, STD1)
    paths = list(files.values())
    ours = preprocess(paths, size, mean, std, channels)
    ref = _hf([load_image(p, channels) for p in paths], size, mean, std)
    assert ours.shape == (len(paths), channels, size, size) and ours.dtype == np.float32
    assert ours.flags.c_contiguous
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours, ref)  # the same float32 operations: bit-identical in fact
    # and from the decoded uint8 arrays (the cache path), batch and one by one: the same floats
    arrays = [np.asarray(load_image(p, channels)) for p in paths]
    np.testing.assert_array_equal(np.concatenate([preprocess(a, size, mean, std, channels) for a in arrays]), ours)


@pytest.mark.parametrize("size", [32, 224])
def test_digits_match_vit_image_processor(size):
    d = load_digits()
    imgs = d.images[:16].repeat(4, 1).repeat(4, 2)  # (16, 32, 32) grey, as demo-data writes them
    ours = preprocess(imgs[:, :, :, None], size, 0.5, 0.5, channels=1)
    ref = _hf([Image.fromarray(a) for a in imgs], size, [0.5], [0.5])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    # not a tautology: the values really change with the size and the statistics
    assert not np.allclose(preprocess(imgs[:1, :, :, None], size, 0.4, 0.5, 1), ours[:1])


def test_scalar_and_list_statistics_agree(files):
    p = files["rgb.png"]
    a = preprocess(p, 32, 0.5, 0.5)
    np.testing.assert_array_equal(a, preprocess([p], 32, [0.5] * 3, [0.5] * 3, 3))
    assert a.shape == (1, 3, 32, 32)


def test_rgba_alpha_is_dropped(files):
    src = np.asarray(_open(files["rgba.png"]))
    assert src.shape[2] == 4 and src[:, :, 3].min() < 200  # really translucent somewhere
    np.testing.assert_array_equal(np.asarray(load_image(files["rgba.png"], 3)), src[:, :, :3])
    np.testing.assert_array_equal(np.asarray(load_image(files["rgba.webp"], 3)), src[:, :, :3])
    np.testing.assert_array_equal(np.asarray(load_image(src, 3)), src[:, :, :3])


def test_grey_conversions_follow_luma_and_replication(files):
    rgb = np.asarray(_open(files["rgb.png"])).astype(np.float64)
    luma = rgb @ [0.299, 0.587, 0.114]  # ITU-R 601-2, computed independently of Pillow
    got = np.asarray(load_image(files["rgb.png"], 1)).astype(np.float64)
    assert got.shape == luma.shape
    assert np.abs(got - luma).max() <= 1.0
    g = np.asarray(_open(files["grey.png"]))
    as_rgb = np.asarray(load_image(files["grey.png"], 3))
    assert as_rgb.shape == (*g.shape, 3)
    for k in range(3):
        np.testing.assert_array_equal(as_rgb[:, :, k], g)


def test_palette_with_transparency(tmp_path):
    pal = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [9, 9, 9]], np.uint8)
    idx = np.arange(24, dtype=np.uint8).reshape(4, 6) % 4
    im = Image.fromarray(idx, "P")
    im.putpalette(pal.ravel().tolist())
    im.save(tmp_path / "p.png", transparency=3)
    assert "transparency" in _open(tmp_path / "p.png").info
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow warns on a careless P -> RGB conversion
        got = np.asarray(load_image(tmp_path / "p.png", 3))
    np.testing.assert_array_equal(got, pal[idx])  # colour under the transparent entry kept: alpha dropped
    np.testing.assert_array_equal(
        np.asarray(load_image(tmp_path / "p.png", 1)), np.asarray(Image.fromarray(pal[idx]).convert("L"))
    )


def test_sixteen_bit_grey_keeps_the_high_byte(tmp_path):
    a = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1031).astype(np.uint16)
    Image.fromarray(a).save(tmp_path / "g16.png")
    assert _open(tmp_path / "g16.png").mode.startswith("I")
    np.testing.assert_array_equal(np.asarray(load_image(tmp_path / "g16.png", 1)), (a >> 8).astype(np.uint8))
    np.testing.assert_array_equal(np.asarray(load_image(a, 1)), (a >> 8).astype(np.uint8))


def test_exif_orientation_is_applied(tmp_path):
    a = np.zeros((4, 6), np.uint8)
    a[:, :3] = 200  # left half bright
    im = Image.fromarray(a)
    exif = Image.Exif()
    exif[0x0112] = 3  # rotated 180 degrees
    im.save(tmp_path / "o.png", exif=exif.tobytes())
    np.testing.assert_array_equal(np.asarray(load_image(tmp_path / "o.png", 1)), a[::-1, ::-1])


def test_one_bit_and_cmyk(tmp_path):
    b = (np.arange(30).reshape(5, 6) % 2).astype(bool)
    Image.fromarray(b).save(tmp_path / "b.png")
    np.testing.assert_array_equal(np.asarray(load_image(tmp_path / "b.png", 1)), b.astype(np.uint8) * 255)
    Image.new("CMYK", (5, 4), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)
    got = np.asarray(load_image(tmp_path / "c.jpg", 3)).astype(int)
    assert got.shape == (4, 5, 3) and np.abs(got - [255, 0, 0]).max() <= 8  # pure red


# -- errors ---------------------------------------------------------------------


def _raises(match: str):
    return pytest.raises(DataError, match=match)


def test_errors_name_the_file(tmp_path, files):
    import toy.errors
    import toy.train.data

    assert issubclass(DataError, BadInputError)
    assert DataError is toy.errors.DataError is toy.train.data.DataError  # one DataError across toy
    with _raises(f"{tmp_path / 'nope.png'}: no such file"):
        load_image(tmp_path / "nope.png")
    with _raises(f"{tmp_path}: not a regular file"):
        load_image(tmp_path)
    (tmp_path / "t.png").write_text("hello")
    with _raises(r"t\.png: not a PNG, JPEG, WebP or BMP image"):
        load_image(tmp_path / "t.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "x.gif")
    with _raises(r"x\.gif: not a PNG, JPEG, WebP or BMP image"):
        load_image(tmp_path / "x.gif")


@pytest.mark.parametrize("name", ["rgb.png", "big.jpg", "rgb.webp", "big.bmp"])
def test_truncated_files_are_refused(tmp_path, files, name):
    raw = files[name].read_bytes()
    bad = tmp_path / name
    bad.write_bytes(raw[: len(raw) // 2])
    with _raises(f"{bad}: (corrupt|not a PNG)"):
        load_image(bad)


def test_png_with_a_broken_crc_is_refused(tmp_path, files):
    raw = bytearray(files["rgb.png"].read_bytes())
    i = raw.index(b"IDAT") + 20
    raw[i] ^= 0xFF
    bad = tmp_path / "crc.png"
    bad.write_bytes(bytes(raw))
    with _raises(r"crc\.png: corrupt"):
        load_image(bad)


def test_argument_errors(files):
    with _raises("channels must be 1 .* or 3 .*, got 4"):
        load_image(files["rgb.png"], 4)
    with _raises(r"array of shape \(4, 4\) and dtype float32: expected uint8"):
        load_image(np.zeros((4, 4), np.float32))
    with _raises(r"array of shape \(4, 4, 2\) .*expected an image"):
        load_image(np.zeros((4, 4, 2), np.uint8))
    with _raises("expected an image path, a PIL image or a uint8 array, got int"):
        load_image(3)
    with _raises("image mean .* must be one number or 3"):
        preprocess(files["rgb.png"], 32, [0.5, 0.5], 0.5)
    with _raises("image std .* must be finite and positive"):
        preprocess(files["rgb.png"], 32, 0.5, [0.5, 0.0, 0.5])
    with _raises("image size must be a positive integer, got 0"):
        preprocess(files["rgb.png"], 0, 0.5, 0.5)
    with _raises("no images to preprocess"):
        preprocess([], 32, 0.5, 0.5)
    with _raises(r"'F' mode"):
        load_image(Image.new("F", (3, 3)))


# -- random resized crop ----------------------------------------------------------


def test_crop_box_stays_in_its_ranges():
    rng = np.random.default_rng(0)
    areas, ratios = [], []
    for _ in range(2000):
        top, left, h, w = crop_box(64, 48, rng, (0.3, 0.9), (0.5, 2.0))
        assert 0 <= top and top + h <= 64 and 0 <= left and left + w <= 48
        areas.append(h * w / (64 * 48))
        ratios.append(w / h)
    areas, ratios = np.array(areas), np.array(ratios)
    # rounding w and h to whole pixels moves area and ratio a little past the ranges
    assert areas.min() > 0.27 and areas.max() < 0.95
    assert ratios.min() > 0.45 and ratios.max() < 2.2
    assert areas.std() > 0.1 and np.log(ratios).std() > 0.2  # really random, not fixed
    # log-uniform ratio: on a square image as many wide crops as tall ones
    # (on the 64x48 one, wide crops of a large area do not fit and are drawn again)
    square = np.array([(lambda b: b[3] / b[2])(crop_box(64, 64, rng, (0.3, 0.9), (0.5, 2.0))) for _ in range(2000)])
    assert abs(np.mean(square > 1) - 0.5) < 0.05
    assert np.mean(ratios > 1) < 0.45


def test_crop_box_falls_back_to_a_centre_crop():
    rng = np.random.default_rng(0)
    # a 2:1 crop of the whole area cannot fit a square image: centre crop with the ratio clamped to 2
    assert crop_box(40, 40, rng, (1.0, 1.0), (2.0, 3.0)) == (10, 0, 20, 40)
    assert crop_box(40, 40, rng, (1.0, 1.0), (1 / 3, 0.5)) == (0, 10, 40, 20)
    assert crop_box(40, 40, rng, (1.0, 1.0), (1.0, 1.0)) == (0, 0, 40, 40)


def test_pil_image_input_is_not_modified(files):
    im = _open(files["rgba.png"])
    out = load_image(im, 3)
    assert im.mode == "RGBA" and out.mode == "RGB"
    buf = io.BytesIO()
    out.save(buf, "PNG")
    assert buf.tell() > 0
