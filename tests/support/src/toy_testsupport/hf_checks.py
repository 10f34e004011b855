"""The checks the Hugging Face conversion tests share (test-only helper,
imported as ``from toy_testsupport.hf_checks import ...`` by the
``test_convert_hf_*`` modules of toy-core).

- ``values_equal(a, b)``: two GGUF metadata values are equal (a scalar of
  the same Python type; a string list item for item; an array element for
  element);
- ``assert_same_gguf(ref, got, skip_keys=, whole_file=)``: toy's import is
  llama.cpp's converter's file: key for key (order, type and value; keys in
  ``skip_keys`` left out), tensor for tensor (names in order, shape, type,
  bytes), then, with ``whole_file``, the files as a whole (read in chunks,
  so a 124M-class file is not held twice in memory);
- ``assert_nothing_written(out)``: a refused import left neither ``out``
  nor a temporary ``.<name>.*`` beside it;
- ``edit_config(folder, **changes)``: ``folder``'s config.json with keys set
  (``...`` as a value removes the key);
- ``converted_once(root, hf_dir, outtype)``: a getter ``get(shape)`` of
  llama.cpp's converter output for ``hf_dir(shape)`` (a reference module's
  ``hf_dir``), converted once per shape under ``root``: the outputs the
  reference caches do not hold (BF16);
- ``hf_causal_lm(folder)``, ``torch_logits(model, ids)``: a transformers
  model in float32 with eager attention and its logits (T, V) for ``ids``;
  ``toy_logits(gguf, ids, lora=None)``: toy's (F32 KV cache, one thread),
  with an adapter applied when given (the PEFT adapter tests).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from toy.gguf import GGUFFile


def values_equal(a, b) -> bool:
    """Two GGUF metadata values are equal: a str, bool, int or float of the
    same type and value; a sequence (string arrays) item for item; a NumPy
    array element for element."""
    if isinstance(a, (str, bool, int, float)):
        return type(a) is type(b) and a == b
    return list(a) == list(b) if not isinstance(a, np.ndarray) else np.array_equal(a, np.asarray(b))


def _same_file(a, b, chunk: int = 16 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def assert_same_gguf(ref, got, *, skip_keys: Collection[str] = frozenset(), whole_file: bool = True) -> None:
    """Key for key (order, value and type; ``skip_keys`` left out) and tensor
    for tensor (name, shape, type, bytes), then, with ``whole_file``, the
    files as a whole."""
    with GGUFFile(ref) as a, GGUFFile(got) as b:
        assert [k for k in a.metadata if k not in skip_keys] == [k for k in b.metadata if k not in skip_keys]
        for k in a.metadata:
            if k in skip_keys:
                continue
            assert a.types[k] == b.types[k], k
            assert values_equal(a.metadata[k], b.metadata[k]), k
        assert list(a.tensors) == list(b.tensors)
        for n, t in a.tensors.items():
            u = b.tensors[n]
            assert (t.shape, t.dtype) == (u.shape, u.dtype), n
            assert bytes(a.tensor_bytes(n)) == bytes(b.tensor_bytes(n)), n
    if whole_file:
        assert _same_file(ref, got), f"{ref} and {got} differ"


def assert_nothing_written(out) -> None:
    """Neither ``out`` nor a temporary ``.<out's name>.*`` beside it exists."""
    out = Path(out)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []


def edit_config(folder, **changes) -> Path:
    """``folder/config.json`` with each key of ``changes`` set to its value, or
    removed where the value is ``...``; the file is rewritten (``json.dumps``)
    even without changes, and replaced, never written through a link.
    Returns ``folder``."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.unlink()
    path.write_text(json.dumps(cfg))
    return Path(folder)


def converted_once(root, hf_dir: Callable[[str], Path], outtype: str = "bf16") -> Callable[[str], Path]:
    """``get(shape)``: llama.cpp's converter (``hf_llama_ref.convert``) with
    ``--outtype outtype`` on ``hf_dir(shape)``, written to
    ``root/<shape>.gguf`` on the first call for a shape and returned from
    then on. A module fixture wraps it (one ``root`` per module)."""
    from toy_testsupport import hf_llama_ref

    root = Path(root)
    cache: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in cache:
            cache[shape] = hf_llama_ref.convert(hf_dir(shape), root / f"{shape}.gguf", outtype)
        return cache[shape]

    return get


def hf_causal_lm(folder):
    """transformers' model of ``folder`` in float32 with eager attention, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def torch_logits(model, ids) -> np.ndarray:
    """A transformers (or PEFT) model's logits (T, V) for one sequence of ids, as float32."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def toy_logits(gguf, ids, lora=None) -> np.ndarray:
    """toy's logits (T, V) for ``ids`` (F32 KV cache, one thread), with the adapter ``lora`` when given."""
    import toy

    with toy.load(gguf, threads=1, n_ctx=64, kv_type="f32", lora=lora) as m:
        return np.asarray(m.logits(ids), np.float32)
