"""The bundled demo data set: scikit-learn's handwritten digits.

1,797 grey 8x8 images of the digits 0-9 (about 180 per class), the copy of the
UCI "Optical Recognition of Handwritten Digits" test set that scikit-learn
ships (``sklearn.datasets.load_digits``). ``toy_vit/data/digits.npz`` holds
them, so the demo needs no download and no scikit-learn at run time;
``tools/make_digits.py`` rebuilds the file from scikit-learn.

The npz holds ``images`` (uint8 ``(1797, 8, 8)``: the data set's values 0..16
scaled as ``round(v * 255 / 16)``, so 16 is 255 and 8 is 128), ``labels``
(uint8 ``(1797,)``, the digit) and ``provenance`` (a string: scikit-learn
version, source, licences, the scaling).

``write_demo_data(dir)`` writes them as an image folder toy-vit trains on:
``DIR/<digit>/<index>.png`` (``index`` the 4-digit position in the data set,
so sorted order is data-set order), grey PNGs upscaled ``scale`` times by
nearest neighbour (default 4: 32x32 pixels, so a 32-pixel ViT sees every
pixel as a clean 4x4 block), plus ``DIR/README.txt`` with the provenance.

Decisions: the folder is written into a hidden temp folder beside ``DIR`` and
renamed into place, so ``DIR`` is either absent or complete. A non-empty
``DIR`` is refused unless ``overwrite``; even then only a folder holding
nothing but what this function writes (the ten digit folders of PNGs and
README.txt) is replaced: ``overwrite`` never deletes unrelated files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

from toy_vit.preprocess import DataError

N_IMAGES = 1797
CLASSES = tuple(str(d) for d in range(10))
_README = "README.txt"


@dataclass(frozen=True)
class Digits:
    images: np.ndarray  # uint8 (1797, 8, 8), 0..255
    labels: np.ndarray  # uint8 (1797,), 0..9
    provenance: str


def digits_path() -> Path:
    return Path(str(resources.files("toy_vit") / "data" / "digits.npz"))


def load_digits() -> Digits:
    """The bundled digits (fresh arrays each call)."""
    path = digits_path()
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels, provenance = z["images"], z["labels"], str(z["provenance"])
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: the bundled digits file is unreadable ({e}); reinstall toy-vit") from None
    if images.shape != (N_IMAGES, 8, 8) or images.dtype != np.uint8 or labels.shape != (N_IMAGES,):
        raise DataError(f"{path}: the bundled digits file has unexpected arrays; reinstall toy-vit")
    return Digits(images, labels, provenance)


def _listdir(path) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return list(it)


def _check_replaceable(out: Path) -> bool:
    """True if ``out`` exists (a folder); refuses anything but our own output."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise DataError(f"{out}: exists and is not a folder")
    foreign = []
    for e in _listdir(out):
        if e.name == _README and e.is_file():
            continue
        if e.name in CLASSES and e.is_dir() and not e.is_symlink():
            foreign += [
                f"{e.name}/{f.name}" for f in os.scandir(e.path) if not (f.is_file() and f.name.endswith(".png"))
            ]
            continue
        foreign.append(e.name)
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise DataError(
            f"{out}: holds files that write_demo_data does not write ({shown}); refusing to replace it",
            hint="choose an empty or new folder",
        )
    return True


def write_demo_data(
    dir: str | os.PathLike,
    *,
    scale: int = 4,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the digits as ``DIR/<digit>/<index>.png`` (see the module
    docstring); returns ``DIR``."""
    if isinstance(scale, bool) or not isinstance(scale, int) or not 1 <= scale <= 64:
        raise DataError(f"scale must be an integer from 1 to 64, got {scale!r}")
    out = Path(dir)
    if out.is_dir() and _listdir(out) and not overwrite:
        raise DataError(
            f"{out}: the folder is not empty", hint="choose another folder, or pass overwrite (--overwrite)"
        )
    exists = _check_replaceable(out)
    digits = load_digits()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise DataError(f"{out.parent}: cannot create a folder there: {e.strerror or e}") from None
    trash = None
    try:
        for c in CLASSES:
            (tmp / c).mkdir()
        big = digits.images.repeat(scale, axis=1).repeat(scale, axis=2)  # nearest-neighbour upscale
        for i, (img, label) in enumerate(zip(big, digits.labels)):
            Image.fromarray(img).save(tmp / str(label) / f"{i:04d}.png", optimize=False)
            if progress and (i + 1) % 100 == 0:
                progress(i + 1, N_IMAGES)
        (tmp / _README).write_text(
            "scikit-learn's handwritten digits, written by toy-vit (toy vit demo-data).\n"
            f"{N_IMAGES} images, one folder per digit; <index>.png is the image's position in the data set;\n"
            f"8x8 pixels upscaled {scale}x by nearest neighbour.\n\n{digits.provenance}\n"
        )
        if exists:
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rename(out, trash / "old")
        os.rename(tmp, out)
    except OSError as e:
        kept = ""
        if trash is not None and (trash / "old").exists() and not out.exists():
            try:
                os.rename(trash / "old", out)  # put the previous folder back
            except OSError:
                kept, trash = f" (the previous folder is in {trash / 'old'})", None
        raise DataError(f"{out}: cannot write the demo data: {e.strerror or e}{kept}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    if progress:
        progress(N_IMAGES, N_IMAGES)
    return out
