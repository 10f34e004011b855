"""toy serve replicas behind ``sglang-router`` on namespace hosts (``toy_testsupport.netns``), for
the tests and benchmarks of serving at scale (``from toy_testsupport.router import Deployment``).

Why a module of its own: the namespace hosts are out of the test process's reach (nothing is
added to the root namespace), so everything that talks HTTP to the replicas or the router has
to run inside a namespace too. ``Deployment`` starts the pieces on their hosts and asks host 0
to do the talking by running this very module there (``python -m toy_testsupport.router
COMMAND``): ``wait`` (until URLs answer 200), ``get`` (one GET), ``send`` (a list of requests,
their answers back as JSON) and ``load`` (a closed loop of N clients, bounded in requests and
seconds, each request's outcome written to a JSON file).

Layout: host 0 runs the router and the clients, hosts 1..n-1 one replica each
(``toy serve MODEL --host ADDR --port PORT --api-key KEY --parallel 2 --threads 1``). The
router gets the workers' URLs on its command line (``router_argv``) with health checks every
second, so a replica that stops answering /health leaves the rotation within about a second
and one that answers again comes back within about two.

The router is a test, benchmark and documentation dependency (requirements/dev.txt), never a
dependency of toy itself. Every wait here is bounded; processes started through ``Hosts``
are killed when the ``hosts`` block ends.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toy_testsupport.netns import Hosts

REPLICA_PORT = 8100
ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000  # the router's Prometheus exporter (inside host 0's namespace)

#: the router's options that make it fit for replicas that die, drain and restart (see the guide):
#: health checks each second, one failed check takes a worker out, two good ones bring it back;
#: failed requests (connection refused, 429, 503) retried on another worker with short backoffs;
#: the circuit breaker reopens a worker's circuit after 2 s instead of 60
ROUTER_FLAGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "2",
    "--health-check-timeout-secs", "2",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "50",
    "--retry-max-backoff-ms", "1000",
    "--cb-failure-threshold", "3",
    "--cb-timeout-duration-secs", "2",
    "--worker-startup-timeout-secs", "60",
    "--worker-startup-check-interval", "1",
    "--log-level", "warn",
)  # fmt: skip


def why_unavailable() -> str | None:
    """None when ``sglang-router`` is importable here; otherwise the reason."""
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (requirements/dev.txt: pip install sglang-router==0.3.2)"
    return None


def toy_exe() -> str:
    """The ``toy`` command next to this interpreter."""
    exe = Path(sys.executable).parent / "toy"
    if not exe.is_file():
        raise FileNotFoundError(f"the toy command is not installed next to {sys.executable}")
    return str(exe)


def router_argv(host: str, port: int, workers: Sequence[str], policy: str, *extra: str) -> list[str]:
    """The router's command line: ``workers`` are the replicas' base URLs."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    argv += ["--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(ROUTER_METRICS_PORT)]
    return [*argv, *ROUTER_FLAGS, *extra]


