"""toy's inference speed on the inference benchmark (the toy half).

Run as a subprocess by ``test_bench_infer.py`` (its own process, so its peak
RSS is toy's alone); mirrors ``tools/fixtures/bench_infer_peer.py`` (the
llama.cpp half) step for step::

    python packages/toy-core/benchmarks/bench_infer_toy.py --model M.gguf --ids ids.json

``ids.json`` holds the prompts as token ids (``{"prompts": {"128": [...],
"512": [...]}, "short": [...]}``), so tokenization is not measured.

Protocol (stdin/stdout, one JSON object per stdout line): the script loads
the model with ``toy.load(path, n_ctx=..., threads=..., device=...)`` (n_batch 512, F16 KV
cache, no flash attention; ``--device``, default as ``toy.load``'s: the GPU check runs it on a GPU), runs one untimed warm-up of every step below (the
engine builds a compute graph per shape on first use) and prints
``{"ready": true, ...}``. Each ``rep`` line on stdin runs the timed steps once
and prints their figures; ``done`` prints the peak RSS (``VmHWM``) and exits.

What is timed:

- prefill and time to first token, per prompt length: ``m.generate(ids,
  temperature=0, max_tokens=1, ignore_eos=True)``, its ``timings["prefill_s"]``
  (start of the generate call to the prompt's last logits) and
  ``timings["ttft_s"]`` (... to the first sampled token);
- decode: ``m.generate(short, max_tokens=new_tokens)`` greedy with EOS
  ignored: ``decode_s`` is the generate loop's own sum of ``engine.decode``
  calls (feed uploads, one graph compute, logits copied out), ``loop_s`` the
  whole loop after the first token (adds greedy sampling, incremental
  detokenizing, stop-string matching); ``compute_s`` sums the
  ``Runtime.compute`` calls of those decode steps alone (timed by a thin
  wrapper around the runtime for this run; it includes the scheduler's
  re-allocation when the attention length crosses a 32-cell step).

The ready line also says which toy_ggml this process runs (its file, whether
it is a native build, the CPU backend variant loaded and ggml's CPU
features); ``--expect-native DIR`` makes the script fail unless it runs a
native build of toy_ggml imported from under DIR (``build_config.NATIVE``;
or, for ``tools/bench_native.py``'s ``march-native`` fallback, one CPU
backend and no variants) (the native side of the
native-vs-portable benchmark, started with ``python -S`` so the dev venv's
editable loader does not win).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from toy_testsupport.bench_side import vm_hwm_bytes


class _ComputeTimer:
    """Stands in for the engine's runtime during one generate call: times
    each ``compute`` and passes everything else through."""

    def __init__(self, runtime):
        self._runtime = runtime
        self.durations: list[float] = []

    def compute(self, graph) -> None:
        t0 = time.perf_counter()
        self._runtime.compute(graph)
        self.durations.append(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._runtime, name)


class _OpProfiler:
    """Stands in for the engine's runtime during one generate call: computes
    each graph node by node (``Runtime.compute(profile=True)``) and sums the
    seconds per op; a product is named by its weight's type (``MUL_MAT
    Q8_0``), since that is what decides its kernel."""

    def __init__(self, runtime):
        self._runtime = runtime
        self.seconds: dict[str, float] = {}
        self.computes = 0

    def compute(self, graph) -> None:
        types = {}
        for t in graph.nodes:
            if t.op in ("MUL_MAT", "MUL_MAT_ID") and t.sources:
                types[t.name] = t.sources[0].dtype.name
        for op, name, sec in self._runtime.compute(graph, profile=True):
            key = f"{op} {types[name]}" if name in types else op
            self.seconds[key] = self.seconds.get(key, 0.0) + sec
        self.computes += 1

    def __getattr__(self, name):
        return getattr(self._runtime, name)


class ToySide:
    def __init__(
        self, model: str, n_ctx: int, threads: int, device: str | None = None, lora: str | None = None, repack=True
    ):
        import toy

        t0 = time.perf_counter()
        self.m = toy.load(model, n_ctx=n_ctx, threads=threads, device=device, lora=lora, repack=repack)
        self.load_s = time.perf_counter() - t0
        self.version = toy.__version__

    def rep(self, prompts: dict[str, list[int]], short: list[int], n_new: int, warm_up: bool = False) -> dict:
        """One run of every step; ``warm_up``: without the compute timer (the
        engine builds its graphs then, and that needs the real runtime)."""
        m = self.m
        res: dict = {"prefill": {}}
        for n, ids in prompts.items():
            t = m.generate(ids, temperature=0, max_tokens=1, ignore_eos=True).timings
            res["prefill"][n] = {"tokens": len(ids), "prefill_s": t["prefill_s"], "ttft_s": t["ttft_s"]}

        eng = m.engine
        if warm_up:
            m.generate(short, temperature=0, max_tokens=n_new, ignore_eos=True)
            return res
        timer = _ComputeTimer(eng.runtime)
        eng.runtime = timer
        try:
            g = m.generate(short, temperature=0, max_tokens=n_new, ignore_eos=True)
        finally:
            eng.runtime = timer._runtime
        t = g.timings
        steps = t["decode_tokens"]
        computes = timer.durations
        # the short prompt is one prefill micro-batch: one compute, then one per decode step
        assert len(computes) == 1 + steps, (len(computes), steps)
        res["decode"] = {
            "tokens": g.tokens,
            "ttft_s": t["ttft_s"],
            "decode_s": t["decode_s"],
            "decode_steps": steps,
            "loop_s": t["total_s"] - t["ttft_s"],
            "compute_s": sum(computes[1:]),
        }
        return res

    def profile(self, short: list[int], n_new: int) -> dict:
        """Toy's decode step op by op: the prompt's prefill, then ``n_new - 1``
        decode steps computed node by node; seconds per op per decode step (the
        prefill's compute left out by taking the per-op sums of a second run
        without decode steps away)."""
        m = self.m
        eng = m.engine

        def run(n: int) -> _OpProfiler:
            prof = _OpProfiler(eng.runtime)
            eng.runtime = prof
            try:
                m.generate(short, temperature=0, max_tokens=n, ignore_eos=True)
            finally:
                eng.runtime = prof._runtime
            return prof

        full, head = run(n_new), run(1)
        steps = full.computes - head.computes
        ops = {k: (v - head.seconds.get(k, 0.0)) / steps for k, v in full.seconds.items()}
        return {"profile": {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v > 0}, "steps": steps}


def ggml_info(expect_native: str | None) -> dict:
    """Which toy_ggml this process imported, and its CPU backend variant."""
    import toy_ggml

    info = {
        "toy_ggml_file": toy_ggml.__file__,
        "native": toy_ggml.build_config.NATIVE,
        "cpu_variant": toy_ggml.cpu_variant().tag,
        "cpu_variants_built": list(toy_ggml.build_config.CPU_VARIANTS),
        "cpu_features": sorted(k for k, v in toy_ggml.cpu_features().items() if v),
    }
    if expect_native is not None:
        where = os.path.realpath(expect_native)
        here = os.path.realpath(toy_ggml.__file__)
        assert here.startswith(where + os.sep), f"toy_ggml comes from {here}, not from under {where}"
        # tools/bench_native.py's note of how it built this toy_ggml
        marker = os.path.join(os.path.dirname(here), "_bench_native.json")
        info["bench_native"] = json.load(open(marker)) if os.path.isfile(marker) else None
        mode = (info["bench_native"] or {}).get("mode")
        if mode == "march-native":  # -march=native without the meson option (it fails to build)
            assert toy_ggml.build_config.CPU_VARIANTS == (), toy_ggml.build_config.CPU_VARIANTS
        else:
            assert toy_ggml.build_config.NATIVE is True, f"not a native toy_ggml: {here}"
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--ids", required=True, help="JSON file with the prompt token ids")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", help="a device toy_ggml lists, or cpu (default: TOY_DEVICE, else auto)")
    ap.add_argument("--expect-native", metavar="DIR", help="fail unless toy_ggml is a native build from under DIR")
    ap.add_argument("--lora", help="a LoRA adapter GGUF applied at scale 1")
    ap.add_argument(
        "--repack", choices=("on", "off", "all"), default="on", help="toy.load's repack: True, False or 'all'"
    )
    args = ap.parse_args()
    ggml = ggml_info(args.expect_native)

    with open(args.ids) as f:
        spec = json.load(f)
    prompts, short = spec["prompts"], spec["short"]

    side = ToySide(
        args.model,
        args.n_ctx,
        args.threads,
        args.device,
        args.lora,
        {"on": True, "off": False}.get(args.repack, args.repack),
    )
    side.rep(prompts, short, args.new_tokens, warm_up=True)  # warm-up: builds every graph the reps use
    eng = side.m.engine
    builds = eng.stats.graph_builds
    ready = {
        "ready": True,
        "toy": f"toy {side.version}",
        "load_s": side.load_s,
        "threads": side.m.runtime.threads,
        "device": side.m.runtime.device,
        "n_ctx": side.m.n_ctx,
        "kv_bytes": eng.cache.nbytes,
        "graphs": builds,
        "ggml": ggml,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "rep":
            print(json.dumps(side.rep(prompts, short, args.new_tokens)), flush=True)
        elif cmd == "profile":
            print(json.dumps(side.profile(short, args.new_tokens)), flush=True)
        elif cmd == "done":
            break
    done = {"done": True, "vm_hwm_bytes": vm_hwm_bytes(), "graph_builds_in_reps": eng.stats.graph_builds - builds}
    side.m.close()
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
