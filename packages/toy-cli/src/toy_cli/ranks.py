"""`--ranks N`: one machine's shortcut for `mpiexec -n N toy train ...`.

A training command given ``--ranks N`` with N > 1 does not train itself: it
starts the same command line, minus ``--ranks N``, under the ``mpiexec`` of
the MPI that mpi4py uses, and waits. The ranks do the work
(``toy.train.distributed``); this process only launches, relays and reports.
Why a re-launch rather than spawning ranks from Python: the ranks are then
exactly what ``mpiexec -n N toy train ...`` starts by hand or across hosts,
so there is one code path to test and document.

What the launcher adds around ``mpiexec``:

- Finding it: ``TOY_MPIEXEC``, else the ``mpiexec`` beside the running
  Python (where ``pip install 'toy-cli[distributed]'`` puts MPICH's), else
  the one on ``PATH``. No mpi4py or no mpiexec: one ``error:`` line naming the
  extra, exit 2, nothing started or written.
- Placement: with N no larger than the physical cores, hydra's
  ``-bind-to core`` pins each rank to a core of its own.
- ``TOY_RANKS_INFO``: rank 0 writes the run folder, the ranks' pids and hosts
  to this file as soon as the folder exists. The launcher sets it to a
  temporary file unless the caller set it (then the caller's file is used
  and kept, which is how tests and scripts learn the pids).
- Signals: ``mpiexec`` runs in a session of its own, so a terminal's Ctrl-C
  reaches the launcher alone. Each SIGINT or SIGTERM the launcher gets is
  sent once to every rank, by pid (the info file's, or before it exists the
  processes under mpiexec), as soon as that rank has installed its handlers
  (a rank still importing would die of it): so the ranks count signals
  exactly as a one-process run does: the first stops after the step with a
  checkpoint, the second is ignored, the third aborts. ``mpiexec`` itself
  is never signalled (hydra force-kills the ranks at its second Ctrl-C). The
  exit code is the ranks': 130 after SIGINT, 0 after SIGTERM.
- A lost rank: when a rank dies of a signal (SIGKILL, the OOM killer),
  hydra kills the others and prints a "BAD TERMINATION" banner on stdout.
  That banner names the lowest rank's pid, not the first to die, so the
  launcher watches the ranks' pids itself (``pidfd_open``: the first one to
  end is the one lost) and replaces the banner with ``error: rank R (pid P
  on HOST) was lost (killed by signal S) at step K; the last good checkpoint
  is PATH`` and a ``hint:`` to resume, exits 1, and ends the run's events
  with ``run_end`` "errored" when no rank could.
- A rank that fails by itself prints its ``error:`` lines and ends every
  rank with ``MPI_Abort`` (``toy_cli.ui.run_training``); the launcher drops
  MPICH's "Abort(N) on node ..." line and exits with that code, adding the
  ``run_end`` rank 0 may not have written.

Everything waits with a bound: reading the info file, the relay threads, and
the other ranks once one has ended (``_wait``: 10 s during set-up, else the
ranks' communication timeout and a minute).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from toy_cli.ui.errors import BAD_INPUT, CLIError

MPIEXEC_ENV = "TOY_MPIEXEC"
INFO_ENV = "TOY_RANKS_INFO"


def install_hint() -> str:
    """The command that adds MPI to this toy (``toy.extras``: pip from an
    index, ``just setup`` in a development checkout, ...)."""
    from toy.extras import install_command

    return install_command("distributed")


SETUP_GRACE = 10.0  # seconds the other ranks get to end after one ended before the run folder was announced

_BANNER_RULE = re.compile(r"^=+\s*$")
_BANNER_PID = re.compile(r"^=\s+PID (\d+) RUNNING AT (\S+)")
_BANNER_CODE = re.compile(r"^=\s+EXIT CODE: (\d+)")
_EXIT_STRING = re.compile(r"^YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*\(signal (\d+)\)")
# hydra's lines after the banner and around a forwarded Ctrl-C: replaced by toy's own
_HYDRA_TAIL = ("This typically refers to a problem with your application.", "Please see the FAQ page")
_HYDRA_CTRL_C = re.compile(r"^\[mpiexec@[^\]]*\] (Sending Ctrl-C to processes as requested|Press Ctrl-C again)")
# MPICH's line when a rank ends every rank (toy_cli.ui.training: after its own error: lines)
_MPI_ABORT = re.compile(r"^Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort")


class LaunchError(CLIError):
    """The ranks cannot be launched (MPI missing, a bad ``--ranks``): an
    ``error:`` line and exit 2 (bad input) unless ``code`` says otherwise."""

    def __init__(self, message: str, hint: str | None = None, code: int = BAD_INPUT):
        super().__init__(message, hint, code)


# ------------------------------------------------------------------ command line


def strip_ranks(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without its ``--ranks N`` (or ``--ranks=N``) and the N found
    (None: none given). Options after ``--`` are arguments and stay; a
    ``--ranks`` without a value raises ``LaunchError``."""
    out: list[str] = []
    ranks: int | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        value: str | None = None
        if a == "--ranks":
            if i + 1 >= len(argv):
                raise LaunchError("--ranks needs a number of processes")
            value = argv[i + 1]
            i += 2
        elif a.startswith("--ranks="):
            value = a[len("--ranks=") :]
            i += 1
        else:
            out.append(a)
            i += 1
            continue
        try:
            ranks = int(value)
        except ValueError:
            raise LaunchError(f"--ranks {value!r}: give a number of processes") from None
    return out, ranks


