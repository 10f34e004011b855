"""Multi-rank training runs in tests: start a command under ``mpiexec -n N``
(MPICH's hydra from the environment's bin folder) with a bound on its time,
read a run's step events, and compare what two runs wrote.

The comparisons follow the contract of data-parallel training (N ranks with
one micro-batch each make the same step as one process accumulating N): a
model checkpoint holds the run id (``toy.train.run_id``), so two runs' files
are compared byte for byte after the one id is swapped for the other; a
``.state.gguf`` records the run's shape (grad_accum, ranks), so only its
tensors are compared.

Every child runs in its own session: on a timeout the whole group (the
launcher and its ranks) is killed, so nothing outlives a test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: seconds one launched command may take unless the caller says otherwise
TIMEOUT = 180.0


def mpiexec() -> str:
    """The ``mpiexec`` of this Python's environment (the ``mpich`` wheel puts
    it there), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec: install the distributed extra (pip install mpi4py mpich)")
    return found


def launch(argv: Sequence[str], ranks: int) -> list[str]:
    """``argv`` as ``ranks`` processes (plain ``argv`` for one)."""
    return [*argv] if ranks <= 1 else [mpiexec(), "-n", str(ranks), *argv]


def toy_argv(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "toy_cli", *args]


def kill_group(p: subprocess.Popen[str]) -> None:
    """Kill ``p``'s process group (its session: the launcher and the ranks) and reap ``p``."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def start(
    argv: Sequence[str], ranks: int = 1, *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``argv`` on ``ranks`` processes in a session of their own (stop it
    with ``kill_group`` in a ``finally``); output to pipes."""
    return subprocess.Popen(
        launch(argv, ranks),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_command(
    cmd: Sequence[str], *, cwd: str | os.PathLike[str], env: dict[str, str], timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` exactly as given (an ``mpiexec`` line of the caller's, MPMD
    included), with exactly ``env``, in a session of its own: on a timeout
    or any error the launcher and every rank are killed, then
    ``subprocess.TimeoutExpired`` is raised."""
    p = subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            kill_group(p)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run(
    argv: Sequence[str],
    ranks: int = 1,
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on ``ranks`` processes and wait at most ``timeout`` seconds
    (then kill them all and raise ``subprocess.TimeoutExpired``)."""
    return run_command(launch(argv, ranks), cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def toy(args: Sequence[str], ranks: int = 1, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m toy_cli ARGS`` on ``ranks`` processes (``run``'s keywords)."""
    return run(toy_argv(args), ranks, **kw)


def train(args: Sequence[str], ranks: int = 1, **kw: Any) -> Path:
    """A ``toy train ... --json`` command that must succeed: its run folder
    (relative paths resolved against ``cwd``)."""
    r = toy([*args, "--json", "-q"], ranks, **kw)
    assert r.returncode == 0, f"{r.args} exited {r.returncode}:\n{r.stderr[-4000:]}"
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, f"one JSON summary expected (rank 0's), got:\n{r.stdout}"
    run_dir = Path(json.loads(lines[0])["run_dir"])
    return run_dir if run_dir.is_absolute() else Path(kw["cwd"]) / run_dir


# ------------------------------------------------------------------ what a run wrote


def events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def step_records(run_dir: str | os.PathLike[str]) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} of the step events; a step recorded twice (done
    again after a resume) must agree with itself."""
    out: dict[int, tuple[float, float]] = {}
    for e in events(run_dir):
        if e["kind"] == "step":
            v = (e["loss"], e["grad_norm"])
            assert out.setdefault(e["step"], v) == v, (e["step"], out[e["step"]], v)
    return out


def eval_losses(run_dir: str | os.PathLike[str]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir) if e["kind"] == "eval"}


def checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The model checkpoints of a run (not their ``.state.gguf``), by step
    (a name order would put step_11 before step_8)."""
    files = (Path(run_dir) / "checkpoints").glob("step_*.gguf")
    return sorted((p for p in files if not p.name.endswith(".state.gguf")), key=lambda p: int(p.stem.split("_")[1]))


def state_of(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name.replace(".gguf", ".state.gguf"))


def run_id_of(checkpoint: Path) -> str:
    """The id of the run that wrote a checkpoint: its run folder's name (the
    file holds it in ``toy.train.run_id`` or, for adapters, in ``general.name``)."""
    return checkpoint.parent.parent.name


def assert_same_model_file(a: Path, b: Path) -> None:
    """``a`` and ``b`` (checkpoints in their runs' folders) are the same bytes
    once ``a``'s run id is replaced by ``b``'s wherever it occurs."""
    ida, idb = run_id_of(a).encode(), run_id_of(b).encode()
    da, db = a.read_bytes(), b.read_bytes()
    assert len(ida) == len(idb) and da.count(ida) == db.count(idb) >= 1, (ida, idb)
    da = da.replace(ida, idb)
    if da != db:
        first = next((i for i, (x, y) in enumerate(zip(da, db)) if x != y), min(len(da), len(db)))
        raise AssertionError(f"{a} and {b} differ from byte {first} on (sizes {len(da)} and {len(db)})")


def assert_same_state_tensors(a: Path, b: Path) -> None:
    """The training states beside two checkpoints hold the same tensors, bit for bit."""
    from toy.gguf import GGUFFile

    with GGUFFile(state_of(a)) as fa, GGUFFile(state_of(b)) as fb:
        assert fa.tensors and sorted(fa.tensors) == sorted(fb.tensors)
        for n in fa.tensors:
            assert bytes(fa.tensor_bytes(n)) == bytes(fb.tensor_bytes(n)), n


def assert_same_run(got: Path, want: Path, *, steps: int) -> None:
    """What the contract promises of two runs: every step's loss and gradient
    norm, every eval loss, and every checkpoint (model bytes modulo the run
    id, state tensors) equal."""
    sg, sw = step_records(got), step_records(want)
    assert sorted(sw) == list(range(1, steps + 1)), sorted(sw)
    assert sg == sw
    assert eval_losses(got) == eval_losses(want)
    cg, cw = checkpoints(got), checkpoints(want)
    assert cw and [p.name for p in cg] == [p.name for p in cw]
    for x, y in zip(cg, cw):
        assert_same_model_file(x, y)
        assert_same_state_tensors(x, y)


def ordered_sums(per_rank: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """NumPy's float32 ``((r0 + r1) + r2) + ...`` of each tensor over the ranks
    (``per_rank[r][i]``: rank r's tensor i), written out step by step."""
    out = []
    for i in range(len(per_rank[0])):
        acc = np.asarray(per_rank[0][i], np.float32).copy()
        for r in range(1, len(per_rank)):
            acc = np.add(acc, np.asarray(per_rank[r][i], np.float32), dtype=np.float32)
        out.append(acc)
    return out
