"""Checkpoints: GGUF models llama.cpp loads, plus the state to resume exactly.

A checkpoint at optimizer step N is two files in ``<run>/checkpoints/``:

- ``step_N.gguf``: the model. Standard llama.cpp metadata
  (``general.type = model``, ``general.architecture`` and the architecture's
  dimension keys from the registry, ``general.file_type`` 0 = all F32,
  ``general.quantization_version``) and tensor names, the tokenizer embedded (``tokenizer.*``), F32
  weights, and a few ``toy.train.*`` keys (run id, step) that other readers
  ignore. ``toy infer`` and llama.cpp load it unchanged.
- ``step_N.state.gguf``: what resuming needs beyond the weights: AdamW's
  moments (``adam_m.<name>``, ``adam_v.<name>``, F32) and, as JSON strings,
  the resolved config, the data cursor, the RNG state and counters
  (``toy.state.*``), and the checksums (``toy.state.checksums``, below).

``latest`` is a symbolic link to the newest ``step_N.gguf``. Writing order
makes a crash harmless: both files are written to temporary names and renamed
into place (``GGUFWriter``): the model first, then the state (which records
the model file's checksum), then ``latest`` is re-pointed by renaming a new
link over it. Until that rename, ``latest`` names the previous, complete
checkpoint; a state file without its model (or the reverse) is ignored.
Older checkpoints beyond ``keep`` are deleted after the new one is in place.
A write that fails (a full disk) raises ``CheckpointWriteError`` naming the
file; the half-made checkpoint is removed, so the previous one stays the
newest complete one.

Integrity. ``toy.state.checksums`` (a JSON string) holds CRC-32s
(``zlib.crc32``): ``model``, of the whole model file's bytes (its metadata,
tokenizer included, and its tensors); ``json``, of the ``toy.state.json``
string; ``tensors``, of each optimizer tensor's bytes. ``load`` verifies
them and raises ``DamagedCheckpointError`` naming the file (and the tensor)
that does not match, or that cannot even be parsed. Only the state file gets
the extra key, so model files are byte for byte what they were (pinned by
fixtures). Checkpoints written before checksums existed load unverified
(``Resumable.verified`` is False). ``load_resumable`` (what resuming uses)
walks back from ``latest`` to the newest checkpoint that verifies and
reports the damaged ones it skipped; ``set_aside`` renames a damaged
checkpoint's files to ``*.damaged`` (kept for inspection, no longer seen as
a checkpoint) and ``latest`` is re-pointed at the one resumed from.

Validity. Checksums catch accidental damage, not a state that is wrong as
written (hand-edited, or from another run). ``load`` refuses a state whose
step or JSON record has the wrong type and optimizer tensors that are not
F32; ``check_state`` (what a run calls on resume, once it knows the
parameters it trains) checks every parameter and AdamW moment against
them: present, exactly the trained names, the parameter's shape, F32,
finite, second moments >= 0, and the counters non-negative integers. Both
raise ``CheckpointStateError`` naming the file and the tensor or key
(``field``), with no fallback to an earlier checkpoint: the state was
written that way.

Orphans. ``GGUFWriter`` writes ``.step_N.gguf.<random>.tmp`` and
``.step_N.state.gguf.<random>.tmp`` (``tempfile.mkstemp``), ``_relink``
``.latest.<pid>.tmp``; a process killed mid-write (SIGKILL, power loss)
leaves them behind. ``remove_orphans`` deletes every file of those names.
It must only run while the run's lock (``toy.runs.folder.RunLock``) is held:
then no other toy process is writing in the folder, so each such file is an
orphan, whatever pid its name carries.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy import models
from toy.errors import BadInputError, ToyError
from toy.gguf import GGUFFile, GGUFWriter
from toy.gguf.constants import ValueType
from toy.gguf.convert import QUANT_VERSION
from toy.gguf.reader import GGUFError, TypeInfo

_STEP_RE = re.compile(r"^step_(\d+)\.gguf$")
# the temporary names of GGUFWriter (mkstemp: prefix ".<name>.", suffix ".tmp") and _relink
_ORPHAN_RE = re.compile(r"^\.(?:step_\d+(?:\.state)?\.gguf\.[A-Za-z0-9_]+|latest\.\d+)\.tmp$")
CHECKSUMS_KEY = "toy.state.checksums"


class CheckpointError(BadInputError):
    """A run folder or checkpoint cannot be resumed from; the message says why."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file whose bytes do not match the checksums recorded
    with it, or that cannot be parsed: ``path`` names the file."""

    def __init__(self, message: str, path: Path, hint: str | None = None):
        super().__init__(message, hint)
        self.path = path


class CheckpointStateError(CheckpointError):
    """A checkpoint whose checksums match but whose state cannot be the
    run's: a tensor of another shape or type, a non-finite value, a missing
    or unknown tensor, a counter of the wrong type. ``path`` names the file,
    ``field`` the tensor or state key."""

    def __init__(self, path: Path, what: str, field: str):
        super().__init__(
            f"checkpoint {path}: {what}",
            hint="this state was not written by this run as configured (edited, or copied from another run); "
            "point checkpoints/latest at an earlier step_N.gguf, or start the run again",
            field=field,
        )
        self.path = path


class CheckpointWriteError(ToyError):
    """A checkpoint file could not be written (a full disk, a read-only
    folder): ``path`` names it, ``step`` its step. Not bad input: exit 1."""

    def __init__(self, message: str, path: Path, step: int, hint: str | None = None):
        super().__init__(message, hint)
        self.path = path
        self.step = step


def model_metadata(cfg, name: str) -> dict[str, Any]:
    """The GGUF metadata of a checkpoint of this config with F32 weights, as
    llama.cpp's converter writes it: ``general.type = "model"``, the
    architecture's keys (``arch.metadata``), ``general.file_type`` 0 (all
    F32) and ``general.quantization_version``."""
    u32 = TypeInfo(ValueType.UINT32)
    return {
        "general.type": "model",
        **models.language_model_of(cfg).metadata(cfg, name),
        "general.file_type": (0, u32),
        "general.quantization_version": (QUANT_VERSION, u32),
    }


@dataclass
class Resumable:
    """What ``load`` gives back."""

    step: int
    model_path: Path
    params: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]  # config, data cursor, rng, counters
    tokenizer_metadata: dict[str, Any]
    verified: bool = False  # checksums recorded and matched (False: an older checkpoint without them)
    param_types: dict[str, str] = field(default_factory=dict)  # the model file's tensor types (GGML names)
    # load_resumable: (step, error) of the newer checkpoints skipped as damaged, newest first
    damaged: list[tuple[int, DamagedCheckpointError]] = field(default_factory=list)

    @property
    def state_path(self) -> Path:
        return self.model_path.with_name(f"step_{self.step}.state.gguf")


def _relink(link: Path, target_name: str) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


def list_steps(folder: Path) -> list[int]:
    """Steps that have both a model and a state file, ascending."""
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (folder / f"step_{m.group(1)}.state.gguf").is_file():
                out.append(int(m.group(1)))
    return sorted(out)


def remove_orphans(folder: str | Path) -> list[Path]:
    """Delete the temporary files killed writers left in ``folder`` (see the
    module docstring; call it only with the run's lock held); returns them."""
    folder = Path(folder)
    gone = []
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if _ORPHAN_RE.match(p.name) and not p.is_dir():
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                gone.append(p)
    return gone


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crc_array(a: np.ndarray) -> int:
    # numpy arrays are buffers, which numpy's stubs declare (__buffer__) for Python 3.12+ only
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))  # type: ignore[arg-type]


