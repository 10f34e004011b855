"""Images in, model pixels out: decoding, channel conversion, the ViT resize.

``load_image`` turns a file, a PIL image or a decoded uint8 array into a PIL
image in the model's mode ("L" for 1 channel, "RGB" for 3). ``preprocess``
turns images into the float32 ``(B, C, H, W)`` batch a ViT reads, doing
exactly what transformers' ``ViTImageProcessor`` does by default
(transformers 4.57.6, ``image_processing_vit.py`` + ``image_transforms.resize``):

1. resize to ``size x size`` (aspect ratio not kept) with PIL's
   ``Image.resize((size, size), BILINEAR)`` on the uint8 image
   (``reducing_gap=None``): the output is uint8 again;
2. rescale: ``uint8 -> float64 * (1/255) -> float32``;
3. normalize in float32: ``(x - float32(mean)) / float32(std)`` per channel;
4. channels first.

Because every step is the same operation on the same dtype, the result is
bit-identical to the processor's ``pixel_values`` (tests check 1e-6).

Decisions:

- Formats: PNG, JPEG, WebP and BMP only (``Image.open(formats=...)``); the
  first frame of an animated file. A file is checked with ``verify()`` (PNG
  chunk CRCs) and then fully decoded with ``load()``, so a truncated or corrupt
  file fails here with a ``DataError`` naming it, never later.
- Pixel limit: a file whose header declares more than ``max_pixels()`` pixels
  (``MAX_PIXELS``, 50 megapixels, a 48 MP photo fits; the
  ``TOY_VIT_MAX_PIXELS`` environment variable changes it) is refused with a
  ``DataError`` naming the file and its declared size, before any pixel is
  decoded: the size comes from the header alone, so a 900-byte file declaring
  12000 x 12000 costs milliseconds, not a 1 GB decode. Pillow's own
  ``DecompressionBombWarning`` is silenced in favour of that error (its
  ``DecompressionBombError`` becomes the same message). A ViT reads
  224 x 224 or so; the limit only keeps a hostile header from costing
  gigabytes.
- Paths that are not regular files (a FIFO, ``/dev/zero``) are refused
  before they are opened (``toy.inputs.regular_file``).
- EXIF orientation is applied (``ImageOps.exif_transpose``), as transformers'
  ``load_image`` (the image-classification pipeline) does.
- Alpha is dropped, not composited: RGBA/LA/transparent-palette pixels keep
  their stored colour. This is what transformers' ``load_image`` and
  ``convert_to_rgb`` (``image.convert("RGB")``) and torchvision's
  ``ImageFolder`` loader do, so a model fine-tuned from a Hugging Face
  checkpoint sees the same pixels it was trained on.
- 1-channel models get "L" (Pillow's ITU-R 601-2 luma for colour input); 3-channel
  models get "RGB" (grey replicated). Palette images are expanded first.
- 16-bit grey ("I;16*", and "I" clipped to 0..65535) keeps its high byte
  (``v >> 8``), as Pillow itself does for 16-bit RGB PNGs (Pillow's own
  ``convert("L")`` would clip everything above 255 to white).
- Arrays are uint8 (or uint16, reduced by ``>> 8``) ``(H, W)``, ``(H, W, 1)``,
  ``(H, W, 3)`` or ``(H, W, 4)`` (alpha dropped); a 4-D array is a batch
  ``(B, H, W, C)``.

Invariants: ``load_image`` returns a fully loaded image in mode "L" or "RGB";
``preprocess`` returns a C-contiguous float32 ``(B, C, size, size)`` array.
Bad input raises ``DataError`` (``toy.errors.DataError``, a ``BadInputError``)
naming the file or value.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from toy.errors import DataError as DataError  # toy's one DataError (toy.train.data raises it too); re-exported here
from toy.inputs import regular_file

#: the default most pixels (width x height) an image file may declare
MAX_PIXELS = 50_000_000
#: the environment variable that overrides ``MAX_PIXELS`` (a positive integer)
PIXELS_ENV = "TOY_VIT_MAX_PIXELS"

FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
RESAMPLE = Image.Resampling.BILINEAR
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")

ImageSource = str | os.PathLike | Image.Image | np.ndarray


def check_channels(channels: int) -> int:
    if channels not in (1, 3):
        raise DataError(f"channels must be 1 (grey) or 3 (RGB), got {channels!r}")
    return int(channels)


def _mode_for(channels: int) -> str:
    return "L" if check_channels(channels) == 1 else "RGB"


def _high_byte(a: np.ndarray) -> np.ndarray:
    return (np.clip(a.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)


def _convert(im: Image.Image, channels: int, where: str) -> Image.Image:
    """``im`` in mode "L" or "RGB" (see the module docstring for the rules)."""
    target = _mode_for(channels)
    if im.mode in _SIXTEEN_BIT:
        im = Image.fromarray(_high_byte(np.asarray(im)))
    elif im.mode == "F":
        raise DataError(f"{where}: a floating-point ('F' mode) image; expected 8- or 16-bit pixels")
    elif im.mode in ("P", "PA"):
        # via RGBA: Pillow warns on P -> RGB/L when the palette has transparency
        im = im.convert("RGBA")
    if im.mode != target:
        im = im.convert(target)  # drops alpha; L -> RGB replicates; RGB -> L is luma
    return im


def _from_array(a: np.ndarray, channels: int) -> Image.Image:
    where = f"array of shape {a.shape} and dtype {a.dtype}"
    if a.dtype == np.uint16:
        a = _high_byte(a)
    if a.dtype != np.uint8:
        raise DataError(f"{where}: expected uint8 (or uint16) pixels")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))) or 0 in a.shape:
        raise DataError(f"{where}: expected an image (H, W), (H, W, 1), (H, W, 3) or (H, W, 4)")
    return _convert(Image.fromarray(np.ascontiguousarray(a)), channels, where)


def max_pixels() -> int:
    """The most pixels an image file may declare: ``TOY_VIT_MAX_PIXELS`` when set, else ``MAX_PIXELS``."""
    raw = os.environ.get(PIXELS_ENV, "").strip()
    if not raw:
        return MAX_PIXELS
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise DataError(f"{PIXELS_ENV}={raw!r} must be a positive number of pixels", field=PIXELS_ENV)
    return value


def _declared_size(path: Path) -> tuple[int, int] | None:
    """Width and height from the file's header alone (Pillow's format plugins parse only the header when
    an image is opened; called directly they skip Pillow's own pixel-count check), or None."""
    Image.init()
    with open(path, "rb") as fp:
        head = fp.read(16)
        for fmt in FORMATS:
            factory, accept = Image.OPEN.get(fmt, (None, None))
            if factory is None or (accept is not None and not accept(head)):
                continue
            fp.seek(0)
            try:
                return factory(fp, str(path)).size
            except Exception:  # not this format, or a header Pillow rejects (reported by the open below)
                continue
    return None


