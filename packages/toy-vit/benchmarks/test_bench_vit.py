"""ViT speed and memory: toy-vit side by side with PyTorch
(``transformers.ViTForImageClassification``, float32) on the same weights,
in the same run, same threads (2, or ``$TOY_BENCH_THREADS``).

The models: for each preset (``vit-tiny``: 224 px, patches of 16, width
192, 12 layers, 3 heads, 1000 classes; ``vit-small32``: 32 px, patches of
4, width 192, 6 layers, 10 classes) a seeded random Hugging Face model
(``torch.manual_seed(0)``, Hugging Face's own initialisation) is saved with
``save_pretrained`` and converted with ``toy_vit.convert.convert_hf``
(``bench_vit_side.py prepare``, once per preset per session): toy loads the
GGUF, PyTorch the folder.

Every side is a process of its own (``bench_vit_side.py``, the protocol of
toy-core's ``bench_side.Side``), so its peak RSS is its own; per shape the
toy side is started and warmed up, then the torch side, then ``ROUNDS`` (2)
rounds of ``K / ROUNDS`` timed calls alternate (toy, torch, toy, torch;
``bench_side.alternate``) after a 0.5 s pause each, so both see the same
machine noise. A figure is the median over a side's K timings.

Inference (``test_infer``, ``INFER_SHAPES``): ``toy_vit.load(gguf,
threads=N).logits(pixels)`` against ``model(pixel_values=...).logits``
under ``torch.inference_mode()`` with SDPA attention and
``torch.set_num_threads(N)``, the same seeded (B, C, H, W) pixels on every
call. Figures: images/s at B=32 (ratio toy / torch, target >= 1) and the
latency of one image at B=1 (ms; ratio toy / torch, target <= 1). The
sides' warm-up logits are compared (``logits_max_abs_diff``, asserted
``<= LOGITS_ATOL``: both sides compute the same model). toy's time is split
into ggml's compute and the rest (patchify, upload, read-back).

Training (``test_train``, ``TRAIN_SHAPES``): toy's ``TrainEngine`` with
``toy_vit.train.ViTTrainModel`` (AdamW lr 1e-3, betas (0.9, 0.95), weight
decay 0.1 on the matrices, global-norm clip 1.0; one graph a step)
against the Hugging Face model in train mode with ``F.cross_entropy``,
``clip_grad_norm_(..., 1.0)`` and ``torch.optim.AdamW(fused=True)`` with
the same hyper-parameters and decay groups, B=32, the same seeded batch
per step (random pixels and labels). The first warm-up losses (same weights,
same batch, before any update) are asserted equal within ``LOSS_RTOL``;
the records carry both sides' last losses too. Figures: step time (ms;
ratio toy / torch, target <= 1), training images/s, and peak RSS growth
(``VmHWM`` minus the RSS after the imports; target toy <= torch), with
toy's split (ggml compute, scheduler allocation, upload and Python),
torch's (forward + loss, backward, clip, optimizer), the step graph's size
and its most frequent ops, and each side's minor page faults per step.

Note on the work each side does: toy's graph runs the last block's MLP and
the final LayerNorm on the class rows only (the rest do not reach the
logits); Hugging Face computes them for every token. The same function;
the saving is toy's.

Every record carries the threads, the shapes, the 1-minute load average
before and after the timed rounds (and all three at the end), the CPU
model and toy's CPU variant. ``TOY_BENCH_QUICK=1`` times fewer calls and
steps (measured: 111 s on 2 lightly loaded cores, load average 0.5-1.2;
the full run adds about a minute of timed work). A missed target does not
fail the benchmark; an error or a disagreement does.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport.bench_side import Side, alternate

pytestmark = pytest.mark.bench

HERE = Path(__file__).resolve().parent
SIDE_SCRIPT = HERE / "bench_vit_side.py"
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
QUICK = os.environ.get("TOY_BENCH_QUICK", "") not in ("", "0")
ROUNDS = 2  # toy, torch, toy, torch
SETTLE_S = 0.5
SIDE_TIMEOUT_S = 1800
PREPARE_TIMEOUT_S = 600
LOGITS_ATOL = 1e-3  # toy vs torch logits (float32; measured ~1e-6)
LOSS_RTOL = 1e-4  # first training losses, toy vs torch

# (preset, batch, timed calls per side)
INFER_SHAPES = [
    ("vit-tiny", 32, 4 if QUICK else 10),
    ("vit-tiny", 1, 10 if QUICK else 40),
    ("vit-small32", 32, 10 if QUICK else 30),
    ("vit-small32", 1, 20 if QUICK else 60),
]
# (preset, batch, timed steps per side)
TRAIN_SHAPES = [
    ("vit-small32", 32, 6 if QUICK else 20),
    ("vit-tiny", 32, 4 if QUICK else 10),
]


# ---------------------------------------------------------------- set-up


def side_env() -> dict:
    """A side's environment: BLAS/OpenMP pools sized to the benchmark's threads, offline Hugging Face."""
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(THREADS)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


@pytest.fixture(scope="session")
def vit_models(tmp_path_factory):
    """preset -> folder with ``hf/`` (the seeded random HF model) and ``model.gguf`` (its conversion)."""
    made: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in made:
            d = tmp_path_factory.mktemp(f"vit-{preset}")
            r = subprocess.run(
                [sys.executable, str(SIDE_SCRIPT), "prepare", "--preset", preset, "--dir", str(d)],
                capture_output=True,
                text=True,
                timeout=PREPARE_TIMEOUT_S,
                env=side_env(),
            )
            if r.returncode != 0:
                raise RuntimeError(f"prepare {preset} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
            made[preset] = d
        return made[preset]

    return get


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_variant() -> str | None:
    try:
        import toy_ggml

        return toy_ggml.cpu_variant().tag
    except Exception:  # noqa: BLE001 - informational only
        return None


def run_sides(mode: str, preset: str, batch: int, k: int, folder: Path, logdir: Path) -> dict:
    args = ["--mode", mode, "--preset", preset, "--dir", str(folder), "--batch", str(batch)]
    args += ["--threads", str(THREADS)]
    per_round = [k // ROUNDS + (1 if r < k % ROUNDS else 0) for r in range(ROUNDS)]
    sides: dict[str, Side] = {}
    out: dict = {"ready": {}, "runs": {}, "done": {}}
    try:
        for name in ("toy", "torch"):  # one after the other: the warm-ups do not overlap
            sides[name] = Side(
                name,
                [sys.executable, str(SIDE_SCRIPT), "--side", name, *args],
                logdir,
                timeout_s=SIDE_TIMEOUT_S,
                env=side_env(),
            )
            out["ready"][name] = sides[name].read()
        alternate(sides, per_round, SETTLE_S, out)
    finally:
        for side in sides.values():
            side.close()
    return out


def _collect(runs: list[dict]) -> tuple[list[float], list[float], dict[str, float], float]:
    """A side's timings, losses, median split (ms) and median minor page faults per call."""
    times = [t for r in runs for t in r["times"]]
    losses = [v for r in runs for v in r["losses"]]
    keys = runs[0]["splits"][0].keys()
    split = {f"{key}_ms": 1e3 * statistics.median([s[key] for r in runs for s in r["splits"]]) for key in keys}
    faults = statistics.median([f for r in runs for f in r["page_faults"]])
    return times, losses, split, faults