def _write(writer_fn, path: Path, step: int) -> None:
    try:
        writer_fn()
    except OSError as e:
        raise CheckpointWriteError(
            f"could not write checkpoint step_{step} ({path}): {e.strerror or e}", path, step
        ) from e


def save(
    folder: str | Path,
    *,
    step: int,
    cfg,
    params: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray],
    tokenizer_metadata: dict[str, Any],
    state: dict[str, Any],
    run_id: str,
    keep: int = 0,
    write_model=None,
) -> Path:
    """Write the checkpoint of ``step`` and point ``latest`` at it; returns
    the model file's path. ``tokenizer_metadata``: ``tokenizer.*`` keys,
    values optionally ``(value, TypeInfo)`` pairs (kept exactly).
    ``write_model(path, params, step, run_id)`` (optional) writes the model
    file instead of the llama model below: a LoRA run writes its adapter, a
    full fine-tune the base's metadata with the trained weights. An OSError
    while writing becomes ``CheckpointWriteError`` (nothing of this step
    stays behind; ``latest`` still names the previous checkpoint)."""
    folder = Path(folder)
    model_path = folder / f"step_{step}.gguf"
    state_path = folder / f"step_{step}.state.gguf"
    _write(lambda: folder.mkdir(parents=True, exist_ok=True), model_path, step)
    w = None
    if write_model is None:
        w = GGUFWriter(model_path)
        for k, v in {**model_metadata(cfg, run_id), **tokenizer_metadata}.items():
            if isinstance(v, tuple):
                w.add(k, v[0], v[1])
            else:
                w.add(k, v)
        w.add("toy.train.run_id", run_id)
        w.add("toy.train.step", int(step))
        for name, a in params.items():
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    state_json = json.dumps(state, sort_keys=True)
    s = GGUFWriter(state_path)
    s.add("toy.state.step", int(step))
    s.add("toy.state.run_id", run_id)
    s.add("toy.state.json", state_json)
    tensor_crcs = {}
    for name, a in optimizer.items():
        a32 = np.ascontiguousarray(a, np.float32)
        tensor_crcs[name] = _crc_array(a32)
        s.add_tensor(name, a32)
    try:
        # the model first: the state records its checksum
        _write(w.write if w is not None else (lambda: write_model(model_path, params, step, run_id)), model_path, step)
        checksums = {"model": _crc_file(model_path), "json": zlib.crc32(state_json.encode()), "tensors": tensor_crcs}
        s.add(CHECKSUMS_KEY, json.dumps(checksums, sort_keys=True))
        _write(s.write, state_path, step)
        _write(lambda: _relink(folder / "latest", model_path.name), folder / "latest", step)
    except BaseException:
        # a checkpoint that is not complete is removed, unless latest already names it
        if latest_step(folder) != step:
            for p in (model_path, state_path):
                try:
                    p.unlink()
                except OSError:
                    pass
        raise
    if keep > 0:
        for old in list_steps(folder)[:-keep]:
            if old != step:
                for suffix in (".gguf", ".state.gguf"):
                    try:
                        (folder / f"step_{old}{suffix}").unlink()
                    except FileNotFoundError:
                        pass
    return model_path


