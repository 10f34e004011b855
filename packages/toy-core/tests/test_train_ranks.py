"""Data-parallel training's contract, recipe by recipe: N ranks with one
micro-batch each (``mpiexec -n N toy train ... --grad-accum 1``) train bit for
bit like one process accumulating N micro-batches (``toy train ...
--grad-accum N``), the independent reference. Compared for every step: the
loss and gradient norm; every eval loss; every checkpoint, byte for byte once
the run id is swapped (``toy_testsupport.ranks``), and the tensors of its
training state (parameters' AdamW moments; its metadata records the run's
shape, so it differs).

Recipes, with N = 2 and 3, on a tiny llama made here (d_model 32, 2 blocks, a
300-token BPE) unless said: from-scratch llama and gpt2, LoRA on the F32 base,
QLoRA on its Q8_0 copy, full fine-tune (on the tiny base: on the real 135M
model 2 steps took 34 s and 6.2 GB of RSS in one process, and every rank holds
the F32 weights), warm-start; QLoRA on the real SmolLM2-135M Q4_1 file with
N = 2 (``model``; ~20 s a run on 2 cores: N = 3 adds nothing the tiny runs do
not check).

Also: a 2-rank run equals itself run again; resume (a run ended early, then
``--resume --steps K`` with a constant schedule, so the early end changes no
learning rate) on 2 ranks and on one process ends with the uninterrupted run's
bytes, and so does a 2-rank run stopped by SIGTERM to ``mpiexec`` and resumed
on 2 ranks; resuming a run of 2 micro-batches a step on 3 ranks is an error that
writes nothing; a run of 2 ranks x 2 micro-batches resumed on one process
records the note that its bits differ. ZeRO-1, at the engine: the AdamW
moments a rank holds are its own tensors' only (figures in
``test_optimizer_state_is_sharded``).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from toy_testsupport import ranks as R
from toy_testsupport.signals import step_events
from toy_testsupport.train_helpers import python_docs_corpus

STEPS = 4
RUN = ["--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "2", "--save-every", "2"]
SHAPE = ["--d-model", "32", "--layers", "2", "--heads", "4", "--ffn", "64"]
ENV = {"TOY_DEVICE": "cpu", "TOY_COMM_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A corpus, a tiny llama trained on it (F32; its tokenizer serves the
    from-scratch runs), its Q8_0 copy and JSONL examples from the corpus."""
    from toy.gguf import quantize_model

    w = tmp_path_factory.mktemp("ranks")
    (w / "home").mkdir()
    ENV["TOY_HOME"] = str(w / "home")
    corpus = python_docs_corpus(w, 8)["small"]
    (w / "corpus").symlink_to(corpus)
    args = ["train", "from-scratch", "corpus", *SHAPE, "--kv-heads", "2", "--vocab-size", "300"]
    run = R.train([*args, *RUN, "--steps", "3", "--out", "base-run"], cwd=w, env=ENV)
    (w / "base.gguf").write_bytes(R.checkpoints(run)[-1].read_bytes())
    quantize_model(w / "base.gguf", w / "base-q8_0.gguf", "q8_0")
    rows = []
    for i, p in enumerate(sorted(corpus.iterdir())):
        paras = [x.strip() for x in p.read_text().split("\n\n") if x.strip()]
        for j, x in enumerate(paras[:8]):
            head, tail = x[:60], x[60:200]
            rows.append({"text": x[:200]} if (i + j) % 3 else {"prompt": head, "completion": tail or " ok"})
    (w / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return w


def recipe_args(recipe: str, base: str = "base.gguf") -> list[str]:
    """The ``toy train`` arguments of a recipe (the run's shape comes after)."""
    lora = ["--rank", "4", "--targets", "q,v,down"]
    return {
        "llama": ["train", "from-scratch", "corpus", *SHAPE, "--kv-heads", "2", "--tokenizer", "base.gguf"],
        "gpt2": ["train", "from-scratch", "corpus", "--arch", "gpt2", *SHAPE, "--tokenizer", "base.gguf"],
        "lora": ["train", "lora", "data.jsonl", "-m", base, *lora],
        "qlora": ["train", "lora", "data.jsonl", "-m", "base-q8_0.gguf", *lora],
        "full": ["train", "full", "data.jsonl", "-m", base, "--lr", "1e-3"],
        "warm-start": ["train", "warm-start", "corpus", "-m", base, *SHAPE, "--layers", "1", "--kv-heads", "2"],
    }[recipe]


_runs: dict[tuple, Path] = {}


def run_once(work: Path, recipe: str, ranks: int, accum: int, *extra: str, steps: int = STEPS) -> Path:
    """A run (made once per module and arguments): ``ranks`` processes with
    ``accum`` micro-batches each."""
    key = (recipe, ranks, accum, extra, steps)
    if key not in _runs:
        out = f"runs-{recipe}-{ranks}x{accum}-{len(_runs)}"
        args = [*recipe_args(recipe), *RUN, "--steps", str(steps), "--grad-accum", str(accum), *extra]
        _runs[key] = R.train([*args, "--out", out], ranks, cwd=work, env=ENV)
    return _runs[key]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("recipe", ["llama", "gpt2", "lora", "qlora", "full", "warm-start"])
def test_ranks_train_like_one_process_accumulating(work, recipe, n):
    ranked = run_once(work, recipe, n, 1)
    one = run_once(work, recipe, 1, n)
    R.assert_same_run(ranked, one, steps=STEPS)
    start = R.events(ranked)[0]
    assert start["kind"] == "run_start" and start["world"]["size"] == n and start["world"]["zero"] == 1  # ZeRO stage 1
    assert "world" not in R.events(one)[0]
    steps = [e for e in R.events(ranked) if e["kind"] == "step"]
    assert all(e["sent_bytes"] > 0 and e["rank_s_max"] >= e["rank_s_min"] >= 0 for e in steps)


@pytest.mark.model
@pytest.mark.slow
def test_qlora_on_the_real_model_on_two_ranks(work, smollm2_path):
    args = ["train", "lora", "data.jsonl", "-m", str(smollm2_path), "--rank", "4", "--targets", "q,v"]
    args += ["--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0", "--save-every", "2"]
    args += ["--steps", "2", "--max-length", "33"]
    ranked = R.train([*args, "--grad-accum", "1", "--out", "smol-2"], 2, cwd=work, env=ENV, timeout=400)
    one = R.train([*args, "--grad-accum", "2", "--out", "smol-1"], cwd=work, env=ENV, timeout=400)
    R.assert_same_run(ranked, one, steps=2)
    assert R.events(ranked)[0]["base"]["weight_types"] == ["Q4_1"]


def test_a_two_rank_run_equals_itself(work):
    first = run_once(work, "llama", 2, 1)
    again = R.train([*recipe_args("llama"), *RUN, "--steps", str(STEPS), "--out", "again"], 2, cwd=work, env=ENV)
    R.assert_same_run(again, first, steps=STEPS)


# ------------------------------------------------------------------ resume

CONSTANT = ("--schedule", "constant", "--warmup", "0")


def cut_run(work: Path, out: str, ranks: int = 2, accum: int = 1, steps: int = 2) -> Path:
    args = [*recipe_args("llama"), *RUN, *CONSTANT, "--grad-accum", str(accum), "--steps", str(steps)]
    return R.train([*args, "--out", out], ranks, cwd=work, env=ENV)


def resume(work: Path, run_dir: Path, ranks: int, steps: int = STEPS):
    return R.toy(["train", "--resume", str(run_dir), "--steps", str(steps), "--json", "-q"], ranks, cwd=work, env=ENV)


def notes(run_dir: Path) -> list[str]:
    return [e["text"] for e in R.events(run_dir) if e["kind"] == "note"]


@pytest.mark.parametrize("ranks", [2, 1])
def test_resume_on_two_ranks_or_one_process_ends_with_the_same_bytes(work, ranks):
    straight = run_once(work, "llama", 2, 1, *CONSTANT)
    part = cut_run(work, f"cut-{ranks}")
    assert sorted(R.step_records(part)) == [1, 2]
    r = resume(work, part, ranks)
    assert r.returncode == 0, r.stderr
    R.assert_same_run(part, straight, steps=STEPS)
    assert not [x for x in notes(part) if "bits differ" in x]  # 2 x 1 and 1 x 2: one left fold either way


def test_resume_on_ranks_that_cannot_share_the_micro_batches_writes_nothing(work):
    part = cut_run(work, "cut-3")
    before = {p.name: p.read_bytes() for p in [part / "events.jsonl", *sorted((part / "checkpoints").iterdir())]}
    r = resume(work, part, 3)
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert err and "2 micro-batches" in err[0] and "3 ranks" in err[0], r.stderr
    assert "hint:" in r.stderr
    after = {p.name: p.read_bytes() for p in [part / "events.jsonl", *sorted((part / "checkpoints").iterdir())]}
    assert after == before


def test_resume_that_changes_the_summation_order_says_so(work):
    part = cut_run(work, "cut-accum", ranks=2, accum=2, steps=2)
    r = resume(work, part, 1, steps=3)
    assert r.returncode == 0, r.stderr
    assert sorted(R.step_records(part)) == [1, 2, 3]
    (note,) = [x for x in notes(part) if "bits differ" in x]
    assert "1 rank(s) x 4" in note and "2 x 2" in note


# ------------------------------------------------------------------ ZeRO-1

_ENGINE = r"""
import json, sys
import numpy as np
from toy.gguf import GGUFFile
from toy.models.llama import LlamaConfig
from toy.train.distributed import World
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport.reference.llama_np import load_weights
import toy_ggml

with GGUFFile(sys.argv[1]) as gf:
    cfg = LlamaConfig.from_gguf(gf)
    w = {k: v.astype(np.float32) for k, v in load_weights(gf).items()}
world = World.from_env()
rt = toy_ggml.Runtime("cpu", threads=1)
eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=1, context=8, world=world)
sizes = {s.name: int(np.prod(s.shape)) for s in eng.specs}
mine = world.allgather({"bytes": eng.optimizer_bytes(), "owned": sorted(eng.owned)})
if world.is_root:
    print(json.dumps({"ranks": mine, "sizes": sizes}))
eng.close()
rt.close()
"""


def test_optimizer_state_is_sharded(work, tmp_path):
    """Each rank keeps the AdamW moments (2 x 4 bytes an element) of the
    tensors it owns, and nothing else: together the one-process figure,
    each share within the largest tensor's (32,768 bytes) of 1/N. Measured on
    a 64-wide 4-block tiny llama (``toy_testsupport.tiny_llama``, 39 tensors):
    one process 758,272 bytes; 2 ranks 378,880 + 379,392; 3 ranks 255,488 +
    247,296 + 255,488."""
    from toy_testsupport.tiny_llama import VARIANTS, write_tiny

    model = write_tiny(tmp_path / "tiny.gguf", **{**VARIANTS["gqa_untied"], "d": 64, "head_dim": 16, "n_layer": 4})
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE)
    figures = {}
    for n in (1, 2, 3):
        r = R.run([sys.executable, str(script), str(model)], n, cwd=tmp_path, env=ENV, timeout=120)
        assert r.returncode == 0, r.stderr
        figures[n] = json.loads(r.stdout.strip().splitlines()[-1])
    sizes = figures[1]["sizes"]
    whole = 8 * sum(sizes.values())
    assert figures[1]["ranks"][0]["bytes"] == whole
    biggest = 8 * max(sizes.values())
    for n in (2, 3):
        shares = figures[n]["ranks"]
        owned = [set(s["owned"]) for s in shares]
        assert set().union(*owned) == set(sizes) and sum(len(o) for o in owned) == len(sizes)  # each tensor once
        for s in shares:
            assert s["bytes"] == 8 * sum(sizes[k] for k in s["owned"])  # the owned tensors' moments, nothing more
            assert abs(s["bytes"] - whole / n) <= biggest
        assert sum(s["bytes"] for s in shares) == whole