def _context(res: dict, preset: str, batch: int, k: int, folder: Path) -> dict:
    from toy_vit.config import ViTConfig
    from toy_vit.model import n_params

    cfg = ViTConfig.preset(preset)
    return {
        "threads": THREADS,
        "preset": preset,
        "batch": batch,
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "tokens_per_image": cfg.n_tokens,
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "d_ff": cfg.d_ff,
        "n_classes": cfg.n_classes,
        "n_params": n_params(cfg),
        "timed": k,
        "rounds": ROUNDS,
        "quick": QUICK,
        "loadavg_1m": [res["loadavg_before"], res["loadavg_after"]],
        "loadavg_end": list(os.getloadavg()),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "toy_cpu_variant": cpu_variant(),
    }


def _growth(d: dict) -> int:
    return d["peak"] - d["rss_start"]


def _steps_growth(d: dict) -> int | None:
    return d["steps_peak"] - d["rss_start"] if d["steps_peak"] is not None else None


# ---------------------------------------------------------------- inference


@pytest.mark.parametrize("preset,batch,k", INFER_SHAPES, ids=[f"{p}-B{b}" for p, b, _ in INFER_SHAPES])
def test_infer(record, vit_models, tmp_path, preset, batch, k):
    folder = vit_models(preset)
    res = run_sides("infer", preset, batch, k, folder, tmp_path)
    ready, done = res["ready"], res["done"]
    toy_logits = np.load(folder / f"toy-infer-B{batch}.npy")
    torch_logits = np.load(folder / f"torch-infer-B{batch}.npy")
    assert toy_logits.shape == torch_logits.shape, (toy_logits.shape, torch_logits.shape)
    diff = float(np.abs(toy_logits.astype(np.float64) - torch_logits).max())
    assert diff <= LOGITS_ATOL, f"toy and torch logits differ by {diff:.3g}: not the same model"

    toy_t, _, toy_split, toy_faults = _collect(res["runs"]["toy"])
    torch_t, _, torch_split, torch_faults = _collect(res["runs"]["torch"])
    toy_ms, torch_ms = 1e3 * statistics.median(toy_t), 1e3 * statistics.median(torch_t)
    toy_ips, torch_ips = 1e3 * batch / toy_ms, 1e3 * batch / torch_ms
    peer = f"PyTorch {ready['torch']['version']} (transformers ViTForImageClassification, float32, {ready['torch']['attn_implementation']})"
    common = dict(
        **_context(res, preset, batch, k, folder),
        peer=peer,
        toy_ms_per_call=toy_ms,
        torch_ms_per_call=torch_ms,
        toy_images_per_s=toy_ips,
        torch_images_per_s=torch_ips,
        logits_max_abs_diff=diff,
        logits_max_abs=float(np.abs(torch_logits).max()),
        toy_split_ms=toy_split,
        toy_page_faults_per_call=toy_faults,
        torch_page_faults_per_call=torch_faults,
        toy_runs_ms=[1e3 * t for t in toy_t],
        torch_runs_ms=[1e3 * t for t in torch_t],
        toy_graph_nodes=ready["toy"].get("graph_nodes"),
        toy_graph_top_ops=ready["toy"].get("graph_top_ops"),
        toy_rss_growth=_growth(done["toy"]),
        torch_rss_growth=_growth(done["torch"]),
        toy_setup_s=ready["toy"]["setup_s"],
        torch_setup_s=ready["torch"]["setup_s"],
    )
    if batch == 1:
        record(
            "vit",
            figure=f"inference latency, {preset}, B=1",
            value=toy_ms,
            unit="ms",
            peer_value=torch_ms,
            ratio=toy_ms / torch_ms,
            better="lower",
            target="toy / torch <= 1.0",
            met=toy_ms / torch_ms <= 1.0,
            **common,
        )
    else:
        record(
            "vit",
            figure=f"inference images/s, {preset}, B={batch}",
            value=toy_ips,
            unit="images/s",
            peer_value=torch_ips,
            ratio=toy_ips / torch_ips,
            better="higher",
            target="toy / torch >= 1.0",
            met=toy_ips / torch_ips >= 1.0,
            **common,
        )


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("preset,batch,k", TRAIN_SHAPES, ids=[f"{p}-B{b}" for p, b, _ in TRAIN_SHAPES])
def test_train(record, vit_models, tmp_path, preset, batch, k):
    folder = vit_models(preset)
    res = run_sides("train", preset, batch, k, folder, tmp_path)
    ready, done = res["ready"], res["done"]
    n_params = ready["toy"]["n_params"]
    assert n_params == ready["torch"]["n_params"], (n_params, ready["torch"]["n_params"])
    first = {side: ready[side]["warmup_losses"][0] for side in ("toy", "torch")}
    assert first["toy"] == pytest.approx(first["torch"], rel=LOSS_RTOL), first  # the same model and batch

    toy_t, toy_loss, toy_split, toy_faults = _collect(res["runs"]["toy"])
    torch_t, torch_loss, torch_split, torch_faults = _collect(res["runs"]["torch"])
    toy_ms, torch_ms = 1e3 * statistics.median(toy_t), 1e3 * statistics.median(torch_t)
    peer = (
        f"PyTorch {ready['torch']['version']} (transformers ViTForImageClassification, float32, "
        f"{ready['torch']['attn_implementation']}, fused AdamW)"
    )
    context = dict(**_context(res, preset, batch, k, folder), warmup_steps=len(ready["toy"]["warmup_losses"]))
    shape = f"{preset}, B={batch}"
    record(
        "vit",
        figure=f"train step time, {shape}",
        value=toy_ms,
        unit="ms",
        **context,
        peer=peer,
        peer_value=torch_ms,
        ratio=toy_ms / torch_ms,
        better="lower",
        target="toy / torch <= 1.0",
        met=toy_ms / torch_ms <= 1.0,
        toy_split_ms=toy_split,
        torch_split_ms=torch_split,
        toy_page_faults_per_step=toy_faults,
        torch_page_faults_per_step=torch_faults,
        toy_runs_ms=[1e3 * t for t in toy_t],
        torch_runs_ms=[1e3 * t for t in torch_t],
        toy_setup_s=ready["toy"]["setup_s"],
        torch_setup_s=ready["torch"]["setup_s"],
        toy_warmup_s=ready["toy"]["warmup_s"],
        torch_warmup_s=ready["torch"]["warmup_s"],
        loss_first=first,
        loss_first_rel_diff=abs(first["toy"] - first["torch"]) / abs(first["torch"]),
        loss_last={"toy": toy_loss[-1], "torch": torch_loss[-1]},
        toy_graph_nodes=ready["toy"].get("graph_nodes"),
        toy_graph_top_ops=ready["toy"].get("graph_top_ops"),
    )
    toy_ips, torch_ips = 1e3 * batch / toy_ms, 1e3 * batch / torch_ms
    record(
        "vit",
        figure=f"training images/s, {shape}",
        value=toy_ips,
        unit="images/s",
        **context,
        peer=peer,
        peer_value=torch_ips,
        ratio=toy_ips / torch_ips,
        better="higher",
    )
    toy_rss, torch_rss = _growth(done["toy"]), _growth(done["torch"])
    record(
        "vit",
        figure=f"training peak RSS growth, {shape}",
        value=toy_rss,
        unit="bytes",
        **context,
        peer=peer,
        peer_value=torch_rss,
        ratio=toy_rss / torch_rss if torch_rss > 0 else None,
        better="lower",
        target="toy <= torch",
        met=toy_rss <= torch_rss,
        f32_params_bytes=4 * n_params,
        toy_steps_peak_growth=_steps_growth(done["toy"]),
        torch_steps_peak_growth=_steps_growth(done["torch"]),
        toy_peak=done["toy"]["peak"],
        torch_peak=done["torch"]["peak"],
        toy_rss_start=done["toy"]["rss_start"],
        torch_rss_start=done["torch"]["rss_start"],
        note="growth: the process's peak (VmHWM) minus its RSS after the imports; steps_peak_growth: the peak "
        "over the timed steps alone (VmHWM reset after the warm-up) minus the same start",
    )
