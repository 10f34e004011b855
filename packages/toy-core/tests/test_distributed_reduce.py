"""The fixed-order gradient reduction of ``toy.train.distributed``, piece by
piece: ``owners`` (which rank owns each tensor), ``ordered_sum`` (the float32
left fold), and ``World.reduce_owned`` / ``World.gather_owned`` across real
ranks (``mpiexec -n N`` on a small script), checked against NumPy.

References: NumPy's float32 additions written out in rank order
(``toy_testsupport.ranks.ordered_sums``), from the inputs each rank saved;
the balance bound of ``owners`` follows from its rule (a tensor goes to the
rank whose share of the total its middle falls in, so a rank's load exceeds
total/N by less than one tensor). The data mixes magnitudes so that another
summation order gives other bits (asserted, so the comparisons can fail).

A rank that never sends: its peers raise ``CommTimeoutError`` naming it
(and only it) after ``TOY_COMM_TIMEOUT`` seconds.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from toy.train.distributed import ordered_sum, owners
from toy_testsupport import ranks as R

# ------------------------------------------------------------------ owners


def loads(sizes: list[int], owner: list[int], n: int) -> list[int]:
    out = [0] * n
    for s, o in zip(sizes, owner, strict=True):
        out[o] += s
    return out


def assert_valid(sizes: list[int], owner: list[int], n: int) -> None:
    assert len(owner) == len(sizes)
    assert all(0 <= o < n for o in owner)
    assert owner == sorted(owner)  # contiguous runs of the list, in rank order
    if sizes:
        total, biggest = sum(sizes), max(sizes)
        for load in loads(sizes, owner, n):
            assert abs(load - total / n) <= biggest, (load, total / n, biggest)


def test_owners_of_nothing_and_of_one_rank():
    assert owners([], 3) == []
    assert owners([5, 7, 1], 1) == [0, 0, 0]


def test_owners_split_equal_tensors_evenly():
    assert owners([1] * 6, 3) == [0, 0, 1, 1, 2, 2]
    assert owners([8] * 4, 2) == [0, 0, 1, 1]


def test_owners_with_fewer_tensors_than_ranks():
    owner = owners([10, 10], 3)
    assert_valid([10, 10], owner, 3)
    assert owner == [0, 2]  # the middles at 1/4 and 3/4 of the total: rank 1 owns nothing
    assert owners([4], 4) == [2]
    assert_valid([0, 0, 0], owners([0, 0, 0], 2), 2)  # zero-size tensors: no division by zero


def test_owners_balance_and_contiguity_on_random_sizes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k, n = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        sizes = [int(x) for x in rng.integers(1, 5000, k) * (rng.random(k) < 0.9)]  # some zero-size tensors
        owner = owners(sizes, n)
        assert_valid(sizes, owner, n)
        assert owners(sizes, n) == owner  # deterministic


def test_owners_balance_a_model_like_list():
    # an embedding, then blocks of (norm, 4 attention matrices, 3 MLP matrices), a final norm and an output matrix
    sizes = [49152 * 64] + [64, 64 * 64, 64 * 32, 64 * 32, 64 * 64, 64 * 128, 64 * 128, 128 * 64] * 8 + [64, 49152 * 64]
    for n in (2, 3, 4):
        owner = owners(sizes, n)
        assert_valid(sizes, owner, n)
        assert set(owner) == set(range(n))


# ------------------------------------------------------------------ ordered_sum


def mixed(rng, shape, scale_seed: int) -> np.ndarray:
    """float32 values of mixed magnitudes: sums of them depend on the order."""
    mags = 10.0 ** np.random.default_rng(scale_seed).integers(-4, 5, shape)
    return (rng.standard_normal(shape) * mags).astype(np.float32)


def test_ordered_sum_is_the_float32_left_fold():
    rng = np.random.default_rng(1)
    pieces = [mixed(rng, (257,), 7) for _ in range(5)]
    kept = [p.copy() for p in pieces]
    got = ordered_sum(pieces)
    want = R.ordered_sums([[p] for p in pieces])[0]
    assert got.dtype == np.float32 and got.shape == (257,)
    assert got.tobytes() == want.tobytes()
    backwards = R.ordered_sums([[p] for p in pieces[::-1]])[0]
    assert backwards.tobytes() != want.tobytes()  # the data is order-sensitive: the check above means something
    assert all(a.tobytes() == b.tobytes() for a, b in zip(pieces, kept))  # inputs untouched
    one = ordered_sum([pieces[0]])
    assert one.tobytes() == pieces[0].tobytes() and one is not pieces[0]
    shaped = ordered_sum([p.reshape(1, 257) for p in pieces])
    assert shaped.shape == (1, 257) and shaped.tobytes() == want.tobytes()


# ------------------------------------------------------------------ across ranks

SHAPES = [(1,), (2,), (3, 5), (7,), (1, 1), (4, 3, 2), (11,)]

_REDUCE = r"""
import json, sys
import numpy as np
from toy.train.distributed import World, owners

