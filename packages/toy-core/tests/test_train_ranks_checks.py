"""Ranks that must not train together stop before anything is written.

A language-model run on two MPI ranks (MPICH's ``mpiexec``; MPMD launches,
``mpiexec -n 1 CMD_A : -n 1 CMD_B``, give the ranks different command lines
or environments) is refused on every rank, with one ``error:`` line each,
a non-zero exit and no run folder, when:

- the ranks' configs differ (another ``--lr``);
- a data file or the donor model at the same path holds other bytes on one
  rank (a private mount namespace for rank 1 binds another file over the
  path: root only, which CI is);
- the ranks run different ggml CPU variants (``TOY_GGML_CPU_VARIANT`` on
  rank 1): the hint names the best variant both run (this CPU's own choice);
  with ``--mixed-cpus allow`` the run trains and records the variants and a
  warning;
- diagnostics or a step trace are asked for (one-process tools);
- ``TOY_COMM_TIMEOUT`` is not a positive number of seconds.

Every launch is bounded (``TIMEOUT``) and ``TOY_COMM_TIMEOUT`` is short, so a
rank left waiting cannot hang the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toy_testsupport.ranks import mpiexec, run_command

PY = sys.executable
TOY = [PY, "-m", "toy_cli"]
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0"]
TIMEOUT = 120  # seconds any one launch may take (each takes a few)
HOST = os.uname().nodename


def _env(work: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TOY_GGML_CPU_VARIANT"}
    return {**env, "TOY_HOME": str(work / "home"), "TOY_DEVICE": "cpu", "TOY_COMM_TIMEOUT": "30", **extra}


def _run(cmd: list[str], work: Path, **extra: str) -> subprocess.CompletedProcess:
    return run_command(cmd, cwd=work, env=_env(work, **extra), timeout=TIMEOUT)  # ranks killed on a timeout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A small corpus, a copy of it with one file changed, and two 1-step models (the first's tokenizer)."""
    from toy_testsupport.train_helpers import python_docs_corpus

    w = tmp_path_factory.mktemp("rankchecks")
    small = python_docs_corpus(w / "c", 8)["small"]
    shutil.copytree(small, w / "other")
    first = sorted((w / "other").iterdir())[0]
    first.write_text(first.read_text() + "\none more line on one rank only\n")
    for seed, name in ((0, "model.gguf"), (1, "model2.gguf")):
        tok = ["--tokenizer", "model.gguf"] if seed else []
        cmd = [*TOY, "train", "from-scratch", str(small), *SMALL, *tok, "--steps", "1", "--seed", str(seed)]
        r = _run([*cmd, "--out", f"m{seed}", "--quiet"], w)
        assert r.returncode == 0, r.stderr
        (ck,) = (w / f"m{seed}").glob("train-*/checkpoints/step_1.gguf")
        (w / name).write_bytes(ck.read_bytes())
    return w


def _train(work: Path, out: str, *extra: str) -> list[str]:
    corpus = str(work / "c" / "small")
    args = ["train", "from-scratch", corpus, *SMALL, "--tokenizer", "model.gguf", "--steps", "2", "--save-every", "0"]
    return [*TOY, *args, "--out", out, "--quiet", *extra]


def _no_run(work: Path, out: str) -> bool:
    d = work / out
    return not d.exists() or not any(d.iterdir())


def _refused(r: subprocess.CompletedProcess, *fragments: str) -> None:
    """The ranks refused with the one error line (and a hint), no traceback.
    Every rank raises the same refusal, but the first to report ends the
    others (MPI_Abort), so one or two of them get to print it."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error: " in line]
    assert 1 <= len(errors) <= 2, r.stderr
    for f in fragments:
        assert r.stderr.count(f) == len(errors), (f, r.stderr)


def _private_mount(source: Path, target: Path) -> list[str]:
    """A prefix that runs a command with ``source`` bound over ``target``, seen by that command alone."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root (a private mount namespace for one rank); CI runs as root")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("unshare -m is not permitted here")
    return ["unshare", "-m", "sh", "-c", f'mount --bind "{source}" "{target}" && exec "$@"', "sh"]


# ---------------------------------------------------------------- other inputs


def test_another_config_on_one_rank(work):
    cmd = _train(work, "o-config")
    r = _run([mpiexec(), "-n", "1", *cmd, ":", "-n", "1", *cmd, "--lr", "0.002"], work)
    _refused(
        r,
        f"error: rank 1 ({HOST}) was started with other settings than rank 0: optim.lr 0.002 (rank 0: 0.001)",
        "hint: ",
    )
    assert _no_run(work, "o-config")


