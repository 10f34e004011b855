"""TRL's own loss code as the reference of toy's preference and RL objectives
(test-only; TRL 1.16.0, pinned in requirements/dev.txt).

The model is a seeded random Hugging Face llama (``hf_llama_ref.make_hf_llama``:
width 64, 2 layers, GQA 4/2 heads, GPT-2's 50257-token vocabulary, which the
llama.cpp converter needs for that tokenizer) converted to an F32 GGUF by
llama.cpp's converter (``make_model``). Toy trains the GGUF's tensors; the
reference loads the same values back into a ``LlamaForCausalLM`` in float64
(``hf_model``: GGUF names -> Hugging Face names, the converter's RoPE row order
of ``attn_q``/``attn_k`` undone) and the gradients come back under toy's names
(``Reference.grads``), so a test compares tensor by tensor.

Each reference builds the real trainer (``DPOTrainer``, ``trl.experimental.orpo.
ORPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``) on a two-row dummy dataset (no
hub access, CPU, ``report_to="none"``, output under a temporary folder) and
calls its ``compute_loss`` on an input dict built from the test's token ids, in
the layout the trainer's collator produces (right-padded rows; GRPO: prompts of
one length, so no left padding moves the positions), then back-propagates:
the loss, the metrics and the gradients are TRL's. Mixed precision is off
(TRL's configs default to bf16, which would run the reference model under a
bfloat16 autocast). The trainer runs in eval
mode, so nothing is divided by gradient-accumulation steps (TRL's train-mode
scaling for accumulation is not part of the objective).

- Full fine-tune: ``policy`` and ``reference`` are full weight sets (toy names);
  TRL gets ``model`` = the policy and ``ref_model`` = the reference.
- LoRA (``Lora``): ``reference`` is the base; TRL gets the base with a PEFT
  ``LoraConfig`` (so, as in a real run, its reference is the base with the
  adapters disabled) and the adapter values are then set to toy's: toy's
  ``<W>.lora_a`` (r, in) is PEFT's ``lora_A`` and ``<W>.lora_b`` (out, r)
  PEFT's ``lora_B`` with the RoPE row order of q/k; scale alpha / r (rsLoRA:
  alpha / sqrt(r)) in both.

Precision: the backbone runs in float64, but TRL 1.16 computes every trainer's
per-token log-probabilities (except ORPO's, which takes the model's logits)
with its fused LM head (``trl/kernels/chunked_logprob.py``), whose
log-sum-exp and backward accumulation are float32 whatever the model's dtype;
ORPO casts its average log-probs to float32 before the odds ratio. So the
reference carries float32 rounding at the head (~1e-7 relative per token).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy_testsupport import hf_llama_ref

TRL_VERSION = "1.16.0"
#: the tiny model's shape (make_hf_llama's fields)
FIELDS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
N_HEAD, N_HEAD_KV = FIELDS["num_attention_heads"], FIELDS["num_key_value_heads"]
PAD = hf_llama_ref.N_VOCAB - 1  # TRL pads with the tokenizer's EOS (GPT-2 has no pad token); masked everywhere

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HEADS = {"attn_q": N_HEAD, "attn_k": N_HEAD_KV}  # rows the converter reorders for RoPE's pairs


def make_model(folder, seed: int = 4) -> tuple[Path, Path]:
    """The seeded HF llama (``folder/hf``) and its F32 GGUF by llama.cpp's converter (``folder/base.gguf``)."""
    folder = Path(folder)
    hf = hf_llama_ref.make_hf_llama(folder / "hf", seed=seed, **FIELDS)
    return hf, hf_llama_ref.convert(hf, folder / "base.gguf", "f32")


