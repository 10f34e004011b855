"""`toy train --ranks N`: the launcher (toy_cli.ranks) around ``mpiexec``.

The reference for every multi-rank run is a one-process run of the same
command with ``--grad-accum 2`` (the contract of toy.train.distributed: two
ranks with one micro-batch each equal one process accumulating two, bit for
bit). Checkpoints are compared as files: the model file byte for byte once
the run id (the one key that must differ, same length in both) is swapped,
the AdamW moments tensor by tensor (the state file also records the config,
whose out folder and grad_accum differ by design).

The runs are tiny (a 2-layer, 32-wide llama on a 12-file corpus) and start
real processes: every one has a timeout, and a launcher still alive at the
end of a test is killed with its ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toy.extras import install_command
from toy.train import checkpoint
from toy_cli import ranks as R
from toy_testsupport.ranks import run_command

PY = sys.executable
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0"]
STEPS = 200


# ---------------------------------------------------------------- command lines (no processes)


@pytest.mark.parametrize(
    ("argv", "rest", "n"),
    [
        (["train", "from-scratch", "c", "--ranks", "2", "--steps", "3"], ["train", "from-scratch", "c", "--steps", "3"], 2),
        (["train", "--resume", "r", "--ranks=3"], ["train", "--resume", "r"], 3),
        (["train", "--ranks", "2", "lora", "d.jsonl"], ["train", "lora", "d.jsonl"], 2),
        (["train", "full", "x", "--steps", "4"], ["train", "full", "x", "--steps", "4"], None),
        # after "--" everything is an argument, even a file called --ranks
        (["train", "from-scratch", "--ranks", "2", "--", "--ranks", "5"], ["train", "from-scratch", "--", "--ranks", "5"], 2),
    ],
)  # fmt: skip
def test_strip_ranks(argv, rest, n):
    assert R.strip_ranks(argv) == (rest, n)


@pytest.mark.parametrize("argv", [["train", "--ranks"], ["train", "--ranks", "two"], ["train", "--ranks="]])
def test_strip_ranks_refuses_a_missing_or_bad_value(argv):
    with pytest.raises(R.LaunchError, match="--ranks"):
        R.strip_ranks(argv)


def test_the_ranks_run_the_same_command_under_mpiexec():
    ranks = R.rank_command(["train", "--resume", "r"], python="/v/bin/python")
    assert ranks == ["/v/bin/python", "-m", "toy_cli", "train", "--resume", "r"]
    assert R.mpiexec_command("/v/bin/mpiexec", 2, ranks, bind=True) == [
        "/v/bin/mpiexec", "-n", "2", "-bind-to", "core", *ranks
    ]  # fmt: skip
    assert R.mpiexec_command("mpiexec", 4, ranks, bind=False) == ["mpiexec", "-n", "4", *ranks]


def test_mpiexec_is_found_beside_python_unless_toy_mpiexec_says(monkeypatch, tmp_path):
    monkeypatch.delenv(R.MPIEXEC_ENV, raising=False)
    beside = Path(sys.executable).parent / "mpiexec"
    assert beside.is_file()  # the dev requirements install the mpich wheel into the venv
    assert R.find_mpiexec() == str(beside)
    monkeypatch.setenv(R.MPIEXEC_ENV, str(tmp_path / "my-mpiexec"))
    assert R.find_mpiexec() == str(tmp_path / "my-mpiexec")


def test_the_relay_keeps_hydras_banner_back_and_passes_the_rest(tmp_path):
    """What MPICH 5's mpiexec printed on stdout when a rank was SIGKILLed
    (captured from a real run): the banner is kept for the launcher's own
    error line, everything else goes through unchanged."""
    import io

    text = (
        "runs/train-1\n"
        "\n"
        "===================================================================================\n"
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
        "=   PID 31862 RUNNING AT vm\n"
        "=   EXIT CODE: 9\n"
        "=   CLEANING UP REMAINING PROCESSES\n"
        "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES\n"
        "===================================================================================\n"
        "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
        "This typically refers to a problem with your application.\n"
        "Please see the FAQ page for debugging suggestions\n"
        "\n"
        "last words\n"
    )
    w = R._Watch(str(tmp_path / "info.json"))
    dst = io.StringIO()
    R._relay(io.BytesIO(text.encode()), dst, w)
    assert dst.getvalue() == "runs/train-1\n\nlast words\n"
    assert (w.banner_pid, w.banner_host, w.banner_code, w.exit_signal) == (31862, "vm", 9, 9)
    assert len(w.banner) == 10  # the rules, the 5 "=" lines, the exit string and the 2 lines after it


# ---------------------------------------------------------------- MPI missing: one error line, nothing written


def _toy(*args, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "toy_cli", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture()
def env(tmp_path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "TOY_"))}
    e.update(TOY_DEVICE="cpu", TOY_HOME=str(tmp_path / "home"), TOY_COMM_TIMEOUT="60")
    return e


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    from toy.train.demodata import write_python_docs

    paths = sorted(write_python_docs(root / "corpus"))
    for p in paths[12:]:  # a smaller corpus keeps tokenizer training short
        p.unlink()
    return root / "corpus"


def test_a_missing_mpiexec_is_one_error_line_naming_the_extra(env, corpus, tmp_path):
    env[R.MPIEXEC_ENV] = str(tmp_path / "no-such-mpiexec")
    r = _toy("train", "from-scratch", corpus, *SMALL, "--steps", "2", "--out", tmp_path / "runs", "--ranks", "2",
             env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: --ranks 2 needs MPI") and "no-such-mpiexec" in lines[0]
    assert lines[1].startswith("hint: ") and install_command("distributed") in lines[1]
    assert len(lines) == 2 and r.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_without_mpi4py_ranks_is_one_error_line_naming_the_extra(monkeypatch, capsys, tmp_path):
    from toy_cli.main import main

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now fails, as where it is not installed
    monkeypatch.delenv(R.MPIEXEC_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--resume", str(tmp_path / "run"), "--ranks", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [
        "error: --ranks 2 needs MPI: mpi4py is not installed",
        f"hint: install the extra: {install_command('distributed')}",
    ]
    assert list(tmp_path.iterdir()) == []


def test_ranks_inside_an_mpi_launch_is_refused(monkeypatch, capsys, tmp_path):
    from toy_cli.main import main

    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "0")
    code = main(["train", "--resume", str(tmp_path / "run"), "--ranks", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --ranks 2: this command is already one of 2 ranks"), err


def test_ranks_one_runs_in_this_process(monkeypatch, capsys, tmp_path):
    """--ranks 1 is today's command: no mpiexec is looked for (one that does
    not exist is never reported)."""
    from toy_cli.main import main

    monkeypatch.setenv(R.MPIEXEC_ENV, str(tmp_path / "no-such-mpiexec"))
    code = main(["train", "--resume", str(tmp_path / "nothing-here"), "--ranks", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "mpiexec" not in err and "nothing-here" in err, err


# ---------------------------------------------------------------- real runs


def _model_bytes(run_dir: Path, step: int) -> bytes:
    data = (run_dir / "checkpoints" / f"step_{step}.gguf").read_bytes()
    return data.replace(run_dir.name.encode(), b"<run-id>")


def _curve(run_dir: Path) -> list[tuple]:
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return [(e["step"], e["loss"], e["grad_norm"]) for e in evs if e["kind"] == "step"]


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _same_checkpoint(a: Path, b: Path, step: int) -> None:
    assert _model_bytes(a, step) == _model_bytes(b, step)
    ca, cb = checkpoint.load(a / "checkpoints", step), checkpoint.load(b / "checkpoints", step)
    assert set(ca.optimizer) == set(cb.optimizer) and ca.optimizer
    for name in ca.optimizer:
        assert ca.optimizer[name].tobytes() == cb.optimizer[name].tobytes(), name


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, --grad-accum 2: what two ranks must reproduce."""
    root = tmp_path_factory.mktemp("ref")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "TOY_"))}
    e.update(TOY_DEVICE="cpu", TOY_HOME=str(root / "home"))
    r = _toy("train", "from-scratch", corpus, *SMALL, "--steps", STEPS, "--save-every", "20", "--grad-accum", "2",
             "--out", root / "runs", "-q", env=e, cwd=root)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def test_two_ranks_equal_one_process_accumulating_two(env, corpus, reference, tmp_path):
    r = _toy("train", "from-scratch", corpus, *SMALL, "--steps", STEPS, "--save-every", "20", "--out",
             tmp_path / "runs", "--ranks", "2", env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert r.stdout == f"{run_dir}\n"  # rank 0's summary only
    assert r.stderr.count("completed at step") == 1  # rank 1 says nothing
    start = _events(run_dir)[0]
    assert start["world"]["size"] == 2
    assert _curve(run_dir) == _curve(reference)
    _same_checkpoint(run_dir, reference, STEPS)


def _start(args: list, env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, Path, Path]:
    out, err = cwd / "launcher.out", cwd / "launcher.err"
    p = subprocess.Popen(
        [PY, "-m", "toy_cli", *map(str, args)], cwd=cwd, env=env, stdout=out.open("w"), stderr=err.open("w")
    )
    return p, out, err


def _wait_for(pred, p: subprocess.Popen, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert p.poll() is None, err.read_text()
        assert time.monotonic() < deadline, f"timed out; stderr:\n{err.read_text()}"
        time.sleep(0.02)


def _kill_all(p: subprocess.Popen, info: Path) -> None:
    """Ends a launcher (and the ranks it names) still running after a test."""
    if p.poll() is None:
        for pid in (R.read_info(info) or {}).get("pids", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.kill()
        p.wait(timeout=30)


def _steps_done(info: Path, n: int) -> bool:
    facts = R.read_info(info)
    if facts is None:
        return False
    try:
        return sum(e["kind"] == "step" for e in _events(Path(facts["run_dir"]))) >= n
    except (OSError, ValueError, KeyError):
        return False


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_every_rank_and_resume_finishes_exactly(sig, code, env, corpus, reference, tmp_path):
    info = tmp_path / "ranks.json"
    env[R.INFO_ENV] = str(info)
    p, out, err = _start(["train", "from-scratch", corpus, *SMALL, "--steps", STEPS, "--save-every", "20",
                          "--out", tmp_path / "runs", "--ranks", "2"], env, tmp_path)  # fmt: skip
    try:
        _wait_for(lambda: _steps_done(info, 5), p, err)
        p.send_signal(sig)
        assert p.wait(timeout=120) == code, err.read_text()
    finally:
        _kill_all(p, info)
    run_dir = Path(R.read_info(info)["run_dir"])
    end = _events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted", err.read_text()
    stopped = end["final_step"]
    assert 5 <= stopped < STEPS
    assert checkpoint.latest_step(run_dir / "checkpoints") == stopped
    assert f"resume: toy train --resume {run_dir}" in err.read_text()
    assert out.read_text() == f"{run_dir}\n"
    r = _toy("train", "--resume", run_dir, "--ranks", "2", "-q", env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _curve(run_dir) == _curve(reference)
    _same_checkpoint(run_dir, reference, STEPS)


def test_a_lost_rank_is_named_with_the_last_checkpoint_and_resume_goes_on(env, corpus, reference, tmp_path):
    info = tmp_path / "ranks.json"
    env[R.INFO_ENV] = str(info)
    p, out, err = _start(["train", "from-scratch", corpus, *SMALL, "--steps", STEPS, "--save-every", "20",
                          "--out", tmp_path / "runs", "--ranks", "2"], env, tmp_path)  # fmt: skip
    try:
        _wait_for(lambda: _steps_done(info, 45), p, err)  # two checkpoints (20, 40) written
        facts = R.read_info(info)
        pid = facts["pids"][1]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert p.wait(timeout=90) == 1, err.read_text()
        assert time.monotonic() - t0 < 60
    finally:
        _kill_all(p, info)
    run_dir = Path(facts["run_dir"])
    evs = _events(run_dir)
    step = max(e["step"] for e in evs if e["kind"] == "step")
    ck = checkpoint.latest_step(run_dir / "checkpoints")
    assert ck is not None and ck >= 40
    lines = err.read_text().splitlines()
    assert lines[-2] == (
        f"error: rank 1 (pid {pid} on {facts['hosts'][1]}) was lost (killed by signal 9) at step {step}; "
        f"the last good checkpoint is {run_dir / 'checkpoints' / f'step_{ck}.gguf'}"
    ), err.read_text()
    assert lines[-1] == f"hint: toy train --resume {run_dir} --ranks 2"
    assert "BAD TERMINATION" not in out.read_text() + err.read_text()  # hydra's banner is replaced
    end = evs[-1]  # rank 0's own (when MPI told it of the loss before hydra ended it), else the launcher's
    assert end["kind"] == "run_end" and end["reason"] == "errored" and end["final_step"] == step
    r = _toy("train", "--resume", run_dir, "--ranks", "2", "-q", env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    _same_checkpoint(run_dir, reference, STEPS)


def test_a_rank_that_fails_alone_ends_every_rank_at_once(env, corpus, tmp_path):
    """Rank 1 alone has a communication timeout too short for anything
    (mpiexec's MPMD form gives it its own environment): it fails by itself
    with an error: line; rank 0, whose timeout is 10 minutes, must not wait
    for it (toy_cli.ui.training ends every rank with MPI_Abort)."""
    mpiexec = R.find_mpiexec()
    assert mpiexec is not None
    cmd = [PY, "-m", "toy_cli", "train", "from-scratch", str(corpus), *SMALL, "--steps", str(STEPS),
           "--out", str(tmp_path / "runs")]  # fmt: skip
    env["TOY_COMM_TIMEOUT"] = "600"
    t0 = time.monotonic()
    mpmd = [mpiexec, "-n", "1", *cmd, ":", "-n", "1", "-env", "TOY_COMM_TIMEOUT", "0.00001", *cmd]
    r = run_command(mpmd, cwd=tmp_path, env=env, timeout=120)  # the ranks are killed on a timeout
    assert time.monotonic() - t0 < 60
    assert r.returncode not in (0, 130) and "error: " in r.stderr, r.stderr
