"""Which CPU backend variant this process runs, chosen once at import.

The CPU backend of ggml is built once per x86-64 level (``libggml-cpu-<tag>.so``
beside ``libggml``; the levels are meson's ``cpu_variants`` option). When
``toy_ggml`` is imported, ``load()`` asks every variant for ggml's own score of
this CPU (``ggml_backend_score``: 0 when the CPU lacks an instruction the
variant was compiled for, higher for a later level), loads the best-scoring
one, and registers any other backend module it finds (CUDA, Metal). Exactly one
CPU variant is loaded per process; ``cpu_variant()`` says which and why. Then
it loads the CUDA backend of the toy-ggml-cuda distribution when that is
installed (``plugins()`` says what became of it; see "backend plugins" below).

``TOY_GGML_CPU_VARIANT=<tag>`` picks a variant by name instead (for tests and
comparisons); naming one that is not built, or one this CPU cannot run, is an
error at import rather than a silent fallback. A native build (meson option
``native=true``) carries a single ``libggml-cpu.so`` (tag ``native``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toy_ggml import _build_config as build_config
from toy_ggml import _core, x86_variants
from toy_ggml.errors import GGMLError

log = logging.getLogger("toy_ggml")

ENV = "TOY_GGML_CPU_VARIANT"

# Why a variant scored 0 is explained from toy_ggml.x86_variants (ggml's table of the
# instruction sets each x86-64 variant is compiled for, as /proc/cpuinfo names them);
# the choice itself is ggml's score.


@dataclass(frozen=True)
class Candidate:
    tag: str
    path: str
    score: int  # ggml's score for this CPU; 0: cannot run here
    missing: tuple[str, ...] = ()  # instruction sets this CPU lacks (x86 variants)


@dataclass(frozen=True)
class VariantChoice:
    tag: str
    path: str
    score: int
    reason: str
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "path": self.path,
            "score": self.score,
            "reason": self.reason,
            "candidates": [{"tag": c.tag, "score": c.score, "missing": list(c.missing)} for c in self.candidates],
        }


_choice: VariantChoice | None = None


def _tag(path: Path) -> str:
    stem = path.name.split(".")[0]  # libggml-cpu-haswell
    tag = stem[len("libggml-cpu") :].lstrip("-")
    return tag or ("native" if build_config.NATIVE else "default")


def _order(tag: str) -> int:
    variants = list(getattr(build_config, "CPU_VARIANTS", ()))
    return variants.index(tag) if tag in variants else len(variants)


def candidates(lib_dir: Path | None = None) -> list[Candidate]:
    """Every CPU variant this build carries, with ggml's score for this CPU."""
    lib_dir = lib_dir or Path(_core.library_path()).resolve().parent
    flags = x86_variants.read_flags()
    out = []
    for p in lib_dir.glob("libggml-cpu*.so"):
        tag = _tag(p)
        score = _core.backend_score(p)
        missing: tuple[str, ...] = ()
        if flags is not None and tag in x86_variants.X86_NEEDS:
            missing = x86_variants.missing(tag, flags)
        out.append(Candidate(tag, str(p), score, missing))
    out.sort(key=lambda c: (_order(c.tag), c.tag))
    return out


def _choose(cands: list[Candidate], forced: str | None) -> tuple[Candidate, str]:
    if not cands:
        raise GGMLError("this toy_ggml build carries no CPU backend (no libggml-cpu*.so beside libggml)")
    if forced:
        by_tag = {c.tag: c for c in cands}
        if forced not in by_tag:
            raise GGMLError(
                f"{ENV}={forced!r} is not a CPU variant of this build; built: {', '.join(by_tag)} "
                "(`just install --cpu-variants all` builds every one)"
            )
        c = by_tag[forced]
        if c.score == 0:
            lacks = f" (it lacks {', '.join(c.missing)})" if c.missing else ""
            raise GGMLError(f"{ENV}={forced!r}: this CPU cannot run that variant{lacks}")
        return c, f"chosen by {ENV}"
    usable = [c for c in cands if c.score != 0]
    if not usable:
        raise GGMLError(
            "this CPU runs none of the CPU variants built: "
            + "; ".join(f"{c.tag} lacks {', '.join(c.missing) or '?'}" for c in cands)
        )
    best = max(usable, key=lambda c: c.score)  # the first of equal scores (build order)
    if len(cands) == 1:
        return best, "the only CPU backend in this build"
    skipped = [c for c in cands if c.score == 0]
    why = f"the highest ggml score ({best.score}) of the {len(usable)} variants this CPU runs"
    if skipped:
        why += "; not runnable here: " + "; ".join(
            f"{c.tag} (lacks {', '.join(c.missing)})" if c.missing else c.tag for c in skipped
        )
    return best, why


