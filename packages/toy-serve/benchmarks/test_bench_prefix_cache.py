"""The prefix cache on a multi-turn chat (issue 34): ``toy serve`` with its
prefix cache (``--cache-ram 256``, the default budget) against toy with the
cache off (``--cache-ram 0``: only a free slot's kept prefix is reused, toy's
behaviour before the cache) and against llama.cpp's llama-server with its
prompt cache (``--cache-ram 256``, ``cache_prompt: true`` in every request;
a llama-server without ``--cache-ram`` runs without it and the records say
so), same GGUF (SmolLM2-135M-Instruct Q4_1), same threads (``$TOY_BENCH_THREADS``, 2), same
slots (8) and per-slot context, in the same run.

The load: 8 clients (httpx, one connection each), 10 turns each, closed loop,
streaming ``/v1/chat/completions``. Every conversation starts with the same
system prompt (a text of exactly 400 tokens, toy's tokenizer) and a client's
own first user message; each turn appends the server's answer as an
assistant message and a new short user message, so turn t's prompt is turn
t-1's prompt plus about 50 tokens (about 400 tokens at turn 1, 900 at turn
10). Greedy, ``max_tokens=32`` (end of generation not ignored: an answer may
end early; completion tokens come from the usage chunk, else the streamed
chunks). All clients send their first turn together
(``$TOY_BENCH_PREFIX_STAGGER_S``: client c waits c times that many seconds
first; default 0).

The three servers never run at once: each is started, warmed up, measured
and stopped before the next starts, in the order toy cached, toy uncached,
llama-server. The warm-up: one request and a burst of 8 short ones on another
system prompt (toy builds a graph per batch shape), then one earlier
visitor's request (8 tokens) on the measured system prompt. That last one
makes the measured run the steady state of a deployed chat app, whose system
prompt has been served before, rather than a cold start. Without it the 8
first turns would all prefill the system prompt at the same moment. No cache
can serve a prefix that no request has finished computing yet, so that first
wave alone would set every server's p95. With it, toy's prefix cache hands
the system prompt to every first turn. Toy without the cache reuses it only
for the one request that lands in the slot still holding it. So did
llama-server in the recorded run: its RAM cache takes a slot's prompt when
the slot is given to another request, and the earlier visitor's prompt was
still in its slot. Later turns differ less: with 8 clients on 8 slots a
conversation finds its own previous turn still in a free slot, which all three
servers reuse. One round: on a shared 2-core machine a run swings by
20-40 %.

Figures per server: TTFT p50/p95 over the 80 requests (send to first
streamed content), the median TTFT of each turn, aggregate completion
tokens/s (all completion tokens over the wall time, first request sent to
last stream ended), prompt-token totals; for toy the cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``) and the ``toy_prefix_cache_*``
series of ``/metrics`` (deltas over the run, and the hit ratio); for
llama-server its own ``cached_tokens`` (and ``timings.cache_n``). The p95 of
the turns after the first is recorded too. Targets (issue 34), recorded as ratios: toy's cached TTFT
p95 <= 0.5x toy's uncached and <= llama-server's. Also checked: toy's answers with the cache are those without it, text for
text, for every (client, turn). Every loop is bounded in count and time
(START_TIMEOUT_S, REQUEST_TIMEOUT_S, RUN_DEADLINE_S). The recorded run took 22
minutes on a 2-core VM that other work kept at a load of 4 to 11.
llama-server's spinning thread pool suffers most from that. The run should
take about 5 minutes on an idle machine (an estimate, not measured).

Knobs: ``$TOY_BENCH_LLAMA_SERVER`` (a llama-server binary; default: built by
tools/build_llama_server.py), ``$TOY_BENCH_PREFIX_TURNS`` (10),
``$TOY_BENCH_PREFIX_CLIENTS`` (8), ``$TOY_BENCH_TOY_FLASH_ATTN`` (1: toy runs
``--flash-attn``, as llama-server runs flash attention by default).
"""

from __future__ import annotations

import json
import os
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

THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
CLIENTS = int(os.environ.get("TOY_BENCH_PREFIX_CLIENTS", "8"))
TURNS = int(os.environ.get("TOY_BENCH_PREFIX_TURNS", "10"))
TOY_FLASH_ATTN = os.environ.get("TOY_BENCH_TOY_FLASH_ATTN", "1") != "0"
PARALLEL = 8
N_CTX = 1536  # per slot: the longest conversation (turn 10) is about 900 tokens
SYSTEM_TOKENS = 400
MAX_TOKENS = 32
CACHE_RAM_MB = 256  # toy's default budget; llama-server gets the same
SETTLE_S = 0.5
START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 300  # per request (also the read timeout between chunks); generous: a busy shared machine
RUN_DEADLINE_S = 600  # per server: no client starts a turn after this
STAGGER_S = float(os.environ.get("TOY_BENCH_PREFIX_STAGGER_S", "0"))
MODEL_ID = "smollm2"

SYSTEM = (
    "You are Harbor, the front-desk assistant of the Saltmarsh Maritime Museum, a small museum in an old "
    "customs house by the harbour. Answer visitors' questions in a friendly, plain and short way, in the "
    "language of the question. Facts you may use: the museum opens from ten in the morning to five in the "
    "afternoon, Tuesday to Sunday, and is closed on Mondays except on public holidays. Tickets cost eight "
    "euros for adults, five for students and people over sixty-five, and nothing for children under twelve. "
    "The ground floor holds the ship models: a three-masted barque, a steam tug, two fishing smacks and a "
    "lifeboat that served the harbour for forty years. The first floor tells the story of the lighthouse "
    "keepers, with their logbooks, lamps, a clockwork that turned the lens, and letters sent home during "
    "long winters. The second floor is about trade: salt, timber, wool and tea, with a room of scales, "
    "weights and customs stamps. The café on the terrace serves soup, sandwiches, cakes and coffee until "
    "half past four. The shop sells maps, postcards, books about local history and small brass compasses. "
    "Guided tours start at eleven and at three, last one hour, and are free with a ticket; groups of more "
    "than ten people should book a week ahead by telephone. Strollers are welcome; there is a lift to every "
    "floor and a quiet room on the first floor. Dogs are not allowed inside, except assistance dogs. "
    "Photography without flash is allowed everywhere except in the room of letters. If a visitor asks "
    "something you do not know, say so and suggest asking at the desk. Never invent opening hours, prices or "
    "events. Keep answers to a few sentences unless the visitor asks for more detail, and do not repeat the "
    "question. When a visitor greets you, greet them back and ask how you can help. Be patient with children, "
    "and explain sea words such as barque, smack, tug and ballast in simple terms when they come up. "
    "The museum was founded in 1952 by a society of retired sailors, who gave most of the early collection. "
)
WARM_SYSTEM = "You are a terse assistant for a bakery. Answer in one sentence."
PRIME_QUESTION = "Good morning! Are you open today?"  # the earlier visitor's (no client asks it)
PLACES = ("the ship models", "the lighthouse room", "the trade rooms", "the café", "the shop", "the tours",
          "the lift", "the letters")  # fmt: skip
