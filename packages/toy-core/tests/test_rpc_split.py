"""Models split across hosts (``toy.engine.split``, ``toy.load(rpc=...)``).

- The plan, alone: contiguous blocks in device order, sized by the shares (the counts add up and
  each is within one layer of its exact share), the default by free memory (even when a device
  reports none), endpoint and ``--tensor-split`` parsing and their refusals.
- SmolLM2 split between this process's CPU and a ``toy rpc-server`` subprocess on 127.0.0.1
  (model-marked, like the other tests of the real model): greedy tokens and every logit equal
  the one-host run's, bit for bit (both sides run toy's CPU kernels), for several splits and again
  after other graphs ran (the second request of a split model once aborted in ggml's scheduler); the
  placement says where the layers went; a server killed between two requests makes the next one
  fail with ``RemoteDeviceError`` naming the endpoint, within a bounded time.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from toy.engine import split
from toy.errors import BadInputError
from toy_testsupport.rpc import start_rpc_server, stop

# ---------------------------------------------------------------- the plan


def _counts(plan: list[int], n_dev: int) -> list[int]:
    return [plan.count(d) for d in range(n_dev)]


@pytest.mark.parametrize(
    "n_layer, shares, counts",
    [
        (30, [1, 1], [15, 15]),
        (30, [1, 1, 1], [10, 10, 10]),
        (30, [3, 1], [22, 8]),  # 22.5 rounds to the even 22
        (30, [0, 1], [0, 30]),
        (30, [1, 0], [30, 0]),
        (7, [1, 1, 1], [2, 3, 2]),
        (1, [1, 1], [0, 1]),  # 0.5 rounds to 0: the one layer goes to the second device
        (0, [1, 2], [0, 0]),
    ],
)
def test_plan_counts(n_layer, shares, counts):
    plan = split.plan_layers(n_layer, shares)
    assert _counts(plan, len(shares)) == counts
    assert plan == sorted(plan)  # contiguous blocks in device order


@pytest.mark.parametrize("seed", range(20))
def test_plan_blocks_follow_the_shares(seed):
    rng = np.random.default_rng(seed)
    n_dev = int(rng.integers(1, 5))
    n_layer = int(rng.integers(1, 80))
    shares = [float(x) for x in rng.integers(0, 10, n_dev)]
    shares[int(rng.integers(0, n_dev))] += 1  # at least one > 0
    plan = split.plan_layers(n_layer, shares)
    assert len(plan) == n_layer and plan == sorted(plan)
    exact = n_layer * np.cumsum(shares) / sum(shares)
    got = np.cumsum(_counts(plan, n_dev))
    assert np.all(np.abs(got - exact) <= 0.5 + 1e-9)  # every boundary is the rounded cumulative share
    assert all(c == 0 for c, s in zip(_counts(plan, n_dev), shares) if s == 0)


@pytest.mark.parametrize("shares", [[], [0, 0], [-1, 2], [float("nan"), 1], [float("inf"), 1]])
def test_plan_refuses_bad_shares(shares):
    with pytest.raises(ValueError):
        split.plan_layers(10, shares)


def test_shares_by_memory_and_by_tensor_split():
    assert split.shares_for([3 << 30, 1 << 30], None) == [3 << 30, 1 << 30]
    assert split.shares_for([3 << 30, 0], None) == [1.0, 1.0]  # one figure unknown: an even split
    assert split.shares_for([5, 7], [1, 3]) == [1.0, 3.0]
    with pytest.raises(BadInputError) as e:
        split.shares_for([5, 7, 9], [1, 3])
    assert e.value.field == "tensor_split" and "3 devices" in str(e.value)


def test_placement_describes_its_blocks():
    p = split.plan(30, ["CPU", "RPC0[10.0.0.2:50052]"], ["CPU", "RPC[10.0.0.2:50052]"], [8, 8])
    assert p.split
    assert p.describe() == "layers 0-14 CPU, 15-29 RPC[10.0.0.2:50052]"
    assert p.device_of("blk.3.attn_q.weight") == "CPU"
    assert p.device_of("blk.15.ffn_down.weight") == "RPC0[10.0.0.2:50052]"
    assert p.device_of("token_embd.weight") == "CPU" and p.device_of("output.weight") == "CPU"
    assert p.to_dict()["layers"] == [
        {"first": 0, "last": 14, "device": "CPU"},
        {"first": 15, "last": 29, "device": "RPC[10.0.0.2:50052]"},
    ]
    one = split.plan(3, ["CPU", "RPC0"], ["CPU", "RPC[h:1]"], [1, 1], [0, 1])
    assert one.describe() == "layers 0-2 RPC[h:1]"
    local = split.plan(2, ["CPU", "RPC0"], ["CPU", "RPC[h:1]"], [1, 1], [1, 0])
    assert not local.split and local.describe() == "layers 0-1 CPU"


def test_layer_of():
    assert split.layer_of("blk.0.attn_norm.weight") == 0
    assert split.layer_of("blk.29.ffn_up.weight") == 29
    assert split.layer_of("token_embd.weight") is None
    assert split.layer_of("output_norm.weight") is None
    assert split.layer_of("blkx.1.w") is None


def test_endpoints_parse_and_refuse():
    assert split.parse_endpoints(None) == [] and split.parse_endpoints("") == []
    assert split.parse_endpoints("10.0.0.2:50052, 10.0.0.3:50053") == ["10.0.0.2:50052", "10.0.0.3:50053"]
    assert split.parse_endpoints(["gpu-box:1", "h.lan:50052,"]) == ["gpu-box:1", "h.lan:50052"]
    assert split.parse_endpoint(" host:0080 ") == "host:80"
    for bad in ("host", "host:", ":50052", "host:0", "host:65536", "::1:50052", "[::1]:50052", "a b:1", "host:port"):
        with pytest.raises(BadInputError) as e:
            split.parse_endpoints(bad)
        assert e.value.field == "rpc" and e.value.hint
    with pytest.raises(BadInputError, match="twice"):
        split.parse_endpoints("h:1,h:1")


def test_tensor_split_parse_and_refuse():
    assert split.parse_tensor_split(None) is None and split.parse_tensor_split(" ") is None
    assert split.parse_tensor_split("3,1") == [3.0, 1.0]
    assert split.parse_tensor_split([0.5, 0.5]) == [0.5, 0.5]
    for bad in ("a,1", "-1,2", "0,0", "nan,1", "1,,2"):
        with pytest.raises(BadInputError) as e:
            split.parse_tensor_split(bad)
        assert e.value.field == "tensor_split"


# ---------------------------------------------------------------- SmolLM2 over loopback

PROMPT = "The three primary colors are"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_server(tmp_path):
    p = start_rpc_server(tmp_path, _free_port())
    try:
        yield p, f"127.0.0.1:{p.args[p.args.index('--port') + 1]}"
    finally:
        stop(p)


@pytest.fixture(scope="module")
def one_host(smollm2_path):
    """The reference: the one-host run (CPU, one thread) of the prompt's logits and greedy tokens."""
    import toy

    with toy.load(smollm2_path, device="cpu", threads=1, n_ctx=256) as m:
        ids = m.prompt_ids(PROMPT)
        g = m.generate(ids, temperature=0, max_tokens=24, ignore_eos=True)
        return ids, m.logits(ids), g.tokens


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("tensor_split", [None, "1,2", "0,1"])
def test_split_model_equals_one_host(smollm2_path, one_host, rpc_server, tensor_split):
    import toy

    ids, logits, tokens = one_host
    proc, endpoint = rpc_server
    with toy.load(smollm2_path, device="cpu", threads=1, n_ctx=256, rpc=[endpoint], tensor_split=tensor_split) as m:
        n = m.cfg.n_layer
        expect = {None: None, "1,2": round(n / 3), "0,1": 0}[tensor_split]
        if expect is None:  # by free memory: both sides are this machine, so neither gets every layer
            local = m.placement.layers.count(0)
            assert 0 < local < n, m.describe()
        else:
            assert m.placement.layers.count(0) == expect, m.describe()
        assert m.placement.split
        assert m.describe().endswith(f"{n - 1} RPC[{endpoint}]")
        remote = m.engine.cache.device.split("+")[1:]
        assert len(remote) == 1 and endpoint in remote[0]
        got = m.logits(ids)
        assert got.dtype == logits.dtype and np.array_equal(got, logits)
        g = m.generate(ids, temperature=0, max_tokens=24, ignore_eos=True)
        assert g.tokens == tokens
        # again, after other graphs ran: a graph split across devices is never allocated twice (ggml's scheduler
        # rewrites its inputs), so this also checks that the engine rebuilds instead of reusing a stale one
        assert np.array_equal(m.logits(ids), logits)
        assert m.generate(ids, temperature=0, max_tokens=24, ignore_eos=True).tokens == tokens
    assert proc.poll() is None  # the server outlives its client


