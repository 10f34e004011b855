"""Selectable LoRA adapters loaded and unloaded while a model is open
(``Model.load_adapter`` / ``unload_adapter`` / ``adapter_identity``).

Where each expected value comes from:

- logits and tokens: the same model loaded with that adapter alone at start-up
  (``toy.load(lora=[file])``, a path that existed before this feature), one
  sequence at a time, compared bit for bit (exact batching, F32 K/V);
- ``adapter_identity``: ``hashlib.sha256`` of the file's bytes, computed here;
- errors: the mismatches written into the test adapters by hand.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import toy
from toy.adapters import Adapter, AdapterError, AdapterNameError, load_adapter, save_adapter
from toy.errors import BadInputError

IDS = [1, 5, 9, 33, 2, 70, 4, 4, 12, 88, 40, 41, 7, 0, 63, 95, 17]
STEMS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
KW = {"kv_type": "f32", "threads": 1, "exact_batching": True, "n_ctx": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model path, {name: adapter file}) of a tiny seeded F32 llama and three adapters."""
    from toy.gguf import GGUFFile
    from toy_testsupport.toy_test_models import write_tiny_model

    d = tmp_path_factory.mktemp("reload")
    path = write_tiny_model(d / "tiny.gguf", seed=3, extra_metadata={"tokenizer.ggml.merges": []})
    with GGUFFile(path) as gf:
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    files = {}
    for k, name in enumerate(("a", "b", "c")):
        rng = np.random.default_rng(20 + k)
        pairs = {}
        for layer in (0, 1) if name != "c" else (1,):
            for stem in STEMS:
                w = f"blk.{layer}.{stem}.weight"
                out, inn = shapes[w]
                pairs[w] = (
                    (rng.standard_normal((4, inn)) * 0.3).astype(np.float32),
                    (rng.standard_normal((out, 4)) * 0.3).astype(np.float32),
                )
        files[name] = save_adapter(d / f"{name}.gguf", architecture="llama", pairs=pairs, alpha=8.0, rank=4)
    return Path(path), files


def alone(model_path, lora, prompt, steps=5):
    """Logits (steps + 1, V) and greedy tokens of one sequence, the adapter applied from start-up."""
    with toy.load(model_path, lora=lora, **KW) as m:
        eng = m.engine
        rows, toks = [eng.prefill(0, prompt)], []
        for _ in range(steps):
            toks.append(int(np.argmax(rows[-1])))
            rows.append(eng.decode([0], [toks[-1]])[0])
        return np.stack(rows), toks


def test_runtime_loaded_adapters_batch_bit_for_bit(tiny):
    """Start with "a", load "b", unload "a", load "c" (it takes a's freed index 0): a batch of c, the base and
    b gives each sequence the logits of that adapter applied alone from start-up, bit for bit."""
    path, files = tiny
    prompts = [IDS[:9], IDS[3:14], IDS[5:17]]
    choice = ["c", None, "b"]
    want = [alone(path, [(files[c], 0.5 if c == "b" else 1.0)] if c else None, p) for c, p in zip(choice, prompts)]
    assert not np.array_equal(want[0][0], alone(path, None, prompts[0])[0])  # the adapter matters
    with toy.load(path, adapters={"a": files["a"]}, n_slot=3, **KW) as m:
        eng = m.engine
        eng.prefill(0, IDS[:4])  # graphs built with "a" only
        assert m.load_adapter("b", files["b"], 0.5) == 1
        assert len(eng._graphs) == 0  # a change drops the graphs: they reference the adapters' tensors
        first = m.selectable_adapters()["a"]
        m.unload_adapter("a")
        assert first.context is None and first.terms is None  # freed
        assert m.adapter_index("b") == 1  # indices stay
        assert m.load_adapter("c", str(files["c"])) == 0  # the hole is reused
        assert m.named_adapters == [("c", str(files["c"]), 1.0), ("b", str(files["b"]), 0.5)]
        rows = [[] for _ in prompts]
        for s, (c, p) in enumerate(zip(choice, prompts)):
            eng.cache.truncate(s, 0)
            eng.slot_adapter[s] = m.adapter_index(c)
            rows[s].append(eng.prefill(s, p))
        for step in range(5):
            out = eng.decode([0, 1, 2], [want[s][1][step] for s in range(3)])
            for s in range(3):
                rows[s].append(out[s])
        for s in range(3):
            assert np.array_equal(np.stack(rows[s]), want[s][0]), (s, choice[s])
        g = m.generate(prompts[2], temperature=0, max_tokens=5, ignore_eos=True, adapter="b")
        assert g.tokens == want[2][1]
        with pytest.raises(BadInputError, match="no adapter named 'a'"):
            m.generate(prompts[0], max_tokens=2, adapter="a")


def test_unload_empties_slots_that_hold_its_kv(tiny):
    """A slot whose K/V were computed with an unloaded adapter is emptied, so a later adapter at the same index
    never reuses that prefix; the other slots keep theirs."""
    path, files = tiny
    with toy.load(path, adapters={"a": files["a"]}, n_slot=2, **KW) as m:
        eng = m.engine
        eng.slot_adapter[0] = 0
        eng.prefill(0, IDS[:6])
        eng.prefill(1, IDS[:5])
        m.unload_adapter("a")
        assert eng.cache.length(0) == 0 and eng.slot_adapter[0] is None
        assert eng.cache.length(1) == 5
        assert m.named_adapters == [] and m.adapter_identity(None) == ""
        with pytest.raises(BadInputError, match="no adapter named 'a'"):
            m.unload_adapter("a")
        # without any adapter left, the engine runs the base graphs
        assert np.array_equal(eng.prefill(0, IDS[:6]), alone(path, None, IDS[:6], steps=0)[0][0])