def hf_name(gguf: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name."""
    if gguf in _TOP:
        return _TOP[gguf]
    _, layer, stem, _ = gguf.split(".")
    return f"model.layers.{layer}.{_BLOCK[stem]}.weight"


def _stem(gguf: str) -> str:
    return gguf.split(".")[2] if gguf.startswith("blk.") else ""


def to_gguf_rows(x: np.ndarray, gguf: str) -> np.ndarray:
    """Rows of a q/k weight (or gradient, or LoRA B) in HF's order -> the converter's (pairs per head interleaved)."""
    heads = _HEADS.get(_stem(gguf))
    if heads is None:
        return x
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def to_hf_rows(x: np.ndarray, gguf: str) -> np.ndarray:
    """The inverse of ``to_gguf_rows``."""
    heads = _HEADS.get(_stem(gguf))
    if heads is None:
        return x
    return x.reshape(heads, x.shape[0] // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # ORPO lives in trl.experimental
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def hf_model(hf_dir, weights: Mapping[str, np.ndarray]):
    """A float64 ``LlamaForCausalLM`` of ``hf_dir``'s config carrying ``weights`` (toy's names, every tensor)."""
    _offline()
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).to(torch.float64)
    params = dict(model.named_parameters())
    names = {hf_name(n): n for n in weights}
    assert set(names) == set(params), set(names) ^ set(params)
    with torch.no_grad():
        for h, p in params.items():
            g = names[h]
            p.copy_(torch.from_numpy(to_hf_rows(np.asarray(weights[g], np.float64), g).copy()))
    model.name_or_path = str(hf_dir)
    model.config.name_or_path = str(hf_dir)
    return model.eval()


@dataclass
class Lora:
    """Toy's LoRA parameters (``<W>.lora_a`` / ``<W>.lora_b``) and scaling."""

    values: Mapping[str, np.ndarray]
    alpha: float
    rslora: bool = False

    @property
    def weights(self) -> list[str]:
        return sorted({n.rsplit(".", 1)[0] for n in self.values})

    @property
    def rank(self) -> int:
        (r,) = {int(v.shape[0]) for n, v in self.values.items() if n.endswith(".lora_a")}
        return r

    def peft_config(self):
        from peft import LoraConfig

        modules = sorted({_BLOCK[_stem(w)].split(".")[1] for w in self.weights})
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            use_rslora=self.rslora,
            lora_dropout=0.0,
            target_modules=modules,
            task_type="CAUSAL_LM",
        )


def _peft_key(gguf_weight: str, which: str) -> str:
    return hf_name(gguf_weight).removesuffix(".weight") + f".lora_{which}.default.weight"


@dataclass
class Reference:
    """TRL's loss, gradients (toy's parameter names) and logged metrics."""

    loss: float
    grads: dict[str, np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _prepare(trainer, lora: Lora | None):
    """The trainer's model in float64 and eval mode, LoRA values set to toy's; its trained parameters by toy name."""
    import torch

    model = trainer.model.to(torch.float64).eval()
    if getattr(trainer, "ref_model", None) is not None:  # ORPO has none
        trainer.ref_model.to(torch.float64).eval()
    params = dict(model.named_parameters())
    if lora is None:
        by_hf = {hf_name(n): n for n in _all_gguf(params)}
        assert set(by_hf) == set(params), set(by_hf) ^ set(params)
        return model, {by_hf[name]: p for name, p in params.items()}
    peft_params = {k.split("base_model.model.", 1)[-1]: p for k, p in params.items()}
    trained = {}
    with torch.no_grad():
        for w in lora.weights:
            a, b = peft_params[_peft_key(w, "A")], peft_params[_peft_key(w, "B")]
            a.copy_(torch.from_numpy(np.asarray(lora.values[f"{w}.lora_a"], np.float64)))
            b.copy_(torch.from_numpy(to_hf_rows(np.asarray(lora.values[f"{w}.lora_b"], np.float64), w).copy()))
            trained[f"{w}.lora_a"], trained[f"{w}.lora_b"] = a, b
    assert {n for n, p in params.items() if p.requires_grad} == {
        k for k, p in params.items() if any(p is t for t in trained.values())
    }, "PEFT trains other parameters than the adapters"
    return model, trained


def _all_gguf(params) -> list[str]:
    """Every GGUF name of a plain (not PEFT) llama's parameters."""
    n_layer = 1 + max(int(k.split(".")[2]) for k in params if k.startswith("model.layers."))
    return list(_TOP) + [f"blk.{i}.{s}.weight" for i in range(n_layer) for s in _BLOCK]


def _grads(trained) -> dict[str, np.ndarray]:
    out = {}
    for name, p in trained.items():
        g = p.grad.detach().to(dtype=p.dtype).numpy().astype(np.float64)
        w = name.removesuffix(".lora_a").removesuffix(".lora_b")
        out[name] = g if name.endswith(".lora_a") else to_gguf_rows(g, w)
    return out


def _tokenizer(hf_dir):
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)


