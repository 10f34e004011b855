"""Replicas behind a router (issue 35): is a second ``toy serve`` replica on a
second core worth it, and what does the router cost?

Two set-ups on this machine's loopback, measured one after the other with
the same closed-loop load:

- *one replica*: ``toy serve --threads 1``, pinned to core 0 with
  ``taskset -c 0``, the clients talking to it directly;
- *two replicas*: that replica plus a second one pinned to core 1
  (``taskset -c 1``), both behind ``sglang-router`` (``python -m
  sglang_router.launch_router``; policy ``$TOY_BENCH_REPLICA_POLICY``,
  default ``round_robin``: the prompts share no prefix, so a cache-aware
  policy can only balance load, and round robin splits the clients evenly
  and repeatably).

Pinning: each replica is one core's worth of work (one compute thread, its
HTTP thread on the same core). The router and the load clients (threads of
this process) are not pinned: a 2-core machine has no third core to give
them, so the kernel places them where it can. In the one-replica run they
have core 1 to themselves, in the two-replica run they take their share
from the replicas: the baseline is favoured, and the ratio is a lower bound
of what separate machines would give.

The load, at two levels (``$TOY_BENCH_REPLICA_CLIENTS``, default ``8,16``):
N client threads (httpx, one connection each), closed loop,
``$TOY_BENCH_REPLICA_REQS`` (4) streaming ``/v1/completions`` requests each,
back to back. Every replica has ``--parallel 8``, so 8 clients fit one
replica's batch, and 16 keep every slot of two replicas busy (one replica
then queues half of them). Each prompt is a text of exactly 64 tokens (toy's
tokenizer) of its own, and each (set-up, level) run gets its own leading
word, so no request finds another's prefix in a replica's prefix cache.
Greedy, ``max_tokens=64`` (``$TOY_BENCH_REPLICA_MAX_TOKENS``), end of
generation ignored (``ignore_eos``); the tokens counted are the usage
chunk's ``completion_tokens`` (``stream_options.include_usage``, which the
router passes through). Before measuring, every replica gets an untimed
warm-up (one request, then bursts of 1, 2, 4, 8 short requests: toy builds a
graph per batch shape), and the router a burst of 8 through it.

Why two levels: a decode step on one core costs mostly a pass over the
weights, whatever the batch, so one replica batching 8 clients produces
almost as much as two replicas batching 4 each; a second replica pays where
one replica's slots are all taken. The target (>= 1.8x, issue 35) is
checked at the level that fills both replicas (16 clients); the 8-client
ratio is recorded as it is.

Figures, per level: aggregate completion tokens/s (all tokens over the wall
time, first request sent to last stream ended) of each set-up and their
ratio; p50/p95 TTFT (send to first streamed text); how the
router split the requests (each replica's ``toy_requests_total`` from
``/metrics``, deltas). Then the router's own overhead: ``$TOY_BENCH_ROUTER_N``
(40) pairs of the same small request (non-streaming, 8-token prompt,
``max_tokens=1``), one sent directly to a replica and one through the router,
alternating, with both replicas otherwise idle; the overhead is the median
through the router minus the median direct (and the median of the pairwise
differences). The records carry the 1-minute load average before and after
each run, and the CPU each process used during it (``cpu_share``: CPU
seconds per second of wall time, from /proc/PID/stat; ``clients`` is this
process), which shows where the two cores went. One round, about 3 minutes on an idle 2-core machine; on a
shared machine a run swings by 20-40 %.

sglang-router comes from the dev requirements (``sglang-router==0.3.2``);
``$TOY_BENCH_ROUTER_PYTHON`` names another Python that has it. Without one
the benchmark records that the router is unavailable and measures the
one-replica set-up only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.model]

# closed-loop clients per load level: 8 fit one replica's batch (--parallel 8), 16 keep every slot of two busy
LEVELS = tuple(int(x) for x in os.environ.get("TOY_BENCH_REPLICA_CLIENTS", "8,16").split(","))
REQS = int(os.environ.get("TOY_BENCH_REPLICA_REQS", "4"))
MAX_TOKENS = int(os.environ.get("TOY_BENCH_REPLICA_MAX_TOKENS", "64"))
POLICY = os.environ.get("TOY_BENCH_REPLICA_POLICY", "round_robin")
OVERHEAD_N = int(os.environ.get("TOY_BENCH_ROUTER_N", "40"))
PROMPT_TOKENS = 64
N_CTX = 512
PARALLEL = 8
CORES = ("0", "1")
START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120  # per request, also the longest gap between two chunks
SETTLE_S = 0.5
ALIAS = "smollm2"
TARGET = 1.8

STORY = (
    "kettle had been whistling on the stove for a good minute before anyone in the house noticed it. "
    "Upstairs the twins were arguing about whose turn it was to feed the cat, the radio in the kitchen "
    "was reading out the shipping forecast to nobody, and grandfather had fallen asleep over the crossword "
    "with a pencil still in his hand. Outside, the first snow of the winter was settling on the hedges, "
    "and a fox crossed the lane without hurrying, leaving a neat line of prints that led to the allotments."
)
OPENERS = (
    "The A One That This Our Her His Their Your My Every Some Each No Its Then Now Soon Later Still Once "
    "Today Meanwhile Suddenly Eventually Perhaps Indeed Yesterday Tonight Somewhere Nearby Outside Inside "
    "Upstairs Downstairs Beyond Across Around Behind Before After"
).split()
# one leading word per use of the prompt set, so that no run repeats a prompt a replica has cached
LEADS = {"warm": "Listen,", "overhead": "Briefly"}
RUN_LEADS = ("Picture", "Imagine", "Remember", "Consider", "Suppose", "Recall")
ADJECTIVES = ("", "quiet ", "small ", "tired ")


# ---------------------------------------------------------------- processes


def router_python() -> str | None:
    env = os.environ.get("TOY_BENCH_ROUTER_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("sglang_router") is not None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess with its output in a log file; ``close`` stops it (TERM, then KILL)."""

    def __init__(self, name: str, argv: list[str], port: int, logdir: Path):
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) the process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}):\n{self.tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


def wait_until(proc: Proc, probe, what: str) -> float:
    """Call ``probe()`` until it returns True (bounded by START_TIMEOUT_S); the seconds it took."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < START_TIMEOUT_S:
        proc.check_alive()
        try:
            if probe():
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{proc.name}: {what} not reached after {START_TIMEOUT_S} s:\n{proc.tail()}")


def start_replica(name: str, core: str, model: str, runs_dir: str, logdir: Path) -> tuple[Proc, float]:
    import httpx

    port = free_port()
    argv = ["taskset", "-c", core, sys.executable, "-m", "toy_cli", "serve", model, "--port", str(port)]
    argv += ["--threads", "1", "--parallel", str(PARALLEL), "--ctx", str(N_CTX), "--max-queue", "64"]
    argv += ["--alias", ALIAS, "--runs-dir", runs_dir, "--log-level", "warning"]
    proc = Proc(name, argv, port, logdir)
    took = wait_until(proc, lambda: httpx.get(proc.url + "/health", timeout=2).status_code == 200, "/health 200")
    return proc, took


def start_router(python: str, workers: list[Proc], logdir: Path) -> tuple[Proc, float]:
    import httpx

    port = free_port()
    argv = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *(w.url for w in workers), "--policy", POLICY, "--log-level", "warn"]
    # its metrics server would take port 29000 by default, on every interface
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    proc = Proc("router", argv, port, logdir)

    def routes() -> bool:
        # ready once a request through it is answered (its own readiness endpoints vary between versions)
        body = {"model": ALIAS, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        return httpx.post(proc.url + "/v1/completions", json=body, timeout=30).status_code == 200

    return proc, wait_until(proc, routes, "a completion answered through the router")


# ---------------------------------------------------------------- load


def prompt_set(tok, n: int, lead: str) -> list[str]:
    """``n`` distinct texts of exactly PROMPT_TOKENS tokens, all starting with ``lead``."""
    out: list[str] = []
    for word, adj in ((w, a) for a in ADJECTIVES for w in OPENERS):
        ids = tok.encode(f"{lead} {word} {adj}{STORY}")[:PROMPT_TOKENS]
        text = tok.decode(ids)
        if len(tok.encode(text)) == PROMPT_TOKENS:
            out.append(text)
            if len(out) == n:
                return out
    raise AssertionError(f"only {len(out)} of {n} prompts come to {PROMPT_TOKENS} tokens")


def one_stream(client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: send time, first-text time, end time, completion tokens."""
    body = {
        "model": ALIAS,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = None
    tokens = None
    finish = None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:400]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            msg = json.loads(payload)
            if "error" in msg:
                raise RuntimeError(f"{url}: error in the stream: {msg}")
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            for choice in msg.get("choices") or ():
                if choice.get("text") and first is None:
                    first = time.perf_counter()
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError(f"{url}: no usage chunk in the stream (stream_options dropped on the way?)")
    return {"sent": sent, "first": first if first is not None else end, "end": end, "tokens": tokens, "finish": finish}


def closed_loop(url: str, per_client: list[list[str]], max_tokens: int) -> dict:
    """One thread per prompt list, each sending its prompts back to back; every result and the wall time."""
    import httpx

    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(per_client))

    def client(prompts: list[str]) -> None:
        try:
            with httpx.Client() as http:
                barrier.wait(timeout=30)
                for p in prompts:
                    res = one_stream(http, url, p, max_tokens)
                    with lock:
                        results.append(res)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(ps,), daemon=True) for ps in per_client]
    for t in threads:
        t.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S * max(len(ps) for ps in per_client)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{len(results)} request(s) done, a client still waits after the deadline")
    return {"results": results, "wall_s": max(r["end"] for r in results) - min(r["sent"] for r in results)}


def quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def figures(run: dict) -> dict:
    res = run["results"]
    ttft = [r["first"] - r["sent"] for r in res]
    tokens = sum(r["tokens"] for r in res)
    return {
        "agg_tok_s": tokens / run["wall_s"],
        "tokens": tokens,
        "requests": len(res),
        "wall_s": run["wall_s"],
        "ttft_p50_s": quantile(ttft, 0.50),
        "ttft_p95_s": quantile(ttft, 0.95),
        "ttft_max_s": max(ttft),
        "finish_reasons": sorted({str(r["finish"]) for r in res}),
    }


def requests_served(url: str) -> float:
    """The replica's ``toy_requests_total`` of /v1/completions (summed over status codes; the router's
    health checks and our /metrics reads are other endpoints)."""
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("toy_requests_total") and 'endpoint="/v1/completions"' in line:
            total += float(line.rpartition(" ")[2])
    return total


def warm(url: str, texts: list[str]) -> None:
    closed_loop(url, [texts[:1]], 8)
    for n in (1, 2, 4, 8):
        closed_loop(url, [[texts[i]] for i in range(n)], 8)


def measured(url: str, per_client: list[list[str]], procs: list[Proc]) -> dict:
    """One closed-loop run and its figures, with the CPU seconds per core-second of wall time each process
    used meanwhile (``clients``: this process, whose threads are the load clients)."""
    time.sleep(SETTLE_S)
    load0 = os.getloadavg()[0]
    cpu0 = {p.name: p.cpu_s() for p in procs} | {"clients": time.process_time()}
    out = figures(closed_loop(url, per_client, MAX_TOKENS))
    cpu1 = {p.name: p.cpu_s() for p in procs} | {"clients": time.process_time()}
    out["cpu_share"] = {k: (cpu1[k] - cpu0[k]) / out["wall_s"] for k in cpu0}
    out["loadavg_1m"] = [load0, os.getloadavg()[0]]
    sys.stderr.write(f"[bench replicas] {url}: {json.dumps(out)}\n")
    return out