QUESTIONS = (
    "Hello! I would like to know about {p}.",
    "What can I see in {p}?",
    "Is {p} good for children?",
    "How long should I plan for {p}?",
    "Tell me one surprising detail about {p}.",
    "Can I take photographs in {p}?",
    "What is the history behind {p}?",
    "Which other part of the museum goes well with {p}?",
    "Is {p} busy on Sunday afternoons?",
    "Thank you! Anything else I should know about {p}?",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(tok) -> str:
    """SYSTEM cut to exactly SYSTEM_TOKENS tokens (toy's tokenizer), stable under re-encoding."""
    for n in range(SYSTEM_TOKENS, SYSTEM_TOKENS + 8):
        text = tok.decode(tok.encode(SYSTEM)[:n]).strip()
        if len(tok.encode(text)) == SYSTEM_TOKENS:
            return text
    raise AssertionError(f"no cut of the system prompt tokenizes to {SYSTEM_TOKENS} tokens")


def llama_server_binary() -> tuple[str | None, str]:
    """``$TOY_BENCH_LLAMA_SERVER``, else tools/build_llama_server.py's binary (built on first use)."""
    env = os.environ.get("TOY_BENCH_LLAMA_SERVER")
    if env:
        return env, "TOY_BENCH_LLAMA_SERVER"
    script = Path(__file__).resolve().parents[3] / "tools" / "build_llama_server.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"tools/build_llama_server.py failed: {proc.stderr[-2000:]}"
    return proc.stdout.strip().splitlines()[-1], "tools/build_llama_server.py"


class Server:
    """One server subprocess, its log in a file, ready once /health answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, logdir: Path):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logdir / f"{name}.log"
        self.log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT_S} s:\n{self.tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- load


def stream_chat(client, url: str, body: dict) -> dict:
    """One streaming chat completion: TTFT, the answer's text, usage (or the streamed chunk count)."""
    t0 = time.perf_counter()
    first = None
    chunks = 0
    text: list[str] = []
    usage = timings = finish = None
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(f"{url}: error chunk {msg}")
            usage = msg.get("usage") or usage
            timings = msg.get("timings") or timings
            for ch in msg.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    chunks += 1
                    text.append(piece)
                    if first is None:
                        first = time.perf_counter()
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
    end = time.perf_counter()
    usage = usage or {}
    return {
        "t0": t0,
        "end": end,
        "ttft": (first if first is not None else end) - t0,
        "text": "".join(text),
        "completion_tokens": usage.get("completion_tokens", chunks),
        "token_count_source": "usage" if "completion_tokens" in usage else "text chunks",
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "peer_cache_n": (timings or {}).get("cache_n"),
        "finish": finish,
    }


def run_chat(
    url: str, system: str, extra: dict, clients: int, turns: int, max_tokens: int, stagger_s: float = 0.0
) -> dict:
    """``clients`` threads, each a conversation of ``turns`` turns (closed loop, first turns together);
    every result (with its client and turn) and the wall time."""
    import httpx

    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)
    deadline = time.perf_counter() + RUN_DEADLINE_S

    def client_loop(c: int) -> None:
        place = PLACES[c % len(PLACES)]
        messages = [{"role": "system", "content": system}]
        try:
            with httpx.Client() as client:
                start.wait(timeout=REQUEST_TIMEOUT_S)
                time.sleep(c * stagger_s)
                for t in range(turns):
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"client {c}: run deadline ({RUN_DEADLINE_S} s) passed before turn {t}")
                    messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)].format(p=place)})
                    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                    res = stream_chat(client, url, {**body, "stream": True, **extra})
                    messages.append({"role": "assistant", "content": res["text"]})
                    with lock:
                        results.append({**res, "client": c, "turn": t})
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(RUN_DEADLINE_S + REQUEST_TIMEOUT_S)
    if errors:
        raise errors[0]
    if len(results) != clients * turns or any(th.is_alive() for th in threads):
        raise RuntimeError(f"{len(results)} of {clients * turns} requests finished (a busy machine?)")
    wall = max(r["end"] for r in results) - min(r["t0"] for r in results)
    return {"results": results, "wall_s": wall}


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summary(run: dict) -> dict:
    res = run["results"]
    ttfts = [r["ttft"] for r in res]
    tokens = sum(r["completion_tokens"] for r in res)
    prompt = [r["prompt_tokens"] for r in res if r["prompt_tokens"] is not None]
    cached = [r["cached_tokens"] for r in res if r["cached_tokens"] is not None]
    peer_cached = [r["peer_cache_n"] for r in res if r["peer_cache_n"] is not None]
    turns = sorted({r["turn"] for r in res})
    return {
        "ttft_p50_s": pct(ttfts, 0.50),
        "ttft_p95_s": pct(ttfts, 0.95),
        "ttft_max_s": max(ttfts),
        "ttft_p95_later_turns_s": pct([r["ttft"] for r in res if r["turn"] > 0], 0.95) if len(turns) > 1 else None,
        "ttft_p50_by_turn_s": [statistics.median(r["ttft"] for r in res if r["turn"] == t) for t in turns],
        "agg_tok_s": tokens / run["wall_s"],
        "completion_tokens": tokens,
        "requests": len(res),
        "wall_s": run["wall_s"],
        "prompt_tokens": sum(prompt) if len(prompt) == len(res) else None,
        "cached_tokens": sum(cached) if len(cached) == len(res) else None,
        "cached_tokens_first_turns": sum(r["cached_tokens"] or 0 for r in res if r["turn"] == 0),
        "prompt_tokens_first_turns": sum(r["prompt_tokens"] or 0 for r in res if r["turn"] == 0),
        "peer_cache_n": sum(peer_cached) if len(peer_cached) == len(res) else None,
        "token_count_source": sorted({r["token_count_source"] for r in res}),
        "finish_reasons": sorted({str(r["finish"]) for r in res}),
    }


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cache_metrics(url: str) -> dict[str, float]:
    """Every ``toy_prefix_cache_*`` sample of toy's /metrics, labels included (empty where there are none)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("toy_prefix_cache") and "_created" not in name:
            out[name] = float(value)
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters (``*_total``) as deltas over the run; gauges (bytes, blocks, the hit ratio) as at its end."""
    return {k: v - before.get(k, 0.0) if "_total" in k else v for k, v in after.items()}


