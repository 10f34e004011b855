"""``toy vit train`` on several MPI ranks equals one process, bit for bit.

The contract (``toy.train.distributed``): N ranks with ``grad_accum`` 1
take the same steps as one process with ``grad_accum`` N. The independent
reference is that one-process run, through the Python API in this process
(``toy vit train`` has no ``--grad-accum`` flag); the ranks run under
MPICH's ``mpiexec`` (``toy_cli`` itself, or a small driver script for what
the CLI has no flag for: epochs, LoRA, a stop after k steps). Both sides use
one thread per process and the same data, seed and image cache. Compared:
every step's loss, gradient norm and image count, the evaluations, every
model checkpoint byte for byte once the run id (written into the file) is
swapped, and the tensors of every optimizer state file (its metadata
records the ranks and grad_accum, which differ by design).

Checked that way: 2 ranks through ``mpiexec`` and through ``--ranks 2``, 3
ranks with epochs, augmentation and label smoothing, a LoRA fine-tune on 2.

Also: resuming on another number of ranks keeps the images per step (and
ends on the uninterrupted run's bytes when each rank takes one micro-batch;
otherwise a note says the bits change); a micro-batch count the ranks
cannot share is refused. Ranks with another config, other images at the
same path (a private mount for one rank, so root only, which CI is) or
other ggml CPU variants (unless ``--mixed-cpus allow``) stop before
anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toy.gguf import GGUFFile
from toy.train import checkpoint, lmrun
from toy.train.steploop import Hooks
from toy_testsupport.ranks import mpiexec, run_command
from toy_testsupport.vit_images import write_folder
from toy_vit.config import ViTConfig
from toy_vit.gguf_io import write_gguf
from toy_vit.train import init_params, train
from toy_vit.trainconfig import ViTTrainConfig, ViTTrainConfigError, validate

PY = sys.executable
TIMEOUT = 180  # seconds any one launch may take (each takes a few)

# the tiny run every test trains: vit-micro (16 px), 3 classes of 10 images, 1 thread
BASE = dict(preset="vit-micro", batch_size=4, threads=1, eval_every=3, save_every=3, steps=6, seed=0)
CLI_ARGS = ["--preset", "vit-micro", "--batch-size", "4", "--threads", "1", "--eval-every", "3"]
CLI_ARGS += ["--save-every", "3", "--steps", "6", "--seed", "0"]

# a driver for what the CLI has no flag for: train(ViTTrainConfig(**cfg)), stopping after k steps if asked
DRIVER = r"""
import json, sys
from toy.train.steploop import Hooks
from toy_vit.train import train
from toy_vit.trainconfig import ViTTrainConfig, ViTTrainConfigError, validate

spec = json.loads(sys.argv[1])
done = []
stop_after = spec.get("stop_after")
hooks = Hooks(
    progress=lambda info: done.append(info["step"]),
    should_stop=(lambda: len(done) >= stop_after) if stop_after else None,
)
r = train(ViTTrainConfig(**spec["cfg"]), hooks)
# one write per line: the ranks share the launcher's stdout (print's separate newline could interleave)
sys.stdout.write(json.dumps({"run_dir": str(r.run_dir), "reason": r.reason, "final_step": r.final_step}) + "\n")
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("vitranks")
    write_folder(w / "data", per_class=10)  # 27 training images, 3 for validation
    cfg = ViTConfig.preset("vit-micro", labels=("a", "b", "c"))
    write_gguf(w / "base.gguf", cfg, init_params(cfg, 7))
    return w


@pytest.fixture(autouse=True)
def _env(work, monkeypatch):
    for k, v in _env_vars(work).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(work)


def _env_vars(work: Path) -> dict[str, str]:
    return {"TOY_HOME": str(work / "home"), "TOY_DEVICE": "cpu", "TOY_COMM_TIMEOUT": "60"}


def _launch(cmd: list[str], work: Path) -> subprocess.CompletedProcess:
    return run_command(
        cmd, cwd=work, env={**os.environ, **_env_vars(work)}, timeout=TIMEOUT
    )  # ranks killed on a timeout


def _ranks_cli(n: int, args: list[str], work: Path) -> subprocess.CompletedProcess:
    return _launch([mpiexec(), "-n", str(n), PY, "-m", "toy_cli", "vit", "train", *args], work)


def _ranks_driver(n: int, spec: dict, work: Path) -> dict:
    script = work / "driver.py"
    script.write_text(DRIVER)
    r = _launch([mpiexec(), "-n", str(n), PY, str(script), json.dumps(spec)], work)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == n  # every rank returns the same result
    assert len(set(lines)) == 1
    return json.loads(lines[0])