def _too_big(path: Path, size: tuple[int, int], limit: int) -> DataError:
    w, h = size
    return DataError(
        f"{path}: the image declares {w} x {h} = {w * h:,} pixels, more than the {limit:,} allowed",
        hint=f"use a smaller image (a ViT reads about 224 x 224), or raise the limit with {PIXELS_ENV}=PIXELS",
    )


def decode_file(path: str | os.PathLike) -> Image.Image:
    """The file's image, verified and fully decoded, EXIF orientation applied,
    in the mode the file has (not yet converted); refused before decoding when
    its header declares more than ``max_pixels()`` pixels."""
    path, limit = regular_file(path), max_pixels()
    try:
        size = _declared_size(path)
        if size is not None and size[0] * size[1] > limit:
            raise _too_big(path, size, limit)
        with warnings.catch_warnings():
            # the size was checked above: Pillow's warning would only repeat it, in its own words
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path, formats=FORMATS) as im:
                if im.width * im.height > limit:
                    raise _too_big(path, im.size, limit)
                im.verify()  # PNG: chunk CRCs; cheap, no pixel decoding
            with Image.open(path, formats=FORMATS) as im:
                im.load()
                out = ImageOps.exif_transpose(im)
                out.load()
                return out if out is not im else im.copy()
    except UnidentifiedImageError:
        raise DataError(f"{path}: not a PNG, JPEG, WebP or BMP image") from None
    except Image.DecompressionBombError:
        raise DataError(
            f"{path}: the image declares more pixels than Pillow decodes ({2 * (Image.MAX_IMAGE_PIXELS or 0):,})",
            hint=f"use a smaller image (a ViT reads about 224 x 224); {PIXELS_ENV} cannot raise Pillow's own bound",
        ) from None
    except OSError as e:
        if e.errno is not None:  # a real I/O error (permissions, ...), not a decoder complaint
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
        raise DataError(f"{path}: corrupt or truncated image ({e})") from None
    except (ValueError, SyntaxError, EOFError, IndexError, TypeError) as e:
        # Pillow's plugins raise these for malformed headers and chunks
        raise DataError(f"{path}: corrupt image ({type(e).__name__}: {e})") from None