def test_another_data_file_at_the_same_path(work):
    cmd = _train(work, "o-data")
    rank1 = _private_mount(work / "other", work / "c" / "small")
    r = _run([mpiexec(), "-n", "1", *cmd, ":", "-n", "1", *rank1, *cmd], work)
    changed = sorted((work / "c" / "small").iterdir())[0]
    _refused(r, f"error: rank 1 ({HOST}) reads other input files than rank 0 ({HOST}): {changed} differ")
    assert _no_run(work, "o-data")


def test_another_donor_model_at_the_same_path(work):
    dims = ["--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
    run = ["--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0"]
    cmd = [*TOY, "train", "warm-start", str(work / "c" / "small"), "-m", "model.gguf", *dims, *run]
    cmd += ["--steps", "2", "--out", "o-model", "--quiet"]
    rank1 = _private_mount(work / "model2.gguf", work / "model.gguf")
    r = _run([mpiexec(), "-n", "1", *cmd, ":", "-n", "1", *rank1, *cmd], work)
    _refused(r, "reads other input files than rank 0", "model.gguf differ (size or content)")
    assert _no_run(work, "o-model")
    # the same command on both ranks, with the same file, trains
    r = _run([mpiexec(), "-n", "2", *cmd], work)
    assert r.returncode == 0, r.stderr
    assert not _no_run(work, "o-model")


# ---------------------------------------------------------------- CPU variants


def _variants() -> tuple[str, str]:
    """(this CPU's own variant, another one it runs) as toy_ggml chooses them."""
    code = (
        "import json, toy_ggml; c = toy_ggml.cpu_variant(); "
        "print(json.dumps([c.tag, [(x.tag, x.score) for x in c.candidates]]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TOY_GGML_CPU_VARIANT"}
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    own, candidates = json.loads(r.stdout)
    others = sorted((score, tag) for tag, score in candidates if score > 0 and tag != own)
    if not others:
        pytest.skip(f"this CPU runs one ggml variant only ({own})")
    return own, others[0][1]


def test_ranks_on_different_cpu_variants_are_refused(work):
    own, other = _variants()
    cmd = _train(work, "o-cpu")
    r = _run([mpiexec(), "-n", "1", *cmd, ":", "-n", "1", "env", f"TOY_GGML_CPU_VARIANT={other}", *cmd], work)
    _refused(
        r,
        f"error: the ranks run different ggml CPU variants (rank 0 {own}, rank 1 {other})",
        f"hint: start every rank with TOY_GGML_CPU_VARIANT={own} ",
        "--mixed-cpus allow",
    )
    assert _no_run(work, "o-cpu")


def test_mixed_cpus_allow_trains_and_records_the_variants(work):
    own, other = _variants()
    cmd = _train(work, "o-mixed", "--mixed-cpus", "allow")
    r = _run([mpiexec(), "-n", "1", *cmd, ":", "-n", "1", "env", f"TOY_GGML_CPU_VARIANT={other}", *cmd], work)
    assert r.returncode == 0, r.stderr
    (run,) = (work / "o-mixed").iterdir()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    start = events[0]
    assert start["kind"] == "run_start" and start["world"]["cpu_variants"] == [own, other]
    assert json.loads((run / "config.json").read_text())["mixed_cpus"] == "allow"
    notes = [e["text"] for e in events if e["kind"] == "note"]
    assert any(f"different ggml CPU variants (rank 0 {own}, rank 1 {other})" in t for t in notes), notes
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2]
    assert events[-1]["kind"] == "run_end" and events[-1]["reason"] == "completed"


def test_an_unknown_mixed_cpus_value_is_bad_input(work):
    r = _run(_train(work, "o-badmixed", "--mixed-cpus", "sometimes"), work)
    assert r.returncode == 2 and "error: " in r.stderr and "mixed_cpus" in r.stderr, r.stderr
    assert _no_run(work, "o-badmixed")


# ---------------------------------------------------------------- one-process tools, the timeout


@pytest.mark.parametrize("extra", [["--diagnostics", "activations"], ["--trace", "trace.json"]])
def test_diagnostics_and_traces_need_one_process(work, extra):
    r = _run([mpiexec(), "-n", "2", *_train(work, "o-diag", *extra)], work)
    _refused(r, "error: training diagnostics and step traces are one-process tools", "hint: run them without --ranks")
    assert _no_run(work, "o-diag") and not (work / "trace.json").exists()


@pytest.mark.parametrize(("value", "says"), [("abc", "is not a number of seconds"), ("0", "must be positive")])
def test_an_invalid_comm_timeout_is_bad_input(work, value, says):
    r = _run([mpiexec(), "-n", "2", *_train(work, "o-timeout")], work, TOY_COMM_TIMEOUT=value)
    _refused(r, f"error: TOY_COMM_TIMEOUT={value!r}", says)
    assert _no_run(work, "o-timeout")