def load() -> VariantChoice:
    """Load the CPU variant (once per process) and any other backend module."""
    global _choice
    if _choice is not None:
        return _choice
    lib_dir = Path(_core.library_path()).resolve().parent
    cands = candidates(lib_dir)
    best, reason = _choose(cands, os.environ.get(ENV) or None)
    _core.load_backend(best.path)
    for p in sorted(lib_dir.glob("libggml-*.so")):
        if p.name.startswith(("libggml-cpu", "libggml-base")):
            continue
        try:  # a GPU backend whose driver is missing must not stop the CPU
            _core.load_backend(p)
        except GGMLError as e:
            log.warning("%s", e)
    _choice = VariantChoice(best.tag, best.path, best.score, reason, tuple(cands))
    global _plugins
    _plugins = (_load_cuda_plugin(lib_dir),)
    return _choice


def cpu_variant() -> VariantChoice:
    """The CPU backend variant this process loaded, with the reason."""
    return load()


# --- backend plugins: modules of other distributions (toy-ggml-cuda) -----------
#
# ggml's CUDA backend is a distribution of its own, toy-ggml-cuda, whose package
# folder (toy_ggml_cuda/) holds libggml-cuda.so and build-info.json. load() finds
# that folder without importing the package and loads the library through
# ggml's registry after the CPU variant, as it loads the modules beside
# libggml. Whatever goes wrong (the package's library cannot be opened: the
# nvidia wheels are missing; it was built from another ggml; no driver or no
# GPU: ggml's CUDA registry then has no device) is recorded in a Plugin with the
# reason and logged once, and the CPU path is the same as without the plugin.
# TOY_GGML_CUDA=0 skips it. ggml's own log lines from the attempt (the CUDA
# runtime's "no CUDA-capable device", at ggml's error level) are kept out of
# the user's stderr: they become the reason, and go to the toy_ggml logger at
# debug level.

CUDA_ENV = "TOY_GGML_CUDA"
CUDA_DIST = "toy-ggml-cuda"
CUDA_PACKAGE = "toy_ggml_cuda"
CUDA_LIBRARY = "libggml-cuda.so"
CUDA_INSTALL_HINT = "pip install 'toy-cli[cuda]', or `just cuda` in a checkout"


@dataclass(frozen=True)
class Plugin:
    """A backend module of another distribution and what became of it in this process."""

    name: str  # the distribution, e.g. "toy-ggml-cuda"
    path: str | None  # its library; None when the distribution is not installed
    loaded: bool  # registered with ggml (it may still have found no device)
    reason: str  # why it is not loaded, or what it found
    backend: str | None = None  # ggml's registry name ("CUDA") once loaded
    devices: tuple[str, ...] = ()  # the devices it registered ("CUDA0", ...)
    built_for: dict[str, Any] = field(default_factory=dict)  # build-info.json: archs, cuda_version, ggml source

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "loaded": self.loaded,
            "backend": self.backend,
            "devices": list(self.devices),
            "reason": self.reason,
            "archs": list(self.built_for.get("archs", [])),
            "cuda_version": self.built_for.get("cuda_version"),
        }


_plugins: tuple[Plugin, ...] = ()


def plugins() -> tuple[Plugin, ...]:
    """The backend plugins toy_ggml looked for at import (today: toy-ggml-cuda), loaded or not, with the
    reason for each."""
    load()
    return _plugins


class _Capture(logging.Filter):
    """Holds back the toy_ggml logger's records while a plugin loads (ggml logs them from the calling
    thread), to turn them into the plugin's reason instead of lines on the user's stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append((record.levelno, record.getMessage()))
        return False


def _plugin_folder(package: str) -> Path | None:
    """An installed package's folder, found without importing it (None: not installed)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _source_of(stamp: dict[str, Any]) -> tuple[Any, ...]:
    return (stamp.get("ggml_version"), tuple((p.get("name"), p.get("sha256")) for p in stamp.get("patches", [])))