def load_image(src: ImageSource, channels: int = 3) -> Image.Image:
    """``src`` (a path, a PIL image or a uint8/uint16 array) as a loaded PIL
    image in mode "L" (``channels=1``) or "RGB" (``channels=3``)."""
    check_channels(channels)
    if isinstance(src, np.ndarray):
        return _from_array(src, channels)
    if isinstance(src, Image.Image):
        try:
            src.load()
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise DataError(f"the PIL image cannot be decoded ({e})") from None
        return _convert(src, channels, "the PIL image")
    if isinstance(src, (str, os.PathLike)):
        return _convert(decode_file(src), channels, str(src))
    raise DataError(f"expected an image path, a PIL image or a uint8 array, got {type(src).__name__}")


def resize_uint8(im: Image.Image, size: int) -> np.ndarray:
    """``im`` (mode "L" or "RGB") resized to ``size x size`` as ViTImageProcessor
    does: uint8 ``(size, size, C)``. Pillow returns a copy when the size is already right."""
    out = np.asarray(im.resize((size, size), RESAMPLE))
    return out[:, :, None] if out.ndim == 2 else out


def check_size(size: int, what: str = "image size") -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise DataError(f"{what} must be a positive integer, got {size!r}")
    return int(size)


def norm_stats(
    mean: float | Sequence[float], std: float | Sequence[float], channels: int
) -> tuple[np.ndarray, np.ndarray]:
    """``mean`` and ``std`` as float32 ``(channels,)`` arrays (a scalar is
    broadcast, as the processor does); std must be positive and finite."""
    out = []
    for name, v in (("mean", mean), ("std", std)):
        a = np.atleast_1d(np.asarray(v, dtype=np.float64))
        if a.ndim != 1 or a.size not in (1, channels):
            raise DataError(f"image {name} {v!r} must be one number or {channels} (one per channel)")
        if not np.all(np.isfinite(a)) or (name == "std" and not np.all(a > 0)):
            raise DataError(f"image {name} {v!r} must be finite{' and positive' if name == 'std' else ''}")
        out.append(np.broadcast_to(a, (channels,)).astype(np.float32))
    return out[0], out[1]


def normalize_uint8(pixels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """uint8 ``(B, H, W, C)`` -> float32 ``(B, C, H, W)``: the processor's rescale
    (float64 * 1/255, then float32) and normalize (float32), channels first."""
    x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _as_list(images) -> list:
    if isinstance(images, np.ndarray):
        return list(images) if images.ndim == 4 else [images]
    if isinstance(images, (str, os.PathLike, Image.Image)):
        return [images]
    return list(images)


def preprocess(
    images: ImageSource | Sequence[ImageSource],
    size: int,
    mean: float | Sequence[float],
    std: float | Sequence[float],
    channels: int | None = None,
) -> np.ndarray:
    """float32 ``(B, C, size, size)`` model input of ``images`` (one image, a
    sequence of them, or a uint8 ``(B, H, W, C)`` batch), equal to
    ``ViTImageProcessor(size={"height": size, "width": size}, image_mean=mean,
    image_std=std)(images)["pixel_values"]`` on the converted images.
    ``channels`` defaults to the length of ``mean`` (3 for a scalar)."""
    size = check_size(size)
    if channels is None:
        channels = len(mean) if isinstance(mean, Sequence) and len(mean) in (1, 3) else 3
    check_channels(channels)
    m, s = norm_stats(mean, std, channels)
    items = _as_list(images)
    if not items:
        raise DataError("no images to preprocess")
    batch = np.stack([resize_uint8(load_image(x, channels), size) for x in items])
    return normalize_uint8(batch, m, s)


def crop_box(height: int, width: int, rng: np.random.Generator, scale: tuple[float, float], ratio: tuple[float, float]):
    """(top, left, h, w) of a random resized crop, torchvision's
    ``RandomResizedCrop.get_params``: up to 10 tries of an area fraction
    uniform in ``scale`` and an aspect ratio (w/h) log-uniform in ``ratio``;
    then a centre crop with the ratio clamped into ``ratio``."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w
