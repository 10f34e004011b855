"""Run folders on disk: the run lock, and checking an output folder before
long work starts.

The lock (``RunLock``): a training run holds an exclusive advisory lock
(``fcntl.flock``) on ``<run>/.lock`` for as long as it runs, new runs and
resumed ones alike. The file holds the holder's pid (a decimal line) so a
second process that cannot take the lock can say who has it:
``RunInUseError`` ("run <id> is in use by pid N"), a ``BadInputError``
(exit 2: the request conflicts with the run's state, like resuming a
finished run). The kernel drops a flock when its file is closed, which
includes the holder dying (SIGKILL, a crash), so a stale lock never blocks
anyone; the ``.lock`` file itself stays (removing a lock file races with a
process about to lock it) and readers ignore it. Where ``fcntl`` is missing
(Windows) there is no lock.

While the lock is held no other toy process writes in the run folder, so
temporary files found there are orphans of a killed process and may be
deleted (``toy.train.checkpoint.remove_orphans``).

``check_output_dir(path, what)`` creates a folder that outputs will go into
(with its parents) and proves it writable by creating and deleting a probe
file, so a read-only or misnamed ``--out`` fails in a second, before a
tokenizer is trained or a model loaded, with an error naming the path. The
probe is the only check that works as root (``os.access`` says yes to
root for a read-only folder that root can in fact write).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from toy.errors import BadInputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"


class RunInUseError(BadInputError):
    """Another process holds the run folder's lock."""

    def __init__(self, message: str, pid: int | None, hint: str | None = None):
        super().__init__(message, hint)
        self.pid = pid


class OutputDirError(BadInputError):
    """An output folder that cannot be created or written to."""


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def check_output_dir(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """``path`` as a folder that exists and takes new files; else
    ``OutputDirError`` naming ``what`` (e.g. "--out") and the path."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"{what} {p}: is a file, not a folder", hint="give a folder (it is created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
        if blocker is not None or e.errno == errno.ENOTDIR:
            raise OutputDirError(
                f"{what} {p}: cannot create it: {blocker or 'a parent'} is a file, not a folder"
            ) from None
        raise OutputDirError(f"{what} {p}: cannot create it: {_reason(e)}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".toy-write-check.", suffix=".tmp", dir=p)
    except OSError as e:
        raise OutputDirError(f"{what} {p}: cannot write into it: {_reason(e)}") from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return p


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class RunLock:
    """An exclusive lock on a run folder, held until ``release()`` (or the
    process ends). Raises ``RunInUseError`` when another process holds it."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        if fcntl is None:  # pragma: no cover
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputDirError(f"{self.path}: cannot open the run's lock file: {_reason(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = _read_pid(self.path)
            holder = f"pid {pid}" if pid is not None else "another process"
            raise RunInUseError(
                f"run {self.run_dir.name} is in use by {holder} ({self.run_dir})",
                pid,
                hint="wait for that run to finish, or stop it (Ctrl-C / kill -TERM saves a checkpoint) and resume",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The pid is cleared first, so a
        reader never sees a dead holder's pid."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(run_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the process holding ``run_dir``'s lock, or None when nobody does; it never takes the lock.

    On Linux the answer comes from ``/proc/locks`` (the flock on the lock file's inode), so a dead holder's
    pid left in the file by SIGKILL, even if recycled, does not count. Elsewhere the pid written in the file
    counts when that process exists."""
    path = Path(run_dir) / LOCK_NAME
    try:
        st = path.stat()
    except OSError:
        return None
    pid = _read_pid(path)
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        table = None
    if table is not None:
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in table.splitlines():
            f = line.split()
            if len(f) >= 6 and f[1] == "FLOCK" and f[5] == dev and f[4].isdigit():
                return int(f[4])
        return None
    if pid is None or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:
        return pid
    except OSError:
        return None
    return pid


__all__ = ["LOCK_NAME", "OutputDirError", "RunInUseError", "RunLock", "check_output_dir", "lock_holder"]