def _only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _steps(run_dir: Path) -> dict[int, tuple]:
    """step -> (loss, grad_norm, images); a step seen twice (a resume) counts its later event."""
    return {e["step"]: (e["loss"], e["grad_norm"], e["images"]) for e in _events(run_dir) if e["kind"] == "step"}


def _evals(run_dir: Path) -> list[tuple]:
    return [(e["step"], e["loss"], e["accuracy"], e["top5"]) for e in _events(run_dir) if e["kind"] == "eval"]


def _state_tensors(path: Path) -> dict[str, bytes]:
    f = GGUFFile(path)
    return {n: f.tensor_bytes(n) for n in f.tensors}


def _same_checkpoints(ref: Path, other: Path, steps: list[int]) -> None:
    """``other``'s model checkpoints are ``ref``'s bytes once ``ref``'s run id
    stands in for its own; the optimizer states hold the same tensors."""
    for k in steps:
        a = (ref / "checkpoints" / f"step_{k}.gguf").read_bytes()
        b = (other / "checkpoints" / f"step_{k}.gguf").read_bytes()
        assert len(ref.name) == len(other.name) and other.name.encode() in b
        assert b.replace(other.name.encode(), ref.name.encode()) == a, f"step_{k}.gguf"
        sa = _state_tensors(ref / "checkpoints" / f"step_{k}.state.gguf")
        sb = _state_tensors(other / "checkpoints" / f"step_{k}.state.gguf")
        assert list(sa) == list(sb) and sa == sb, f"step_{k}.state.gguf"


def _reference(work: Path, out: str, n: int, hooks: Hooks | None = None, **kw) -> Path:
    """The one-process run with ``grad_accum`` n (in this process)."""
    cfg = ViTTrainConfig(data=str(work / "data"), out=str(work / out), **{**BASE, **kw, "grad_accum": n})
    r = train(cfg, hooks)
    return r.run_dir


@pytest.fixture(scope="module")
def reference2(work) -> Path:
    os.environ.update(_env_vars(work))  # module scope: the autouse env fixture has not run yet
    return _reference(work, "ref2", 2)


# ---------------------------------------------------------------- the contract


def test_two_ranks_on_the_cli_equal_one_process_with_two_micro_batches(work, reference2):
    r = _ranks_cli(2, ["data", *CLI_ARGS, "--out", "r2"], work)
    assert r.returncode == 0, r.stderr
    run = _only_run(work / "r2")
    assert _steps(run) == _steps(reference2) and sorted(_steps(run)) == [1, 2, 3, 4, 5, 6]
    assert _evals(run) == _evals(reference2) and len(_evals(run)) == 2
    _same_checkpoints(reference2, run, [3, 6])
    # rank 0 alone speaks and writes; the run records its world
    assert r.stderr.count("completed at step 6") == 1, r.stderr
    assert r.stdout.count("train-") == 1, r.stdout  # the run folder, once
    ev = _events(run)
    world = ev[0]["world"]
    assert world["size"] == 2 and len(world["hosts"]) == 2 and len(set(world["cpu_variants"])) == 1
    assert "world" not in _events(reference2)[0]
    step = next(e for e in ev if e["kind"] == "step")
    assert step["sent_bytes"] > 0 and step["rank_s_max"] >= step["rank_s_min"] > 0 and step["comm_s"] >= 0
    assert sum(e["kind"] == "run_end" for e in ev) == 1
    state = checkpoint.load_resumable(run / "checkpoints").state
    assert state["ranks"] == 2 and state["global_micro_batches"] == 2 and state["config"]["grad_accum"] == 1


def test_ranks_flag_launches_the_same_run(work, reference2):
    """``toy vit train --ranks 2`` starts ``mpiexec -n 2`` itself: the same bytes."""
    mpiexec()
    r = _launch([PY, "-m", "toy_cli", "vit", "train", "data", *CLI_ARGS, "--out", "flag2", "--ranks", "2"], work)
    assert r.returncode == 0, r.stderr
    run = _only_run(work / "flag2")
    assert _steps(run) == _steps(reference2)
    _same_checkpoints(reference2, run, [6])


def test_three_ranks_with_epochs_augmentation_and_smoothing(work):
    """Epochs count every rank's images: 1 epoch of 27 images at 3 x 3 per
    step is 3 steps on both sides."""
    kw = dict(steps=0, epochs=1.0, batch_size=3, eval_every=2, save_every=2, label_smoothing=0.1)
    ref = _reference(work, "ref3", 3, **kw)
    cfg = {**BASE, **kw, "data": str(work / "data"), "out": str(work / "r3"), "grad_accum": 1}
    got = _ranks_driver(3, {"cfg": cfg}, work)
    run = Path(got["run_dir"])
    assert got["final_step"] == 3 and sorted(_steps(run)) == [1, 2, 3]
    assert _steps(run) == _steps(ref) and _evals(run) == _evals(ref)
    assert [s[2] for s in _steps(run).values()] == [9, 18, 27]
    _same_checkpoints(ref, run, [2, 3])


