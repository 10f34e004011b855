"""The shortcuts ``toy.load`` takes give what the long way gave: the KV cache
starts as zeros in every type it supports (stored as zero bytes, not converted
from float zeros), and a lazy GGUF string array decoded in one native pass
equals the item-by-item decode (the vocabulary and merges are read that way).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import toy_ggml
from toy.engine.kv import KVCache
from toy.gguf import GGUFFile
from toy.gguf.reader import StringArray
from toy.tokenizer import Tokenizer


@pytest.mark.parametrize(("kv_type", "v_trans"), [("f16", True), ("f32", True), ("f16", False), ("q8_0", False)])
def test_kv_cache_starts_as_zeros(kv_type, v_trans):
    cfg = SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=32)
    with toy_ggml.Runtime(toy_ggml.resolve_device("cpu"), threads=1) as rt:
        cache = KVCache(cfg, rt, n_ctx=48, n_slot=2, kv_type=kv_type, v_trans=v_trans)
        try:
            for t in cache.k + cache.v:
                assert not t.raw().any(), t.name
                assert (t.to_float() == 0).all(), t.name
                if t.dtype != toy_ggml.GGMLType.F32:  # the bytes storing float zeros through ggml gives
                    assert toy_ggml.quantize(np.zeros(t.shape, np.float32), t.dtype).tobytes() == t.raw().tobytes()
        finally:
            cache.close()


@pytest.mark.model
def test_string_array_tolist_equals_item_by_item(smollm2_path):
    with GGUFFile(smollm2_path) as gf:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            arr = gf.metadata[key]
            assert isinstance(arr, StringArray)
            fast = arr.tolist()
            assert fast == [arr[i] for i in range(len(arr))]
            assert all(type(s) is str for s in fast)
        vocab = Tokenizer.from_gguf(gf.metadata).vocab
        assert vocab.tokens == list(gf.metadata["tokenizer.ggml.tokens"])