def rank_command(argv: list[str], python: str | None = None) -> list[str]:
    """What every rank runs: this Python with ``-m toy_cli`` and the command
    line's arguments (``argv`` without the program name)."""
    return [python or sys.executable, "-m", "toy_cli", *argv]


def mpiexec_command(mpiexec: str, n: int, rank_argv: list[str], bind: bool) -> list[str]:
    return [mpiexec, "-n", str(n), *(["-bind-to", "core"] if bind else []), *rank_argv]


def find_mpiexec() -> str | None:
    """``TOY_MPIEXEC`` (as given, even when it does not exist: the caller
    reports it), else ``mpiexec`` beside this Python, else on PATH."""
    given = os.environ.get(MPIEXEC_ENV)
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def _has_mpi4py() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def check_launchable(n: int) -> str:
    """The mpiexec to start N ranks with, or ``LaunchError`` (exit 2) saying
    what is missing; nothing is started."""
    from toy.train.distributed import launched_size

    if n < 1:
        raise LaunchError(f"--ranks {n}: give at least 1 process")
    inside = launched_size()
    if inside > 1:
        raise LaunchError(
            f"--ranks {n}: this command is already one of {inside} ranks started by an MPI launcher",
            "drop --ranks when starting with mpiexec (mpiexec -n N toy train ...), or drop mpiexec",
        )
    if not _has_mpi4py():
        raise LaunchError(f"--ranks {n} needs MPI: mpi4py is not installed", f"install the extra: {install_hint()}")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise LaunchError(
            f"--ranks {n} needs MPI: no mpiexec beside {sys.executable} or on PATH",
            f"install the extra: {install_hint()} (or point {MPIEXEC_ENV} at an mpiexec)",
        )
    if not (os.path.isfile(mpiexec) and os.access(mpiexec, os.X_OK)):
        raise LaunchError(
            f"--ranks {n} needs MPI: {MPIEXEC_ENV}={mpiexec} is not an executable file",
            f"install the extra: {install_hint()}, or point {MPIEXEC_ENV} at an mpiexec",
        )
    return mpiexec


def _physical_cores() -> int:
    try:
        from toy_ggml.devices import physical_cores

        return physical_cores()
    except Exception:  # noqa: BLE001 - placement is an optimisation: fall back to the logical count
        return os.cpu_count() or 1


# ------------------------------------------------------------------ the ranks


def read_info(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ranks' facts rank 0 wrote (run_dir, pids, hosts), or None while
    the file is missing or incomplete."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pids"), list):
        return None
    return data


@dataclass
class _Watch:
    """What the launcher learns while the ranks run."""

    info_path: str
    info: dict[str, Any] | None = None
    first_gone: int | None = None  # the pid that ended first (pidfd)
    gone_at: float | None = None  # when (time.monotonic)
    early: list[int] = field(default_factory=list)  # the rank pids as found (before the info file: /proc)
    cut_short: bool = False  # the launcher killed ranks left waiting for one that had ended
    banner: list[str] = field(default_factory=list)
    banner_pid: int | None = None
    banner_host: str | None = None
    banner_code: int | None = None
    exit_signal: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pids(self) -> list[int]:
        if self.info is None:
            self.info = read_info(self.info_path)
        if self.info is None:
            return []
        return [int(p) for p in self.info["pids"] if isinstance(p, int) or str(p).isdigit()]