def warm_up(url: str, system: str, extra: dict) -> None:
    """Untimed: one request, then a burst of PARALLEL short ones (toy builds a graph per batch shape), on
    another system prompt; then one request of an earlier visitor on the measured system prompt (the
    deployed app's system prompt has been served before: steady state, not a cold start)."""
    import httpx

    run_chat(url, WARM_SYSTEM, extra, 1, 1, 8)
    run_chat(url, WARM_SYSTEM, extra, PARALLEL, 1, 4)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PRIME_QUESTION}]
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.Client() as client:
        stream_chat(client, url, {**body, **extra})


# ---------------------------------------------------------------- the benchmark


def toy_argv(model: str, port: int, runs_dir: str, options: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "toy_cli", "serve", model, "--port", str(port)]
    argv += ["--threads", str(THREADS), "--parallel", str(PARALLEL), "--ctx", str(N_CTX)]
    argv += ["--max-queue", "64", "--runs-dir", runs_dir, "--alias", MODEL_ID, "--log-level", "warning"]
    return argv + (["--flash-attn"] if TOY_FLASH_ATTN else []) + options


def llama_server_cache(binary: str) -> tuple[list[str], str]:
    """llama-server's prompt-cache options and what they are (``--cache-ram`` where this version has it)."""
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    if "--cache-ram" in helptext.stdout + helptext.stderr:
        return ["--cache-ram", str(CACHE_RAM_MB)], f"--cache-ram {CACHE_RAM_MB} and cache_prompt: true"
    return [], "this llama-server has no --cache-ram: slot prompt reuse only (cache_prompt: true)"


def llama_server_argv(binary: str, model: str, port: int, options: list[str]) -> list[str]:
    argv = [binary, "-m", model, "--port", str(port), "--alias", MODEL_ID, "-t", str(THREADS), "-tb", str(THREADS)]
    argv += ["-c", str(N_CTX * PARALLEL), "--parallel", str(PARALLEL), "--cont-batching", "--no-webui"]
    return argv + options