out, cases = sys.argv[1], json.loads(sys.argv[2])
world = World.from_env()
r, n = world.rank, world.size
for name, case in cases.items():
    shapes = [tuple(s) for s in case["shapes"]]
    owner = case["owner"] if case["owner"] is not None else owners([int(np.prod(s)) for s in shapes], n)
    rng = np.random.default_rng(1000 * r + len(name))
    mags = np.random.default_rng(len(name))
    arrays = [(rng.standard_normal(s) * 10.0 ** mags.integers(-4, 5, s)).astype(np.float32) for s in shapes]
    world.take_stats()
    reduced = {i: a.copy() for i, a in world.reduce_owned(arrays, owner).items()}  # the next call reuses its buffers
    sent_reduce = world.take_stats().sent
    mine = {i: (a * np.float32(0.5) - np.float32(i)).astype(np.float32) for i, a in reduced.items()}
    got = world.gather_owned(mine, owner, shapes)
    sent_gather = world.take_stats().sent
    full = {**mine, **got}
    # in place, as TrainEngine does with host memory: the sums written over the rank's own inputs, the
    # gathered tensors received into given arrays
    own = [a.copy() for a in arrays]
    world.reduce_owned(own, owner, into={i: own[i] for i, o in enumerate(owner) if o == r})
    given = {i: np.full(shapes[i], np.nan, np.float32) for i, o in enumerate(owner) if o != r}
    world.gather_owned(mine, owner, shapes, into=given)
    np.savez(f"{out}/{name}-{r}.npz", **{f"in{i}": a for i, a in enumerate(arrays)},
             **{f"red{i}": a for i, a in reduced.items()}, **{f"all{i}": a for i, a in full.items()},
             **{f"own{i}": own[i] for i in reduced}, **{f"given{i}": a for i, a in given.items()})
    with open(f"{out}/{name}-{r}.json", "w") as f:
        json.dump({"owner": owner, "sent_reduce": sent_reduce, "sent_gather": sent_gather,
                   "gathered": sorted(got)}, f)