def overhead(direct: list[str], router: str, prompts: list[str]) -> dict:
    """OVERHEAD_N pairs (direct, routed) of the same small request; latencies in seconds. Every prompt is
    sent once to each replica first (untimed), so that both paths find it in the prefix cache wherever the
    router sends it; the first of a pair alternates."""
    import httpx

    d_s: list[float] = []
    r_s: list[float] = []
    with httpx.Client() as http:
        for p in prompts:
            for base in direct:
                body = {"model": ALIAS, "prompt": p, "max_tokens": 1, "temperature": 0}
                http.post(base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S).raise_for_status()
        for i in range(OVERHEAD_N):
            body = {"model": ALIAS, "prompt": prompts[i % len(prompts)], "max_tokens": 1, "temperature": 0}
            pair = [(direct[i % len(direct)], d_s), (router, r_s)]
            for base, into in pair if i % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                r = http.post(base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
                into.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.text[:400]}")
    diffs = [b - a for a, b in zip(d_s, r_s)]
    return {
        "direct_median_s": statistics.median(d_s),
        "router_median_s": statistics.median(r_s),
        "overhead_s": statistics.median(r_s) - statistics.median(d_s),
        "pairwise_median_s": statistics.median(diffs),
        "pairs": len(diffs),
    }


# ---------------------------------------------------------------- the benchmark


