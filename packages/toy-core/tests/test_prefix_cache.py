"""The prefix cache (``toy.engine.prefix``) and ``KVCache.read``/``write``: K/V blocks copied out of one slot
and into another give, bit for bit, the logits of the same prompt prefilled from scratch (exact batching), also
after a trip through the disk tier and a new cache over the same folder, and with a selectable adapter; damaged
and foreign block files are never used; slot files round-trip and refuse another setup.

The reference is always the plain path: the same engine prefilling the whole prompt into a cleared slot.
Tiny seeded F32 llama models (``write_tiny_model``), so every test runs in well under a second.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import toy
from toy.engine.prefix import BLOCK, PrefixCache, SlotFileError, fingerprint, load_slot, save_slot
from toy.errors import BadInputError

RNG = np.random.default_rng(7)
SHARED = [int(t) for t in RNG.integers(2, 96, 75)]  # 4 full blocks and a bit
PROMPT = SHARED[:70] + [int(t) for t in RNG.integers(2, 96, 9)]  # shares 70 tokens: 4 blocks = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from toy_testsupport.toy_test_models import write_tiny_model

    d = tmp_path_factory.mktemp("prefix")
    meta = {"tokenizer.ggml.merges": []}
    return {
        "hd16": write_tiny_model(d / "hd16.gguf", seed=3, extra_metadata=meta),
        "hd32": write_tiny_model(d / "hd32.gguf", seed=4, d=128, extra_metadata=meta),  # Q8_0 needs head size 32k
        "other": write_tiny_model(d / "other.gguf", seed=5, extra_metadata=meta),
    }


def load(path, **kw):
    kw = {"n_ctx": 128, "n_slot": 3, "threads": 1, "exact_batching": True, **kw}
    return toy.load(path, **kw)


def scratch(m, ids, slot=2, steps=3):
    """The plain path: ``ids`` prefilled whole into a cleared slot, then greedy decode steps (all rows)."""
    eng = m.engine
    eng.cache.clear(slot)
    rows = [eng.prefill(slot, ids)]
    for _ in range(steps):
        rows.append(eng.decode([slot], [int(np.argmax(rows[-1]))])[0])
    return np.stack(rows)


def continued(m, ids, slot, steps=3):
    """Prefill the rest of ``ids`` after what ``slot`` holds, then greedy decode steps (all rows)."""
    eng = m.engine
    rows = [eng.prefill(slot, ids[eng.cache.length(slot) :])]
    for _ in range(steps):
        rows.append(eng.decode([slot], [int(np.argmax(rows[-1]))])[0])
    return np.stack(rows)


def cached_run(m, pc, ids, slot=1, adapter_id=""):
    """Take the longest cached prefix of ``ids`` into ``slot`` (at least one token left), then continue."""
    eng = m.engine
    eng.cache.clear(slot)
    n = min(pc.lookup(ids, adapter_id), len(ids) - 1)
    pc.restore(eng.cache, slot, ids, adapter_id, 0, n)
    assert eng.cache.tokens(slot) == list(ids[:n])
    return n, continued(m, ids, slot)


@pytest.mark.parametrize(
    "model,kw",
    [("hd16", {}), ("hd16", {"flash_attn": True}), ("hd32", {"flash_attn": True, "kv_type": "q8_0"})],
    ids=["f16-v-transposed", "f16-flash", "q8_0-flash"],
)
def test_blocks_restored_into_another_slot_give_the_logits_of_a_fresh_prefill(tiny, model, kw):
    with load(tiny[model], **kw) as m:
        eng = m.engine
        eng.prefill(0, SHARED)
        pc = PrefixCache(fingerprint(m), 1 << 20)
        assert pc.insert(eng.cache, 0, "") == len(SHARED) // BLOCK
        assert pc.lookup(SHARED[:40], "") == 32  # only full blocks of the query
        n, got = cached_run(m, pc, PROMPT)
        assert n == 64 and pc.stats.tokens == 64
        want = scratch(m, PROMPT)
        assert np.array_equal(got, want)
        # a restore that starts after a slot's own kept prefix (not on a block boundary)
        eng.cache.truncate(1, 0)
        eng.prefill(1, PROMPT[:21])
        assert pc.lookup(PROMPT, "") == 64
        pc.restore(eng.cache, 1, PROMPT, "", 21, 43)
        assert np.array_equal(continued(m, PROMPT, 1), want)


def test_read_write_round_trip_and_refusals(tiny):
    with load(tiny["hd16"]) as m:
        c = m.engine.cache
        m.engine.prefill(0, SHARED[:20])
        data = c.read(0, 3, 10)
        assert data.shape == (m.cfg.n_layer, 2, 10, c.row_bytes) and data.any()
        c.write(1, 0, c.read(0, 0, 3), SHARED[:3])
        c.write(1, 3, data, SHARED[3:13])
        assert np.array_equal(c.read(1, 0, 13), c.read(0, 0, 13)) and c.tokens(1) == SHARED[:13]
        with pytest.raises(BadInputError, match="holds only"):
            c.write(2, 5, data, SHARED[5:15])
        with pytest.raises(BadInputError, match="outside"):
            c.read(0, 120, 10)
        with pytest.raises(BadInputError, match="does not fit"):
            c.write(2, 0, data, SHARED[:9])
        c.device = "CUDA0"  # what a cache on a device says: the copies refuse, naming the way out
        with pytest.raises(BadInputError, match="CPU") as e:
            c.read(0, 0, 1)
        assert "--cache-ram 0" in e.value.hint
        c.device = "CPU"


def test_tiny_budget_evicts_the_leaf_end_of_a_chain_first(tiny):
    with load(tiny["hd16"]) as m:
        eng = m.engine
        eng.prefill(0, SHARED)
        block = BLOCK * eng.cache.token_bytes
        pc = PrefixCache(fingerprint(m), 2 * block + 10)
        pc.insert(eng.cache, 0, "")
        s = pc.stats
        assert (s.ram_blocks, s.ram_bytes, s.evictions) == (2, 2 * block, 2)
        assert pc.lookup(SHARED, "") == 2 * BLOCK  # the roots stayed
        n, got = cached_run(m, pc, PROMPT)
        assert n == 32 and np.array_equal(got, scratch(m, PROMPT))
        # a budget below one block keeps nothing (and the cache still answers)
        none = PrefixCache(fingerprint(m), block - 1)
        assert none.insert(eng.cache, 0, "") == 4 and none.stats.ram_blocks == 0 and none.lookup(SHARED, "") == 0


def test_disk_tier_survives_a_new_cache_and_discards_damaged_or_foreign_files(tiny, tmp_path, caplog):
    with load(tiny["hd16"]) as m:
        eng = m.engine
        fp = fingerprint(m, full=True)
        block = BLOCK * eng.cache.token_bytes
        eng.prefill(0, SHARED)
        pc = PrefixCache(fp, block, tmp_path)  # one block of RAM: three spill to disk at insert
        pc.insert(eng.cache, 0, "")
        assert pc.stats.evictions == 3 and pc.stats.disk_blocks == 3
        pc.close()  # the RAM block too
        folder = tmp_path / fp.hex
        files = sorted(folder.iterdir())
        assert len(files) == 4 and all(f.suffix == ".kvb" for f in files)

        # a new cache over the same folder (a restarted server) finds every block; the result is exact
        eng.cache.clear()
        again = PrefixCache(fp, 1 << 20, tmp_path)
        assert again.stats.disk_blocks == 4
        n, got = cached_run(m, again, PROMPT)
        want = scratch(m, PROMPT)
        assert n == 64 and np.array_equal(got, want)

        # damage the third block's file: it is deleted with a warning, the two before it are used
        from toy.engine.prefix import chain_keys

        keys = chain_keys(fp, SHARED, "")
        third = folder / (keys[2].hex() + ".kvb")
        raw = bytearray(third.read_bytes())
        raw[-5] ^= 0xFF
        third.write_bytes(bytes(raw))
        fresh = PrefixCache(fp, 1 << 20, tmp_path)
        with caplog.at_level(logging.WARNING, logger="toy.engine.prefix"):
            n, got = cached_run(m, fresh, PROMPT)
        assert n == 32 and np.array_equal(got, want)
        assert "discarding block file" in caplog.text and "checksum" in caplog.text
        assert not third.exists() and fresh.stats.discarded == 1

        # a block file of another fingerprint, copied under this one's name: discarded, never used
        with load(tiny["other"]) as other:
            ofp = fingerprint(other, full=True)
            other.engine.prefill(0, SHARED)
            theirs = PrefixCache(ofp, 0, tmp_path)
            theirs.insert(other.engine.cache, 0, "")
            assert theirs.stats.disk_blocks == 4 and (tmp_path / ofp.hex).is_dir() and ofp.hex != fp.hex
            # another model's folder is never looked at: its blocks do not answer this model's lookups
            assert PrefixCache(fp, 1 << 20, tmp_path).stats.disk_blocks == 3
            (tmp_path / ofp.hex / (chain_keys(ofp, SHARED, "")[2].hex() + ".kvb")).rename(third)
        caplog.clear()
        mixed = PrefixCache(fp, 1 << 20, tmp_path)
        with caplog.at_level(logging.WARNING, logger="toy.engine.prefix"):
            n, got = cached_run(m, mixed, PROMPT)
        assert n == 32 and np.array_equal(got, want) and "another model setup" in caplog.text

        # the folder is bounded: the least recently used files go
        small = PrefixCache(fp, 0, tmp_path, disk_bytes=2 * block + 1000)
        assert small.stats.disk_blocks == 2 and len(list(folder.iterdir())) == 2


def test_blocks_are_per_adapter(tiny, tmp_path):
    from toy.adapters import save_adapter
    from toy.gguf import GGUFFile

    with GGUFFile(tiny["hd16"]) as gf:
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    rng = np.random.default_rng(1)
    pairs = {}
    for name in ("blk.0.attn_k.weight", "blk.1.attn_v.weight", "blk.0.ffn_up.weight"):
        out, inn = shapes[name]
        pairs[name] = ((rng.standard_normal((4, inn)) * 0.3).astype(np.float32),
                       (rng.standard_normal((out, 4)) * 0.3).astype(np.float32))  # fmt: skip
    path = save_adapter(tmp_path / "a.gguf", architecture="llama", pairs=pairs, alpha=8.0, rank=4)
    with load(tiny["hd16"], adapters={"a": path}) as m:
        eng = m.engine
        ident = m.adapter_identity(0) if hasattr(m, "adapter_identity") else "adapter0"
        assert ident != ""
        pc = PrefixCache(fingerprint(m), 1 << 20)
        eng.prefill(0, SHARED)  # the base
        pc.insert(eng.cache, 0, "")
        assert pc.lookup(PROMPT, ident) == 0  # base blocks are not the adapter's
        eng.slot_adapter[2] = 0
        want = scratch(m, PROMPT)  # with the adapter
        eng.slot_adapter[2] = None
        assert not np.array_equal(want, scratch(m, PROMPT))  # the adapter matters
        eng.slot_adapter[0] = 0
        eng.cache.clear(0)
        eng.prefill(0, SHARED)
        pc.insert(eng.cache, 0, ident)
        eng.slot_adapter[1] = 0
        n, got = cached_run(m, pc, PROMPT, adapter_id=ident)
        assert n == 64 and np.array_equal(got, want)


def test_slot_file_round_trip_and_another_setup(tiny, tmp_path):
    with load(tiny["hd16"]) as m:
        eng = m.engine
        fp = fingerprint(m, full=True)
        eng.prefill(0, PROMPT[:50])
        n, size = save_slot(eng.cache, 0, tmp_path / "s.bin", fp, "")
        assert n == 50 and size == (tmp_path / "s.bin").stat().st_size
        ids, adapter, read = load_slot(eng.cache, 1, tmp_path / "s.bin", fp)
        assert ids == PROMPT[:50] and adapter == "" and read == size
        assert np.array_equal(continued(m, PROMPT, 1), scratch(m, PROMPT))
        raw = bytearray((tmp_path / "s.bin").read_bytes())
        raw[200] ^= 1
        (tmp_path / "bad.bin").write_bytes(bytes(raw))
        with pytest.raises(SlotFileError, match="checksum"):
            load_slot(eng.cache, 1, tmp_path / "bad.bin", fp)
    with load(tiny["hd16"], kv_type="f32") as m32:
        with pytest.raises(SlotFileError, match="kv_type: 'F16' in the file, 'F32' here"):
            load_slot(m32.engine.cache, 0, tmp_path / "s.bin", fingerprint(m32, full=True))