class Deployment:
    """``hosts.n - 1`` replicas of ``model`` (hosts 1..) behind one router (host 0).

    ``logs``: a folder for every process's output (``replica<i>-<k>.log``, ``router-<k>.log``)."""

    def __init__(self, hosts: Hosts, model: str, key: str, logs: Path, *, ctx: int = 512, extra: Sequence[str] = ()):
        self.hosts, self.model, self.key, self.logs = hosts, model, key, logs
        self.ctx, self.extra = ctx, list(extra)
        self.replicas: dict[int, subprocess.Popen[str]] = {}
        self.router: subprocess.Popen[str] | None = None
        self.starts: dict[str, int] = {}
        logs.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ addresses

    def url(self, i: int) -> str:
        """Replica ``i``'s base URL (i >= 1)."""
        return f"http://{self.hosts.addresses[i]}:{REPLICA_PORT}"

    @property
    def workers(self) -> list[str]:
        return [self.url(i) for i in range(1, self.hosts.n)]

    @property
    def endpoint(self) -> str:
        """The one endpoint clients use: the router's base URL."""
        return f"http://{self.hosts.addresses[0]}:{ROUTER_PORT}"

    # ------------------------------------------------------------------ processes

    def _log(self, name: str) -> Any:
        k = self.starts[name] = self.starts.get(name, 0) + 1
        return open(self.logs / f"{name}-{k}.log", "w")  # noqa: SIM115 - the child owns it

    def run_ends(self, i: int) -> list[dict[str, Any]]:
        """The ``run_end`` events of replica ``i``'s run bundles (one per process that ended cleanly)."""
        ends = []
        for f in sorted((self.logs / f"runs{i}").glob("*/events.jsonl")):
            ends += [e for e in map(json.loads, f.read_text().splitlines()) if e.get("kind") == "run_end"]
        return ends

    def log_text(self, name: str) -> str:
        """Every log of ``name`` (``replica2``, ``router``), oldest first."""
        files = sorted(self.logs.glob(f"{name}-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return "".join(f"--- {p.name}\n" + p.read_text(errors="replace") for p in files)

    def start_replica(self, i: int, *extra: str) -> None:
        """``toy serve`` on host ``i`` (``extra``: more options, after the deployment's own)."""
        argv = [toy_exe(), "serve", self.model, "--host", self.hosts.addresses[i], "--port", str(REPLICA_PORT)]
        argv += ["--api-key", self.key, "--parallel", "2", "--threads", "1", "--ctx", str(self.ctx)]
        argv += ["--runs-dir", str(self.logs / f"runs{i}"), "--log-level", "info", *self.extra, *extra]
        with self._log(f"replica{i}") as out:
            self.replicas[i] = self.hosts.popen(i, argv, stdout=out, stderr=subprocess.STDOUT)

    def start_replicas(self, timeout: float = 90.0) -> None:
        for i in range(1, self.hosts.n):
            self.start_replica(i)
        self.wait_ready(self.workers, timeout)

    def start_router(self, policy: str, timeout: float = 60.0) -> None:
        """The router in front of every replica, with the replicas' API key: it asks clients for it and
        sends it with its own requests to the workers (/model_info, to name the model in its /v1/models)."""
        argv = router_argv(self.hosts.addresses[0], ROUTER_PORT, self.workers, policy, "--api-key", self.key)
        with self._log("router") as out:
            self.router = self.hosts.popen(0, argv, stdout=out, stderr=subprocess.STDOUT)
        self.wait_router(len(self.workers), timeout)

    def stop_router(self, timeout: float = 20.0) -> None:
        if self.router is None:
            return
        stop(self.router, timeout)
        self.router = None

    def signal(self, i: int, sig: int) -> None:
        """Send ``sig`` to replica ``i`` (``toy serve`` itself: the namespace wrappers exec into it)."""
        os.kill(self.replicas[i].pid, sig)

    def wait_exit(self, i: int, timeout: float) -> int:
        return self.replicas[i].wait(timeout)

    # ------------------------------------------------------------------ talking from host 0

    def client(self, *args: str, timeout: float = 120.0) -> Any:
        """Run ``python -m toy_testsupport.router ARGS`` on host 0; its stdout parsed as JSON."""
        r = self.hosts.run(0, [sys.executable, "-m", "toy_testsupport.router", *args], timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"client {args[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return json.loads(r.stdout)

    def client_popen(self, *args: str) -> subprocess.Popen[str]:
        return self.hosts.popen(0, [sys.executable, "-m", "toy_testsupport.router", *args])

    def wait_ready(self, urls: Sequence[str], timeout: float) -> None:
        """Until every one of ``urls`` (base URLs) answers /health with 200."""
        self.client("wait", *[u + "/health" for u in urls], "--timeout", str(timeout), timeout=timeout + 30)

    def wait_router(self, healthy: int, timeout: float) -> None:
        """Until the router counts ``healthy`` healthy workers."""
        args = ("wait", self.endpoint + "/readiness", "--healthy", str(healthy), "--timeout", str(timeout))
        self.client(*args, timeout=timeout + 30)

    def metrics(self, i: int) -> dict[str, float]:
        """Replica ``i``'s /metrics as {"name{labels}": value} (labels sorted, as ``parse_metrics``)."""
        got = self.client("get", self.url(i) + "/metrics")
        if got["status"] != 200:
            raise RuntimeError(f"{self.url(i)}/metrics answered {got['status']}: {got['text'][:500]}")
        return parse_metrics(got["text"])

    def send(self, requests: list[dict[str, Any]], workdir: Path, key: str | None = None) -> list[dict[str, Any]]:
        """Each ``{"path", "body"}`` POSTed to the router in turn (non-stream), with the API key (or ``key``;
        "" for none); their answers."""
        src = workdir / "requests.json"
        src.write_text(json.dumps(requests))
        key = self.key if key is None else key
        return list(self.client("send", "--base", self.endpoint, "--key", key, "--requests", str(src)))


def stop(p: subprocess.Popen[str], timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page: {"name" or "name{k=v,...}": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def load_results(path: Path) -> list[dict[str, Any]]:
    """The records a ``load`` client wrote (one JSON object a line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ====================================================================== the clients (run on host 0)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait(args: argparse.Namespace) -> int:
    import httpx

    deadline = time.monotonic() + args.timeout
    last: dict[str, str] = {}
    with httpx.Client(timeout=5) as http:
        for url in args.urls:
            while True:
                try:
                    r = http.get(url)
                    if r.status_code == 200 and (
                        args.healthy is None or r.json().get("healthy_workers") == args.healthy
                    ):
                        break
                    last[url] = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    last[url] = f"{type(e).__name__}: {e}"
                if time.monotonic() > deadline:
                    print(f"not ready within {args.timeout:g} s: {last}", file=sys.stderr)
                    return 1
                time.sleep(0.1)
    print(json.dumps({"ready": list(args.urls)}))
    return 0


def _get(args: argparse.Namespace) -> int:
    import httpx

    r = httpx.get(args.url, headers=_headers(args.key) if args.key else None, timeout=30)
    print(json.dumps({"status": r.status_code, "text": r.text}))
    return 0


def _send(args: argparse.Namespace) -> int:
    import httpx

    out = []
    with httpx.Client(base_url=args.base, headers=_headers(args.key) if args.key else None, timeout=120) as http:
        for req in json.loads(Path(args.requests).read_text()):
            r = http.post(req["path"], json=req["body"])
            out.append({"status": r.status_code, "body": r.json() if r.content else None})
    print(json.dumps(out))
    return 0


def conversation_turns(conv: int, turns: int) -> list[str]:
    """The user messages of multi-turn conversation ``conv``: its first turn opens with a text of its own
    (about 100 tokens, so each conversation's prefix spans several 16-token cache blocks)."""
    words = "apple pear plum fig lime kiwi date grape melon peach cherry mango".split()
    story = " ".join(words[(conv * 7 + k * 5) % len(words)] for k in range(60))
    first = f"Conversation {conv}. Remember this list of fruit: {story}. Which fruit comes first?"
    return [first, *[f"And which fruit is number {t + 1}?" for t in range(1, turns)]]


def _load(args: argparse.Namespace) -> int:
    """A closed loop: ``clients`` threads, each sending its next request when the last one answered,
    until ``max_requests`` in all, ``seconds`` passed, or the stop file exists. One JSON line per
    request: client, start and end (``time.time()``), status, error, ttft (streamed), text."""
    import httpx

    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - closed below
    lock = threading.Lock()
    started = [0]
    t_end = time.monotonic() + args.seconds
    stop_file = Path(args.stop_file) if args.stop_file else None

    def more() -> bool:
        with lock:
            if started[0] >= args.max_requests or time.monotonic() > t_end:
                return False
            if stop_file is not None and stop_file.exists():
                return False
            started[0] += 1
            return True

    def one(http: httpx.Client, path: str, body: dict[str, Any], rec: dict[str, Any]) -> str:
        t0 = time.monotonic()
        text: list[str] = []
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = r.read().decode(errors="replace")[:300]
                return ""
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = json.dumps(chunk["error"])[:300]
                    continue
                for c in chunk.get("choices", []):
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        rec.setdefault("ttft", time.monotonic() - t0)
                        text.append(piece)
        return "".join(text)

    def client(k: int) -> None:
        conv = args.conv_offset + k
        turns = conversation_turns(conv, args.turns) if args.workload == "multiturn" else []
        with httpx.Client(base_url=args.base, headers=_headers(args.key), timeout=args.request_timeout) as http:
            messages: list[dict[str, Any]] = []
            while more():
                rec: dict[str, Any] = {"client": k, "start": time.time()}
                if args.workload == "multiturn":
                    t = len(messages) // 2
                    messages.append({"role": "user", "content": turns[t]})
                    body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
                    path, rec["conv"], rec["turn"] = "/v1/chat/completions", conv, t
                else:
                    prompt = f"Client {k} asks: name a colour that starts with the letter {chr(65 + started[0] % 26)}."
                    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                    path = "/v1/completions"
                try:
                    reply = one(http, path, body, rec)
                except httpx.HTTPError as e:
                    rec["status"], rec["error"] = None, f"{type(e).__name__}: {e}"
                    reply = ""
                rec["end"], rec["text"] = time.time(), reply
                if args.workload == "multiturn":
                    if rec["status"] == 200 and "error" not in rec:
                        messages.append({"role": "assistant", "content": reply})
                    else:
                        messages.pop()
                    if len(messages) // 2 >= args.turns:  # a conversation done: the next one starts afresh
                        conv += args.clients
                        turns, messages = conversation_turns(conv, args.turns), []
                with lock:
                    out.write(json.dumps(rec) + "\n")

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, t_end - time.monotonic() + args.request_timeout + 5))
    out.close()
    print(json.dumps({"requests": started[0], "alive": sum(t.is_alive() for t in threads)}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toy_testsupport.router")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("urls", nargs="+")
    w.add_argument("--timeout", type=float, default=60)
    w.add_argument("--healthy", type=int, default=None, help="the router's /readiness: healthy_workers to wait for")
    g = sub.add_parser("get")
    g.add_argument("url")
    g.add_argument("--key", default=None)
    s = sub.add_parser("send")
    s.add_argument("--base", required=True)
    s.add_argument("--key", required=True, help="the API key; empty: send none")
    s.add_argument("--requests", required=True)
    lo = sub.add_parser("load")
    lo.add_argument("--base", required=True)
    lo.add_argument("--key", required=True)
    lo.add_argument("--model", required=True)
    lo.add_argument("--out", required=True)
    lo.add_argument("--clients", type=int, default=8)
    lo.add_argument("--seconds", type=float, default=20)
    lo.add_argument("--max-requests", type=int, default=200)
    lo.add_argument("--max-tokens", type=int, default=8)
    lo.add_argument("--request-timeout", type=float, default=60)
    lo.add_argument("--stop-file", default=None)
    lo.add_argument("--workload", choices=["simple", "multiturn"], default="simple")
    lo.add_argument("--turns", type=int, default=4)
    lo.add_argument("--conv-offset", type=int, default=0, help="the first conversation's number")
    args = ap.parse_args(argv)
    return {"wait": _wait, "get": _get, "send": _send, "load": _load}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "ROUTER_FLAGS",
    "Deployment",
    "conversation_turns",
    "load_results",
    "parse_metrics",
    "router_argv",
    "stop",
    "why_unavailable",
]