@pytest.mark.slow
def test_resume_after_sigterm_to_mpiexec_ends_with_the_same_bytes(work):
    """SIGTERM to ``mpiexec`` mid-run (what a scheduler sends): hydra passes it
    to the ranks, they agree to stop after the same step and rank 0 saves;
    ``--resume`` on 2 ranks then ends like the uninterrupted run."""
    args = [*recipe_args("llama"), "--batch-size", "2", "--context", "32", "--threads", "1", "--eval-every", "0"]
    args += [*CONSTANT, "--save-every", "4", "--steps", "60"]
    straight = R.train([*args, "--out", "term-straight"], 2, cwd=work, env=ENV)
    p = R.start(R.toy_argv([*args, "--out", "term-cut", "--json", "-q"]), 2, cwd=work, env=ENV)
    try:
        end = time.monotonic() + 90
        while not (runs := list((work / "term-cut").glob("train-*"))) or step_events(runs[0]) < 5:
            assert p.poll() is None and time.monotonic() < end, "the run ended or took too long before step 5"
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        R.kill_group(p)
    (cut,) = runs
    last = R.events(cut)[-1]
    assert last["kind"] == "run_end" and last["reason"] == "interrupted" and 5 <= last["final_step"] < 60, last
    assert R.checkpoints(cut)[-1].name == f"step_{last['final_step']}.gguf"  # saved where it stopped
    r = resume(work, cut, 2, steps=60)
    assert r.returncode == 0, r.stderr
    assert R.step_records(cut) == R.step_records(straight)
    a, b = R.checkpoints(cut)[-1], R.checkpoints(straight)[-1]
    assert a.name == b.name == "step_60.gguf"
    R.assert_same_model_file(a, b)
    R.assert_same_state_tensors(a, b)
