"""RunWriter when the disk fills up (toy.runs.writer's module docstring: write failures).

A serve run's writer degrades: a failed event is dropped and counted, the
first failure is logged once, the file keeps whole lines only, the first
write that succeeds again is preceded by a ``note`` with the count lost, and
``end`` never raises an OSError. Other runs (train, eval) still raise, with
the file left at its last whole line. The failure is injected two ways: a
file object whose ``write`` raises ENOSPC (after writing part of the line,
as a full disk does), and a real file-size limit (RLIMIT_FSIZE, EFBIG) in a
child process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from toy.runs.reader import read_events
from toy.runs.writer import RunWriter


class FullDisk:
    """Wraps the events file: while ``full``, a write stores its first ``part`` bytes and raises ENOSPC."""

    def __init__(self, f, part: int = 7):
        self.f, self.part, self.full = f, part, False

    def write(self, data):
        if self.full:
            self.f.write(data[: self.part])  # a partial write, then the disk is full
            if hasattr(self.f, "flush"):
                self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def lines(writer: RunWriter) -> list[dict]:
    raw = (writer.dir / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n"), raw[-80:]
    return [json.loads(line) for line in raw.splitlines()]  # every line is whole JSON


def test_serve_writer_degrades_and_recovers(tmp_path, caplog):
    w = RunWriter("serve", {"x": 1}, root=tmp_path)
    w._f = disk = FullDisk(w._f)
    w.event("request", n=0)
    disk.full = True
    with caplog.at_level(logging.WARNING, logger="toy.runs"):
        for i in range(1, 6):
            w.event("request", n=i)  # never raises
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1  # logged once
    assert "No space left on device" in caplog.records[0].getMessage()
    assert w.errors == 5 and not w.healthy
    assert [e["kind"] for e in lines(w)] == ["run_start", "request"]  # the partial lines were cut back
    disk.full = False
    w.event("request", n=6)
    assert w.healthy and w.errors == 5
    w.end("completed")
    recs = lines(w)
    assert [e["kind"] for e in recs] == ["run_start", "request", "note", "request", "run_end"]
    assert recs[2]["lost"] == 5 and "5 event(s)" in recs[2]["text"]
    events, problems = read_events(w.dir / "events.jsonl")
    assert not problems and events[-1]["kind"] == "run_end"


def test_serve_writer_end_on_a_full_disk_is_quiet(tmp_path):
    w = RunWriter("serve", {}, root=tmp_path)
    w._f = disk = FullDisk(w._f, part=0)
    disk.full = True
    w.end("completed", requests=3)  # the run_end is lost, quietly; the file is closed
    assert w.ended and w.errors == 1
    assert [e["kind"] for e in lines(w)] == ["run_start"]
    with pytest.raises(RuntimeError):
        w.event("request")


def test_train_writer_still_raises_and_keeps_whole_lines(tmp_path):
    w = RunWriter("train", {}, root=tmp_path)
    assert w.on_error == "raise"
    w._f = disk = FullDisk(w._f)
    disk.full = True
    with pytest.raises(OSError) as e:
        w.event("step", step=1)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        w.end("errored")
    assert not w.ended  # end can be tried again
    disk.full = False
    w.end("errored")
    assert [e["kind"] for e in lines(w)] == ["run_start", "run_end"]


def test_on_error_is_checked(tmp_path):
    with pytest.raises(ValueError):
        RunWriter("eval", {}, root=tmp_path, on_error="ignore")
    assert RunWriter("eval", {}, root=tmp_path, on_error="degrade").on_error == "degrade"


CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys
    from toy.runs.writer import RunWriter

    w = RunWriter("serve", {}, root=sys.argv[1])
    size = (w.dir / "events.jsonl").stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 4096, resource.RLIM_INFINITY))
    for i in range(300):
        w.event("request", request_id=f"r{i:04d}", endpoint="/v1/completions", status=200, duration_s=0.01)
    w.end("completed", requests=300)
    print(json.dumps({"errors": w.errors, "healthy": w.healthy, "dir": str(w.dir)}))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX resource limits")
def test_a_real_file_size_limit_in_a_child(tmp_path):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["errors"] > 0 and not res["healthy"]
    assert "File too large" in out.stderr  # the one warning, on stderr
    assert out.stderr.count("cannot write") == 1
    raw = (tmp_path / os.path.basename(res["dir"]) / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    recs = [json.loads(line) for line in raw.splitlines()]  # whole lines only
    assert recs[0]["kind"] == "run_start"
    assert len(recs) - 1 + res["errors"] == 301  # every event was either written or counted