def _stamp_mismatch(info: dict[str, Any]) -> str | None:
    """Why a plugin built from ``info``'s ggml source cannot run with this toy_ggml, or None: the module
    shares toy_ggml's libggml-base, so both must come from the same ggml and patch set."""
    ours = getattr(build_config, "_STAMP", None)
    if isinstance(ours, dict):
        same = _source_of(ours) == _source_of(info)
    else:  # a build record without the hashes: compare the names
        same = (info.get("ggml_version"), tuple(p.get("name") for p in info.get("patches", []))) == (
            build_config.GGML_VERSION,
            tuple(build_config.PATCHES),
        )
    if same:
        return None
    theirs = [p.get("name") for p in info.get("patches", [])]
    extra = sorted(set(theirs) - set(build_config.PATCHES))
    missing = sorted(set(build_config.PATCHES) - set(theirs))
    diff = "; ".join(
        x
        for x in (
            f"ggml {info.get('ggml_version')} vs {build_config.GGML_VERSION}"
            if info.get("ggml_version") != build_config.GGML_VERSION
            else "",
            f"patches only it has: {', '.join(extra)}" if extra else "",
            f"patches it lacks: {', '.join(missing)}" if missing else "",
        )
        if x
    )
    return (
        f"it was built from another ggml source than this toy_ggml ({diff or 'a patch differs'}); "
        "install the toy-ggml-cuda of the same version, or rebuild it (`just cuda`)"
    )


def _load_cuda_plugin(lib_dir: Path) -> Plugin:
    folder = _plugin_folder(CUDA_PACKAGE)
    if folder is None:
        return Plugin(CUDA_DIST, None, False, f"not installed ({CUDA_INSTALL_HINT})")
    lib = folder / CUDA_LIBRARY

    def failed(reason: str, info: dict[str, Any] | None = None, level: int = logging.WARNING) -> Plugin:
        log.log(level, "%s: %s not loaded: %s", CUDA_DIST, lib, reason)
        return Plugin(CUDA_DIST, str(lib), False, reason, built_for=info or {})

    if os.environ.get(CUDA_ENV, "").strip() == "0":
        return failed(f"skipped: {CUDA_ENV}=0", level=logging.INFO)
    if (lib_dir / CUDA_LIBRARY).is_file():
        return failed(f"this toy_ggml build carries its own CUDA backend ({lib_dir / CUDA_LIBRARY})")
    if not lib.is_file():
        return failed(f"the package has no {CUDA_LIBRARY} (a broken install: reinstall {CUDA_DIST})")
    try:
        import json

        info = json.loads((folder / "build-info.json").read_text(encoding="utf-8"))
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return failed(f"cannot read its build-info.json ({e}): cannot tell which ggml it was built from")
    why = _stamp_mismatch(info)
    if why:
        return failed(why, info)
    # open it first on our own (RTLD_LOCAL, kept open: ggml's open below then finds it loaded), for the
    # loader's own words when a library it needs is missing
    import ctypes

    try:
        ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
    except OSError as e:
        reason = f"cannot open it: {e}"
        if "libcudart" in str(e) or "libcublas" in str(e):
            reason += " (the nvidia-cuda-runtime and nvidia-cublas 13 wheels are its dependencies: pip install them)"
        return failed(reason, info)
    capture = _Capture()
    log.addFilter(capture)
    try:
        backend: str | None = _core.load_backend(lib)
        error = None
    except GGMLError as e:
        backend, error = None, str(e)
    finally:
        log.removeFilter(capture)
    for _, m in capture.records:
        log.debug("%s: ggml: %s", CUDA_DIST, m)
    # ggml's warnings and errors, less the "function: " prefix of its log lines
    said = "; ".join(m.split(": ", 1)[-1] for level, m in capture.records if level >= logging.WARNING)
    if backend is None:
        return failed(f"{error}{f': {said}' if said else ''}", info)
    devs = tuple(row[1] for row in _core.devices_raw() if row[6] == backend)
    if devs:
        reason = f"{len(devs)} device{'s' if len(devs) != 1 else ''}: " + ", ".join(
            f"{row[1]} ({row[2]})" for row in _core.devices_raw() if row[6] == backend
        )
    else:
        reason = f"no device{f' ({said})' if said else ''}"
    log.info("%s: loaded %s from %s: %s", CUDA_DIST, backend, lib, reason)
    return Plugin(CUDA_DIST, str(lib), True, reason, backend, devs, info)


def sum_step() -> int:
    """How many elements ggml's F32/F16 dot products of the loaded CPU variant
    take per SIMD step (GGML_F32_STEP / GGML_F16_STEP; a whole multiple of
    both): 32 with AVX/AVX2 (and on other CPUs), 64 with AVX-512, 128 for a
    native build on a CPU with AVX512-FP16. A dot product of length n sums
    its first n - n % step elements in SIMD lanes and the rest one by one, so
    two lengths that are both multiples of the step give the same sum when
    one only adds zeros: the engine pads attention lengths to a multiple of
    this so that a sequence's logits do not depend on its batch."""
    from toy_ggml._core import cpu_features

    feats = cpu_features()
    if not feats.get("avx512"):
        return 32
    flags = x86_variants.read_flags() or set()
    if build_config.NATIVE and "avx512_fp16" in flags:
        return 128
    return 64
