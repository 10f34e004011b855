"""Training runs against a hostile disk and careless users: orphaned temporary
files after SIGKILL, two processes on one run folder, OS errors (a full disk,
an output path that is a file) and damaged checkpoint bytes.

Each test here failed before the fix it guards; names new with the fix
(``toy.runs.folder``, ``checkpoint.remove_orphans``, ...) are imported inside
the tests, and the lock is taken with ``fcntl`` directly (the protocol:
``flock`` on ``<run>/.lock``, which holds the pid), so on the old code each
test failed on its own assertion. Runs use a tiny model so each takes a
second or two. As root, chmod does not stop writes, so unwritable folders
are made with a regular file where a folder should be (ENOTDIR) and a full
disk by an injected ENOSPC.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toy.errors import BadInputError, ToyError
from toy.gguf import GGUFFile, GGUFWriter
from toy.gguf.writer import copy_metadata
from toy.train import checkpoint
from toy.train import config as C
from toy.train.lmrun import Hooks, resume, train
from toy_testsupport.train_helpers import TINY_SCRATCH, python_docs_corpus

SMALL = TINY_SCRATCH


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 8)


def make_cfg(corpus, out: Path, **kw):
    values = {**SMALL, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values.update({"out": str(out), "steps": 12, "save_every": 4})
    values.update(kw)
    return C.override(C.TrainConfig(), **values)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def stop_after(n: int) -> Hooks:
    polls = {"n": 0}

    def should_stop():  # polled before each step: poll n+1 comes after step n
        polls["n"] += 1
        return polls["n"] == n + 1

    return Hooks(should_stop=should_stop)


def curve(run_dir: Path) -> list:
    by_step = {}
    for e in events(run_dir):
        if e["kind"] == "step":
            by_step[e["step"]] = (e["loss"], e["grad_norm"])
    return [by_step[i] for i in sorted(by_step)]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """12 steps without a stop: the curve every resumed run must reproduce."""
    r = train(make_cfg(corpus, tmp_path_factory.mktemp("straight")))
    return curve(r.run_dir)


def stopped_at_8(corpus, tmp_path) -> Path:
    r = train(make_cfg(corpus, tmp_path / "runs"), stop_after(8))
    assert r.reason == "interrupted" and r.final_step == 8
    assert checkpoint.list_steps(r.run_dir / "checkpoints") == [4, 8]
    return r.run_dir


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# -- 7: temporary files orphaned by SIGKILL ------------------------------------------

KILLED_CHILD = """
import os, signal, sys
from toy.train import config as C
from toy.train.lmrun import train

real_fsync = os.fsync

def fsync(fd):  # SIGKILL in the middle of writing step 8's first file
    if ".step_8." in os.readlink(f"/proc/self/fd/{fd}"):
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)

