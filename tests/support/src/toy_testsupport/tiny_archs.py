"""A tiny seeded GGUF model of every architecture toy runs, each loadable by
``toy.load`` (an ASCII vocabulary, so it can be prompted with text), for
the load-hardening tests and the model-file fuzzer.

``write(path, name, seed=0)`` writes the model ``name`` (one of ``NAMES``:
llama, qwen2 (QKV bias), qwen3 (QK-norm), gpt2, gemma2, gemma3, olmoe,
qwen2moe (with a shared expert), qwen3moe) with F32 weights: the shapes come
from the family's own ``params(cfg)`` and the metadata from its
``metadata(cfg, name)`` (renamed to the architecture for the llama-family
names), so a change of a family's layout changes the file with it. A few
KB each; writing one takes milliseconds.

Test modules import it as ``from toy_testsupport import tiny_archs``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NAMES = ("llama", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3", "olmoe", "qwen2moe", "qwen3moe")

# one set of small dimensions for every family
D_MODEL, N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM, D_FF, CTX = 32, 2, 4, 2, 8, 64, 64


def _tokenizer_metadata() -> list[tuple[str, object, object]]:
    """The ASCII tokenizer's keys (key, value, TypeInfo) of
    ``toy_test_models.write_ascii_tiny_model``."""
    import tempfile

    from toy.gguf import GGUFFile
    from toy_testsupport.toy_test_models import write_ascii_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        src = write_ascii_tiny_model(Path(tmp) / "ascii.gguf", d=D_MODEL, n_head=N_HEAD, n_layer=1)
        with GGUFFile(src) as f:
            return [(k, v, f.types[k]) for k, v in f.metadata.items() if k.startswith("tokenizer.")]


def _config(name: str, vocab: int):
    """The family's config of the tiny model ``name``."""
    from toy.models.gemma import GemmaConfig
    from toy.models.gpt2 import GPT2Config
    from toy.models.llama import _TRAITS, LlamaConfig

    if name == "gpt2":
        return GPT2Config(n_vocab=vocab, d_model=D_MODEL, n_layer=N_LAYER, n_head=N_HEAD, d_ff=D_FF, n_ctx_train=CTX,
                          context_length=CTX)  # fmt: skip
    if name in ("gemma2", "gemma3"):
        return GemmaConfig(
            n_vocab=vocab, d_model=D_MODEL, n_layer=N_LAYER, n_head=N_HEAD, n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM,
            d_ff=D_FF, rms_eps=1e-6, rope_base=10000.0, rope_base_swa=10000.0, sliding_window=4,
            swa_layers=(True, False) if name == "gemma2" else (True, True),
            attn_softcap=50.0 if name == "gemma2" else 0.0, final_softcap=30.0 if name == "gemma2" else 0.0,
            qk_norm=name == "gemma3", tied_output=True, context_length=CTX, architecture=name,
        )  # fmt: skip
    traits = _TRAITS[name]
    moe = {}
    if name in ("olmoe", "qwen2moe", "qwen3moe"):
        moe = dict(n_expert=4, n_expert_used=2, d_ff_expert=D_FF if traits.expert_width_is_ff else 16,
                   d_ff_shared=32 if name == "qwen2moe" else 0, expert_weights_norm=traits.expert_weights_norm)  # fmt: skip
    return LlamaConfig(
        n_vocab=vocab, d_model=D_MODEL, n_layer=N_LAYER, n_head=N_HEAD, n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM,
        d_ff=D_FF, rms_eps=1e-5, rope_base=10000.0, rope_dims=HEAD_DIM, rope_mode=traits.rope_pairs,
        tied_output=name != "qwen3", qkv_bias=name in ("qwen2", "qwen2moe"),
        qk_norm=name in ("qwen3", "olmoe", "qwen3moe"), qk_norm_full=traits.qk_norm_full, context_length=CTX,
        architecture=name, **moe,
    )  # fmt: skip


def _metadata(name: str, cfg) -> dict:
    from toy import models

    arch = models.get(name)
    meta = dict(arch.metadata(cfg, f"tiny-{name}"))
    if name in ("gpt2", "gemma2", "gemma3"):
        return meta
    # the llama family writes its checkpoints as llama: rename to the variant, add the experts' keys
    from toy.models.common import uint32_counts

    out = {"general.architecture": name}
    out.update({k.replace("llama.", f"{name}.", 1): v for k, v in meta.items() if k != "general.architecture"})
    if cfg.n_expert:
        extra = {f"{name}.expert_count": cfg.n_expert, f"{name}.expert_used_count": cfg.n_expert_used}
        if name != "olmoe":
            extra[f"{name}.expert_feed_forward_length"] = cfg.d_ff_expert
        if cfg.d_ff_shared:
            extra[f"{name}.expert_shared_feed_forward_length"] = cfg.d_ff_shared
        out.update(uint32_counts(extra))
    return out


def write(path, name: str, seed: int = 0) -> Path:
    """Write the tiny model ``name`` (one of ``NAMES``) to ``path``; returns the path."""
    from toy import models
    from toy.gguf import GGUFWriter

    if name not in NAMES:
        raise ValueError(f"unknown tiny model {name!r}: one of {', '.join(NAMES)}")
    tok = _tokenizer_metadata()
    vocab = len(next(v for k, v, _ in tok if k == "tokenizer.ggml.tokens"))
    cfg = _config(name, vocab)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path)
    for k, v in _metadata(name, cfg).items():
        w.add(k, *v) if isinstance(v, tuple) else w.add(k, v)
    w.add("general.file_type", 0)
    for k, v, t in tok:
        w.add(k, v, t)
    for tname, p in models.get(name).params(cfg).items():
        if p.kind in ("norm",):
            arr = 1.0 + 0.1 * rng.standard_normal(p.shape)
        else:
            arr = 0.2 * rng.standard_normal(p.shape)
        w.add_tensor(tname, arr.astype(np.float32))
    return w.write()


__all__ = ["NAMES", "write"]