def _common(out_dir: str) -> dict[str, Any]:
    # bf16=False: TRL's configs default to bf16 mixed precision, under which accelerate wraps the prepared
    # reference model's forward in a bfloat16 autocast
    return dict(output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=2, seed=0)


def _models(hf_dir, policy, reference, lora):
    """(model, ref_model, peft_config) as a TRL run of this kind gets them."""
    if lora is None:
        return hf_model(hf_dir, policy), hf_model(hf_dir, reference), None
    return hf_model(hf_dir, reference), None, lora.peft_config()


def _rows(seqs: Sequence[Sequence[int]], width: int | None = None):
    """Right-padded int64 rows and their attention mask."""
    import torch

    width = width or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def _completion_mask(prompt_lens: Sequence[int], seqs: Sequence[Sequence[int]], width: int):
    import torch

    m = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompt_lens, seqs, strict=True)):
        m[i, p : len(s)] = 1
    return m


@dataclass
class Example:
    """One sequence: ``prompt`` token ids then ``completion`` token ids."""

    prompt: list[int]
    completion: list[int]

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.completion


def _metrics(d) -> dict[str, float]:
    return {k: float(v[-1]) if isinstance(v, list) else float(v) for k, v in d.items()}


def dpo(
    hf_dir,
    policy: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    chosen: Sequence[Example],
    rejected: Sequence[Example],
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    lora: Lora | None = None,
) -> Reference:
    """``DPOTrainer.compute_loss`` on the pairs (chosen[i], rejected[i]) (batch [chosen; rejected]); the
    reference log-probs computed by the trainer itself (``ref_model`` / adapters disabled)."""
    _offline()
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, ref_model, peft_config = _models(hf_dir, policy, reference, lora)
    ds = Dataset.from_dict({"prompt": ["a", "b"], "chosen": [" c", " d"], "rejected": [" e", " f"]})
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(beta=beta, loss_type=[loss_type], label_smoothing=label_smoothing, **_common(out))
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=ds,
            processing_class=_tokenizer(hf_dir),
            peft_config=peft_config,
        )
        model, trained = _prepare(trainer, lora)
        seqs = [e.seq for e in chosen] + [e.seq for e in rejected]
        ids, attn = _rows(seqs)
        cm = _completion_mask([len(e.prompt) for e in [*chosen, *rejected]], seqs, ids.shape[1])
        loss = trainer.compute_loss(model, {"input_ids": ids, "attention_mask": attn, "completion_mask": cm})
        loss.backward()
        return Reference(float(loss.detach()), _grads(trained), _metrics(trainer._metrics["eval"]))


def orpo(
    hf_dir,
    policy: Mapping[str, np.ndarray],
    chosen: Sequence[Example],
    rejected: Sequence[Example],
    *,
    lam: float,
    lora: Lora | None = None,
) -> Reference:
    """``trl.experimental.orpo.ORPOTrainer.compute_loss`` (``beta`` = lambda) on the pairs; ``lora``: the
    adapters on ``policy`` as the base."""
    _offline()
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model = hf_model(hf_dir, policy)
    ds = Dataset.from_dict({"prompt": ["a", "b"], "chosen": [" c", " d"], "rejected": [" e", " f"]})
    with tempfile.TemporaryDirectory() as out:
        args = ORPOConfig(beta=lam, **_common(out))
        trainer = ORPOTrainer(
            model=model,
            args=args,
            train_dataset=ds,
            processing_class=_tokenizer(hf_dir),
            peft_config=None if lora is None else lora.peft_config(),
        )
        model, trained = _prepare(trainer, lora)
        inputs = {}
        width = max(len(e.seq) for e in [*chosen, *rejected])  # both sides one width, as TRL's collator pads them
        for side, exs in (("chosen", chosen), ("rejected", rejected)):
            seqs = [e.seq for e in exs]
            ids, attn = _rows(seqs, width)
            labels = ids.masked_fill(_completion_mask([len(e.prompt) for e in exs], seqs, ids.shape[1]) == 0, -100)
            inputs.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attn, f"{side}_labels": labels})
        loss, metrics = trainer.compute_loss(model, inputs, return_outputs=True)
        loss.backward()
        return Reference(float(loss.detach()), _grads(trained), _metrics(metrics))


