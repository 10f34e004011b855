"""A toy project: the folder holding a ``toy.toml`` (written by ``toy new``).

Commands run inside a project take their defaults from its ``toy.toml``::

    [project]
    name = "tales"            # informative
    runs = "runs"             # the runs folder (default: runs, next to toy.toml)
    model = "smollm2-135m"    # the default model: a path or a `toy list` name
    seed = 0                  # the training seed
    device = "cpu"            # the training device
    threads = 2               # the training threads

Every key is optional. Paths (``runs``, and ``model`` when it is a path) are
relative to the folder of ``toy.toml``, so a command finds the same files
from any subfolder of the project.

``find()`` looks for ``toy.toml`` in the current folder, then in each parent;
it stops at the home folder (checked, its parents not) and at a filesystem
boundary (a parent on another device is not checked), so a stray file far
above the working folder is never picked up. ``load(path)`` reads and
validates one file with tomllib: an unknown key, a wrong type or a file that
is not TOML is a ``ConfigError`` naming the key and the file.
``current()`` is the project around the current folder, or None.

Precedence, for every command: a flag, then a config file (``--config``),
then the environment (``$TOY_RUNS_DIR``, ``$TOY_DEVICE``, ``$TOY_THREADS``:
set for this shell, the more specific choice than a project's file), then
the project, then toy's built-in default.

Layer 0: this module imports only the standard library and ``toy.errors``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toy.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["FILENAME", "KEYS", "Project", "current", "find", "load"]

FILENAME = "toy.toml"

#: the keys of the [project] table and their types
KEYS: dict[str, type] = {"name": str, "runs": str, "model": str, "seed": int, "device": str, "threads": int}
_KIND = {str: "a string", int: "an integer"}


@dataclass(frozen=True)
class Project:
    root: Path  # the folder holding toy.toml
    file: Path
    name: str | None = None
    runs: Path | None = None  # absolute (load() sets <root>/runs when the file does not say)
    model: str | None = None  # a `toy list` name, or an absolute path
    seed: int | None = None
    device: str | None = None
    threads: int | None = None

    def train_defaults(self, recipe: str) -> dict[str, Any]:
        """Training config values (nested, as in a config file) this project
        sets: seed, device, threads, and for the fine-tuning recipes (lora,
        full) the base model. ``$TOY_DEVICE`` and ``$TOY_THREADS`` win over
        the project's device and threads (the environment over the project)."""
        out: dict[str, Any] = {}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.device is not None and not os.environ.get("TOY_DEVICE"):
            out["device"] = self.device
        if self.threads is not None and not os.environ.get("TOY_THREADS"):
            out["threads"] = self.threads
        if recipe in ("lora", "full") and self.model is not None:
            out["base"] = self.model
        return out


def _is_path(model: str) -> bool:
    return "/" in model or os.sep in model or model.startswith(".") or model.lower().endswith(".gguf")


def load(path: str | os.PathLike[str]) -> Project:
    """Read and validate one ``toy.toml``."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}", "fix the file or remove it") from None
    extra = sorted(set(data) - {"project"})
    if extra:
        raise ConfigError(f"{p}: unknown key {extra[0]!r}", "toy.toml holds one table, [project]", field=extra[0])
    table = data.get("project", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{p}: project must be a table ([project])", field="project")
    values: dict[str, Any] = {}
    for key, value in table.items():
        want = KEYS.get(key)
        if want is None:
            raise ConfigError(
                f"{p}: unknown key 'project.{key}'", f"known keys: {', '.join(KEYS)}", field=f"project.{key}"
            )
        if not isinstance(value, want) or isinstance(value, bool):
            raise ConfigError(f"{p}: project.{key} = {value!r} is not {_KIND[want]}", field=f"project.{key}")
        values[key] = value
    if "threads" in values and values["threads"] < 1:
        raise ConfigError(f"{p}: project.threads = {values['threads']} must be >= 1", field="project.threads")
    for key in ("runs", "model", "device", "name"):
        if key in values and not values[key].strip():
            raise ConfigError(f"{p}: project.{key} is empty", field=f"project.{key}")
    root = p.resolve().parent
    values["runs"] = root / values.get("runs", "runs")
    if "model" in values and _is_path(values["model"]):
        values["model"] = str(root / values["model"])
    return Project(root=root, file=p, **values)


def find(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The nearest ``toy.toml`` from ``start`` (default: the current folder)
    upwards, stopping at the home folder and at a filesystem boundary."""
    try:
        here = Path(start if start is not None else os.getcwd()).resolve()
        dev = here.stat().st_dev
    except OSError:
        return None  # the current folder was deleted, or cannot be read
    try:
        home: Path | None = Path.home().resolve()
    except (OSError, RuntimeError):  # no $HOME and no passwd entry: no home boundary
        home = None
    while True:
        candidate = here / FILENAME
        try:
            if candidate.is_file():
                return candidate
            if here == home or here.parent == here or here.parent.stat().st_dev != dev:
                return None
        except OSError:  # a folder we may not read ends the search
            return None
        here = here.parent


def current(start: str | os.PathLike[str] | None = None) -> Project | None:
    """The project around ``start`` (default: the current folder), or None."""
    path = find(start)
    return load(path) if path is not None else None