def latest_step(folder: str | Path) -> int | None:
    """The step ``latest`` points at (if its state file exists), else the
    newest complete step, else None."""
    folder = Path(folder)
    link = folder / "latest"
    if link.is_symlink() or link.exists():
        m = _STEP_RE.match(os.readlink(link) if link.is_symlink() else link.name)
        if m and (folder / f"step_{m.group(1)}.state.gguf").is_file() and (folder / m.group(0)).is_file():
            return int(m.group(1))
    steps = list_steps(folder)
    return steps[-1] if steps else None


def _detach(v: Any) -> Any:
    """A metadata value that outlives its file's mapping."""
    if isinstance(v, np.ndarray):
        return v.copy()
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    return v


def tokenizer_metadata_of(gf: GGUFFile) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of an open GGUF as ``(value, TypeInfo)`` pairs."""
    return {k: (_detach(v), gf.types[k]) for k, v in gf.metadata.items() if k.startswith("tokenizer.")}


def _damaged(path: Path, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"checkpoint {path} is damaged: {what}",
        path,
        hint="the file changed after it was written (disk or copy error); resume from an earlier checkpoint",
    )


def _kind(v: Any) -> str:
    """A wrong value as an error names it: its JSON kind (a value the
    state holds may be large; its repr is not repeated)."""
    if v is None:
        return "missing (or null)"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, (int, float, np.integer, np.floating)):
        return f"the number {v}"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, (list, tuple, np.ndarray)):
        return "an array"
    return f"a {type(v).__name__}"


def load(folder: str | Path, step: int | None = None, *, verify: bool = True) -> Resumable:
    """Read a checkpoint (default: the latest) back as float arrays; with
    ``verify``, check its checksums (``DamagedCheckpointError``)."""
    folder = Path(folder)
    if step is None:
        step = latest_step(folder)
        if step is None:
            raise CheckpointError(f"{folder}: no complete checkpoint to resume from")
    model_path = folder / f"step_{step}.gguf"
    state_path = folder / f"step_{step}.state.gguf"
    for p in (model_path, state_path):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing")
    try:
        sf = GGUFFile(state_path)
    except GGUFError as e:
        raise _damaged(state_path, f"it cannot be read ({e})") from None
    with sf:
        recorded = sf.metadata.get("toy.state.step")
        if not isinstance(recorded, (int, np.integer)) or isinstance(recorded, bool):
            raise CheckpointStateError(
                state_path, f"toy.state.step is {_kind(recorded)}, expected the step number {step}", "toy.state.step"
            )
        if int(recorded) != step:
            raise CheckpointError(f"{state_path}: its step does not match {model_path.name}")
        state_json = sf.metadata.get("toy.state.json")
        sums = None
        if verify and CHECKSUMS_KEY in sf.metadata:
            try:
                sums = json.loads(sf.metadata[CHECKSUMS_KEY])
                tensor_sums = dict(sums["tensors"])
            except (ValueError, TypeError, KeyError):
                raise _damaged(state_path, f"its {CHECKSUMS_KEY} record is unreadable") from None
            if not isinstance(state_json, str) or zlib.crc32(state_json.encode()) != sums.get("json"):
                raise _damaged(state_path, "the training state (toy.state.json) does not match its checksum")
            if set(tensor_sums) != set(sf.tensors):
                raise _damaged(state_path, "its tensors are not the ones its checksums name")
        optimizer = {}
        for n, info in sf.tensors.items():
            a = np.array(sf.tensor_to_float(n), np.float32)
            if sums is not None and _crc_array(a) != tensor_sums[n]:
                raise _damaged(state_path, f"tensor {n} does not match its checksum")
            if info.dtype.name != "F32":  # after the checksum: damage falls back, a wrong state does not
                raise CheckpointStateError(state_path, f"tensor {n} is {info.dtype.name}, expected F32", n)
            optimizer[n] = a
        try:
            state = json.loads(state_json)  # type: ignore[arg-type]  # None (no state) raises TypeError: caught
        except (TypeError, ValueError):
            raise _damaged(state_path, "the training state (toy.state.json) is not valid JSON") from None
        if not isinstance(state, dict):
            raise CheckpointStateError(
                state_path,
                f"the training state (toy.state.json) is {_kind(state)}, expected an object",
                "toy.state.json",
            )
    if sums is not None and _crc_file(model_path) != sums.get("model"):
        raise _damaged(model_path, f"its bytes do not match the checksum recorded in {state_path.name}")
    try:
        with GGUFFile(model_path) as gf:
            params = {n: np.array(gf.tensor_to_float(n), np.float32) for n in gf.tensors}
            types = {n: info.dtype.name for n, info in gf.tensors.items()}
            tok = tokenizer_metadata_of(gf)
    except GGUFError as e:
        raise _damaged(model_path, f"it cannot be read ({e})") from None
    return Resumable(step, model_path, params, optimizer, state, tok, verified=sums is not None, param_types=types)


def load_resumable(folder: str | Path) -> Resumable:
    """The newest checkpoint that verifies, starting at ``latest``: the
    damaged ones skipped are in ``.damaged``. When none verifies, the newest
    one's ``DamagedCheckpointError`` (its message says none is left)."""
    folder = Path(folder)
    first = latest_step(folder)
    if first is None:
        raise CheckpointError(f"{folder}: no complete checkpoint to resume from")
    order = [first] + [s for s in reversed(list_steps(folder)) if s != first]
    damaged: list[tuple[int, DamagedCheckpointError]] = []
    for step in order:
        try:
            ck = load(folder, step)
        except DamagedCheckpointError as e:
            damaged.append((step, e))
            continue
        ck.damaged = damaged
        return ck
    newest = damaged[0][1]
    others = f" (and {len(damaged) - 1} earlier one(s) are damaged too)" if len(damaged) > 1 else ""
    raise DamagedCheckpointError(
        f"{newest}; there is no earlier intact checkpoint to fall back on{others}", newest.path, hint=newest.hint
    ) from None