def kto(
    hf_dir,
    policy: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    examples: Sequence[Example],
    desirable: Sequence[bool],
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    lora: Lora | None = None,
) -> Reference:
    """``KTOTrainer.compute_loss`` on ``examples`` with their labels and the KL batch TRL's dataset preparation
    builds for one batch: example i's prompt followed by example (i - 1 mod n)'s completion. ``metrics["kl"]``
    is the KL estimate z0 the loss used."""
    _offline()
    import torch
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    model, ref_model, peft_config = _models(hf_dir, policy, reference, lora)
    ds = Dataset.from_dict({"prompt": ["a", "b"], "completion": [" c", " d"], "label": [True, False]})
    n = len(examples)
    kl_examples = [Example(examples[i].prompt, examples[(i - 1) % n].completion) for i in range(n)]
    with tempfile.TemporaryDirectory() as out:
        args = KTOConfig(
            beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, **_common(out)
        )
        trainer = KTOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=ds,
            processing_class=_tokenizer(hf_dir),
            peft_config=peft_config,
        )
        assert trainer.calculate_KL and not trainer.precompute_ref_logps
        model, trained = _prepare(trainer, lora)
        inputs: dict[str, Any] = {"label": torch.tensor(list(desirable), dtype=torch.bool)}
        for prefix, exs in (("", examples), ("KL_", kl_examples)):
            seqs = [e.seq for e in exs]
            ids, attn = _rows(seqs)
            cm = _completion_mask([len(e.prompt) for e in exs], seqs, ids.shape[1])
            inputs.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": attn, f"{prefix}completion_mask": cm})
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return Reference(float(loss.detach()), _grads(trained), _metrics(trainer._metrics["eval"]))


def grpo(
    hf_dir,
    policy: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    advantages: Sequence[float],
    *,
    beta: float,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    old_logps: np.ndarray | None = None,
    max_completion_length: int = 16,
    lora: Lora | None = None,
) -> Reference:
    """``GRPOTrainer.compute_loss`` given the completions and advantages (row i: ``prompts[i]`` then
    ``completions[i]``; every prompt the same length). ``old_logps`` (rows, longest completion): the
    rollout-time per-token log-probs (None: on-policy, TRL's detached current log-probs). With ``beta``
    the reference per-token log-probs are TRL's (``_get_per_token_logps_and_entropies`` on the reference
    model, or with the adapters disabled) and come back in ``extra["ref_logps"]``; ``num_items_in_batch``
    (dapo's normalizer) is this batch's completion token count."""
    _offline()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head, use_adapter

    (plen,) = {len(p) for p in prompts}
    model, ref_model, peft_config = _models(hf_dir, policy, reference, lora)

    def reward(completions, **kw):
        return [0.0] * len(completions)

    ds = Dataset.from_dict({"prompt": ["a", "b"]})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            beta=beta,
            loss_type=loss_type,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            num_generations=2,
            max_completion_length=max_completion_length,
            **_common(out),
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=_tokenizer(hf_dir),
            peft_config=peft_config,
        )
        assert trainer.temperature == 1.0
        model, trained = _prepare(trainer, lora)
        prompt_ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
        completion_ids, completion_mask = _rows(completions)
        inputs: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(list(advantages), dtype=torch.float64),
            "num_items_in_batch": completion_mask.sum(),
        }
        if old_logps is not None:
            inputs["old_per_token_logps"] = torch.from_numpy(np.asarray(old_logps, np.float64))
        extra = {}
        if beta != 0.0:
            ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attn = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
            with torch.no_grad():
                if lora is None:
                    add_fused_lm_head(ref_model, temperature=trainer.temperature)
                    ref, _, _ = trainer._get_per_token_logps_and_entropies(ref_model, ids, attn, ids.shape[1] - plen)
                else:
                    with use_adapter(model, adapter_name=None):
                        ref, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, ids.shape[1] - plen)
            inputs["ref_per_token_logps"] = ref
            extra["ref_logps"] = ref.to(torch.float64).numpy() * completion_mask.numpy()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return Reference(float(loss.detach()), _grads(trained), _metrics(trainer._metrics["eval"]), extra)
