"""Seeded random Hugging Face llama-family folders and llama.cpp's conversion of
them (test-only helper for the HF import tests).

- ``make_hf_llama(out_dir, arch=, seed=, tie=, shards=, dtype=, **fields)``:
  a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` made by
  ``transformers`` with seeded random weights (every matrix N(0, (1.6/sqrt(d))²),
  norms N(1, 0.1²), biases N(0, 0.1²), so a bug in any of them shows), saved
  with ``save_pretrained`` (``shards``: a ``max_shard_size`` so that the
  weights are split with an index; ``dtype``: "float32", "float16" or
  "bfloat16" on disk), plus GPT-2's tokenizer files
  (``gpt2_ref.gpt2_tokenizer_files``, vocabulary 50257, whose pre-tokenizer
  llama.cpp's converter names ``gpt-2``) with a small chat template added.
- ``convert(hf_dir, out, outtype)``: llama.cpp's ``convert_hf_to_gguf.py`` of
  the pinned sdist (``gpt2_ref.llama_cpp_dir``) with ``--outtype`` f32, f16,
  bf16 or q8_0.

Nothing is downloaded from a model hub; transformers runs offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from toy_testsupport import gpt2_ref

N_VOCAB = gpt2_ref.N_VOCAB
MODEL_NAME = "toy-test-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)

ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def make_hf_llama(out_dir, *, arch="llama", seed=0, tie=False, shards=None, dtype="float32", **fields) -> Path:
    """The seeded HF model of ``arch`` with GPT-2's tokenizer in ``out_dir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    cls_name = ARCHS[arch]
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    kw = dict(TINY)
    kw.update(
        vocab_size=N_VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=N_VOCAB - 1,
        eos_token_id=N_VOCAB - 1,
    )
    kw.update(fields)
    cfg = cfg_cls(**kw)
    model = getattr(transformers, cls_name)(cfg).float().eval()
    d = cfg.hidden_size
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.ndim == 1:
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.6 / d**0.5)
    model = model.to(getattr(torch, dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shards} if shards else {}
    model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    gpt2_ref.gpt2_tokenizer_files(out)
    tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    tc["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2), encoding="utf-8")
    return out


def convert(hf_dir, out, outtype: str = "f32") -> Path:
    """llama.cpp's converter (pinned sdist) on ``hf_dir``: ``out``."""
    lcpp = gpt2_ref.llama_cpp_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env["PYTHONPATH"] = os.pathsep.join([str(lcpp / "gguf-py"), str(lcpp)])
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, str(lcpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out)]
    cmd += ["--outtype", outtype, "--model-name", MODEL_NAME]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return Path(out)