def _rank_pids(mpiexec_pid: int) -> list[int]:
    """The rank processes under a local ``mpiexec``: the children of its
    children (hydra's proxy starts them), read from /proc; [] elsewhere."""

    def children(pid: int) -> list[int]:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    return sorted(c for proxy in children(mpiexec_pid) for c in children(proxy))


def _watch_pids(w: _Watch, proc: subprocess.Popen, n: int, stop: threading.Event) -> None:
    """Find the rank processes (the info file's pids, or before it exists the
    ``n`` processes under mpiexec), then wait for the first one to end (its
    pid in ``w.first_gone``). Polls every 50 ms; gives up when mpiexec has
    ended or ``stop`` is set."""
    pids: list[int] = []
    while not stop.is_set() and proc.poll() is None:
        pids = w.pids() or _rank_pids(proc.pid)
        if len(pids) >= n:
            break
        stop.wait(0.05)
    if len(pids) < n or not hasattr(os, "pidfd_open"):
        return
    with w.lock:
        w.early = pids
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:  # already gone: that one is the first
                with w.lock:
                    if w.first_gone is None:
                        w.first_gone, w.gone_at = pid, time.monotonic()
                return
            except OSError:
                return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while not stop.is_set():
            ready = poller.poll(100)
            if ready:
                with w.lock:
                    if w.first_gone is None:
                        w.first_gone, w.gone_at = fds[ready[0][0]], time.monotonic()
                return
    finally:
        for fd in fds:
            os.close(fd)


def _relay(src: IO[bytes], dst: IO[str], w: _Watch) -> None:
    """Copy ``src`` (a pipe from mpiexec) to ``dst`` line by line, holding
    back hydra's termination banner (kept in ``w``, with the blank line
    before it and the lines after it) and its Ctrl-C lines."""
    in_banner = False
    blank: str | None = None  # a blank line is held until the next line shows whether a banner starts
    for raw in iter(src.readline, b""):
        line = raw.decode("utf-8", "replace")
        text = line.rstrip("\n")
        rule = _BANNER_RULE.match(text) is not None and bool(text.strip())
        if in_banner or rule:
            with w.lock:
                w.banner.append(line)
                if (m := _BANNER_PID.match(text)) is not None:
                    w.banner_pid, w.banner_host = int(m.group(1)), m.group(2)
                if (m := _BANNER_CODE.match(text)) is not None:
                    w.banner_code = int(m.group(1))
            in_banner = not (in_banner and rule)  # a rule opens the banner, the next rule closes it
            blank = None
            continue
        if blank is not None:
            dst.write(blank)
            blank = None
        if not text.strip():
            blank = line
            continue
        if (m := _EXIT_STRING.match(text)) is not None:
            with w.lock:
                w.exit_signal = int(m.group(1))
                w.banner.append(line)
            continue
        if w.banner and text.startswith(_HYDRA_TAIL):
            w.banner.append(line)
            continue
        if _HYDRA_CTRL_C.match(text) or _MPI_ABORT.match(text):
            continue
        dst.write(line)
        dst.flush()
    if blank is not None:
        dst.write(blank)
        dst.flush()


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask
    in /proc; True where that cannot be read, so the signal is sent anyway)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


