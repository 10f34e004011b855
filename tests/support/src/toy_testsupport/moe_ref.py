"""Independent mixture-of-experts reference models for tests (test-only helper).

OLMoE (``olmoe``), Qwen2-MoE (``qwen2moe``) and Qwen3-MoE (``qwen3moe``)
models made by Hugging Face ``transformers`` (``OlmoeForCausalLM``,
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` with seeded random
weights, saved with ``save_pretrained``) and turned into GGUF by llama.cpp's
own ``convert_hf_to_gguf.py`` (``gpt2_ref.convert_to_gguf``: the
llama-cpp-python 0.3.36 sdist, hash-checked and extracted by
``gpt2_ref.llama_cpp_dir``). Neither step goes through toy, so a toy MoE
tested on these files is checked against two outside implementations: the
converter's layout (per-expert HF matrices stacked into 3-D
``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp`` kept F32, the
Qwen2-MoE shared expert ``*_shexp`` and its gate ``ffn_gate_inp_shexp``,
OLMoE's whole-projection and Qwen3-MoE's per-head Q/K norms) and HF's
forward (``hf_logits``, ``hf_greedy``, ``hf_router_topk``).

- ``make_hf_moe(out_dir, arch=, seed=, tied_router=None, **fields)``
  (``SHAPES[shape]`` holds ``arch``, the optional ``tied_router`` pair and the
  HF config fields): the HF model (GPT-2's vocabulary, 50257 tokens; float32)
  plus GPT-2's tokenizer files (``gpt2_ref.gpt2_tokenizer_files``), whose
  pre-tokenizer the converter recognises by its hash (``gpt-2``) for all
  three architectures (llama.cpp does not tie a vocabulary to an
  architecture; tests feed token ids anyway).
- ``hf_dir(shape, seed)`` / ``gguf_path(shape, seed, outtype)``: the same,
  cached under ``$TOY_TEST_MOE_CACHE`` (default ``~/.cache/toy-test-moe``)
  in a folder keyed by the recipe and a digest of this file, gpt2_ref.py (the
  converter driver and the tokenizer), the sdist and the
  torch/transformers/tokenizers versions. ``outtype`` is the converter's
  ``--outtype`` (``f32``, ``f16``, ``q8_0``) or ``q4_k_m``: the F32 file
  quantized by **toy's own** ``toy.gguf.quantize_model(f32, out, "Q4_K_M")``
  (llama.cpp's quantizer is only in llama-cpp-python, which CI does not
  install); that file's name carries a digest of toy's convert.py,
  quant_mix.py and ggml version too. toy's Q4_K_M is llama.cpp's Q4_K_M mix,
  tensor for tensor and byte for byte (routers F32, attn_k/attn_v Q8_0 and
  attn_output Q5_K for these 8-expert models, output Q6_K ...;
  ``packages/toy-core/tests/test_quant_mix.py`` checks it against llama.cpp's own files).
- ``hf_logits(hf_dir, ids)`` (float32 ``(T, V)``), ``hf_greedy(hf_dir, ids,
  n)``: the HF model in float32, eager attention, one torch thread.
- ``hf_router_topk(hf_dir, ids)``: per layer and token, the router logits,
  the softmax over all experts, and the experts HF selects with their
  weights (``torch.topk`` of the softmax, renormalised when the config's
  ``norm_topk_prob``), recomputed with HF's own ops from the router logits
  captured by a forward hook on each ``mlp.gate``.
- ``llamacpp_topk(probs, k)``: the experts llama.cpp's CPU argsort selects
  (lower index first among exact ties, for <= 16 experts);
- ``router_margin(router)``: how decisive the routing is (below);
  ``sample_ids(n, seed)``: a deterministic token sample;
- ``GGUF_LAYER_NAMES``: the converter's tensor names of a layer's modules
  (the experts' ``mlp.experts.E.*_proj`` go into the stacked ``*_exps``).

The cache machinery and the HF forward are gpt2_ref's (``recipe_hf_dir``,
``recipe_gguf``, ``cached_file``, ``load_causal_lm``, ...).

The shapes follow the checklist that makes llama.cpp and HF compute the same
function (docs: /work/notes/moe_spec.md section 3.3): every layer sparse
(``decoder_sparse_step=1``, ``mlp_only_layers=[]``), ``norm_topk_prob``
False for olmoe/qwen2moe and True for qwen3moe (llama.cpp hard-codes both),
untied output (``output.weight`` is required by llama.cpp's olmoe and
qwen2moe), OLMoE with ``num_key_value_heads == num_attention_heads``
(llama.cpp creates ``attn_k_norm`` of the whole width), ``clip_qkv=None``
and ``rms_norm_eps=1e-5`` (the converter forces 1e-5), Qwen2-MoE with Q/K/V
biases and a shared expert, Qwen3-MoE with a ``head_dim`` other than
``hidden/heads`` (so ``attn_q`` is ``{D, H*d}``). All have 8 experts, top-2:
8 experts also trigger llama.cpp's quantizer rules for "8-expert models"
(attn_k and attn_v Q8_0, attn_output Q5_K). The ``*-k`` shapes have hidden
size and expert widths (and the shared expert's) 256, so K-quant rows fit
and a Q4_K_M mix really makes K-quant expert tensors; ``*-tiny`` ones are
64/32/48 wide (K-quants fall back to Q5_0/Q8_0/F16 there).
``qwen3moe-tied-router`` is ``qwen3moe-tiny`` whose router rows of experts
2 and 5 are identical in every layer, so those two experts' router logits
and probabilities tie exactly for every token: a deliberate tie to test that
an implementation picks the same experts as llama.cpp (ggml's CPU argsort
puts the lower index first among equal values for <= 16 experts).

The random weights: after ``torch.manual_seed(seed)``, every parameter is
drawn anew in ``named_parameters`` order from torch's stream: embeddings and
the (untied) ``lm_head`` N(0, 0.1²) (``EMBD_STD``); RMSNorm weights (layer,
final and Q/K norms) N(1, 0.2²) (``NORM_MEAN``, ``NORM_STD``); biases
(Qwen2-MoE Q/K/V) N(0, 0.1²) (``BIAS_STD``); the routers ``mlp.gate``
N(0, (2/sqrt(hidden))²) (``ROUTER_GAIN``: router logits of std about 2,
about 12 times HF's init; see below); every other Linear weight
(attention, experts, shared expert and its gate) N(0, (1/sqrt(fan_in))²)
(``WEIGHT_GAIN``). Then, for a
``tied_router`` shape, row ``b`` of every router is set to row ``a``. HF's
own init (N(0, 0.02²) matrices, unit norms) gives router logits of about
0.02 · sqrt(hidden): all experts nearly equally likely, and selection
decided by float rounding (a weak and fragile parity test). The router
gain does not change which experts the first layer selects (its logits
scale with it) but trades the second expert's share against the probability gap:
at gain 4 the second expert's weight is a tenth of the first's on the median
token (qwen2moe-tiny) and the smallest k-th minus (k+1)-th probability is
6e-7; at gain 2 the median ratio is 0.33-0.47 and the smallest probability
gap 1e-4 to 2e-3 (the smallest logit gap stays of the same order).

Routing decisiveness (``router_margin``): over every layer and token, the
smallest ``|p_i - p_j|`` between a selected expert ``i`` and an unselected
one ``j`` with ``p_i != p_j`` (the k-th minus (k+1)-th probability when
there is no exact tie), also as a log-probability (logit) gap; exact ties
across the boundary are counted apart. Measured on ``sample_ids(64)`` for
seed 0 (the ``MARGINS`` table below, which test_moe_ref.py checks): the
smallest probability gap is 1.4e-4 (qwen3moe-k) to 1.7e-3 (olmoe-k), the
smallest logit gap 1.2e-3 (qwen2moe-k) to 1.1e-2 (olmoe-k), both far above
float32 rounding; ``qwen3moe-tied-router`` has the tied pair straddling the
top-2 boundary for 37 of its 192 (layer, token) pairs and both selected for
62; at those 37 HF's ``torch.topk`` picks expert 5 (the higher index) 17
times, where llama.cpp's CPU argsort always picks 2 (``llamacpp_topk``), so
HF's logits are no reference for that shape at tied tokens: it is for
comparing an implementation's expert choice with llama.cpp's. Every layer
of every shape routes the sample to at least 7 of its 8 experts; HF greedy
decoding gives 15-16 distinct tokens in 16 steps.

Checked once by hand in llama-cpp-python 0.3.36 (not a test; F16 KV cache,
16 tokens of ``sample_ids(16, 2)``): every F32 file loads and its logits are
within 2.7e-3 to 6.6e-3 of HF's (logits up to about 4 (tiny) and 8.7 (-k)),
the greedy argmax agreeing at all 16 positions; the ``-k`` F16 files within
1.5e-2 to 1.9e-2; ``qwen3moe-tied-router`` differs by up to 1.7 (3 of 16
argmaxes), the tie-breaking above. toy's ``q4_k_m`` files loaded too (their
logits 3.2 to 5.2 from HF's, measured when toy's quantizer wrote Q4_K
everywhere, routers included; they are now llama.cpp's Q4_K_M mix).

Offline and imported as gemma_ref is (its docstring says how): ``from
toy_testsupport import moe_ref``.
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import numpy as np

from toy_testsupport import gpt2_ref  # sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE on import

ROOT = gpt2_ref.ROOT
N_VOCAB = gpt2_ref.N_VOCAB
CONVERTER_OUTTYPES = gpt2_ref.OUTTYPES  # f32, f16, q8_0: convert_hf_to_gguf.py --outtype
TOY_QUANT = {"q4_k_m": "Q4_K_M"}  # the F32 file quantized by toy.gguf.quantize_model
OUTTYPES = (*CONVERTER_OUTTYPES, *TOY_QUANT)
# the converter's general.name
MODEL_NAME = "toy-test-moe"

_CLASSES = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

_OLMOE = {
    "arch": "olmoe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,  # llama.cpp's olmoe never renormalises
    "clip_qkv": None,  # HF clamps Q/K/V when set, llama.cpp never does
    "rms_norm_eps": 1e-5,  # the converter writes 1e-5 whatever the config says
    "rope_theta": 10_000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
_QWEN = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,  # every layer sparse: llama.cpp has no dense-layer path
    "mlp_only_layers": [],
    "use_sliding_window": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
_QWEN2MOE = {**_QWEN, "arch": "qwen2moe", "norm_topk_prob": False, "qkv_bias": True}
_QWEN3MOE = {**_QWEN, "arch": "qwen3moe", "norm_topk_prob": True, "attention_bias": False}

SHAPES = {
    "olmoe-tiny": {
        **_OLMOE,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,  # llama.cpp's olmoe needs Hkv == H
        "intermediate_size": 32,  # OLMoE's expert width
    },
    "qwen2moe-tiny": {
        **_QWEN2MOE,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,  # unused (no dense layer); the file's feed_forward_length
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3moe-tiny": {
        **_QWEN3MOE,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,  # H*d = 96 != hidden
        "intermediate_size": 96,  # unused
        "moe_intermediate_size": 32,
    },
    "olmoe-k": {
        **_OLMOE,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 256,
    },
    "qwen2moe-k": {
        **_QWEN2MOE,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,  # unused
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
    },
    "qwen3moe-k": {
        **_QWEN3MOE,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,  # H*d = 512: attn_output rows of 512, a K-quant multiple
        "intermediate_size": 512,  # unused
        "moe_intermediate_size": 256,
    },
}
# qwen3moe-tiny with the router rows of experts 2 and 5 equal in every layer
SHAPES["qwen3moe-tied-router"] = {**copy.deepcopy(SHAPES["qwen3moe-tiny"]), "tied_router": [2, 5]}

# measured on sample_ids(64), seed 0 (router_margin): the smallest probability and
# logit gap across the top-k boundary (exact ties excepted), the number of
# (layer, token) pairs whose top-k boundary falls inside an exact tie and of those
# whose selected experts tie (out of 3 layers x 64 tokens for the tiny shapes)
MARGINS = {
    "olmoe-tiny": {"prob": 1.216e-3, "logit": 7.013e-3, "boundary_ties": 0, "inner_ties": 0},
    "qwen2moe-tiny": {"prob": 1.827e-4, "logit": 3.443e-3, "boundary_ties": 0, "inner_ties": 0},
    "qwen3moe-tiny": {"prob": 4.888e-4, "logit": 2.555e-3, "boundary_ties": 0, "inner_ties": 0},
    "qwen3moe-tied-router": {
        "prob": 7.699e-4,
        "logit": 4.727e-3,
        "boundary_ties": 37,
        "inner_ties": 62,
        "hf_picks_higher": 17,  # of the boundary ties, where llama.cpp picks the lower index
    },
    "olmoe-k": {"prob": 1.705e-3, "logit": 1.131e-2, "boundary_ties": 0, "inner_ties": 0},
    "qwen2moe-k": {"prob": 2.910e-4, "logit": 1.219e-3, "boundary_ties": 0, "inner_ties": 0},
    "qwen3moe-k": {"prob": 1.425e-4, "logit": 7.067e-3, "boundary_ties": 0, "inner_ties": 0},
}

# torch's intra-op threads for the HF forward (restored afterwards): the models are tiny
TORCH_THREADS = 1
# the random weights (see make_hf_moe)
EMBD_STD = 0.1  # embed_tokens and lm_head
WEIGHT_GAIN = 1.0  # Linear weights: N(0, (WEIGHT_GAIN / sqrt(fan_in))²)
ROUTER_GAIN = 2.0  # router (mlp.gate) weights: N(0, (ROUTER_GAIN / sqrt(hidden))²)
BIAS_STD = 0.1  # Q/K/V biases (qwen2moe)
NORM_MEAN = 1.0  # RMSNorm weights: N(NORM_MEAN, NORM_STD²)
NORM_STD = 0.2
# the converter's names of a layer's tensors, by HF module (the experts' are stacked into *_exps)
GGUF_LAYER_NAMES = {
    **gpt2_ref.ATTN_GGUF_NAMES,
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def cache_root() -> Path:
    return Path(os.environ.get("TOY_TEST_MOE_CACHE") or Path.home() / ".cache" / "toy-test-moe")


# ------------------------------------------------------------ HF model


def hf_config(arch: str, *, vocab_size: int = N_VOCAB, **fields):
    """The HF config of a shape (``SHAPES[shape]`` without ``arch`` and
    ``tied_router``)."""
    import transformers

    cfg_name, model_name = _CLASSES[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size,
        bos_token_id=N_VOCAB - 1,
        eos_token_id=N_VOCAB - 1,
        attn_implementation="eager",
        dtype="float32",
        **copy.deepcopy(fields),
    )
    cfg.architectures = [model_name]
    return cfg


def make_hf_moe(out_dir, *, arch: str, seed: int, tied_router=None, **fields) -> Path:
    """A seeded random MoE model of ``arch`` saved in ``out_dir`` (float32
    safetensors) with GPT-2's tokenizer files; ``tied_router=(a, b)`` copies
    router row ``a`` onto row ``b`` in every layer."""
    import torch
    import transformers

    if arch not in _CLASSES:
        raise ValueError(f"arch must be one of {sorted(_CLASSES)}, not {arch!r}")
    out = Path(out_dir)
    gpt2_ref.gpt2_tokenizer_files(out)
    cfg = hf_config(arch, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[arch][1])(cfg).float().eval()
    # every parameter drawn anew in named_parameters order from one torch
    # stream (see the module docstring)
    router_std = ROUTER_GAIN / cfg.hidden_size**0.5
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.normal_(NORM_MEAN, NORM_STD)
            elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                p.normal_(0.0, EMBD_STD)
            elif name.endswith(".bias"):
                p.normal_(0.0, BIAS_STD)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            elif p.ndim == 2:
                p.normal_(0.0, WEIGHT_GAIN / p.shape[1] ** 0.5)
            else:
                raise RuntimeError(f"no rule for the parameter {name} {tuple(p.shape)}")
        if tied_router is not None:
            a, b = tied_router
            for layer in model.model.layers:
                layer.mlp.gate.weight[b] = layer.mlp.gate.weight[a]
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# the saved tensors as float32 NumPy arrays (HF names and layout:
# ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``)
hf_state_dict = gpt2_ref.hf_state_dict


def hf_logits(hf_dir, ids, **config) -> np.ndarray:
    """Float32 logits ``(T, V)`` of ``ids`` at positions 0..T-1, on
    ``TORCH_THREADS``. ``config``: config fields changed at load time."""
    return gpt2_ref.model_logits(gpt2_ref.load_causal_lm(hf_dir, **config), ids, TORCH_THREADS)


def hf_greedy(hf_dir, ids, n: int, **config) -> list[int]:
    """``n`` greedy tokens after ``ids`` (the argmax of the last position's
    logits, fed back; full recompute each step, no KV cache)."""
    return gpt2_ref.model_greedy(gpt2_ref.load_causal_lm(hf_dir, **config), ids, n, TORCH_THREADS)


def hf_router_topk(hf_dir, ids, **config) -> dict[str, np.ndarray]:
    """HF's routing of ``ids``, per layer and token (arrays ``(L, T, ...)``):

    - ``logits`` ``(L, T, E)``: the router (``mlp.gate``) outputs, captured
      by a forward hook;
    - ``probs`` ``(L, T, E)``: ``softmax(logits)`` over all experts;
    - ``experts`` ``(L, T, k)`` int64: ``torch.topk(probs, k)`` indices, the
      experts HF runs (slot 0 = the largest probability);
    - ``weights`` ``(L, T, k)``: their weights, ``probs`` at ``experts``
      renormalised to sum 1 when the config's ``norm_topk_prob`` (qwen3moe).

    The last three are recomputed from ``logits`` with the ops of HF's
    sparse-MoE blocks (``F.softmax(dtype=float)``, ``torch.topk``), so they
    are the values HF used."""
    import torch
    import torch.nn.functional as F

    model = gpt2_ref.load_causal_lm(hf_dir, **config)
    captured: list = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
        for layer in model.model.layers
    ]
    try:
        with gpt2_ref.torch_threads(TORCH_THREADS):
            model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
            k = model.config.num_experts_per_tok
            logits = torch.stack([c.reshape(-1, c.shape[-1]) for c in captured])  # (L, T, E)
            probs = F.softmax(logits, dim=-1, dtype=torch.float)
            weights, experts = torch.topk(probs, k, dim=-1)
            if model.config.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
    finally:
        for h in hooks:
            h.remove()
    if len(captured) != model.config.num_hidden_layers:
        raise RuntimeError(f"captured {len(captured)} router outputs for {model.config.num_hidden_layers} layers")
    return {
        "logits": logits.float().numpy(),
        "probs": probs.float().numpy(),
        "experts": experts.numpy(),
        "weights": weights.float().numpy(),
    }


def router_margin(router: dict[str, np.ndarray]) -> dict:
    """How decisive ``hf_router_topk``'s routing is: over every layer and
    token, the smallest ``p_i - p_j`` with ``i`` selected, ``j`` not and
    ``p_i != p_j`` (``prob``; the k-th minus the (k+1)-th probability when
    there is no exact tie), the same as ``log p_i - log p_j`` (``logit``,
    the router-logit gap), and the number of (layer, token) pairs whose
    boundary falls inside an exact tie (``boundary_ties``: a selected and an
    unselected expert of equal probability) or whose selected experts tie
    exactly among themselves (``inner_ties``)."""
    probs, experts = router["probs"].astype(np.float64), router["experts"]
    L, T, E = probs.shape
    sel = np.zeros((L, T, E), dtype=bool)
    np.put_along_axis(sel, experts, True, axis=-1)
    prob_gap, logit_gap = np.inf, np.inf
    boundary, inner = 0, 0
    for li in range(L):
        for t in range(T):
            p, s = probs[li, t], sel[li, t]
            ps, pu = p[s], p[~s]
            d = ps[:, None] - pu[None, :]
            if (d == 0).any():
                boundary += 1
            if len(np.unique(ps)) < len(ps):
                inner += 1
            nz = d[d != 0]
            if nz.size:
                prob_gap = min(prob_gap, float(np.abs(nz).min()))
            lg = np.log(ps)[:, None] - np.log(pu)[None, :]
            lz = lg[d != 0]
            if lz.size:
                logit_gap = min(logit_gap, float(np.abs(lz).min()))
    return {"prob": prob_gap, "logit": logit_gap, "boundary_ties": boundary, "inner_ties": inner}


def llamacpp_topk(probs, k: int) -> np.ndarray:
    """The experts llama.cpp's CPU backend selects from ``probs`` (``(..., E)``):
    ``ggml_argsort(DESC)`` and a ``k``-wide view. For E <= 16 experts its
    libstdc++ ``std::sort`` ends in a stable insertion sort, so among exactly
    equal probabilities the lower expert index comes first (a stable
    descending sort); not valid for E > 16 or other C++ libraries
    (/work/notes/moe_spec.md section 2.4). ``torch.topk`` breaks such ties
    data-dependently: on ``qwen3moe-tied-router`` HF picks the higher index of
    the tied pair at about half the boundary ties."""
    probs = np.asarray(probs)
    if probs.shape[-1] > 16:
        raise ValueError("the lower-index-first rule holds for at most 16 experts")
    return np.argsort(-probs, axis=-1, kind="stable")[..., :k]


def sample_ids(n: int = 64, seed: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly from the vocabulary (a fixed NumPy
    stream), the sample ``MARGINS`` was measured on."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, N_VOCAB, n)]


# ------------------------------------------------------------ cached recipes


def _digest() -> str:
    return gpt2_ref.versions_digest([__file__, gpt2_ref.__file__], "torch", "transformers", "tokenizers")


def _toy_quant_digest() -> str:
    """toy's quantizer: its source and the ggml it runs on."""
    import toy_ggml
    from toy.gguf import convert, quant_mix

    h = hashlib.sha256()
    h.update(Path(convert.__file__).read_bytes())
    h.update(Path(quant_mix.__file__).read_bytes())
    h.update(f"ggml={toy_ggml.GGML_VERSION} toy_ggml={toy_ggml.__version__}".encode())
    return h.hexdigest()[:12]


