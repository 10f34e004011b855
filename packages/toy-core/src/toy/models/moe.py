"""The routed mixture-of-experts feed-forward, as llama.cpp builds it
(``build_moe_ffn``): a graph piece the MoE variants of a family use in place
of their dense feed-forward (``toy.models.llama``: olmoe, qwen2moe,
qwen3moe). Not an architecture module itself.

For T tokens u (T, d) and a layer with E experts of width F, k used per
token (NumPy shapes; the 3-D expert tensors are llama.cpp's
``ffn_{gate,up,down}_exps``: gate and up (E, F, d), down (E, d, F)):

1. router logits ``u · W_routerᵀ`` (T, E) (``ffn_gate_inp``, always F32 in
   converted files; a LoRA target), softmax over the E experts;
2. the k most probable experts of each token, most probable first
   (``argsort_top_k``, llama.cpp's op: on the CPU exactly equal
   probabilities resolve to the lower expert index for E <= 16);
3. their probabilities (gathered from the softmax over all E, not
   renormalised) — renormalised to sum 1 (floor 6.1035e-5) when the
   architecture says (``expert_weights_norm``: qwen3moe);
4. for each (token, slot): ``down_e(silu(gate_e(u)) * up_e(u))`` by three
   ``mul_mat_id`` products, one graph for every token and expert (no
   per-expert or per-token Python loop), times its probability;
5. the k slot outputs summed in slot order (llama.cpp's left fold);
6. a shared expert when the layer has one (qwen2moe): a dense SwiGLU
   feed-forward of width ``d_ff_shared`` scaled by sigmoid(u · w_gate),
   computed as llama.cpp does, silu(x)/x (which is 0/0 at exactly x = 0).

Experts stay in their file's type (memory-mapped on the CPU). A token's
result depends only on its own row for F32, F16 and Q8_0 experts (each
output is one ``vec_dot``); with ``row_invariant`` the products keep that
for every type (toy-ggml patch 0015 extends patch 0004's hint to
``mul_mat_id``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toy.models import ParamInfo, Traits, UnsupportedModelError

NORM_FLOOR = 6.103515625e-5  # llama.cpp's clamp of the renormalising sum


def config_fields(
    arch: str, metadata: Mapping[str, Any], tensors: Mapping[str, Any], d_ff: int, traits: Traits
) -> dict[str, Any]:
    """The MoE fields of a config from GGUF metadata (empty for a dense
    model): ``n_expert``, ``n_expert_used``, ``d_ff_expert``,
    ``d_ff_shared`` (0: no shared expert) and ``expert_weights_norm``, as
    llama.cpp resolves them for ``arch``, whose ``traits`` (the family's
    ``ARCH.traits[arch]``) say what the name fixes: the expert width and
    the renormalised weights."""

    def num(key: str):
        v = metadata.get(f"{arch}.{key}")
        if v is not None and (isinstance(v, (str, bytes)) or hasattr(v, "__len__")):
            raise UnsupportedModelError(f"{arch}.{key}: per-layer values are not supported")
        return v

    n_expert = int(num("expert_count") or 0)
    if not n_expert:
        return {}
    used = int(num("expert_used_count") or 0)
    if not 0 < used <= n_expert:
        raise UnsupportedModelError(f"{arch}.expert_used_count={used} must be in 1..{n_expert}")
    if num("expert_group_count") or num("expert_weights_scale"):
        raise UnsupportedModelError(f"{arch}: expert groups and expert weight scaling are not supported")
    gating = num("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp: 1 = softmax
        raise UnsupportedModelError(f"{arch}.expert_gating_func={gating}: only softmax gating is supported")
    if traits.expert_width_is_ff:  # olmoe: the expert width is feed_forward_length
        d_ff_expert = d_ff
    else:
        d_ff_expert = int(num("expert_feed_forward_length") or 0) or d_ff // used
    shared = 0
    if "blk.0.ffn_up_shexp.weight" in tensors:
        shared = int(num("expert_shared_feed_forward_length") or 0) or d_ff
    return {
        "n_expert": n_expert,
        "n_expert_used": used,
        "d_ff_expert": d_ff_expert,
        "d_ff_shared": shared,
        "expert_weights_norm": traits.expert_weights_norm,
    }


def layer_tensors(cfg) -> list[str]:
    """The feed-forward tensors of a MoE layer (suffixes of ``blk.N.``)."""
    names = ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
    if cfg.d_ff_shared:
        names += ["ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
    return names


def params(cfg, p: str) -> dict[str, ParamInfo]:
    """The trainable feed-forward tensors of layer ``p`` (``blk.N``), in
    llama.cpp's converter order. The router and the shared expert's gate
    are ``matrix``; the expert products into the residual stream are
    ``residual`` like a dense down projection."""
    d, E, F, Fs = cfg.d_model, cfg.n_expert, cfg.d_ff_expert, cfg.d_ff_shared
    out = {
        f"{p}.ffn_gate_inp.weight": ParamInfo((E, d), "matrix"),
        f"{p}.ffn_gate_exps.weight": ParamInfo((E, F, d), "matrix"),
        f"{p}.ffn_up_exps.weight": ParamInfo((E, F, d), "matrix"),
        f"{p}.ffn_down_exps.weight": ParamInfo((E, d, F), "residual"),
    }
    if Fs:
        out[f"{p}.ffn_gate_inp_shexp.weight"] = ParamInfo((1, d), "matrix")
        out[f"{p}.ffn_gate_shexp.weight"] = ParamInfo((Fs, d), "matrix")
        out[f"{p}.ffn_up_shexp.weight"] = ParamInfo((Fs, d), "matrix")
        out[f"{p}.ffn_down_shexp.weight"] = ParamInfo((d, Fs), "residual")
    return out


def ffn(ctx, cfg, weights, lin, p: str, u, row_invariant: bool = False, lora=None):
    """The MoE feed-forward of layer ``p`` on u (T, d) -> (T, d) (see the
    module docstring). ``lin(name, x)`` is the family's projection (LoRA
    terms included): the router and the shared expert go through it.
    ``lora`` (the forward's term map) may hold 3-D terms of the experts
    (``ffn_{gate,up,down}_exps``: A (E, r, in), B (E, out, r)), added as
    llama.cpp's ``build_lora_mm_id`` does: ``scale · B_e (A_e x)`` for each
    (token, slot) routed to expert e, by two more ``mul_mat_id`` products
    (nothing is added without them). Their ``drop`` is None or the engine's
    per-sequence row masks (a tuple of (rows, 1) tensors, the one with the
    input's row count used); a training dropout mask is refused."""
    T, d, k = u.shape[0], cfg.d_model, cfg.n_expert_used
    probs = ctx.soft_max(lin(f"{p}.ffn_gate_inp.weight", u))  # (T, E)
    sel = ctx.argsort_top_k(probs, k)  # (T, k) I32, most probable first
    w = ctx.get_rows(ctx.reshape(probs, (T, cfg.n_expert, 1)), sel)  # (T, k, 1)
    if cfg.expert_weights_norm:
        w2 = ctx.reshape(w, (T, k))
        total = ctx.clamp(ctx.sum_rows(w2), NORM_FLOOR, float("inf"))  # (T, 1)
        # the sum repeated to (T, k): the same quotients as llama.cpp's broadcast division, and a
        # division ggml can differentiate (its DIV backward needs operands of one shape)
        w = ctx.reshape(ctx.div(w2, ctx.repeat(total, (T, k))), (T, k, 1))
    x = ctx.reshape(u, (T, 1, d))

    def mm_id(w, a):
        return ctx.mul_mat_id(w, a, sel, row_invariant=row_invariant)

    def experts(which: str, a):
        name = f"{p}.ffn_{which}_exps.weight"
        y = mm_id(weights[name], a)
        for la, lb, s, drop in lora.get(name, ()) if lora else ():
            y = ctx.add(y, ctx.scale(mm_id(lb, mm_id(la, expert_input(name, a, drop))), s))
        return y

    def expert_input(name: str, a, drop):
        """a (T, 1 or k, in) times a per-sequence row mask (T, 1) (the engine's selectable adapters)."""
        if drop is None:
            return a
        if not isinstance(drop, tuple):
            raise ValueError(
                f"{name}: expert LoRA pairs are applied at inference only; training (dropout masks) adapts "
                "the 2-D projections (the architecture's lora_targets)"
            )
        m = next(d for d in drop if d.shape[0] == a.shape[0])
        return ctx.mul(a, ctx.reshape(m, (a.shape[0], 1, 1)))

    h = ctx.swiglu(experts("gate", x), experts("up", x))  # (T, k, F)
    y = ctx.mul(experts("down", h), w)  # (T, k, d), each slot scaled by its probability
    out = None
    for s in range(k):  # slot order, as llama.cpp's left fold
        ys = ctx.view(y, (T, d), strides=(y.strides[0], y.strides[2]), offset=s * y.strides[1])
        out = ys if out is None else ctx.add(out, ys)
    if k == 1:
        out = ctx.cont(out)
    if cfg.d_ff_shared:
        gi = lin(f"{p}.ffn_gate_inp_shexp.weight", u)  # (T, 1)
        gate = ctx.div(ctx.silu(gi), gi)  # sigmoid, as llama.cpp computes it
        shared = ctx.swiglu(lin(f"{p}.ffn_gate_shexp.weight", u), lin(f"{p}.ffn_up_shexp.weight", u))
        out = ctx.add(out, ctx.mul(lin(f"{p}.ffn_down_shexp.weight", shared), gate))
    return out


__all__ = ["NORM_FLOOR", "config_fields", "ffn", "layer_tensors", "params"]
