"""toy serve replicas behind ``sglang-router``, on network-namespace hosts (``toy_testsupport.netns``).

Host 0 runs the router and the clients, hosts 1-3 one ``toy serve`` replica each (the real SmolLM2,
``--parallel 2 --threads 1``, one API key that the router passes through). What must hold, checked
against independent evidence:

- every answer through the router equals the library's greedy output for that request
  (``toy.load(..., exact_batching=True)``, as the server loads the model; slot 0, no HTTP);
- a replica killed with SIGKILL under a closed loop of 8 clients fails only requests that were in
  flight when it died (the router retries the others on the remaining replicas); restarted, it
  serves requests again (its own /metrics counts them);
- a rolling restart of all replicas (SIGTERM, drain, exit, start, ready, next) under the same load
  fails no request, and the drains had requests to finish;
- a replica whose queue is full answers 429 and the router retries the request on another replica:
  no client sees it;
- the router, given the replicas' key (``--api-key``), refuses clients without it and names the
  model in its /v1/models from the replicas' ``GET /server_info``;
- cache-aware routing against round-robin on a multi-turn chat load: the replicas' prefix-cache
  figures (/metrics) and the clients' time to first token, printed; cache-aware keeps each
  conversation on one replica, so it must reuse more cached prompt tokens than round-robin.

Skips (with the reason) where namespaces cannot be made (not root, no ``ip``); a missing
``sglang-router`` is a failure (requirements/dev.txt has it, and CI runs as root).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from toy_testsupport import netns
from toy_testsupport import router as rt

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "router-key"
CTX = 512
N = 8  # tokens per answer
CLIENTS = 8


@pytest.fixture(scope="module")
def dep(smollm2_path, tmp_path_factory) -> Iterator[rt.Deployment]:
    why = netns.why_unavailable()
    if why:
        pytest.skip(why)
    why = rt.why_unavailable()
    if why:
        pytest.fail(why)
    logs = tmp_path_factory.mktemp("router-logs")
    with ExitStack() as stack:  # the namespaces and every process in them go at the end, also on failure
        try:
            hosts = stack.enter_context(netns.hosts(4))
        except netns.NetnsUnavailable as e:  # `ip netns add` refused (a container without the right)
            pytest.skip(str(e))
        d = rt.Deployment(hosts, str(smollm2_path), KEY, logs, ctx=CTX)
        d.start_replicas(timeout=120)
        yield d


@pytest.fixture
def routed(dep) -> Iterator[rt.Deployment]:
    """The deployment with a round-robin router in front (stopped after the test): every replica gets work.
    (Cache-aware routing sends unrelated requests of a light load to one replica.)"""
    dep.start_router("round_robin")
    try:
        yield dep
    finally:
        dep.stop_router()


@pytest.fixture(scope="module")
def alias(smollm2_path) -> str:
    return Path(smollm2_path).stem


def _requests_served(m: dict[str, float], status: str | None = "200") -> float:
    """Completions and chat requests a replica answered with ``status`` (None: any) (its /metrics)."""
    return sum(
        v
        for k, v in m.items()
        if k.startswith("toy_requests_total{")
        and (status is None or f"status={status}" in k)
        and ("/v1/completions" in k or "/v1/chat/completions" in k)
    )


def _load(d: rt.Deployment, out: Path, alias: str, **kw: object) -> tuple[subprocess.Popen[str], Path]:
    """A closed-loop load on host 0, in the background, stopped by touching the returned stop file."""
    stop_file = out.with_suffix(".stop")
    args = ["load", "--base", d.endpoint, "--key", KEY, "--model", alias, "--out", str(out)]
    args += ["--clients", str(CLIENTS), "--max-tokens", str(N), "--stop-file", str(stop_file)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return d.client_popen(*args), stop_file


def _finish(p: subprocess.Popen[str], stop_file: Path | None, timeout: float = 90) -> None:
    """Stop the load (``stop_file``; None: let it end by itself) and wait for its end."""
    if stop_file is not None:
        stop_file.touch()
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]


def _failed(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("status") != 200 or "error" in r]


def _restart(d: rt.Deployment, i: int, *extra: str) -> None:
    d.signal(i, signal.SIGTERM)
    assert d.wait_exit(i, 40) == 0, d.log_text(f"replica{i}")[-3000:]
    d.start_replica(i, *extra)
    d.wait_ready([d.url(i)], 60)
    d.wait_router(3, 30)


# ---------------------------------------------------------------------------------------------------- a


def test_every_answer_through_the_router_equals_the_library(routed, smollm2_path, alias, tmp_path):
    import toy

    prompts = ["The capital of France is", "Once upon a time, a small robot", "1, 2, 3, 4,"]
    chats = [
        [{"role": "user", "content": "Name a fruit."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}],
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Again, louder."}],
    ]  # fmt: skip
    greedy = {"model": alias, "max_tokens": N, "temperature": 0}
    reqs = [{"path": "/v1/completions", "body": {**greedy, "prompt": p}} for p in prompts]
    reqs += [{"path": "/v1/chat/completions", "body": {**greedy, "messages": m}} for m in chats]
    reqs = reqs * 2  # 12 requests over 3 replicas: each of them answers some
    got = routed.send(reqs, tmp_path)

    ref = toy.load(smollm2_path, n_ctx=CTX, n_slot=1, threads=1, exact_batching=True)
    try:
        for req, ans in zip(reqs, got):
            assert ans["status"] == 200, ans
            body = req["body"]
            g = ref.generate(body.get("prompt") or body["messages"], temperature=0, max_tokens=N)
            choice = ans["body"]["choices"][0]
            text = choice["text"] if "prompt" in body else choice["message"]["content"]
            assert (text, ans["body"]["usage"]["prompt_tokens"]) == (g.text, g.prompt_tokens), req
    finally:
        ref.close()
    served = [_requests_served(routed.metrics(i)) for i in range(1, 4)]
    assert sum(served) >= len(reqs) and all(n > 0 for n in served), served


def test_the_router_names_the_model_and_checks_the_key(routed, alias, tmp_path):
    # the router learnt the model's name from the replicas' /server_info (asked with its --api-key)
    listed = routed.client("get", routed.endpoint + "/v1/models", "--key", KEY)
    assert listed["status"] == 200 and [m["id"] for m in json.loads(listed["text"])["data"]] == [alias]
    info = routed.client("get", routed.url(1) + "/server_info", "--key", KEY)
    assert info["status"] == 200 and json.loads(info["text"]) == {
        "model_path": alias, "served_model_name": alias, "is_generation": True, "max_context_length": CTX
    }  # fmt: skip
    assert routed.client("get", routed.url(1) + "/server_info")["status"] == 401  # the replica's key applies
    # with --api-key the router itself refuses a client without the key (its /v1/models is open)
    req = {"path": "/v1/completions", "body": {"model": alias, "prompt": "Hi", "max_tokens": 1}}
    before = sum(_requests_served(routed.metrics(i), None) for i in range(1, 4))
    for key in ("", "wrong"):
        assert [a["status"] for a in routed.send([req], tmp_path, key=key)] == [401], key
    assert sum(_requests_served(routed.metrics(i), None) for i in range(1, 4)) == before  # no replica saw them


# ---------------------------------------------------------------------------------------------------- b


def test_sigkill_fails_only_the_requests_in_flight_and_the_replica_comes_back(routed, alias, tmp_path):
    out = tmp_path / "kill.jsonl"
    p, stop_file = _load(routed, out, alias, seconds=40, max_requests=400)
    try:
        time.sleep(4)
        t_kill = time.time()
        routed.signal(2, signal.SIGKILL)
        routed.wait_exit(2, 10)
        routed.wait_router(2, 10)  # its health checks took replica 2 out of the rotation (within ~1 s)
        time.sleep(3)  # the others carry the load
        before = len(rt.load_results(out))
        routed.start_replica(2)
        routed.wait_ready([routed.url(2)], 60)
        routed.wait_router(3, 30)
        time.sleep(4)  # replica 2 back in rotation, under the same load
    finally:
        _finish(p, stop_file)
    recs = rt.load_results(out)
    failed = _failed(recs)
    in_flight = [r for r in recs if r["start"] <= t_kill <= r["end"]]
    print(f"\n{len(recs)} requests, {len(failed)} failed, {len(in_flight)} in flight at the kill; "
          f"{len(recs) - before} after the restart")  # fmt: skip
    assert len(recs) > before > 0
    # a failure is a request that was in flight on the killed replica (at most its 2 slots + what it had queued)
    assert all(r["start"] <= t_kill <= r["end"] for r in failed), failed
    assert len(failed) <= len(in_flight) and len(failed) <= CLIENTS, failed
    served = _requests_served(routed.metrics(2))  # the new process's counters: only what it served since
    assert served > 0, routed.log_text("replica2")[-3000:]


# ---------------------------------------------------------------------------------------------------- c


def test_rolling_restart_under_load_fails_no_request(routed, alias, tmp_path):
    out = tmp_path / "rolling.jsonl"
    p, stop_file = _load(routed, out, alias, seconds=150, max_requests=2000)
    try:
        time.sleep(3)
        for i in (1, 2, 3):
            _restart(routed, i)
            time.sleep(1)
    finally:
        _finish(p, stop_file)
    recs = rt.load_results(out)
    failed = _failed(recs)
    print(f"\nrolling restart: {len(recs)} requests, {len(failed)} failed")
    assert len(recs) > 20
    assert failed == []
    # the drain did the work: replicas had requests in flight at SIGTERM, and ended none of them
    drained = [i for i in (1, 2, 3) if "request(s) in flight" in routed.log_text(f"replica{i}")]
    assert drained, "no replica had a request in flight when it got SIGTERM"
    assert all(e["abandoned"] == 0 for i in (1, 2, 3) for e in routed.run_ends(i))
    for i in (1, 2, 3):  # every restarted replica served requests again
        assert _requests_served(routed.metrics(i)) > 0, i


def test_a_full_replica_answers_429_and_the_router_retries_elsewhere(routed, alias, tmp_path):
    _restart(routed, 1, "--parallel", "1", "--max-queue", "1")  # room for 2 sequences: 12 clients overflow it
    try:
        out = tmp_path / "full.jsonl"
        p, _ = _load(routed, out, alias, seconds=30, max_requests=36, clients=12)
        _finish(p, None, timeout=120)
        recs = rt.load_results(out)
        refused = _requests_served(routed.metrics(1), "429")
        print(f"\n{len(recs)} requests, {len(_failed(recs))} failed; replica 1 answered 429 {refused:g} times")
        assert refused > 0  # the replica said "full" ...
        assert len(recs) == 36 and _failed(recs) == []  # ... and no client saw it: retried on another replica
    finally:
        _restart(routed, 1)


# ---------------------------------------------------------------------------------------------------- d


def _cache_figures(d: rt.Deployment) -> dict[str, float]:
    tot = {"hits": 0.0, "misses": 0.0, "cached": 0.0, "prompt": 0.0}
    for i in range(1, 4):
        m = d.metrics(i)
        tot["hits"] += m.get("toy_prefix_cache_hits_total", 0.0)
        tot["misses"] += m.get("toy_prefix_cache_misses_total", 0.0)
        tot["cached"] += m.get("toy_prefix_cache_cached_tokens_total", 0.0)
        tot["prompt"] += m.get("toy_prompt_tokens_total", 0.0)
    return tot


def test_cache_aware_routing_reuses_more_prefix_than_round_robin(dep, alias, tmp_path):
    turns, convs_per_client = 4, 1
    results: dict[str, dict[str, float]] = {}
    for n, policy in enumerate(["round_robin", "cache_aware"]):
        dep.start_router(policy)
        try:
            before = _cache_figures(dep)
            out = tmp_path / f"{policy}.jsonl"
            reqs = CLIENTS * turns * convs_per_client
            # each policy gets conversations of its own (the replicas' caches outlive the router)
            p, _ = _load(dep, out, alias, seconds=120, max_requests=reqs, workload="multiturn",
                         turns=turns, conv_offset=1000 * (n + 1))  # fmt: skip
            _finish(p, None, timeout=200)  # it ends after its requests
            after = _cache_figures(dep)
        finally:
            dep.stop_router()
        recs = rt.load_results(out)
        assert len(recs) == reqs and _failed(recs) == [], _failed(recs)[:3]
        d = {k: after[k] - before[k] for k in after}
        later = sorted(r["ttft"] for r in recs if r["turn"] > 0 and "ttft" in r)
        results[policy] = {
            "hit_ratio": d["hits"] / max(1.0, d["hits"] + d["misses"]),
            "cached_share": d["cached"] / max(1.0, d["prompt"]),
            "ttft_p50": later[len(later) // 2],
            "ttft_p95": later[min(len(later) - 1, int(len(later) * 0.95))],
        }
    print()
    for policy, r in results.items():
        print(f"{policy:12s} prefix-cache hit ratio {r['hit_ratio']:.2f}, cached share of prompt tokens "
              f"{r['cached_share']:.2f}, TTFT of later turns p50 {r['ttft_p50'] * 1000:.0f} ms "
              f"p95 {r['ttft_p95'] * 1000:.0f} ms")  # fmt: skip
    assert results["cache_aware"]["cached_share"] > results["round_robin"]["cached_share"]
