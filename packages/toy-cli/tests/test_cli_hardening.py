"""The command line when the disk or the user gets in the way: a run folder in
use by another process, outputs that are files or read-only, a full disk
during training, a damaged checkpoint. Each case is one ``error:`` line
(and a ``hint:``) naming the path, with exit 2 for bad input and 1 for a
failure, and no traceback; each failed before its fix (the other process's
lock is taken with ``fcntl`` directly, the protocol, not toy's helper).

``toy`` runs in this process (``cli_helpers.run``) so a full disk or a
read-only folder can be injected; as root, chmod does not stop writes.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from toy_testsupport import toy_test_models as mp
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.train_helpers import python_docs_corpus

SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 8)["small"]


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


def train_stopped(capsys, corpus, tmp_path, steps=4) -> Path:
    """A finished run of ``steps`` steps (checkpoint at the end) whose
    ``--steps`` can be raised by a resume."""
    code, out, err = run(capsys, "train", "from-scratch", corpus, *SMALL, "--steps", steps, "--out", tmp_path / "runs")
    assert code == 0, err
    return Path(out.strip())


# another toy process training the run: the lock protocol (flock on <run>/.lock holding the pid)
HOLDER = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_resume_of_a_run_in_use_names_the_holder(capsys, corpus, tmp_path):
    run_dir = train_stopped(capsys, corpus, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (run_dir / "events.jsonl").read_bytes()
        code, _, err = run(capsys, "train", "--resume", run_dir, "--steps", 6)
        assert_clean_error(code, err, 2, f"error: run {run_dir.name} is in use by pid {holder.pid}", hint=True)
        assert (run_dir / "events.jsonl").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    code, _, err = run(capsys, "train", "--resume", run_dir, "--steps", 6)  # the kill dropped the lock
    assert code == 0, err


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_train_out_that_is_a_file(capsys, corpus, tmp_path, where):
    f = tmp_path / "taken"
    f.write_text("x")
    out = f if where == "file" else f / "runs"
    code, _, err = run(capsys, "train", "from-scratch", corpus, *SMALL, "--steps", 2, "--out", out)
    assert_clean_error(code, err, 2, str(f), "is a file, not a folder")
    assert "tokenizer" not in err  # refused before the tokenizer is trained


def test_full_disk_during_training(capsys, corpus, tmp_path, monkeypatch):
    from toy.gguf import GGUFWriter

    real = GGUFWriter.write

    def write(self):
        if self.path.name == "step_4.gguf":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self)

    monkeypatch.setattr(GGUFWriter, "write", write)
    code, _, err = run(
        capsys, "train", "from-scratch", corpus, *SMALL, "--steps", 6, "--save-every", 2, "--out", tmp_path / "runs"
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    ck = run_dir / "checkpoints"
    assert_clean_error(
        code,
        err,
        1,
        f"error: could not write checkpoint step_4 ({ck / 'step_4.gguf'}): No space left on device; "
        f"the last good checkpoint is step_2 ({ck / 'step_2.gguf'})",
        f"hint: free some space (or fix the folder), then go on from it: toy train --resume {run_dir}",
    )
    monkeypatch.undo()
    code, _, err = run(capsys, "train", "--resume", run_dir)
    assert code == 0 and "step 6/6" in err, err


def test_damaged_checkpoint_is_named(capsys, corpus, tmp_path):
    run_dir = train_stopped(capsys, corpus, tmp_path)
    state = run_dir / "checkpoints" / "step_4.state.gguf"
    data = bytearray(state.read_bytes())
    data[-3] ^= 0x40
    state.write_bytes(bytes(data))
    code, _, err = run(capsys, "train", "--resume", run_dir, "--steps", 6)
    assert_clean_error(code, err, 2, f"error: checkpoint {state} is damaged", "no earlier intact checkpoint", hint=True)
    assert "nan" not in err and "learning rate" not in err


@pytest.fixture
def tiny(tmp_path):
    return mp.write_tiny_model(tmp_path / "models" / "tiny.gguf", extra_metadata={"tokenizer.ggml.merges": []})


def test_eval_runs_dir_that_is_a_file(capsys, tiny, tmp_path):
    # (before the fix the model loaded and the text was scored, then: [Errno 20] Not a directory, exit 1)
    f = tmp_path / "runs-file"
    f.write_text("x")
    code, out, err = run(capsys, "eval", "logprobs", tiny, "hello world", "--runs-dir", f)
    assert_clean_error(code, err, 2, f"--runs-dir {f}: is a file, not a folder")
    assert out == ""
    code, _, err = run(capsys, "eval", "logprobs", tiny, "hello world", "--runs-dir", f / "sub")
    assert_clean_error(code, err, 2, f"--runs-dir {f / 'sub'}: cannot create it: {f} is a file, not a folder")


def test_quantize_into_a_read_only_folder_names_the_output(capsys, tiny, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, prefix=None, suffix=None, **kw):  # a read-only folder, even for root
        if dir is not None and Path(dir) == ro:
            name = f"{prefix or 'tmp'}XXXXXXXX{suffix or ''}"
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(ro / name))
        return real(*a, dir=dir, prefix=prefix, suffix=suffix, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    dst = ro / "tiny.Q8_0.gguf"
    code, out, err = run(capsys, "quantize", tiny, dst, "--type", "Q8_0")
    assert_clean_error(code, err, 2, str(ro), "tiny.Q8_0.gguf", "cannot write into it: Permission denied")
    assert ".spill" not in err and ".tmp" not in err, err
    assert out == "" and list(ro.iterdir()) == []


def test_quantize_full_disk_names_the_output(capsys, tiny, tmp_path, monkeypatch):
    from toy.gguf import GGUFWriter

    def write(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GGUFWriter, "write", write)
    dst = tmp_path / "out" / "tiny.Q8_0.gguf"
    code, _, err = run(capsys, "quantize", tiny, dst, "--type", "Q8_0")
    assert_clean_error(code, err, 1, f"error: could not write {dst}: No space left on device; tiny.Q8_0.gguf was not")
    assert not dst.exists() and [p.name for p in dst.parent.iterdir()] == []


def test_resume_json_reports_fallback(capsys, corpus, tmp_path):
    code, out, err = run(
        capsys, "train", "from-scratch", corpus, *SMALL, "--steps", 4, "--save-every", 2, "--out", tmp_path / "runs"
    )
    assert code == 0, err
    run_dir = Path(out.strip())
    model = run_dir / "checkpoints" / "step_4.gguf"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x40
    model.write_bytes(bytes(data))
    code, out, err = run(capsys, "train", "--resume", run_dir, "--steps", 6, "--json")
    assert code == 0, err
    assert f"warning: checkpoint {model} is damaged" in err and "resuming from step_2" in err
    assert json.loads(out)["final_step"] == 6