world.barrier()
"""


def cases_for(n: int) -> dict:
    skew = [0] * len(SHAPES) if n == 2 else [0, 0, 2, 2, 2, 2, 2]  # rank 1 owns nothing
    return {
        "balanced": {"shapes": SHAPES, "owner": None},
        "skewed": {"shapes": SHAPES, "owner": skew},
        "fewer": {"shapes": [(1,), (3,)], "owner": None},  # fewer tensors than 3 ranks
        "single": {"shapes": [(1,)], "owner": None},
    }


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_and_gather_across_ranks_match_numpy(tmp_path, n):
    script = tmp_path / "reduce.py"
    script.write_text(_REDUCE)
    cases = cases_for(n)
    r = R.run([sys.executable, str(script), str(tmp_path), json.dumps(cases)], n, cwd=tmp_path, timeout=90)
    assert r.returncode == 0, r.stderr
    order_matters = False
    for name, case in cases.items():
        shapes = [tuple(s) for s in case["shapes"]]
        files = [np.load(tmp_path / f"{name}-{k}.npz") for k in range(n)]
        facts = [json.loads((tmp_path / f"{name}-{k}.json").read_text()) for k in range(n)]
        owner = facts[0]["owner"]
        assert all(f["owner"] == owner for f in facts)
        inputs = [[f[f"in{i}"] for i in range(len(shapes))] for f in files]
        want = R.ordered_sums(inputs)
        reverse = R.ordered_sums(inputs[::-1])
        order_matters |= any(a.tobytes() != b.tobytes() for a, b in zip(want, reverse))
        sizes = [int(np.prod(s)) for s in shapes]
        for k, f in enumerate(files):
            mine = [i for i, o in enumerate(owner) if o == k]
            assert sorted(int(x[3:]) for x in f.files if x.startswith("red")) == mine, (name, k)
            for i in mine:
                got = f[f"red{i}"]
                assert got.shape == shapes[i] and got.dtype == np.float32
                assert got.tobytes() == want[i].tobytes(), (name, k, i)
                assert f[f"own{i}"].tobytes() == want[i].tobytes(), (name, k, i)  # summed over its own input
            # every rank ends with every tensor: the owner's update, bit for bit
            for i in range(len(shapes)):
                upd = (want[i] * np.float32(0.5) - np.float32(i)).astype(np.float32)
                assert f[f"all{i}"].shape == shapes[i] and f[f"all{i}"].tobytes() == upd.tobytes(), (name, k, i)
                if owner[i] != k:
                    assert f[f"given{i}"].tobytes() == upd.tobytes(), (name, k, i)  # received in place
            assert facts[k]["gathered"] == [i for i, o in enumerate(owner) if o != k]
            # bytes on the wire: the gradients of the tensors it does not own, then its own tensors to each peer
            assert facts[k]["sent_reduce"] == 4 * sum(s for s, o in zip(sizes, owner) if o != k)
            assert facts[k]["sent_gather"] == 4 * sum(sizes[i] for i in mine) * (n - 1)
        if name == "skewed":
            assert 1 not in owner
    # the data tells rank orders apart (two float32 addends commute: only 3 or more have an order)
    assert order_matters == (n > 2)


_SILENT = r"""
import json, sys, time
import numpy as np
from toy.train.distributed import CommTimeoutError, World

out = sys.argv[1]
world = World.from_env()
arrays = [np.ones(5, np.float32), np.ones(3, np.float32)]
owner = [0, world.size - 1]
if world.rank == 1:
    time.sleep(float(sys.argv[2]))  # never takes part: the others must give up on it
else:
    t0 = time.monotonic()
    try:
        world.reduce_owned(arrays, owner)
        res = {"error": None}
    except CommTimeoutError as e:
        res = {"error": str(e), "hint": e.hint}
    res["waited"] = time.monotonic() - t0
    with open(f"{out}/silent-{world.rank}.json", "w") as f:
        json.dump(res, f)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_a_silent_rank_is_named_after_the_timeout(tmp_path, n):
    script = tmp_path / "silent.py"
    script.write_text(_SILENT)
    env = {"TOY_COMM_TIMEOUT": "2"}
    r = R.run([sys.executable, str(script), str(tmp_path), "5"], n, cwd=tmp_path, env=env, timeout=60)
    waiting = [k for k in range(n) if k != 1]
    for k in waiting:
        path = tmp_path / f"silent-{k}.json"
        assert path.is_file(), (k, r.returncode, r.stderr)
        res = json.loads(path.read_text())
        assert res["error"] is not None, res
        assert f"rank {k}:" in res["error"] and "rank(s) 1 (" in res["error"], res["error"]
        assert not any(f"rank(s) {j}" in res["error"] or f", {j} (" in res["error"] for j in waiting)
        assert "within 2 s" in res["error"] and "TOY_COMM_TIMEOUT" in res["hint"]
        assert 2.0 <= res["waited"] < 4.5, res["waited"]
