"""Speculative decoding (prompt lookup) in ``toy serve``: decode tokens/s with and without it, on a copy-heavy
task and on free writing, against llama.cpp's llama-server with and without its own prompt lookup
(``--spec-type ngram-simple``), same GGUF (SmolLM2-135M-Instruct Q4_1), same threads (``$TOY_BENCH_THREADS``,
2), in the same run.

Tasks (completions, ``temperature=0``, ``max_tokens=256``, end of generation ignored on both servers):

- copy-heavy: a ~300-token Python file, then "The same code with the class Inventory renamed to Stock:" and
  the file's first line: the model rewrites the file, copying most of it (what prompt lookup is for);
- free writing: a story prompt; little of the output repeats the prompt.

toy runs one server (``--parallel 1``) and switches speculation per request (``"speculative": {"type":
"none"}`` or ``{"type": "ngram"}``, the defaults n=3, k=8). llama-server runs twice, plain and with
``--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8`` (the same lookup
length and draft size). One server at a time, each warmed up with one untimed request per task; every figure
is the median of ``$TOY_BENCH_SPEC_REPS`` (3) streamed requests, plain and speculative alternating. Decode
tokens/s is measured by the client: (tokens - 1) / (last chunk - first chunk), tokens from the usage (toy) or
the finish reason ``length`` (256). Each request's text with speculation must equal the plain one's (toy
promises it; for llama-server it is recorded, not required).

Targets (issue 34): toy with prompt lookup >= 1.5x toy plain on the copy-heavy task and >= 0.95x on free
writing; toy's speculative tokens/s against llama-server's speculative tokens/s is recorded as a ratio.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
REPS = int(os.environ.get("TOY_BENCH_SPEC_REPS", "3"))
MAX_TOKENS = 256
N_CTX = 1024
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600
MODEL_ID = "smollm2"

CODE = """import json
import os
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1
    tags: list[str] = field(default_factory=list)

    def total(self) -> float:
        return self.price * self.quantity


