"""A model split across two hosts with ggml RPC (issue 35): what decode speed
does splitting SmolLM2 cost, and how many bytes cross the network per token?
Splitting is for a model that does not fit one machine's memory; these
figures let a user judge what the link must carry and what it costs in speed.

Set-up. As root (where ``toy_testsupport.netns`` can make namespaces), two
namespace hosts on a bridge: host 1 runs ``toy rpc-server --host <its
address> --allow-remote --threads 1`` pinned to core 1 (``taskset -c 1``),
host 0 the client, pinned to core 0 with one thread. Elsewhere both run on
loopback in this namespace (same pinning; ``--host 127.0.0.1``), and so
with ``$TOY_BENCH_RPC_LOOPBACK=1``. The client
is this file run as a script (``python test_bench_rpc.py --client ...``): it
loads the model with ``toy.load(path, threads=1, n_ctx=512, rpc=[endpoint])``
(layers split by free memory, the default, or by
``$TOY_BENCH_RPC_SPLIT``, e.g. ``1,1``, given as ``tensor_split``) and
measures; then the same script without ``rpc`` is the one-host reference,
same core, same thread count, so both columns run the same kernels on the
same silicon and differ only by the split. A layer split runs the layers one
device after the other (a pipeline of two stages for one sequence): it
cannot be faster than one host, only show what the crossing costs.

What the client measures, after an untimed warm-up generation: for each of
``$TOY_BENCH_RPC_REPS`` (3) prompts (16 tokens each, their own first word),
greedy generation of 1 token and then of ``$TOY_BENCH_RPC_TOKENS`` (64)
tokens with end of generation ignored. Decode tokens/s is the generate
loop's own ``decode_tokens / decode_s`` (its timings: the engine's decode
calls after the first token, so the prompt's prefill is not in it), the
median over the prompts. Bytes moved: the client's namespace counters in
``/proc/self/net/dev`` (every interface but ``lo`` as a host, sent and
received separately: the link's traffic, TCP/IP headers included) read
around each generation; bytes per decode token = (bytes of the N-token
generation - bytes of the 1-token one) / (N - 1), which removes the
prompt's prefill and the per-request fixed cost. On loopback the counters
are ``lo``'s, shared with every other process of the machine using
loopback: an upper bound, recorded as such, with both directions counted as
sent. The greedy tokens of the split
run must equal the one-host run's (the same CPU kernels on both devices).

sglang-router plays no part here; the RPC backend must be in the toy_ggml
build (``toy_ggml.rpc_available()``), else the benchmark fails saying so.
About 1 minute on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.model]

TOKENS = int(os.environ.get("TOY_BENCH_RPC_TOKENS", "64"))
REPS = int(os.environ.get("TOY_BENCH_RPC_REPS", "3"))
SPLIT = os.environ.get("TOY_BENCH_RPC_SPLIT") or None
LOOPBACK = os.environ.get("TOY_BENCH_RPC_LOOPBACK") == "1"  # loopback even where namespaces could be made
PROMPT_TOKENS = 16
N_CTX = 512
PORT = 50052
START_TIMEOUT_S = 120
CLIENT_TIMEOUT_S = 600
OPENERS = ("Yesterday", "Tomorrow", "Meanwhile", "Elsewhere", "Nearby", "Outside", "Upstairs", "Later", "Soon")
STORY = (
    "the ferry left the harbour a little after six, its deck crowded with cyclists, schoolchildren and a "
    "man carrying a crate of live lobsters, and the gulls followed it out past the breakwater."
)


# ---------------------------------------------------------------- the client (run as a script)


def net_bytes(loopback: bool) -> dict[str, int]:
    """Bytes sent and received by this network namespace's interfaces (``lo`` only when ``loopback``,
    every other one otherwise), from /proc/self/net/dev. On ``lo`` every byte is both sent and received:
    its traffic, both directions, is counted once, as sent."""
    sent = received = 0
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if (name.strip() == "lo") != loopback:
                continue
            cols = rest.split()
            received += int(cols[0])
            sent += int(cols[8])
    return {"sent": sent, "received": 0 if loopback else received}


def client(args: argparse.Namespace) -> dict:
    import toy

    kw: dict = {"threads": 1, "n_ctx": N_CTX}
    if args.rpc:
        kw["rpc"] = [args.rpc]
        if args.split:
            kw["tensor_split"] = [float(x) for x in args.split.split(",")]
    t0 = time.perf_counter()
    m = toy.load(args.model, **kw)
    load_s = time.perf_counter() - t0
    try:
        tok = m.tokenizer
        prompts = []
        for word in OPENERS[: args.reps + 1]:
            prompts.append(tok.encode(f"{word} {STORY}")[:PROMPT_TOKENS])
        gen = {"temperature": 0, "ignore_eos": True}
        m.generate(prompts[-1], max_tokens=args.tokens, **gen)  # warm-up: builds the graphs, fills the buffers
        runs = []
        for ids in prompts[: args.reps]:
            b0 = net_bytes(args.loopback)
            one = m.generate(ids, max_tokens=1, **gen)
            b1 = net_bytes(args.loopback)
            many = m.generate(ids, max_tokens=args.tokens, **gen)
            b2 = net_bytes(args.loopback)
            t = many.timings
            runs.append(
                {
                    "tokens": many.tokens,
                    "first_token": one.tokens,
                    "decode_tokens": t["decode_tokens"],
                    "decode_s": t["decode_s"],
                    "ttft_s": t["ttft_s"],
                    "bytes_1": {k: b1[k] - b0[k] for k in b0},
                    "bytes_n": {k: b2[k] - b1[k] for k in b1},
                }
            )
        describe = m.describe() if hasattr(m, "describe") else None
    finally:
        m.close()
    return {"load_s": load_s, "runs": runs, "placement": describe}


def main() -> None:
    ap = argparse.ArgumentParser(description="the client side of test_bench_rpc.py")
    ap.add_argument("--client", action="store_true", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc", help="HOST:PORT of a toy rpc-server (none: the one-host reference)")
    ap.add_argument("--split", help="tensor_split shares, local first (default: by free memory)")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--loopback", action="store_true", help="count bytes on lo (else every other interface)")
    print(json.dumps(client(ap.parse_args())), flush=True)


# ---------------------------------------------------------------- the benchmark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path: Path, proc: subprocess.Popen, needle: str) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < START_TIMEOUT_S:
        if needle in path.read_text(errors="replace"):
            return time.perf_counter() - t0
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(
        f"toy rpc-server not ready ({needle!r} not printed):\n{path.read_text(errors='replace')[-3000:]}"
    )


def client_argv(model: str, core: str, endpoint: str | None, loopback: bool) -> list[str]:
    argv = ["taskset", "-c", core, sys.executable, str(Path(__file__).resolve()), "--client", "--model", model]
    argv += ["--tokens", str(TOKENS), "--reps", str(REPS)] + (["--loopback"] if loopback else [])
    if endpoint:
        argv += ["--rpc", endpoint] + (["--split", SPLIT] if SPLIT else [])
    return argv


def parse_client(proc: subprocess.CompletedProcess, what: str) -> dict:
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: the client failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(res: dict) -> dict:
    runs = res["runs"]
    rates = [r["decode_tokens"] / r["decode_s"] for r in runs]
    per_token = {
        k: statistics.median((r["bytes_n"][k] - r["bytes_1"][k]) / (len(r["tokens"]) - 1) for r in runs)
        for k in ("sent", "received")
    }
    return {
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_each": rates,
        "ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
        "bytes_per_decode_token": per_token,
        "bytes_per_request_n": [r["bytes_n"] for r in runs],
        "load_s": res["load_s"],
        "placement": res["placement"],
        "tokens": [r["tokens"] for r in runs],
    }


def test_rpc_split(record, bench_line, smollm2_path, tmp_path):
    import toy_ggml
    from toy_testsupport import netns

    if not getattr(toy_ggml, "rpc_available", lambda: False)():
        pytest.fail("this toy_ggml has no RPC backend (libggml-rpc): rebuild toy-ggml (`just setup`)")
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        pytest.fail("the benchmark pins the client and the rpc-server to one core each: needs taskset and 2 cores")
    model = str(smollm2_path)
    why_not_netns = "TOY_BENCH_RPC_LOOPBACK=1" if LOOPBACK else netns.why_unavailable()
    loopback = why_not_netns is not None
    log = tmp_path / "rpc-server.log"
    with ExitStack() as stack:
        logf = stack.enter_context(open(log, "w"))
        if loopback:
            port = free_port()
            endpoint = f"127.0.0.1:{port}"
            server_argv = ["taskset", "-c", "1", sys.executable, "-m", "toy_cli", "rpc-server"]
            server_argv += ["--host", "127.0.0.1", "--port", str(port), "--threads", "1"]
            server = subprocess.Popen(server_argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)

            def stop() -> None:
                if server.poll() is None:
                    server.terminate()
                    try:
                        server.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        server.kill()
                        server.wait(timeout=20)

            stack.callback(stop)

            def run_client(endpoint_or_none: str | None) -> subprocess.CompletedProcess:
                argv = client_argv(model, "0", endpoint_or_none, True)
                return subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)

        else:
            h = stack.enter_context(netns.hosts(2))
            endpoint = f"{h.addresses[1]}:{PORT}"
            server_argv = ["taskset", "-c", "1", sys.executable, "-m", "toy_cli", "rpc-server", "--host"]
            server_argv += [h.addresses[1], "--port", str(PORT), "--threads", "1", "--allow-remote"]
            server = h.popen(1, server_argv, stdout=logf, stderr=subprocess.STDOUT)

            def run_client(endpoint_or_none: str | None) -> subprocess.CompletedProcess:
                return h.run(0, client_argv(model, "0", endpoint_or_none, False), timeout=CLIENT_TIMEOUT_S)

        ready_s = wait_for_line(log, server, "toy rpc-server: serving")
        load0 = os.getloadavg()[0]
        split = summarize(parse_client(run_client(endpoint), "split"))
        one = summarize(parse_client(run_client(None), "one host"))
        raw = {"split": split, "one": one}
        load1 = os.getloadavg()[0]
    sys.stderr.write(f"[bench rpc] {json.dumps({k: {**v, 'tokens': None} for k, v in raw.items()})}\n")

    context = {
        "model": Path(model).name,
        "threads_per_device": 1,
        "new_tokens": TOKENS,
        "prompts": REPS,
        "prompt_tokens": PROMPT_TOKENS,
        "hosts": "loopback" if loopback else "two network namespaces on a bridge",
        "why_loopback": why_not_netns,
        "tensor_split": SPLIT or "by free memory (default)",
        "placement": split["placement"],
        "pinning": "client taskset -c 0, rpc-server taskset -c 1",
        "loadavg_1m": [load0, load1],
    }
    ratio = split["decode_tok_s"] / one["decode_tok_s"]
    record(
        "rpc",
        figure="decode tokens/s, split over local CPU + 1 rpc-server / one host",
        value=ratio,
        unit="x",
        **context,
        split_tok_s=split["decode_tok_s"],
        one_host_tok_s=one["decode_tok_s"],
        split_each=split["decode_tok_s_each"],
        one_host_each=one["decode_tok_s_each"],
        split_ttft_s=split["ttft_median_s"],
        one_host_ttft_s=one["ttft_median_s"],
        better="higher",
        ready_s=ready_s,
    )
    per = split["bytes_per_decode_token"]
    record(
        "rpc",
        figure="bytes moved per decode token (client side, both directions)",
        value=per["sent"] + per["received"],
        unit="bytes",
        **context,
        sent=per["sent"],
        received=per["received"],
        counters="lo interface (shared with the machine: an upper bound)" if loopback else "client namespace veth",
        one_host_bytes_per_token=one["bytes_per_decode_token"],
        per_request=split["bytes_per_request_n"],
    )
    assert split["placement"] != one["placement"], "the split run put every layer on the local CPU"
    # the same CPU kernels on both devices: the split changes where layers run, not what they compute
    assert split["tokens"] == one["tokens"], "greedy tokens of the split run differ from the one-host run's"
    assert split["bytes_per_decode_token"]["sent"] > 0


if __name__ == "__main__":
    main()