def test_lora_fine_tune_on_two_ranks(work):
    kw = dict(base=str(work / "base.gguf"), lora_rank=2, lora_targets=("q", "v"), steps=4, save_every=2)
    ref = _reference(work, "reflora", 2, **kw)
    cfg = {**BASE, **kw, "data": str(work / "data"), "out": str(work / "rlora"), "grad_accum": 1}
    run = Path(_ranks_driver(2, {"cfg": cfg}, work)["run_dir"])
    assert _steps(run) == _steps(ref) and sorted(_steps(run)) == [1, 2, 3, 4]
    assert _evals(run) == _evals(ref) and _evals(run)[0][0] == 0  # a fine-tune evaluates its base first
    _same_checkpoints(ref, run, [2, 4])
    with GGUFFile(run / "checkpoints" / "step_4.gguf") as f:
        assert any(n.endswith(".lora_a") for n in f.tensors)


# ---------------------------------------------------------------- resuming on another number of ranks


def test_a_two_rank_run_resumed_in_one_process_ends_on_the_same_bytes(work, reference2):
    cfg = {**BASE, "data": str(work / "data"), "out": str(work / "stop2"), "grad_accum": 1}
    got = _ranks_driver(2, {"cfg": cfg, "stop_after": 3}, work)
    assert got["reason"] == "interrupted" and got["final_step"] == 3
    run = Path(got["run_dir"])
    r = lmrun.resume(run)  # one process: grad_accum becomes 2 (2 micro-batches a step, as before)
    assert r.reason == "completed" and r.final_step == 6
    assert _steps(run) == _steps(reference2)
    _same_checkpoints(reference2, run, [6])
    notes = [e["text"] for e in _events(run) if e["kind"] == "note"]
    assert not any("summed in another order" in t for t in notes)  # one micro-batch per rank: the same bits