class _Signals:
    """The launcher's SIGINT/SIGTERM handling (the module docstring): each
    signal the launcher gets is sent once to every rank, as soon as that rank
    has its own handlers (``toy_cli.ui.run_training``'s: SIGTERM caught), so
    that it counts the signal as a one-process run would instead of dying of
    it in its imports. From the third signal on, ranks without handlers get
    theirs anyway (an abort)."""

    def __init__(self, proc: subprocess.Popen, w: _Watch):
        self.proc, self.w = proc, w
        self.received: list[int] = []
        self.sent: dict[int, int] = {}  # pid -> how many of ``received`` it was sent
        self.old: dict[int, Any] = {}

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def __enter__(self) -> _Signals:
        for s in (signal.SIGINT, signal.SIGTERM):
            self.old[s] = signal.signal(s, self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)

    def handler(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)
        self.deliver()

    def deliver(self) -> None:
        """Send each rank the signals it has not been sent yet (called by the
        handler and by the launcher's wait loop)."""
        if not self.received:
            return
        for pid in self.w.pids() or self.w.early:
            k = self.sent.get(pid, 0)
            while k < len(self.received):
                signum = self.received[k]
                if len(self.received) < 3 and not _catches(pid, signal.SIGTERM):
                    break  # not ready: this rank gets it once its handlers are in place
                try:
                    os.kill(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
                k += 1
            self.sent[pid] = k


# ------------------------------------------------------------------ reporting a lost rank


def _last_step(run_dir: Path) -> tuple[int, bool]:
    """The last step in the run's events and whether its last session (since
    the last ``resume`` event) has a run_end."""
    step, ended = 0, False
    try:
        raw = (run_dir / "events.jsonl").read_bytes()
    except OSError:
        return step, ended
    for line in raw.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        if ev.get("kind") == "step" and isinstance(ev.get("step"), int):
            step = ev["step"]
        elif ev.get("kind") == "run_end":
            ended = True
        elif ev.get("kind") == "resume":  # a session of its own: the steps go on from its checkpoint
            step = ev["from_step"] if isinstance(ev.get("from_step"), int) else step
            ended = False
    return step, ended


def _end_run(run_dir: Path, step: int, error: str, reason: str = "errored") -> None:
    """Append ``run_end`` (no rank could): under the run's lock, skipped when
    another process holds it."""
    from toy.runs.folder import RunLock
    from toy.runs.writer import RunWriter

    try:
        lock = RunLock(run_dir)
    except Exception:  # noqa: BLE001 - in use or unreadable: the events stay as the ranks left them
        return
    try:
        w = RunWriter.reopen(run_dir)
        w.end(reason, final_step=step, error=error)
    except (OSError, ValueError):
        pass
    finally:
        lock.release()


def _close_run(w: _Watch, code: int) -> None:
    """A run the ranks left with ``code`` (a rank's error ended them all,
    possibly before rank 0 could write its ``run_end``): the run_end they
    did not write, if the run folder exists."""
    info = w.info or read_info(w.info_path) or {}
    if not info.get("run_dir"):
        return
    run_dir = Path(info["run_dir"])
    step, ended = _last_step(run_dir)
    if not ended:
        reason = "interrupted" if code == 130 else "errored"
        _end_run(run_dir, step, f"the ranks ended with exit code {code} (a rank's error: line says why)", reason)


def lost_rank_report(w: _Watch, n: int, command: str) -> list[str]:
    """The ``error:`` and ``hint:`` lines for a rank lost by signal, or one
    that ended while the others waited for it until the launcher killed them
    (``w.cut_short``), and the run's events ended; [] when neither holds."""
    if w.cut_short:  # hydra's banner, if any, is about the ranks the launcher killed
        what = "ended while the other ranks waited for it (the launcher stopped them)"
    else:
        sig = w.exit_signal if w.exit_signal is not None else w.banner_code
        if sig is None:
            return []
        what = f"was lost (killed by signal {sig})"
    info = w.info or read_info(w.info_path) or {}
    pids = [int(p) for p in info.get("pids", [])]
    hosts = info.get("hosts") or []
    pid = w.first_gone if w.first_gone is not None else w.banner_pid
    rank = pids.index(pid) if pid in pids else None
    host = hosts[rank] if rank is not None and rank < len(hosts) else (w.banner_host or os.uname().nodename)
    who = f"rank {rank}" if rank is not None else "a rank"
    lost = f"{who} (pid {pid} on {host}) {what}"
    run_dir = Path(info["run_dir"]) if info.get("run_dir") else None
    if run_dir is None:
        return [
            f"error: {lost} before the run folder was made: nothing was written",
            "hint: run the command again",
        ]
    from toy.train.checkpoint import latest_step

    step, ended = _last_step(run_dir)
    ck = latest_step(run_dir / "checkpoints")
    if not ended:
        _end_run(run_dir, step, lost)
    if ck is None:
        return [
            f"error: {lost} at step {step}, before the run's first checkpoint: nothing to resume",
            f"hint: run the command again to start over ({run_dir} can be deleted)",
        ]
    return [
        f"error: {lost} at step {step}; the last good checkpoint is {run_dir / 'checkpoints' / f'step_{ck}.gguf'}",
        f"hint: {command} --resume {run_dir} --ranks {n}",
    ]


# ------------------------------------------------------------------ launching


def launch(n: int, argv: list[str] | None = None, command: str = "toy train") -> int:
    """Run ``argv`` (default: this process's arguments) as ``n`` MPI ranks and
    return the exit code to end with (the module docstring). ``LaunchError``
    when MPI is missing; nothing is started then."""
    mpiexec = check_launchable(n)
    args, given = strip_ranks(list(sys.argv[1:] if argv is None else argv))
    if argv is None and given != n:  # called in-process (main(argv)): sys.argv is another program's
        raise LaunchError(
            f"--ranks {n}: this process's command line does not hold --ranks {n}, so it cannot be started again",
            "run toy from a shell, or start the ranks with mpiexec -n N toy train ...",
        )
    bind = n <= _physical_cores()
    cmd = mpiexec_command(mpiexec, n, rank_command(args), bind)
    env = dict(os.environ)
    own_info = not env.get(INFO_ENV)
    if own_info:
        fd, info_path = tempfile.mkstemp(prefix="toy-ranks-", suffix=".json")
        os.close(fd)
        os.unlink(info_path)  # rank 0 creates it (atomically) once the run folder exists
        env[INFO_ENV] = info_path
    else:
        info_path = env[INFO_ENV]
        try:
            os.unlink(info_path)  # a previous launch's facts must not be taken for this one's
        except FileNotFoundError:
            pass
    w = _Watch(info_path)
    try:
        try:
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise LaunchError(
                f"cannot start {mpiexec}: {e.strerror or e}", f"install the extra: {install_hint()}", code=2
            ) from None
        stop = threading.Event()
        assert proc.stdout is not None and proc.stderr is not None
        threads = [
            threading.Thread(target=_relay, args=(proc.stdout, sys.stdout, w), daemon=True),
            threading.Thread(target=_relay, args=(proc.stderr, sys.stderr, w), daemon=True),
            threading.Thread(target=_watch_pids, args=(w, proc, n, stop), daemon=True),
        ]
        for t in threads:
            t.start()
        with _Signals(proc, w) as sigs:
            rc = _wait(proc, w, sigs)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        started = w.info is not None or read_info(info_path) is not None
        if (w.banner or w.cut_short) and sigs.first is not None and not started:
            # stopped during set-up: ranks without their handlers yet die of the signal, or end while
            # the others wait for them; nothing was written (the run folder comes with the info file)
            print("interrupted before the first step: nothing was trained, nothing needs resuming", file=sys.stderr)
            return 130 if sigs.first == signal.SIGINT else 0
        if w.banner or w.cut_short:
            lines = lost_rank_report(w, n, command)
            if lines:
                for line in lines:
                    print(line, file=sys.stderr)
                return 1
            sys.stderr.write("".join(w.banner))  # not a lost rank: hydra's own words
        code = rc if rc >= 0 else 128 - rc
        if code != 0:
            _close_run(w, code)
        return code
    finally:
        if own_info:
            try:
                os.unlink(info_path)
            except FileNotFoundError:
                pass


def _wait(proc: subprocess.Popen, w: _Watch, sigs: _Signals) -> int:
    """mpiexec's exit code. Waits in short slices (signal handlers run in
    between). Once a rank has ended, the others get a bounded time to end
    too: ``SETUP_GRACE`` seconds while the run folder is not announced yet (a
    rank that ends during set-up failed or was stopped, and the others would
    wait for it in their first exchange), else the ranks' own communication
    timeout and a minute more (they notice a lost peer themselves). Then the
    ranks and mpiexec are killed (``w.cut_short``)."""
    from toy.train.distributed import timeout_from_env

    try:
        late = timeout_from_env() + 60.0
    except Exception:  # noqa: BLE001 - a bad TOY_COMM_TIMEOUT is the ranks' to report
        late = 660.0
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        sigs.deliver()
        if w.gone_at is None:
            continue
        grace = late if w.pids() else SETUP_GRACE
        if time.monotonic() - w.gone_at <= grace:
            continue
        w.cut_short = True
        for pid in [*(w.pids() or w.early), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return 1


def run_ranks(n: int | None, command: str = "toy train") -> bool:
    """What a training command calls first with its ``--ranks`` value: False
    when it should run in this process (no ``--ranks``, or 1); otherwise it
    launches the ranks and ends the command with their exit code
    (``typer.Exit``), or raises ``LaunchError`` (nothing started)."""
    if n is None or n == 1:
        return False
    import typer

    if n < 1:
        raise LaunchError(f"--ranks {n}: give a number of processes, 1 or more")
    raise typer.Exit(launch(n, command=command))


__all__ = [
    "INFO_ENV",
    "install_hint",
    "MPIEXEC_ENV",
    "LaunchError",
    "check_launchable",
    "find_mpiexec",
    "launch",
    "lost_rank_report",
    "mpiexec_command",
    "rank_command",
    "read_info",
    "run_ranks",
    "strip_ranks",
]