def test_replicas_behind_router(record, bench_line, smollm2_path, tmp_path):
    if shutil.which("taskset") is None:
        pytest.fail("taskset (util-linux) is needed to pin the replicas to cores")
    if (os.cpu_count() or 1) < 2:
        pytest.fail("this benchmark pins one replica per core and needs 2 cores")
    from toy.tokenizer import Tokenizer

    tok = Tokenizer.from_file(smollm2_path)
    sets = {key: prompt_set(tok, 8, lead) for key, lead in LEADS.items()}
    # per (set-up, level): one prompt list per client, every prompt new to the replicas
    leads = iter(RUN_LEADS)
    runs = {}
    for setup in ("one", "two"):
        for n in LEVELS:
            texts = prompt_set(tok, n * REQS, next(leads))
            runs[setup, n] = [texts[c * REQS : (c + 1) * REQS] for c in range(n)]
    short = [tok.decode(tok.encode(t)[:8]) for t in sets["overhead"]]
    python = router_python()
    model = str(smollm2_path)
    ready: dict[str, float] = {}
    figs: dict[tuple[str, int], dict] = {}
    split: dict[int, dict[str, float]] = {}
    over = None
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-runs-") as runs_dir:
        try:
            a, ready["replica_core0"] = start_replica("replica-core0", CORES[0], model, runs_dir, tmp_path)
            procs.append(a)
            warm(a.url, sets["warm"])
            for n in LEVELS:
                figs["one", n] = measured(a.url, runs["one", n], procs)
            if python is not None:
                b, ready["replica_core1"] = start_replica("replica-core1", CORES[1], model, runs_dir, tmp_path)
                procs.append(b)
                warm(b.url, sets["warm"])
                router, ready["router"] = start_router(python, [a, b], tmp_path)
                procs.append(router)
                closed_loop(router.url, [[t] for t in sets["warm"]], 8)
                for n in LEVELS:
                    before = {p.name: requests_served(p.url) for p in (a, b)}
                    figs["two", n] = measured(router.url, runs["two", n], procs)
                    split[n] = {p.name: requests_served(p.url) - before[p.name] for p in (a, b)}
                time.sleep(SETTLE_S)
                over = overhead([a.url, b.url], router.url, short)
        finally:
            for p in reversed(procs):
                p.close()

    context = {
        "model": Path(model).name,
        "requests_per_client": REQS,
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "replica_threads": 1,
        "parallel": PARALLEL,
        "pinning": "replicas taskset -c 0 / -c 1; router and clients unpinned",
        "cpus": os.cpu_count(),
    }
    if python is None:
        for n in LEVELS:
            record(
                "replicas",
                figure=f"aggregate completion tokens/s, 1 replica (core 0), {n} clients",
                value=figs["one", n]["agg_tok_s"],
                unit="tokens/s",
                **context,
                clients=n,
                one=figs["one", n],
            )
        record(
            "replicas",
            figure="sglang-router",
            value=None,
            unit="",
            router_available=False,
            note="sglang_router is not importable here: install requirements/dev.txt or set "
            "TOY_BENCH_ROUTER_PYTHON to a Python that has sglang-router==0.3.2",
        )
        return
    for n in LEVELS:
        one, two = figs["one", n], figs["two", n]
        ratio = two["agg_tok_s"] / one["agg_tok_s"]
        # the target applies where the load keeps every slot of both replicas busy: below that, one replica
        # batches all the clients at little more than the cost of half of them
        saturating = n >= 2 * PARALLEL
        record(
            "replicas",
            figure=f"aggregate completion tokens/s, {n} clients: 2 replicas behind the router / 1 replica",
            value=ratio,
            unit="x",
            **context,
            clients=n,
            policy=POLICY,
            target=f">= {TARGET}" if saturating else None,
            met=ratio >= TARGET if saturating else None,
            one_replica_tok_s=one["agg_tok_s"],
            two_replicas_tok_s=two["agg_tok_s"],
            requests_per_replica=split[n],
            one=one,
            two=two,
        )
        record(
            "replicas",
            figure=f"time to first token p95, {n} clients, 2 replicas behind the router",
            value=two["ttft_p95_s"],
            unit="s",
            **context,
            clients=n,
            policy=POLICY,
            one_replica_p95_s=one["ttft_p95_s"],
            ratio=two["ttft_p95_s"] / one["ttft_p95_s"],
            better="lower",
            p50_s=two["ttft_p50_s"],
            one_replica_p50_s=one["ttft_p50_s"],
        )
    assert over is not None
    record(
        "replicas",
        figure="router overhead per request (median routed - median direct)",
        value=over["overhead_s"] * 1000,
        unit="ms",
        **context,
        policy=POLICY,
        request="non-streaming /v1/completions, 8-token prompt, max_tokens=1, replicas otherwise idle",
        direct_median_ms=over["direct_median_s"] * 1000,
        routed_median_ms=over["router_median_s"] * 1000,
        pairwise_median_ms=over["pairwise_median_s"] * 1000,
        pairs=over["pairs"],
        ready_s=ready,
    )
    for n in LEVELS:
        want = n * REQS * MAX_TOKENS
        assert figs["one", n]["tokens"] == figs["two", n]["tokens"] == want, (n, figs["one", n], figs["two", n])
        assert all(v > 0 for v in split[n].values()), f"the router left a replica idle at {n} clients: {split[n]}"