def _check_tensor(path: Path, name: str, a: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise CheckpointStateError(
            path, f"tensor {name} has shape {tuple(a.shape)}, expected {tuple(shape)} ({what})", name
        )
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        i = int(bad[0])
        raise CheckpointStateError(
            path,
            f"tensor {name} holds {bad.size} non-finite value(s) ({a.flat[i]} at flat index {i}), expected finite",
            name,
        )


def check_state(ck: Resumable, specs, *, counters: tuple[str, ...] = ()) -> None:
    """Check a loaded checkpoint against what the resuming run trains:
    ``specs`` (``name``, ``shape`` in NumPy order: the engine's parameter
    specs). Every trained parameter is in the model file, F32, of its
    shape and finite; its AdamW moments ``adam_m.<name>`` and
    ``adam_v.<name>`` are in the state file, of the same shape, finite,
    the second >= 0; the state file holds no other tensor; each state key
    in ``counters`` is, when present, a whole number >= 0. The first
    problem raises ``CheckpointStateError`` naming the file and the tensor
    or key."""
    state_path = ck.state_path
    for s in specs:
        a = ck.params.get(s.name)
        if a is None:
            raise CheckpointStateError(ck.model_path, f"it lacks tensor {s.name}, a parameter this run trains", s.name)
        t = ck.param_types.get(s.name, "F32")
        if t != "F32":
            raise CheckpointStateError(ck.model_path, f"tensor {s.name} is {t}, expected F32", s.name)
        _check_tensor(ck.model_path, s.name, a, s.shape, "the parameter's shape in this run's model")
        for moment, which in (("adam_m", "first"), ("adam_v", "second")):
            n = f"{moment}.{s.name}"
            m = ck.optimizer.get(n)
            if m is None:
                raise CheckpointStateError(
                    state_path, f"it lacks tensor {n}, the AdamW {which} moment of parameter {s.name}", n
                )
            _check_tensor(state_path, n, m, s.shape, f"the shape of parameter {s.name}")
            if moment == "adam_v" and (neg := np.flatnonzero(m < 0)).size:
                i = int(neg[0])
                raise CheckpointStateError(
                    state_path,
                    f"tensor {n} holds {neg.size} negative value(s) ({m.flat[i]} at flat index {i}); "
                    "AdamW's second moments are >= 0",
                    n,
                )
    moments = {f"{m}.{s.name}" for s in specs for m in ("adam_m", "adam_v")}
    extra = sorted(set(ck.optimizer) - moments)
    if extra:
        raise CheckpointStateError(
            state_path, f"tensor {extra[0]} is not an AdamW moment of a parameter this run trains", extra[0]
        )
    for key in counters:
        v = ck.state.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointStateError(
                state_path, f"{key} in toy.state.json is {_kind(v)}, expected a whole number >= 0", key
            )


def config_error(ck: Resumable, e: BadInputError) -> CheckpointStateError:
    """``CheckpointStateError`` for the run config recorded in a checkpoint
    (``config`` in ``toy.state.json``) that does not validate: ``e`` the
    config's own error, whose field it prefixes with ``config.``."""
    return CheckpointStateError(
        ck.state_path,
        f"the run config it records (config in toy.state.json) is invalid: {e}",
        f"config.{e.field}" if e.field else "config",
    )


def restore_rng(ck: Resumable, rng: np.random.Generator) -> None:
    """Set ``rng``'s state to the checkpoint's ``rng`` record (if any); a
    record the generator refuses raises ``CheckpointStateError``."""
    if "rng" not in ck.state:
        return
    try:
        rng.bit_generator.state = ck.state["rng"]
    except (TypeError, ValueError, KeyError, OverflowError):
        raise CheckpointStateError(
            ck.state_path,
            f"rng in toy.state.json is not a state of numpy's {type(rng.bit_generator).__name__} generator",
            "rng",
        ) from None


def set_aside(folder: str | Path, step: int) -> list[Path]:
    """Rename a damaged checkpoint's files to ``<name>.damaged`` (no longer
    a checkpoint; kept for inspection); returns the new paths."""
    folder = Path(folder)
    out = []
    for suffix in (".gguf", ".state.gguf"):
        p = folder / f"step_{step}{suffix}"
        if p.exists():
            q = p.with_name(p.name + ".damaged")
            os.replace(p, q)
            out.append(q)
    return out


def point_latest(folder: str | Path, step: int) -> None:
    """Re-point ``latest`` at ``step_<step>.gguf``."""
    _relink(Path(folder) / "latest", f"step_{step}.gguf")


__all__ = [
    "CHECKSUMS_KEY",
    "CheckpointError",
    "CheckpointStateError",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "Resumable",
    "check_state",
    "config_error",
    "latest_step",
    "list_steps",
    "load",
    "load_resumable",
    "model_metadata",
    "point_latest",
    "remove_orphans",
    "restore_rng",
    "save",
    "set_aside",
    "tokenizer_metadata_of",
]
