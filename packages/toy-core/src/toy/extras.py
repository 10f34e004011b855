"""The command that installs an optional part of toy, as it works from here.

``install_command(extra)`` answers for ``"serve"`` (``toy serve``, toy-serve),
``"vit"`` (``toy vit``, toy-vit), ``"plot"`` (matplotlib, for ``toy runs
plot`` and ``toy vit eval --plot``), ``"tensorboard"`` (tensorboardX) and
``"mlflow"`` (mlflow-skinny; both for ``--report-to`` and ``toy runs export``) and
``"distributed"`` (mpi4py and MPICH, for ``toy train --ranks``). Every install hint toy prints comes from
it, so a hint names a command that exists for the way this copy of toy was
installed. The way is read from toy-core's distribution (toy-cli's when
toy-core's metadata is missing): its PEP 610 ``direct_url.json``, and the
record ``tools/install.py`` leaves in the environment (``<prefix>/.toy-install.json``):

- installed by ``tools/install.py`` from a checkout (``just install``): the
  same installer with the extras the environment has plus the one asked for
  (``just install`` is declarative: an extra left out is removed), and
  ``--venv`` when the environment is not the checkout's ``.venv``; for an
  extra the installer has no flag for (tensorboard, mlflow), the index command
  below (pip keeps the installed toy-cli and adds the extra's packages);
- an editable install (``just setup``, the development environment, which
  installs everything): ``just setup``; for an extra that is not a toy package
  (plot, tensorboard, mlflow) only when its package is a development
  requirement (``requirements/dev.txt``), else the index command;
- installed from wheel files in a folder (``tools/install.py --wheels dist``):
  ``pip install --find-links <folder> 'toy-cli[<extra>]'``;
- anything else (from a package index): ``pip install 'toy-cli[<extra>]'``.

The checkout commands start with ``cd <checkout> &&`` when the working folder
is not the checkout. ``pip`` is this environment's: plain ``pip`` when its
``bin`` folder is first on ``PATH``, else the path to it (relative to the
working folder when that is shorter).

Layer 0 (docs/concepts/architecture.md): the standard library only.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

# extra -> the distribution it brings (an extra of toy-cli each)
EXTRAS = {
    "serve": "toy-serve",
    "vit": "toy-vit",
    "plot": "matplotlib",
    "tensorboard": "tensorboardX",
    "mlflow": "mlflow-skinny",
    "distributed": "mpi4py",
}
INSTALLER_FLAGS = ("serve", "vit", "plot")  # the extras tools/install.py has a flag for
STAMP = ".toy-install.json"  # tools/install.py's record in the environment it installed

__all__ = ["EXTRAS", "install_command"]


def install_command(extra: str) -> str:
    """The shell command that adds ``extra`` (one of ``EXTRAS``) to this toy."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r} (have: {', '.join(EXTRAS)})")
    how, where = _origin()
    if how == "checkout" and extra in INSTALLER_FLAGS:
        flags = [f"--{e}" for e in INSTALLER_FLAGS if e == extra or _installed(EXTRAS[e])]
        env = Path(sys.prefix).resolve()
        if env != (where / ".venv").resolve():
            flags = ["--venv", _shown(env, where)] + flags
        return _cd(where) + " ".join(["just", "install", *flags])
    if how == "editable" and (extra in ("serve", "vit") or _dev_requires(where, EXTRAS[extra].lower())):
        return _cd(where) + "just setup"
    links = f"--find-links {shlex.quote(_shorter(where))} " if how == "wheels" else ""
    return f"{_pip()} install {links}'toy-cli[{extra}]'"


def _origin() -> tuple[str, Path]:
    """("checkout", root) | ("editable", root) | ("wheels", folder) | ("index", Path())."""
    for name in ("toy-core", "toy-cli"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        try:
            info = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            info = None
        if not isinstance(info, dict) or not str(info.get("url", "")).startswith("file:"):
            return "index", Path()
        path = Path(unquote(urlparse(info["url"]).path))
        if (info.get("dir_info") or {}).get("editable"):
            root = _checkout_above(path)
            return ("editable", root) if root else ("index", Path())
        if path.suffix == ".whl":
            root = _installer_checkout()
            if root is None and "build" in path.parts:  # <checkout>/build/wheels/...
                i = len(path.parts) - 1 - path.parts[::-1].index("build")
                root = _checkout_above(Path(*path.parts[: i + 1]))
            return ("checkout", root) if root else ("wheels", path.parent)
        return "index", Path()
    return "index", Path()


def _installer_checkout() -> Path | None:
    """The checkout whose tools/install.py built this environment's wheels, from its record."""
    try:
        rec = json.loads((Path(sys.prefix) / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("source") != "checkout" or not rec.get("checkout"):
        return None
    root = Path(rec["checkout"])
    return root if (root / "tools" / "install.py").is_file() else None


def _checkout_above(path: Path) -> Path | None:
    for p in [path, *path.parents]:
        if (p / "tools" / "install.py").is_file() and (p / "justfile").is_file():
            return p
    return None


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _dev_requires(root: Path, name: str) -> bool:
    try:
        lines = (root / "requirements" / "dev.txt").read_text().splitlines()
    except OSError:
        return False
    reqs = (line.split("#", 1)[0].strip().lower() for line in lines)
    return any(r == name or r.startswith((f"{name}>", f"{name}=", f"{name}<", f"{name}[", f"{name};")) for r in reqs)


def _cd(root: Path) -> str:
    try:
        here = Path.cwd().resolve()
    except OSError:
        here = None
    return "" if here == root.resolve() else f"cd {shlex.quote(str(root))} && "


def _shown(path: Path, root: Path) -> str:
    """``path`` as the installer, run in ``root``, takes it."""
    try:
        return shlex.quote(str(path.relative_to(root.resolve())))
    except ValueError:
        return shlex.quote(str(path))


def _shorter(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except (OSError, ValueError):
        return str(path)
    return rel if len(rel) < len(str(path)) else str(path)


def _pip() -> str:
    bindir = Path(sys.prefix) / "bin"
    first = os.environ.get("PATH", "").split(os.pathsep)[0]
    try:
        if first and Path(first).resolve() == bindir.resolve():
            return "pip"
    except OSError:
        pass
    return shlex.quote(_shorter(bindir / "pip"))