def test_prefix_cache_multi_turn(record, bench_line, smollm2_path, tmp_path):
    from toy.tokenizer import Tokenizer

    model = str(smollm2_path)
    system = system_prompt(Tokenizer.from_file(smollm2_path))
    binary, how = llama_server_binary()
    # (name, how to start it on a port, extra request fields, its cache set-up)
    configs: list[tuple[str, object, dict, str]] = []
    usage = {"stream_options": {"include_usage": True}}
    runs_dir = tempfile.mkdtemp(prefix="bench-prefix-runs-", dir=tmp_path)
    on = ["--cache-ram", str(CACHE_RAM_MB)]
    configs.append(("toy_cached", lambda p: toy_argv(model, p, runs_dir, on), usage, f"--cache-ram {CACHE_RAM_MB}"))
    configs.append(
        ("toy_uncached", lambda p: toy_argv(model, p, runs_dir, ["--cache-ram", "0"]), usage, "--cache-ram 0")
    )
    peer_cache = None
    if binary is not None:
        peer_opts, peer_cache = llama_server_cache(binary)
        peer = {**usage, "cache_prompt": True}
        configs.append(("llama-server", lambda p: llama_server_argv(binary, model, p, peer_opts), peer, peer_cache))

    figs: dict[str, dict] = {}
    answers: dict[str, dict[tuple[int, int], str]] = {}  # per server: (client, turn) -> the answer's text
    metrics: dict[str, float] = {}
    for name, argv, extra, cache in configs:
        port = free_port()
        srv = Server(name, argv(port), port, tmp_path)
        try:
            ready_s = srv.wait_ready()
            warm_up(srv.url, system, extra)
            time.sleep(SETTLE_S)
            m0 = cache_metrics(srv.url) if name == "toy_cached" else {}
            load0 = os.getloadavg()[0]
            run = run_chat(srv.url, system, extra, CLIENTS, TURNS, MAX_TOKENS, STAGGER_S)
            answers[name] = {(r["client"], r["turn"]): r["text"] for r in run["results"]}
            s = summary(run)
            s["loadavg_1m"] = [load0, os.getloadavg()[0]]
            s["ready_s"] = ready_s
            s["cache"] = cache
            if name == "toy_cached":
                m1 = cache_metrics(srv.url)
                metrics = metric_deltas(m0, m1)
            figs[name] = s
            sys.stderr.write(f"[bench prefix cache] {name}: {json.dumps(s)}\n")
            sys.stderr.flush()
        finally:
            srv.close()

    # the cache's promise: the same answers, token for token, as without it (greedy, exact batching)
    differ = sorted(k for k in answers["toy_cached"] if answers["toy_cached"][k] != answers["toy_uncached"].get(k))
    context = {
        "model": Path(model).name,
        "threads": THREADS,
        "parallel": PARALLEL,
        "n_ctx_per_slot": N_CTX,
        "clients": CLIENTS,
        "turns": TURNS,
        "system_prompt_tokens": SYSTEM_TOKENS,
        "max_tokens": MAX_TOKENS,
        "stagger_s": STAGGER_S,
        "toy_flash_attn": TOY_FLASH_ATTN,
        "cpus": os.cpu_count(),
    }
    for name, s in figs.items():
        record(
            "prefix_cache",
            figure=f"multi-turn chat, {name}: TTFT p95",
            value=s["ttft_p95_s"],
            unit="s",
            **context,
            server=name,
            **{k: v for k, v in s.items() if k != "ttft_p95_s"},
        )
    cached, uncached = figs["toy_cached"], figs["toy_uncached"]
    ratio = cached["ttft_p95_s"] / uncached["ttft_p95_s"]
    record(
        "prefix_cache",
        figure="toy TTFT p95, prefix cache / no cache (--cache-ram 0)",
        value=ratio,
        unit="x",
        **context,
        target="<= 0.5",
        met=ratio <= 0.5,
        cached_p95_s=cached["ttft_p95_s"],
        uncached_p95_s=uncached["ttft_p95_s"],
        p50_ratio=cached["ttft_p50_s"] / uncached["ttft_p50_s"],
        later_turns_p95_ratio=ratio_or_none(cached["ttft_p95_later_turns_s"], uncached["ttft_p95_later_turns_s"]),
        tok_s_ratio=cached["agg_tok_s"] / uncached["agg_tok_s"],
        answers_differing_from_uncached=len(differ),
    )
    hits, misses = metrics.get("toy_prefix_cache_hits_total", 0.0), metrics.get("toy_prefix_cache_misses_total", 0.0)
    hit = cached["cached_tokens"] / cached["prompt_tokens"] if cached["cached_tokens"] is not None else None
    record(
        "prefix_cache",
        figure="toy prefix cache: cached prompt tokens / prompt tokens (usage)",
        value=hit,
        unit="ratio",
        **context,
        cached_tokens=cached["cached_tokens"],
        prompt_tokens=cached["prompt_tokens"],
        uncached_run_cached_tokens=uncached["cached_tokens"],
        metrics=metrics,
        metrics_block_hit_ratio=ratio_or_none(hits, hits + misses),
        note="metrics: the toy_prefix_cache_* samples of /metrics, counters as deltas over the measured run, "
        "gauges (the hit ratio since start, so warm-up included) as read at its end; cached_tokens count both the "
        "prefix cache's blocks and a free slot's kept prefix; uncached_run_cached_tokens: what --cache-ram 0 still "
        "reused (a free slot's last content only)",
    )
    if "llama-server" in figs:
        p = figs["llama-server"]
        vs = cached["ttft_p95_s"] / p["ttft_p95_s"]
        record(
            "prefix_cache",
            figure="toy TTFT p95 with the prefix cache / llama-server with its prompt cache",
            value=vs,
            unit="x",
            **context,
            peer="llama-server",
            peer_binary=how,
            peer_cache=peer_cache,
            target="<= 1",
            met=vs <= 1,
            toy_p95_s=cached["ttft_p95_s"],
            peer_p95_s=p["ttft_p95_s"],
            p50_ratio=cached["ttft_p50_s"] / p["ttft_p50_s"],
            later_turns_p95_ratio=ratio_or_none(cached["ttft_p95_later_turns_s"], p["ttft_p95_later_turns_s"]),
            tok_s_ratio=cached["agg_tok_s"] / p["agg_tok_s"],
            toy_prompt_tokens=cached["prompt_tokens"],
            peer_prompt_tokens=p["prompt_tokens"],
        )
    else:
        record("prefix_cache", figure="llama-server", value=None, unit="", peer_available=False, note=how)
    assert not differ, f"(client, turn) answers that differ with the prefix cache on: {differ}"