def hf_dir(shape: str = "qwen3moe-tiny", seed: int = 0) -> Path:
    """The cached HF model folder of ``SHAPES[shape]`` and ``seed``."""
    return gpt2_ref.recipe_hf_dir(cache_root(), "moe", SHAPES, shape, seed, _digest(), make_hf_moe)


def gguf_path(shape: str = "qwen3moe-tiny", seed: int = 0, outtype: str = "f32") -> Path:
    """The cached GGUF of ``SHAPES[shape]``, ``seed`` and ``outtype``:
    converted by llama.cpp's convert_hf_to_gguf.py (``f32``, ``f16``,
    ``q8_0``), or (``q4_k_m``) the F32 file quantized by toy's
    ``quantize_model(..., "Q4_K_M")``."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    if outtype not in TOY_QUANT:
        return gpt2_ref.recipe_gguf(hf_dir(shape, seed), "moe", shape, seed, outtype, MODEL_NAME)
    src = gguf_path(shape, seed, "f32")
    tag = f"moe-{shape}-seed{seed}-{outtype}-toy"
    out = src.parent / f"{tag}{_toy_quant_digest()}.gguf"
    if not out.is_file():
        for old in src.parent.glob(f"{tag}*.gguf"):  # an older quantizer's file
            old.unlink(missing_ok=True)
    from toy.gguf import quantize_model

    return gpt2_ref.cached_file(out, lambda tmp: quantize_model(src, tmp, TOY_QUANT[outtype]))


def recipe(shape: str, seed: int, outtype: str) -> dict:
    return {
        "shape": shape,
        **copy.deepcopy(SHAPES[shape]),
        "seed": seed,
        "outtype": outtype,
        "n_vocab": N_VOCAB,
        "embd_std": EMBD_STD,
        "weight_gain": WEIGHT_GAIN,
        "router_gain": ROUTER_GAIN,
        "bias_std": BIAS_STD,
        "norm_mean": NORM_MEAN,
        "norm_std": NORM_STD,
        "quantizer": "toy" if outtype in TOY_QUANT else "convert_hf_to_gguf.py",
    }