def test_a_one_process_run_resumed_on_two_ranks_ends_on_the_same_bytes(work, reference2):
    done: list[int] = []
    hooks = Hooks(progress=lambda i: done.append(i["step"]), should_stop=lambda: len(done) >= 3)
    run = _reference(work, "stop1", 2, hooks=hooks)
    assert sorted(_steps(run)) == [1, 2, 3]
    r = _launch([mpiexec(), "-n", "2", PY, "-m", "toy_cli", "vit", "train", "--resume", str(run)], work)
    assert r.returncode == 0, r.stderr
    assert _steps(run) == _steps(reference2)
    _same_checkpoints(reference2, run, [6])
    resumed = [e for e in _events(run) if e["kind"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["world"]["size"] == 2


def test_resuming_two_micro_batches_a_rank_says_the_bits_change(work):
    """4 micro-batches a step: 1 process x 4 before, 2 ranks x 2 after (another summation order)."""
    done: list[int] = []
    hooks = Hooks(progress=lambda i: done.append(i["step"]), should_stop=lambda: len(done) >= 2)
    run = _reference(work, "stop4", 4, hooks=hooks, batch_size=2, steps=4, save_every=0)
    r = _launch([mpiexec(), "-n", "2", PY, "-m", "toy_cli", "vit", "train", "--resume", str(run)], work)
    assert r.returncode == 0, r.stderr
    assert [s[2] for s in _steps(run).values()] == [8, 16, 24, 32]  # 4 x 2 images a step throughout
    notes = [e["text"] for e in _events(run) if e["kind"] == "note"]
    assert any("resumed on 2 rank(s) x 2 micro-batch(es) after 1 x 4" in t for t in notes), notes
    state = checkpoint.load_resumable(run / "checkpoints").state
    assert state["ranks"] == 2 and state["global_micro_batches"] == 4 and state["config"]["grad_accum"] == 2


def test_a_count_of_micro_batches_the_ranks_cannot_share_is_refused(work):
    done: list[int] = []
    hooks = Hooks(progress=lambda i: done.append(i["step"]), should_stop=lambda: len(done) >= 1)
    run = _reference(work, "stop3", 3, hooks=hooks, steps=2, save_every=0)
    before = (run / "events.jsonl").read_bytes()
    r = _launch([mpiexec(), "-n", "2", PY, "-m", "toy_cli", "vit", "train", "--resume", str(run)], work)
    assert r.returncode == 2, r.stderr
    assert "error: the run's steps take 3 micro-batches, which 2 ranks cannot share evenly" in r.stderr
    assert "Traceback" not in r.stderr
    assert (run / "events.jsonl").read_bytes() == before  # nothing written


# ---------------------------------------------------------------- ranks that differ


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10)
    return r.returncode == 0


def test_ranks_with_other_images_at_the_same_path_stop_before_writing(work, tmp_path):
    if not _can_mount():  # CI runs as root
        pytest.skip("needs root (a private mount namespace for one rank)")
    other = write_folder(tmp_path / "other", per_class=10, seed=5)  # same names and classes, other pixels
    (other / "a" / "extra.png").write_bytes((other / "a" / "00.png").read_bytes())  # and one image more
    args = ["data", *CLI_ARGS, "--out", "mismatch"]
    rank1 = ["unshare", "-m", "sh", "-c", f'mount --bind {other} {work / "data"} && exec "$@"', "sh"]
    cmd = [mpiexec(), "-n", "1", PY, "-m", "toy_cli", "vit", "train", *args]
    cmd += [":", "-n", "1", *rank1, PY, "-m", "toy_cli", "vit", "train", *args]
    r = _launch(cmd, work)
    assert r.returncode != 0
    line = "error: rank 1 (" + os.uname().nodename + ") sees other images than rank 0"
    assert 1 <= r.stderr.count(line) <= 2, r.stderr  # every rank says it, unless the first one's abort ends it
    assert f"in data {work / 'data'} (file names or sizes differ)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (work / "mismatch").exists() or not any((work / "mismatch").iterdir())


def test_ranks_with_another_config_stop_before_writing(work):
    a = ["data", *CLI_ARGS, "--out", "mismatch2"]
    cmd = [mpiexec(), "-n", "1", PY, "-m", "toy_cli", "vit", "train", *a]
    cmd += [":", "-n", "1", PY, "-m", "toy_cli", "vit", "train", *a, "--lr", "0.002"]
    r = _launch(cmd, work)
    assert r.returncode == 2, r.stderr
    said = "was started with other settings than rank 0: lr 0.002 (rank 0: 0.001)"
    assert 1 <= r.stderr.count("error: rank 1 (") <= 2 and said in r.stderr, r.stderr
    assert not (work / "mismatch2").exists() or not any((work / "mismatch2").iterdir())


def test_ranks_on_different_cpu_variants_are_refused_unless_allowed(work):
    code = "import json, toy_ggml; c = toy_ggml.cpu_variant(); print(json.dumps([c.tag, [(x.tag, x.score) for x in c.candidates]]))"
    env = {k: v for k, v in os.environ.items() if k != "TOY_GGML_CPU_VARIANT"}
    got = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    own, candidates = json.loads(got.stdout)
    others = sorted((score, tag) for tag, score in candidates if score > 0 and tag != own)
    if not others:
        pytest.skip(f"this CPU runs one ggml variant only ({own})")
    other = others[0][1]
    for out, extra in (("cpu-refuse", []), ("cpu-allow", ["--mixed-cpus", "allow"])):
        a = [PY, "-m", "toy_cli", "vit", "train", "data", *CLI_ARGS, "--out", out, *extra]
        cmd = [mpiexec(), "-n", "1", *a, ":", "-n", "1", "env", f"TOY_GGML_CPU_VARIANT={other}", *a]
        r = subprocess.run(
            cmd, cwd=work, env={**env, **_env_vars(work)}, capture_output=True, text=True, timeout=TIMEOUT
        )
        if not extra:
            assert r.returncode == 2, r.stderr
            n = r.stderr.count(f"different ggml CPU variants (rank 0 {own}, rank 1 {other})")
            assert 1 <= n <= 2 and r.stderr.count(f"TOY_GGML_CPU_VARIANT={own} ") == n, r.stderr
            assert not (work / out).exists() or not any((work / out).iterdir())
        else:
            assert r.returncode == 0, r.stderr
            ev = _events(_only_run(work / out))
            assert ev[0]["world"]["cpu_variants"] == [own, other]
            assert any("different ggml CPU variants" in e["text"] for e in ev if e["kind"] == "note")
            assert ev[-1]["reason"] == "completed"


def test_an_invalid_mixed_cpus_value_is_a_config_error():
    with pytest.raises(ViTTrainConfigError, match="mixed_cpus: 'sometimes' is not one of refuse, allow"):
        validate(ViTTrainConfig(data="x", steps=1, mixed_cpus="sometimes"))
    assert validate(ViTTrainConfig(data="x", steps=1, mixed_cpus="allow")).mixed_cpus == "allow"
