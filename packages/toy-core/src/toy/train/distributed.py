"""Training on several processes: the MPI world a run sees, and the fixed-order
gradient reduction that keeps a multi-rank step bit-identical to a one-process
step (docs/guide/distributed.md is the user's side of this).

Ranks talk through MPI (``mpi4py``, the optional extra ``toy-core[distributed]``
with the ``mpich`` wheel, or any system MPI mpi4py was built against). A
process started by an MPI launcher (``mpiexec``, ``srun``) with more than one
rank gets a ``World`` of that size from ``World.from_env()``; any other process
gets the one-process world, and nothing imports mpi4py.

Decisions:

- Sharding is by whole tensors, not element ranges. ``owners(sizes, n)``
  gives each tensor to one rank (contiguous runs of the parameter list,
  balanced by element count). The owner receives every rank's gradient of
  the tensor and adds them in rank order, ``((g0 + g1) + g2) + ...``: the
  same float32 additions, in the same order, as a one-process run's
  gradient accumulation over those micro-batches (``TrainEngine``: copy the
  first, add each next). Whole tensors keep the per-tensor sum of squares of
  the gradient norm (ggml's ``sum_sqr``, whose summation order depends on
  the tensor's shape) computable by one rank on the whole tensor.
- The owner alone runs AdamW on its tensors and keeps their moments
  (ZeRO stage 1), then every rank receives every updated tensor from its
  owner. Traffic per rank and step: the gradients of the tensors it does not
  own out, its own tensors' gradients in, then the same sizes of parameters:
  what a ring all-reduce moves. So ZeRO-1 is always on when size > 1.
- Messages are point-to-point (``Isend``/``Irecv``; objects pickled, under
  a tag of their own, received through a polled matched probe), so a wait
  knows which rank has not answered, and no rank is ever inside a blocking
  MPI call that a dead peer could leave unfinished. Every wait spins while
  messages move, then polls at 1 ms, up to ``timeout`` seconds
  (``TOY_COMM_TIMEOUT``, default 600), then raises ``CommTimeoutError``
  naming the silent ranks.
- A rank that dies is noticed by the launcher: MPICH's ``mpiexec`` ends the
  other ranks and says which process died (``toy train --ranks`` reports it
  with the run's last good checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError, ToyError

EXTRA = "toy-core[distributed]"
TIMEOUT_ENV = "TOY_COMM_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
_OBJECT_TAG = 32000  # pickled objects; a tensor's messages are tagged with its index (below this; 32767 is MPI's minimum upper bound)

# the world size an MPI launcher tells its processes (MPICH/Intel MPI's hydra and Slurm's PMI, Open MPI, PMIx)
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


class MPIUnavailableError(ToyError):
    """Several ranks were asked for, but mpi4py (or an MPI library) is missing."""


class CommTimeoutError(ToyError):
    """A rank did not answer within the communication timeout."""


class RankMismatchError(BadInputError):
    """The ranks of a run were started with different inputs."""


def launched_size() -> int:
    """The number of ranks an MPI launcher started this process among (1:
    not started by one)."""
    for var in _SIZE_VARS:
        v = os.environ.get(var)
        if v and v.strip().isdigit():
            return int(v)
    return 1


def _install() -> str:
    from toy.extras import install_command

    return install_command("distributed")


def launched_rank() -> int:
    """This process's rank as its MPI launcher says (0: not started by one)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        v = os.environ.get(var)
        if v and v.strip().isdigit():
            return int(v)
    return 0


def timeout_from_env() -> float:
    v = os.environ.get(TIMEOUT_ENV)
    if not v:
        return DEFAULT_TIMEOUT
    try:
        t = float(v)
    except ValueError:
        raise BadInputError(f"{TIMEOUT_ENV}={v!r} is not a number of seconds") from None
    if not t > 0:
        raise BadInputError(f"{TIMEOUT_ENV}={v!r}: the timeout must be positive")
    return t


