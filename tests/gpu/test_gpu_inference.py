"""Inference on the device against the CPU: logits, greedy tokens, batched decode (SmolLM2-135M-Instruct).

The model files: the original Q4_1 and its Q8_0 and F32 conversions made with ``toy quantize``
(``quantize_model``), the three files of toy's llama.cpp parity tests (test_generation_parity.py). The
CPU is the reference: it equals llama.cpp token for token on these files. Both runtimes load the same
file the same way (256-token context, F16 KV cache, no flash attention, 2 CPU threads).

Tolerances. Nothing promises the device's arithmetic to be the CPU's: its kernels sum in another order,
quantize the activations of quantized products their own way (CUDA: Q8_1 blocks; the CPU: Q8_0 or Q8_1)
and cuBLAS computes some F16 products with F16 outputs. The bounds come from the spread between two
CPU builds of the same products, measured on these prompts (toy's AVX2 kernels against its AVX-512 ones,
``TOY_GGML_CPU_VARIANT=haswell`` against ``zen4``): largest |difference| over every logit of every
position 1.9 (Q4_1), 1.1 (Q8_0), 0.023 (F32), root mean square 0.25, 0.20 and 0.0031 (logits run up to
about 40). Allowed on the device (``LOGIT_TOL``): the largest difference 4.0 for the quantized files and
0.25 for F32, the root mean square 0.75 and 0.03: two to ten times that spread; a wrong kernel (a
transposed block, a lost scale) is off by tens. Each test reports the figures it measured.

Run to run on the device: the same prompt gives the same greedy tokens and the same logits, bit for bit
(a second generation and a second prefill in the same process; toy promises this on one device).

Greedy tokens must be the CPU's, except past a near tie (``toy_testsupport.gpu.check_greedy``): the
two CPU builds above already pick differently where the top two logits are 0.04 to 0.7 apart; the
device may part from the CPU where the CPU's gap is at most ``TIE_TOL`` (1.5 quantized, 0.15 F32),
never before.

No CPU fallback: after a decode step and after a prefill on the device, the scheduler ran the graph in
one split (``Runtime.n_splits()``: every node on the device; a node its backend cannot run would go
to the CPU and add splits). test_gpu_train.py asserts the same of a training step.

Batched decode: three prompts of different lengths prefilled into three slots and decoded together,
greedy, 12 steps, on each runtime: the device's tokens against the CPU's (the same rule). Batch
invariance (a sequence's logits the same whether decoded alone or with others) holds bit for bit on the
CPU and is asserted there (the rehearsal); on a GPU it is not promised, and the test only reports the
largest difference between each sequence decoded alone (fed the same tokens) and in the batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import toy
from toy.gguf.convert import parse_target, quantize_model
from toy_testsupport.gpu import check_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.model]

ORIGINAL = "Q4_1"
FILES = ("Q4_1", "Q8_0", "F32")
# (largest |device - cpu| logit, root mean square), per file: see the module docstring
LOGIT_TOL = {"Q4_1": (4.0, 0.75), "Q8_0": (4.0, 0.75), "F32": (0.25, 0.03)}
TIE_TOL = {"Q4_1": 1.5, "Q8_0": 1.5, "F32": 0.15}
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little girl who lived in a village near the forest. One day",
]
NEW_TOKENS = 16
BATCH_STEPS = 12
N_CTX = 256
THREADS = 2


@pytest.fixture(scope="module")
def model_files(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gpu-models")
    files = {ORIGINAL: smollm2_path}
    for t in FILES:
        if t != ORIGINAL:
            files[t] = out / f"smollm2-{t}.gguf"
            quantize_model(smollm2_path, files[t], parse_target(t))
    return files


def _load(path, device: str, **kw):
    return toy.load(path, device=device, n_ctx=N_CTX, threads=THREADS, fetch=False, **kw)


@pytest.mark.parametrize("name", FILES)
def test_logits_and_greedy_tokens_match_the_cpu(model_files, name, gpu_device, report):
    max_tol, rms_tol = LOGIT_TOL[name]
    worst = rms_worst = 0.0
    parted, splits = [], set()
    with _load(model_files[name], "cpu") as cpu, _load(model_files[name], gpu_device.name) as dev:
        assert dev.runtime.device == gpu_device.label  # really on the device under test
        for k, prompt in enumerate(PROMPTS):
            ids = cpu.tokenize(prompt)
            want = cpu.generate(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True).tokens
            got = dev.generate(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True).tokens
            splits.add(("decode", dev.runtime.n_splits()))
            again = dev.generate(ids, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True).tokens
            assert again == got, f"{name} prompt {k}: two greedy runs on the device differ: {got} / {again}"
            # every position of the prompt and of the CPU's continuation, on both runtimes
            seq = ids + want[:-1]
            lc, ld = cpu.logits(seq), dev.logits(seq)
            splits.add(("prefill", dev.runtime.n_splits()))
            assert dev.logits(seq).tobytes() == ld.tobytes(), f"{name} prompt {k}: device logits differ run to run"
            assert lc.shape == ld.shape and np.isfinite(ld).all(), f"prompt {k}: non-finite logits on the device"
            d = np.abs(ld.astype(np.float64) - lc)
            worst, rms_worst = max(worst, float(d.max())), max(rms_worst, float(np.sqrt((d**2).mean())))
            at = check_greedy(got, want, lc[len(ids) - 1 :], TIE_TOL[name], f"{name} prompt {k}")
            if at is not None:
                parted.append((k, at))
    report(f"max |logit - cpu| {name}", worst, "logit", tolerance=max_tol, rms=rms_worst, rms_tolerance=rms_tol)
    report(f"greedy parted at a near tie {name}", len(parted), "prompts", where=parted, tokens=NEW_TOKENS)
    report(f"graph splits {name}", max(n for _, n in splits), "splits", seen=sorted(splits))
    assert {n for _, n in splits} == {1}, f"{name}: graphs split between the device and the CPU: {sorted(splits)}"
    assert worst <= max_tol, f"{name}: largest logit difference {worst:.4g} > {max_tol}"
    assert rms_worst <= rms_tol, f"{name}: root mean square logit difference {rms_worst:.4g} > {rms_tol}"
    if gpu_device.is_cpu:  # the rehearsal: the CPU against itself is exact
        assert worst == 0.0 and not parted


def _decode_together(m, prompts: list[list[int]], steps: int):
    """Greedy: every prompt prefilled into its own slot, then one decode call per step for all; returns
    (tokens per sequence, logits rows per sequence: row i picked token i)."""
    eng = m.engine
    eng.cache.clear()
    rows = [[eng.prefill(s, p)] for s, p in enumerate(prompts)]
    toks = [[int(np.argmax(r[-1]))] for r in rows]
    for _ in range(steps):
        out = eng.decode(list(range(len(prompts))), [t[-1] for t in toks])
        for s in range(len(prompts)):
            rows[s].append(out[s])
            toks[s].append(int(np.argmax(out[s])))
    return toks, [np.array(r) for r in rows]


def _decode_alone(m, prompt: list[int], feed: list[int]) -> np.ndarray:
    """The logits rows of one sequence decoded alone in slot 0, fed ``feed`` (the batch's tokens)."""
    eng = m.engine
    eng.cache.clear()
    rows = [eng.prefill(0, prompt)]
    for t in feed:
        rows.append(eng.decode([0], [t])[0])
    return np.array(rows)


def test_batched_decode_matches_the_cpu(model_files, gpu_device, report):
    path = model_files[ORIGINAL]
    with _load(path, "cpu", n_slot=3) as cpu, _load(path, gpu_device.name, n_slot=3) as dev:
        prompts = [cpu.tokenize(p) for p in PROMPTS]
        assert len({len(p) for p in prompts}) == len(prompts)
        want, want_rows = _decode_together(cpu, prompts, BATCH_STEPS)
        got, got_rows = _decode_together(dev, prompts, BATCH_STEPS)
        parted = []
        for s in range(len(prompts)):
            at = check_greedy(got[s], want[s], want_rows[s], TIE_TOL[ORIGINAL], f"batched sequence {s}")
            if at is not None:
                parted.append((s, at))
        # batch invariance on the device: each sequence alone, fed the tokens it got in the batch
        inv = max(float(np.abs(_decode_alone(dev, p, got[s][:-1]) - got_rows[s]).max()) for s, p in enumerate(prompts))
    report("batched greedy parted at a near tie", len(parted), "sequences", where=parted, steps=BATCH_STEPS)
    report(
        "batch invariance: max |alone - batched| logit",
        inv,
        "logit",
        promised=gpu_device.is_cpu,
        note="asserted 0 on the CPU; reported, not promised, on a GPU",
    )
    if gpu_device.is_cpu:
        assert inv == 0.0 and not parted
