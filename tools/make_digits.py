"""Rebuild packages/toy-vit/src/toy_vit/data/digits.npz from scikit-learn.

    .venv/bin/python tools/make_digits.py [--check]

Reads ``sklearn.datasets.load_digits()`` (1,797 8x8 images, values 0..16,
10 classes) and writes a compressed npz: ``images`` uint8 scaled as
``round(v * 255 / 16)``, ``labels`` uint8, and a ``provenance`` string. The
zip entries carry a fixed timestamp, so the same scikit-learn data gives the
same bytes. ``--check`` compares the committed file's arrays with a fresh
build instead of writing (exit 1 on a difference).
"""

from __future__ import annotations

import argparse
import io
import sys
import zipfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "packages/toy-vit/src/toy_vit/data/digits.npz"


def build() -> dict[str, np.ndarray]:
    import sklearn
    from sklearn.datasets import load_digits

    d = load_digits()
    values = d.images
    if values.shape != (1797, 8, 8) or values.min() < 0 or values.max() > 16 or not np.all(values == np.round(values)):
        sys.exit(f"make_digits: unexpected load_digits() images {values.shape} in [{values.min()}, {values.max()}]")
    images = np.round(values * 255 / 16).astype(np.uint8)
    labels = d.target.astype(np.uint8)
    provenance = (
        f"scikit-learn {sklearn.__version__} sklearn.datasets.load_digits() "
        "(sklearn/datasets/data/digits.csv.gz; scikit-learn is BSD-3-Clause licensed). "
        "Originally the test set of the UCI Machine Learning Repository data set "
        "'Optical Recognition of Handwritten Digits' (E. Alpaydin, C. Kaynak, 1998, doi:10.24432/C50P49), "
        "which UCI publishes under CC BY 4.0. "
        "Pixels: the data set's 0..16 block counts scaled to 0..255 as round(v * 255 / 16)."
    )
    return {"images": images, "labels": labels, "provenance": np.array(provenance)}


def write(arrays: dict[str, np.ndarray], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(tmp, "w") as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue(), compresslevel=9)
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare the committed file with a fresh build")
    args = ap.parse_args()
    arrays = build()
    if args.check:
        with np.load(OUT, allow_pickle=False) as z:
            same = all(np.array_equal(z[k], v) for k, v in arrays.items() if k != "provenance")
        print(f"make_digits: {OUT} {'matches' if same else 'DIFFERS from'} load_digits()")
        return 0 if same else 1
    write(arrays, OUT)
    print(f"make_digits: wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