def owners(sizes: Sequence[int], n: int) -> list[int]:
    """The owning rank of each tensor (element counts ``sizes``) among ``n``
    ranks: contiguous runs in list order, each tensor to the rank whose
    share of the total its middle falls in. Deterministic; a rank may own
    nothing when tensors are fewer than ranks."""
    total = float(sum(sizes)) or 1.0
    out, start = [], 0
    for s in sizes:
        mid = start + s / 2.0
        out.append(min(n - 1, int(mid * n / total)))
        start += s
    return out


def ordered_sum(pieces: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """``((p0 + p1) + p2) + ...`` in float32, element by element: the order a
    one-process run accumulates micro-batch gradients in. ``out`` (float32,
    the pieces' shape) may be one of the pieces after the first: a + b and
    b + a are the same bits."""
    if len(pieces) == 1:
        return np.array(pieces[0], np.float32, copy=True)
    out = np.add(pieces[0], pieces[1], dtype=np.float32, out=out)
    for p in pieces[2:]:
        out += p
    return out


@dataclass
class CommStats:
    """Communication of the current step: seconds waited or copying, bytes sent."""

    seconds: float = 0.0
    sent: int = 0


class World:
    """The ranks of a run. The one-process world (``World()``) has rank 0 of
    size 1 and never communicates."""

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT):
        self.comm = comm
        self.timeout = timeout
        self.stats = CommStats()
        self._buffers: dict[tuple[int, int], np.ndarray] = {}  # reduce_owned's receive buffers
        if comm is None:
            self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
            self.hosts = [os.uname().nodename]
            self.mpi_library = ""
            return
        from mpi4py import MPI

        self._MPI = MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.mpi_library = MPI.Get_library_version().strip().splitlines()[0].strip()
        self.hosts = self.allgather(MPI.Get_processor_name())

    @classmethod
    def from_env(cls) -> World:
        """The world this process was launched into (see the module docstring)."""
        n = launched_size()
        if n <= 1:
            return cls()
        timeout = timeout_from_env()
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise MPIUnavailableError(
                f"this process was started as one of {n} MPI ranks, but mpi4py cannot be imported ({e})",
                hint=f"install the extra: {_install()}",
            ) from None
        world = cls(MPI.COMM_WORLD, timeout)
        if world.size != n:  # a launcher's variables left in the environment of a process started otherwise
            raise MPIUnavailableError(
                f"the launcher's environment says {n} ranks, but MPI started this process in a world of {world.size}",
                hint="start the ranks with the mpiexec of the MPI that mpi4py uses (the extra, "
                f"{_install()}, puts one in the environment's bin folder)",
            )
        return world

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> dict[str, Any]:
        """What ``run_start`` records about the world."""
        return {"size": self.size, "hosts": self.hosts, "mpi": self.mpi_library}

    # ---------------------------------------------------------------- waiting

    def _wait(self, pending: list[tuple[Any, int]], what: str) -> None:
        """Wait for requests (``(request, peer rank)``); ``CommTimeoutError``
        naming the ranks still pending after ``timeout`` seconds.

        It spins on ``Testsome`` while messages may be moving (MPI moves data
        over TCP only inside its calls: a sleep between tests measured 20x
        slower transfers), and naps 1 ms between tests once nothing has
        completed for 2 s (the peers are computing, not sending)."""
        MPI = self._MPI
        reqs = [r for r, _ in pending]
        open_ = set(range(len(reqs)))
        t0 = last = time.monotonic()
        while open_:
            done = MPI.Request.Testsome(reqs)  # completed ones become inactive
            now = time.monotonic()
            if done is None:  # none left active
                return
            if done:
                open_.difference_update(done)
                last = now
                continue
            if now - t0 > self.timeout:
                for i in open_:
                    if pending[i][1] >= 0:  # point-to-point: cancellable (a barrier's request is not)
                        try:
                            reqs[i].Cancel()
                        except MPI.Exception:
                            pass
                raise self._silent([pending[i][1] for i in open_], what)
            if now - last > 2.0:
                time.sleep(0.001)

    def _silent(self, peers: Sequence[int], what: str) -> CommTimeoutError:
        """The error for ``peers`` that did not answer in time (-1: unknown)."""
        hosts = getattr(self, "hosts", [])
        names = ", ".join(f"{p} ({hosts[p]})" if 0 <= p < len(hosts) else str(p) for p in sorted(set(peers)) if p >= 0)
        return CommTimeoutError(
            f"rank {self.rank}: rank(s) {names or 'some'} did not answer within {self.timeout:g} s while {what}",
            hint=f"a rank died or hangs; raise {TIMEOUT_ENV} if a step or set-up legitimately takes longer",
        )

    def _fence(self, what: str) -> None:
        """Every rank has reached this point (an ``Ibarrier``, polled)."""
        if self.size > 1:
            req = self.comm.Ibarrier()
            self._wait([(req, -1)], what)

    def barrier(self, what: str = "waiting for the other ranks") -> None:
        self._fence(what)

    # ---------------------------------------------------------------- objects

    # Objects travel as point-to-point pickled messages under their own tag (tensor messages use the tensor's
    # index), received by a polled matched probe: a rank that dies at any moment is noticed by the timeout,
    # which a blocking collective begun just before it died would never give.

    def _receive(self, sources: Sequence[int], what: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        pending = list(sources)
        t0 = last = time.monotonic()
        while pending:
            for p in list(pending):
                msg = self.comm.improbe(source=p, tag=_OBJECT_TAG)
                if msg is not None:
                    got[p] = msg.recv()
                    pending.remove(p)
                    last = time.monotonic()
            now = time.monotonic()
            if pending and now - t0 > self.timeout:
                raise self._silent(pending, what)
            if pending and now - last > 2.0:
                time.sleep(0.001)
        return got

    def allgather(self, obj: Any, what: str = "exchanging set-up facts") -> list[Any]:
        """``obj`` of every rank, by rank."""
        if self.size == 1:
            return [obj]
        peers = [p for p in range(self.size) if p != self.rank]
        sends = [(self.comm.isend(obj, dest=p, tag=_OBJECT_TAG), p) for p in peers]
        got = self._receive(peers, what)
        self._wait(sends, what)
        return [obj if p == self.rank else got[p] for p in range(self.size)]

    def bcast(self, obj: Any, root: int = 0, what: str = "receiving rank 0's facts") -> Any:
        """``root``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj
        if self.rank == root:
            peers = [p for p in range(self.size) if p != root]
            self._wait([(self.comm.isend(obj, dest=p, tag=_OBJECT_TAG), p) for p in peers], what)
            return obj
        return self._receive([root], what)[root]

    def any(self, flag: bool, what: str = "agreeing whether to stop") -> bool:
        return any(self.allgather(bool(flag), what))

    def check_same(self, what: str, value: Any) -> None:
        """``RankMismatchError`` on every rank when the ranks' ``value`` differ,
        naming the first rank that differs from rank 0 and both values."""
        values = self.allgather(value, f"comparing the ranks' {what}")
        for r, v in enumerate(values):
            if v != values[0]:
                raise RankMismatchError(
                    f"rank {r} ({self.hosts[r]}) has another {what} than rank 0 ({self.hosts[0]}): {v!r} != {values[0]!r}",
                    hint="start every rank with the same command, config, model and data files",
                )

    def abort(self, code: int = 1) -> None:
        if self.comm is not None:
            self.comm.Abort(code)

    # ---------------------------------------------------------------- tensors

    def _exchange(self, sends: list[tuple[np.ndarray, int, int]], recvs: list[tuple[np.ndarray, int, int]], what: str):
        """Post every ``(buffer, peer, tag)`` receive and send (float32,
        contiguous) and wait for all, counting the step's statistics."""
        t0 = time.perf_counter()
        FLOAT = self._MPI.FLOAT
        reqs = [(self.comm.Irecv([b, FLOAT], source=p, tag=t), p) for b, p, t in recvs]
        reqs += [(self.comm.Isend([b, FLOAT], dest=p, tag=t), p) for b, p, t in sends]
        self._wait(reqs, what)
        self.stats.sent += sum(b.nbytes for b, _, _ in sends)
        self.stats.seconds += time.perf_counter() - t0

    def reduce_owned(
        self, arrays: Sequence[np.ndarray], owner: Sequence[int], into: dict[int, np.ndarray] | None = None
    ) -> dict[int, np.ndarray]:
        """Every rank's ``arrays`` (float32, one per tensor; the same shapes on
        every rank) summed in rank order (``ordered_sum``), for the tensors
        this rank owns: {tensor index: sum}. One message per tensor and peer,
        straight from and into the arrays (no packing copies). The sums are
        written to ``into[i]`` (contiguous float32; it may be ``arrays[i]``
        itself), else to buffers the next call reuses."""
        mine = [i for i, o in enumerate(owner) if o == self.rank]
        if self.size == 1:
            return {i: np.array(arrays[i], np.float32, copy=True) for i in mine}
        if len(owner) > _OBJECT_TAG:
            raise ValueError(f"{len(owner)} tensors: more than the {_OBJECT_TAG} message tags toy uses for tensors")
        t0 = time.perf_counter()
        arr = [np.ascontiguousarray(a, np.float32) for a in arrays]
        sends = [(arr[i], o, i) for i, o in enumerate(owner) if o != self.rank and arr[i].size]
        got = {(p, i): self._scratch(p, i, arr[i].shape) for i in mine for p in range(self.size) if p != self.rank}
        recvs = [(b, p, i) for (p, i), b in got.items() if b.size]
        self.stats.seconds += time.perf_counter() - t0
        self._exchange(sends, recvs, "summing the gradients")
        t0 = time.perf_counter()
        out = {}
        for i in mine:
            pieces = [arr[i] if p == self.rank else got[p, i] for p in range(self.size)]
            dest = into[i] if into is not None else None
            if dest is not None and self.rank < 2:  # own piece is p0 or p1: the first sum may overwrite it
                out[i] = ordered_sum(pieces, out=dest)
            else:  # into a received buffer (p1 on rank 0, else p0), then where asked
                out[i] = ordered_sum(pieces, out=got[1 if self.rank == 0 else 0, i])
                if dest is not None:
                    dest[...] = out[i]
                    out[i] = dest
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _scratch(self, peer: int, i: int, shape: tuple[int, ...]) -> np.ndarray:
        """The receive buffer of tensor ``i`` from ``peer``, kept from step to
        step (no allocation, no page faults after the first step). What
        ``reduce_owned`` returns lives in these: read it before the next call."""
        key = (peer, i)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape:
            buf = self._buffers[key] = np.empty(shape, np.float32)
        return buf

    def gather_owned(
        self,
        mine: dict[int, np.ndarray],
        owner: Sequence[int],
        shapes: Sequence[tuple[int, ...]],
        into: dict[int, np.ndarray] | None = None,
    ) -> dict[int, np.ndarray]:
        """The tensors other ranks own, from their owners (each rank gives
        ``mine``: {index: array} of the tensors it owns): {index: array},
        received straight into ``into[i]`` when given (contiguous float32)."""
        if self.size == 1:
            return {}
        own = {i: np.ascontiguousarray(a, np.float32) for i, a in mine.items()}
        sends = [(a, p, i) for i, a in own.items() for p in range(self.size) if p != self.rank and a.size]
        out = {
            i: into[i] if into is not None else np.empty(shapes[i], np.float32)
            for i, o in enumerate(owner)
            if o != self.rank
        }
        recvs = [(b, owner[i], i) for i, b in out.items() if b.size]
        self._exchange(sends, recvs, "gathering the updated parameters")
        return out

    def take_stats(self) -> CommStats:
        """The statistics since the last call (and start counting again)."""
        s, self.stats = self.stats, CommStats()
        return s


# ------------------------------------------------------------------ a run on several ranks

_MIB = 1 << 20


def file_digest(path: str | os.PathLike[str]) -> str:
    """A cheap fingerprint of a file: its size and the SHA-256 of its first
    and last MiB (what tells copies of a model or corpus apart in practice,
    without reading gigabytes on every rank at start-up)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_MIB))
        if size > _MIB:
            f.seek(max(_MIB, size - _MIB))
            h.update(f.read(_MIB))
    return h.hexdigest()[:16]


def inputs_digest(paths: Sequence[str | os.PathLike[str]]) -> dict[str, str]:
    """{file: ``file_digest``} of files and of the files under folders (as
    given, in a stable order; a missing path is recorded as missing)."""
    out: dict[str, str] = {}
    for p in paths:
        q = Path(p)
        files = sorted(x for x in q.rglob("*") if x.is_file()) if q.is_dir() else [q]
        for f in files:
            out[str(f)] = file_digest(f) if f.is_file() else "missing"
    return out


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out if d else {prefix: d}


def check_inputs(world: World, config: dict[str, Any], paths: Sequence[str | os.PathLike[str]]) -> None:
    """Stop every rank (``RankMismatchError``) unless all were started with
    the same config and the same model and data files; the error names the
    first settings or files that differ."""
    if not world.distributed:
        return
    settings = {k: v for k, v in config.items() if k != "threads"}  # threads never change a bit
    flat = {k.rstrip("."): v for k, v in _flat(json.loads(json.dumps(settings, default=str))).items()}
    every_cfg = world.allgather(flat, "comparing the ranks' configs")
    for r, c in enumerate(every_cfg):
        if c != every_cfg[0]:
            keys = sorted(k for k in set(c) | set(every_cfg[0]) if c.get(k) != every_cfg[0].get(k))
            said = "; ".join(f"{k} {c.get(k)!r} (rank 0: {every_cfg[0].get(k)!r})" for k in keys[:3])
            raise RankMismatchError(
                f"rank {r} ({world.hosts[r]}) was started with other settings than rank 0: {said}"
                + (" ..." if len(keys) > 3 else ""),
                hint="start every rank with the same command and config",
            )
    digests = inputs_digest(paths)
    every = world.allgather(digests, "comparing the ranks' input files")
    for r, d in enumerate(every):
        if d != every[0]:
            diff = sorted(k for k in set(d) | set(every[0]) if d.get(k) != every[0].get(k))
            raise RankMismatchError(
                f"rank {r} ({world.hosts[r]}) reads other input files than rank 0 ({world.hosts[0]}): "
                f"{', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''} differ (size or content)",
                hint="give every rank the same model and data files, at the same paths",
            )


def check_cpu_variants(world: World, mode: str, variant: str, runnable: Sequence[str]) -> tuple[dict, str | None]:
    """Compare the ggml CPU variants the ranks run (``variant``; ``runnable``:
    the ones this CPU could run, best first). Same everywhere: ({"cpu_variants":
    [...]}, None). Different: with ``mode`` "refuse" a ``RankMismatchError``
    naming the best variant every rank can run; with "allow" the facts and a
    warning to record (the bits then depend on which rank computed what)."""
    facts = world.allgather((variant, list(runnable)), "comparing the ranks' CPU variants")
    tags = [v for v, _ in facts]
    info = {"cpu_variants": tags}
    if len(set(tags)) == 1:
        return info, None
    common = [t for t in facts[0][1] if all(t in r for _, r in facts)]
    where = ", ".join(f"rank {i} {t}" for i, t in enumerate(tags))
    if mode != "allow":
        fix = (
            f"start every rank with TOY_GGML_CPU_VARIANT={common[0]} (the best variant all of them run; "
            f"mpiexec -genv TOY_GGML_CPU_VARIANT {common[0]} ...)"
            if common
            else "no variant runs on every rank's CPU"
        )
        raise RankMismatchError(
            f"the ranks run different ggml CPU variants ({where}): their sums differ in the last bits",
            hint=f"{fix}, or accept results that differ from a one-process run with --mixed-cpus allow",
        )
    return info, (
        f"warning: the ranks run different ggml CPU variants ({where}); the run is not bit-identical to a "
        "one-process run (--mixed-cpus allow)"
    )


def rank_threads(threads: int | None, world: World) -> tuple[int, bool]:
    """``toy_ggml.runtime_threads`` for a rank: several ranks on one host
    share its cores (unless the launcher bound each rank to its own share,
    which the process's CPU affinity then says)."""
    import toy_ggml

    n, adaptive = toy_ggml.runtime_threads(threads or None)
    if world.local_size > 1 and not threads and not os.environ.get("TOY_THREADS"):
        if len(os.sched_getaffinity(0)) >= (os.cpu_count() or 1):  # not bound to a share
            n = max(1, n // world.local_size)
        adaptive = False
    return n, adaptive


def world_facts(world: World, mixed_cpus: str) -> tuple[dict[str, Any], str | None]:
    """What ``run_start`` records of several ranks (``describe()``, each
    rank's ggml CPU variant, ``zero``: 1, the moments sharded) and the
    warning to note when ``mixed_cpus`` "allow" let different variants
    through (``check_cpu_variants``)."""
    import toy_ggml

    choice = toy_ggml.cpu_variant()
    runnable = [c.tag for c in sorted(choice.candidates, key=lambda c: -c.score) if c.score > 0]
    info, warning = check_cpu_variants(world, mixed_cpus, choice.tag, runnable or [choice.tag])
    return {**world.describe(), **info, "zero": 1}, warning


def regroup(world: World, accum: int, state: dict[str, Any]) -> tuple[int, str | None]:
    """The per-rank gradient accumulation of a resumed run on ``world.size``
    ranks that keeps its global micro-batch count (``state``: the
    checkpoint's, with ``ranks`` and ``global_micro_batches`` when it was
    written on several ranks), and a note when the bits will differ from the
    uninterrupted run (the summation order changes). A count that does not
    split over the ranks is a ``BadInputError``."""
    old_ranks = int(state.get("ranks", 1))
    total = int(state.get("global_micro_batches", accum * old_ranks))
    if total % world.size:
        raise BadInputError(
            f"the run's steps take {total} micro-batches, which {world.size} ranks cannot share evenly",
            hint=f"resume on a number of ranks that divides {total}",
        )
    new = total // world.size
    if old_ranks == world.size:
        return new, None
    plain_before = old_ranks == 1 or total == old_ranks  # one left fold over all micro-batches
    plain_now = world.size == 1 or new == 1
    note = (
        None
        if plain_before and plain_now
        else (
            f"resumed on {world.size} rank(s) x {new} micro-batch(es) after {old_ranks} x {total // old_ranks}: "
            "the gradients are summed in another order from here, so the bits differ from the uninterrupted run"
        )
    )
    return new, note


class RankWriter:
    """The run writer of a rank other than 0: it knows the run's folder and
    id (rank 0's) and writes nothing."""

    def __init__(self, run_dir: str | os.PathLike[str], run_id: str):
        self.dir, self.run_id = Path(run_dir), run_id

    def event(self, kind: str, **fields: Any) -> bool:
        return True

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


RANKS_INFO_ENV = "TOY_RANKS_INFO"


def announce(world: World, run_dir: str | os.PathLike[str]) -> None:
    """Every rank's pid and host to rank 0, which writes them with the run
    folder to ``$TOY_RANKS_INFO`` (when set: ``toy train --ranks`` reads it
    to name a rank that dies)."""
    if not world.distributed:
        return
    pids = world.allgather(os.getpid(), "exchanging process ids")
    target = os.environ.get(RANKS_INFO_ENV)
    if not world.is_root or not target:
        return
    info = {"run_dir": str(run_dir), "pids": pids, "hosts": world.hosts, "ranks": world.size}
    tmp = Path(target).with_name(Path(target).name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


__all__ = [
    "DEFAULT_TIMEOUT",
    "EXTRA",
    "TIMEOUT_ENV",
    "RANKS_INFO_ENV",
    "CommStats",
    "CommTimeoutError",
    "MPIUnavailableError",
    "RankMismatchError",
    "RankWriter",
    "World",
    "announce",
    "check_cpu_variants",
    "check_inputs",
    "rank_threads",
    "world_facts",
    "file_digest",
    "inputs_digest",
    "launched_rank",
    "launched_size",
    "ordered_sum",
    "owners",
    "regroup",
]