@pytest.mark.model
@pytest.mark.slow
def test_server_killed_between_requests_is_a_clean_error(smollm2_path, rpc_server, monkeypatch):
    import toy

    monkeypatch.setenv("TOY_RPC_TIMEOUT", "10")
    proc, endpoint = rpc_server
    with toy.load(smollm2_path, device="cpu", threads=1, n_ctx=128, rpc=[endpoint]) as m:
        ids = m.prompt_ids(PROMPT)
        m.generate(ids, temperature=0, max_tokens=2)
        stop(proc)
        t0 = time.monotonic()
        with pytest.raises(split.RemoteDeviceError) as e:
            m.generate(ids, temperature=0, max_tokens=8)
        assert time.monotonic() - t0 < 30
        assert endpoint in str(e.value) and e.value.hint


@pytest.mark.model
def test_unreachable_endpoint_is_refused_before_loading(smollm2_path):
    import toy

    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(split.RemoteDeviceError) as e:
        toy.load(smollm2_path, device="cpu", threads=1, n_ctx=64, rpc=f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30
    assert f"127.0.0.1:{port}" in str(e.value) and e.value.endpoint == f"127.0.0.1:{port}"


@pytest.mark.model
def test_tensor_split_needs_one_share_per_device(smollm2_path, rpc_server):
    import toy

    _, endpoint = rpc_server
    with pytest.raises(BadInputError) as e:
        toy.load(smollm2_path, device="cpu", threads=1, n_ctx=64, rpc=endpoint, tensor_split="1,1,1")
    assert e.value.field == "tensor_split" and "3 numbers for 2 devices" in str(e.value)