os.fsync = fsync
train(C.override(C.TrainConfig(), **VALUES))
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_resume_removes_temp_files_a_sigkill_left(corpus, tmp_path, straight):
    values = {**SMALL, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values.update({"out": str(tmp_path / "runs"), "steps": 12, "save_every": 4})
    child = subprocess.run(
        [sys.executable, "-c", f"VALUES = {values!r}\n" + textwrap.dedent(KILLED_CHILD)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    ck = run_dir / "checkpoints"
    left = sorted(p.name for p in ck.iterdir() if p.name.endswith(".tmp"))
    assert left and all(n.startswith(".step_8.") for n in left), left  # the writer's real temporary name
    (ck / f".latest.{2**22 + 7}.tmp").symlink_to("step_4.gguf")  # _relink's, from a killed process
    (ck / "notes.tmp").write_text("not toy's")  # other names are left alone

    r = resume(run_dir)  # the killed process held the lock: the kernel dropped it
    assert r.reason == "completed" and r.final_step == 12
    assert sorted(p.name for p in ck.iterdir() if p.name.endswith(".tmp")) == ["notes.tmp"]
    notes = [e["text"] for e in events(run_dir) if e["kind"] == "note"]
    assert any("removed 2 temporary file(s)" in t and left[0] in t for t in notes), notes
    assert curve(run_dir) == straight


def test_remove_orphans_matches_only_writer_names(tmp_path):
    names = [".step_4.gguf.k2j_9x.tmp", ".step_4.state.gguf.abc123.tmp", ".latest.4242.tmp"]
    keep = ["step_4.gguf", ".step_4.gguf", "x.tmp", ".latest.tmp", ".other.gguf.abc.tmp", "latest"]
    for n in names + keep:
        (tmp_path / n).write_text("x")
    gone = checkpoint.remove_orphans(tmp_path)
    assert sorted(p.name for p in gone) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


# -- 8: one process per run folder ----------------------------------------------------


def hold_lock(run_dir: Path, pid: int) -> int | None:
    """Take the run lock as another toy process would (an own open file
    description: flock conflicts even within one process); None if taken."""
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{pid}\n".encode())
    return fd


def test_second_resume_of_a_locked_run_is_refused(corpus, tmp_path):
    run_dir = stopped_at_8(corpus, tmp_path)
    before = (run_dir / "events.jsonl").read_bytes()
    fd = hold_lock(run_dir, 424242)
    assert fd is not None
    try:
        with pytest.raises(BadInputError, match=rf"^run {run_dir.name} is in use by pid 424242 ") as ei:
            resume(run_dir)
        assert ei.value.pid == 424242 and "resume" in ei.value.hint
    finally:
        os.close(fd)
    assert (run_dir / "events.jsonl").read_bytes() == before  # nothing written by the refused resume
    assert resume(run_dir).final_step == 12  # released: it goes on


def test_a_running_run_holds_its_lock_and_releases_it(corpus, tmp_path):
    seen = {}

    def progress(ev):
        if ev["step"] == 2:
            (run_dir,) = (tmp_path / "runs").iterdir()
            fd = hold_lock(run_dir, 1)
            seen["free"] = fd is not None
            seen["pid"] = (run_dir / ".lock").read_text().strip()
            if fd is not None:
                os.close(fd)

    r = train(make_cfg(corpus, tmp_path / "runs", steps=4), Hooks(progress=progress))
    assert seen == {"free": False, "pid": str(os.getpid())}
    fd = hold_lock(r.run_dir, 1)  # released at the end of the run
    assert fd is not None
    os.close(fd)


# -- 9: OS errors name the path and the consequence -----------------------------------


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_out_that_is_not_a_folder_fails_before_the_tokenizer(corpus, tmp_path, where):
    f = tmp_path / "plain.txt"
    f.write_text("x")
    out = f if where == "file" else f / "runs"
    notes = []
    with pytest.raises(BadInputError) as ei:
        train(make_cfg(corpus, out), Hooks(note=notes.append))
    assert str(f) in str(ei.value) and "is a file, not a folder" in str(ei.value)
    assert not any("tokenizer" in n for n in notes), notes  # refused before any long work


def test_read_only_out_fails_before_the_tokenizer(corpus, tmp_path, monkeypatch):
    # CI runs as root, which writes into a chmod 555 folder; so the folder refuses the probe file the way a
    # read-only one does (EACCES from mkstemp), whoever runs the test.
    import tempfile

    import toy.runs.folder as folder

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and Path(dir) == ro:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(Path(dir) / "probe"))
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(folder.tempfile, "mkstemp", mkstemp)
    notes = []
    with pytest.raises(BadInputError, match="cannot write into it: Permission denied"):
        train(make_cfg(corpus, ro), Hooks(note=notes.append))
    assert not notes


def enospc_on(monkeypatch, name: str) -> None:
    """GGUFWriter.write of the file called ``name`` fails as on a full disk."""
    real = GGUFWriter.write

    def write(self):
        if self.path.name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what f.write raises: no file name
        return real(self)

    monkeypatch.setattr(GGUFWriter, "write", write)


@pytest.mark.parametrize("failing", ["step_8.gguf", "step_8.state.gguf"])
def test_full_disk_names_the_checkpoint_and_the_last_good_one(corpus, tmp_path, monkeypatch, failing, straight):
    enospc_on(monkeypatch, failing)
    with pytest.raises(ToyError) as ei:  # before: the bare OSError
        train(make_cfg(corpus, tmp_path / "runs"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    ck = run_dir / "checkpoints"
    msg = str(ei.value)
    assert f"could not write checkpoint step_8 ({ck / failing}): No space left on device" in msg, msg
    assert f"the last good checkpoint is step_4 ({ck / 'step_4.gguf'})" in msg, msg
    assert ei.value.hint.endswith(f"toy train --resume {run_dir}")
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_4.gguf", "step_4.state.gguf"]
    assert checkpoint.latest_step(ck) == 4
    end = events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "errored" and "step_4" in end["error"]
    monkeypatch.undo()  # space freed: the resume goes on from step 4, exactly
    assert resume(run_dir).final_step == 12
    assert curve(run_dir) == straight


def test_full_disk_on_events_names_the_run_and_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    from toy.runs import RunWriter

    real = RunWriter.event

    def event(self, kind, **fields):
        if kind == "step" and fields.get("step") == 6:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, kind, **fields)

    monkeypatch.setattr(RunWriter, "event", event)
    with pytest.raises(ToyError) as ei:
        train(make_cfg(corpus, tmp_path / "runs"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    msg = str(ei.value)
    assert str(run_dir) in msg and "No space left on device" in msg, msg
    assert "the last good checkpoint is step_4" in msg, msg


def test_full_disk_before_any_checkpoint_says_nothing_can_be_resumed(corpus, tmp_path, monkeypatch):
    enospc_on(monkeypatch, "step_4.gguf")
    with pytest.raises(ToyError, match="no checkpoint had been written yet"):
        train(make_cfg(corpus, tmp_path / "runs"))


def test_full_disk_creating_the_run_bundle(corpus, tmp_path, monkeypatch):
    real = Path.write_text

    def write_text(self, *a, **kw):
        if self.name == "config.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(ToyError) as ei:  # before: the bare OSError
        train(make_cfg(corpus, tmp_path / "runs"))
    msg = str(ei.value)
    assert f"could not create the run bundle ({tmp_path / 'runs'}): No space left on device" in msg, msg
    assert "the run did not start" in msg


def test_check_output_dir(tmp_path):
    from toy.runs.folder import OutputDirError, check_output_dir

    assert check_output_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # the probe is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match=r"--out .*f/x/y: cannot create it: .*f is a file, not a folder"):
        check_output_dir(tmp_path / "f" / "x" / "y", "--out")


# -- 11: checkpoint integrity ---------------------------------------------------------


@pytest.mark.parametrize("damaged", ["step_8.state.gguf", "step_8.gguf"])
def test_damaged_latest_falls_back_to_the_previous_checkpoint(corpus, tmp_path, damaged, straight):
    run_dir = stopped_at_8(corpus, tmp_path)
    ck = run_dir / "checkpoints"
    flip_byte(ck / damaged, -3)  # inside the last tensor's data (an AdamW moment, or a weight)
    notes = []
    r = resume(run_dir, Hooks(note=notes.append))
    assert r.reason == "completed" and r.final_step == 12
    warn = [n for n in notes if n.startswith("warning:")]
    assert len(warn) == 1 and str(ck / damaged) in warn[0] and "resuming from step_4" in warn[0], notes
    assert any(e["kind"] == "note" and e["text"] == warn[0] for e in events(run_dir))
    assert resume_event(run_dir)["from_step"] == 4
    assert (ck / "step_8.gguf.damaged").is_file() and (ck / "step_8.state.gguf.damaged").is_file()
    assert checkpoint.list_steps(ck)[-1] == 12
    assert curve(run_dir) == straight  # the later of each step seen twice: the uninterrupted curve


def resume_event(run_dir: Path) -> dict:
    return [e for e in events(run_dir) if e["kind"] == "resume"][-1]


def test_damaged_only_checkpoint_is_an_error_naming_the_file(corpus, tmp_path):
    r = train(make_cfg(corpus, tmp_path / "runs", save_every=0), stop_after(4))
    ck = r.run_dir / "checkpoints"
    assert checkpoint.list_steps(ck) == [4]
    flip_byte(ck / "step_4.state.gguf", -3)
    before = (r.run_dir / "events.jsonl").read_bytes()
    with pytest.raises(BadInputError) as ei:  # before: it resumed
        resume(r.run_dir)
    msg = str(ei.value)
    assert f"checkpoint {ck / 'step_4.state.gguf'} is damaged: tensor " in msg and "checksum" in msg, msg
    assert "no earlier intact checkpoint" in msg and ei.value.path == ck / "step_4.state.gguf"
    assert (r.run_dir / "events.jsonl").read_bytes() == before
    assert (ck / "step_4.state.gguf").is_file()  # nothing set aside when there is nothing to fall back on


@pytest.mark.parametrize(
    "what, offset, match",
    [
        ("model", 200, "do not match the checksum recorded in step_4.state.gguf"),  # metadata (tokenizer)
        ("json", None, "toy.state.json"),
    ],
)
def test_checksums_cover_model_metadata_and_the_state_json(corpus, tmp_path, what, offset, match):
    r = train(make_cfg(corpus, tmp_path / "runs", steps=4, save_every=0))
    ck = r.run_dir / "checkpoints"
    if what == "model":
        flip_byte(ck / "step_4.gguf", offset)
    else:
        p = ck / "step_4.state.gguf"
        data = p.read_bytes()
        i = data.index(b'"tokens_seen": ') + len(b'"tokens_seen": ')
        p.write_bytes(data[:i] + (b"9" if data[i : i + 1] != b"9" else b"8") + data[i + 1 :])
    with pytest.raises(BadInputError, match=match):  # before: loaded without a word
        checkpoint.load(ck)


def test_checkpoint_without_checksums_still_resumes(corpus, tmp_path, straight):
    run_dir = stopped_at_8(corpus, tmp_path)
    ck = run_dir / "checkpoints"
    p = ck / "step_8.state.gguf"
    with GGUFFile(p) as sf:  # the state file as toy wrote it before checksums
        w = GGUFWriter(p)
        copy_metadata(sf, w, skip={"toy.state.checksums"})
        for n in sf.tensors:
            w.add_tensor(n, sf.tensor_to_float(n))
        w.write()
    assert checkpoint.load(ck).verified is False
    r = resume(run_dir)
    assert r.final_step == 12 and curve(run_dir) == straight
    assert any("step_8 has no checksums" in e.get("text", "") for e in events(run_dir))
    assert checkpoint.load(ck).verified is True  # the new checkpoints have them