class Inventory:
    def __init__(self, path: str):
        self.path = path
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.name in self.items:
            self.items[item.name].quantity += item.quantity
        else:
            self.items[item.name] = item

    def remove(self, name: str, quantity: int = 1) -> None:
        item = self.items[name]
        item.quantity -= quantity
        if item.quantity <= 0:
            del self.items[name]

    def value(self) -> float:
        return sum(item.total() for item in self.items.values())

    def save(self) -> None:
        data = [item.__dict__ for item in self.items.values()]
        with open(self.path, "w") as f:
            json.dump(data, f, indent=2)

    def load(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            for row in json.load(f):
                self.add(Item(**row))
"""
TASKS = {
    "copy-heavy": f"```python\n{CODE}```\n\nThe same code with the class Inventory renamed to Stock:\n"
    "```python\nimport json\n",
    "free-writing": "Write a long story about a lighthouse keeper who finds a message in a bottle, and what "
    "happens when she decides to answer it.\n\nStory:\n",
}
TARGETS = {"copy-heavy": 1.5, "free-writing": 0.95}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess, its log in a file, ready once /health answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, logdir: Path):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = logdir / f"{name}.log"
        self.log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT_S} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def generate(url: str, prompt: str, extra: dict) -> dict:
    """One streamed completion: decode tokens/s after the first chunk, the text, the server's timings."""
    import httpx

    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body.update(ignore_eos=True, stream_options={"include_usage": True}, **extra)
    first = last = None
    text, usage, finish, timings = [], None, None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            msg = json.loads(line[5:])
            usage = msg.get("usage") or usage
            timings = msg.get("timings") or timings
            for ch in msg.get("choices") or ():
                if ch.get("text"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(ch["text"])
                finish = ch.get("finish_reason") or finish
    tokens = usage["completion_tokens"] if usage else (MAX_TOKENS if finish == "length" else len(text))
    rate = (tokens - 1) / (last - first) if first is not None and last > first else None
    return {"tok_s": rate, "tokens": tokens, "text": "".join(text), "timings": timings, "usage": usage}


def measure(url: str, variants: dict[str, dict]) -> dict[str, dict[str, list[dict]]]:
    """runs[task][variant]: REPS results each, the variants alternating within each repetition."""
    runs: dict[str, dict[str, list[dict]]] = {t: {v: [] for v in variants} for t in TASKS}
    for task, prompt in TASKS.items():
        for extra in variants.values():
            generate(url, prompt, extra)  # warm-up: graphs, caches
        for _ in range(REPS):
            for name, extra in variants.items():
                time.sleep(0.5)
                res = generate(url, prompt, extra)
                sys.stderr.write(f"[bench speculative] {url} {task} {name}: {res['tok_s']}\n")
                runs[task][name].append(res)
    return runs


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


def test_speculative_prompt_lookup(record, bench_line, smollm2_path, tmp_path):
    model = str(smollm2_path)
    med = statistics.median
    port = free_port()
    argv = [sys.executable, "-m", "toy_cli", "serve", model, "--port", str(port), "--threads", str(THREADS)]
    argv += ["--parallel", "1", "--ctx", str(N_CTX), "--runs-dir", str(tmp_path / "runs"), "--alias", MODEL_ID]
    argv += ["--log-level", "warning", "--cache-ram", "0"]
    srv = Server("toy", argv, port, tmp_path)
    try:
        srv.wait_ready()
        toy = measure(
            srv.url, {"plain": {"speculative": {"type": "none"}}, "ngram": {"speculative": {"type": "ngram"}}}
        )
    finally:
        srv.close()
    peer: dict[str, dict[str, list[dict]]] = {t: {} for t in TASKS}
    binary, how = llama_server_binary()
    if binary is not None:
        spec_args = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
        spec_args += ["--spec-ngram-simple-size-m", "8"]
        for name, extra_args in (("plain", []), ("ngram", spec_args)):
            port = free_port()
            argv = [binary, "-m", model, "--port", str(port), "--alias", MODEL_ID, "-t", str(THREADS)]
            argv += ["-tb", str(THREADS), "-c", str(N_CTX), "--parallel", "1", "--no-webui", *extra_args]
            srv = Server(f"llama-server-{name}", argv, port, tmp_path)
            try:
                srv.wait_ready()
                for task, res in measure(srv.url, {name: {}}).items():
                    peer[task][name] = res[name]
            finally:
                srv.close()
    for task in TASKS:
        plain, spec = toy[task]["plain"], toy[task]["ngram"]
        ratios = [s["tok_s"] / p["tok_s"] for s, p in zip(spec, plain)]
        details = [(s["usage"] or {}).get("completion_tokens_details") or {} for s in spec]
        accepted = [d.get("accepted_prediction_tokens", 0) for d in details]
        drafted = [a + d.get("rejected_prediction_tokens", 0) for a, d in zip(accepted, details)]
        same = all(s["text"] == plain[0]["text"] for s in spec + plain)
        ctx = {}
        if peer[task]:
            pp, ps = peer[task]["plain"], peer[task]["ngram"]
            ctx = {
                "peer": "llama-server",
                "peer_binary": how,
                "peer_plain_tok_s": med(r["tok_s"] for r in pp),
                "peer_ngram_tok_s": med(r["tok_s"] for r in ps),
                "peer_speedup": med(r["tok_s"] for r in ps) / med(r["tok_s"] for r in pp),
                "vs_peer_ngram": med(r["tok_s"] for r in spec) / med(r["tok_s"] for r in ps),
                "peer_same_text": all(r["text"] == pp[0]["text"] for r in ps),
                "peer_draft": [r["timings"] and r["timings"].get("draft_n") for r in ps],
                "peer_draft_accepted": [r["timings"] and r["timings"].get("draft_n_accepted") for r in ps],
            }
        else:
            ctx = {"peer_available": False, "note": how}
        record(
            "speculative",
            figure=f"decode tokens/s with prompt lookup, {task} (median of {REPS})",
            value=med(r["tok_s"] for r in spec),
            unit="tokens/s",
            plain_tok_s=med(r["tok_s"] for r in plain),
            ratio=med(ratios),
            round_ratios=ratios,
            target=f">= {TARGETS[task]}",
            met=med(ratios) >= TARGETS[task],
            draft_tokens=drafted,
            draft_accepted=accepted,
            same_text_as_plain=same,
            threads=THREADS,
            loadavg_1m=os.getloadavg()[0],
            **ctx,
        )
        assert same, f"{task}: speculative text differs from plain"