def test_adapter_identity(tiny, tmp_path):
    """The sha256 of the file's bytes and the scale; a copy of the file has the same identity, another scale or
    another file another one; an in-memory Adapter hashes its values (the same in any process)."""
    path, files = tiny
    copy = shutil.copy(files["a"], tmp_path / "copy.gguf")
    digest = hashlib.sha256(Path(files["a"]).read_bytes()).hexdigest()
    mem = load_adapter(files["b"])
    with toy.load(path, adapters={"a": files["a"], "a2": (copy, 0.5), "b": mem}, **KW) as m:
        ida, ida2, idb = (m.adapter_identity(m.adapter_index(n)) for n in ("a", "a2", "b"))
        assert ida == f"{digest}:1.0" and ida2 == f"{digest}:0.5"
        assert m.load_adapter("acopy", copy) == 3 and m.adapter_identity(3) == ida
        assert m.load_adapter("c", files["c"]) == 4 and m.adapter_identity(4) != ida
        fresh = Adapter(mem.architecture, mem.alpha, {k: (a.copy(), b.copy()) for k, (a, b) in mem.pairs.items()})
        assert m.load_adapter("b2", fresh) == 5 and m.adapter_identity(5) == idb  # values, not the object
        name0 = next(iter(fresh.pairs))
        fresh.pairs[name0] = (fresh.pairs[name0][0] + 1, fresh.pairs[name0][1])
        assert m.load_adapter("b3", fresh) == 6 and m.adapter_identity(6) != idb
        assert m.adapter_identity(None) == ""
        with pytest.raises(BadInputError):
            m.adapter_identity(9)


def test_load_errors(tiny, tmp_path):
    """Another base (architecture, a weight it lacks, a shape), not an adapter, a name taken or invalid: each an
    error naming the problem, and nothing changes."""
    path, files = tiny
    good = load_adapter(files["a"])
    name0, (a0, b0) = next(iter(good.pairs.items()))
    other_arch = save_adapter(tmp_path / "g.gguf", architecture="gemma", pairs=good.pairs, alpha=8.0, rank=4)
    missing = save_adapter(
        tmp_path / "m.gguf", architecture="llama", pairs={"blk.7.attn_q.weight": (a0, b0)}, alpha=8.0, rank=4
    )
    wide = np.zeros((4, a0.shape[1] + 1), np.float32)
    shape = save_adapter(tmp_path / "s.gguf", architecture="llama", pairs={name0: (wide, b0)}, alpha=8.0, rank=4)
    with toy.load(path, adapters={"a": files["a"]}, **KW) as m:
        with pytest.raises(AdapterError, match="for 'gemma', the model is 'llama'"):
            m.load_adapter("x", other_arch)
        with pytest.raises(AdapterError, match="blk.7.attn_q.weight, which the model does not have"):
            m.load_adapter("x", missing)
        with pytest.raises(AdapterError, match="does not make the model's"):
            m.load_adapter("x", shape)
        with pytest.raises(AdapterError, match="not an adapter file"):
            m.load_adapter("x", path)
        with pytest.raises(AdapterNameError, match="'a' is already loaded"):
            m.load_adapter("a", files["b"])
        with pytest.raises(BadInputError, match="adapter name 'a b'"):
            m.load_adapter("a b", files["b"])
        assert m.named_adapters == [("a", str(files["a"]), 1.0)] and len(m.engine.adapters) == 1


def test_prepare_off_thread_then_attach(tiny):
    """``prepare_adapter`` on another thread (reading, hashing, checking, CPU tensors), ``attach_adapter`` on
    the model's: the adapter then gives the start-up result; a name taken between the two is refused and the
    prepared adapter freed."""
    path, files = tiny
    want = alone(path, [files["b"]], IDS[:8], steps=3)[1]
    with toy.load(path, **KW) as m:
        got = []
        t = threading.Thread(target=lambda: got.append(m.prepare_adapter("b", files["b"])))
        t.start()
        t.join()
        (prepared,) = got
        assert prepared.context is not None  # on the CPU the tensors were made off the model's thread
        other = m.prepare_adapter("b", files["c"])
        assert m.attach_adapter(prepared) == 0
        with pytest.raises(AdapterNameError):
            m.attach_adapter(other)
        assert other.context is None
        assert m.generate(IDS[:8], temperature=0, max_tokens=3, ignore_eos=True, adapter="b").tokens == want


def test_an_adapter_no_row_uses_is_left_out_of_the_graph(tiny):
    """With adapters loaded but used by no sequence of a step, the step's graph has no adapter products (it is
    the same size as a model's without adapters) and its logits equal the base model's alone, bit for bit; once a
    row uses one, that adapter (only) joins the graph."""
    path, files = tiny
    want = alone(path, None, IDS[:9])[0]
    with toy.load(path, **KW) as plain:
        plain.engine.prefill(0, IDS[:9])
        base_nodes = max(g.graph.n_nodes for g in plain.engine._graphs.values())
    with toy.load(path, adapters={"a": files["a"], "b": files["b"]}, n_slot=2, **KW) as m:
        eng = m.engine
        rows = [eng.prefill(0, IDS[:9])]
        for _ in range(5):
            rows.append(eng.decode([0], [int(np.argmax(rows[-1]))])[0])
        assert np.array_equal(np.stack(rows), want)
        assert max(g.graph.n_nodes for g in eng._graphs.values()) == base_nodes
        eng.slot_adapter[1] = m.adapter_index("b")
        eng.prefill(1, IDS[:4])
        key = next(k for k in eng._graphs if k[0] == "prefill" and k[1] == 1)
        assert key[-1] == (m.adapter_index("b"),)
        assert eng._graphs[key].graph.n_nodes > base_nodes
