"""Independent Gemma 2 / Gemma 3 reference models for tests (test-only helper).

A Gemma here is made by Hugging Face ``transformers`` (``Gemma2ForCausalLM``
or ``Gemma3ForCausalLM`` with a ``Gemma3TextConfig``, seeded random weights,
saved with ``save_pretrained``) and turned into GGUF by llama.cpp's own
``convert_hf_to_gguf.py`` (``gpt2_ref.convert_to_gguf``: the llama-cpp-python
0.3.36 sdist, hash-checked and extracted by ``gpt2_ref.llama_cpp_dir``).
Neither step goes through toy, so a toy Gemma tested on these files is
checked against two outside implementations: the converter's tensor layout
and metadata (norm weights stored as ``1 + w``, soft-caps, sliding window,
local RoPE base) and HF's forward (``hf_logits``, ``hf_greedy``).

- ``sp_model_bytes()``: a SentencePiece BPE model trained offline on
  ``CORPUS`` with Gemma's layout (pad 0, eos 1, bos 2, unk 3, then
  ``<mask> [@BOS@] <start_of_turn> <end_of_turn>``, the 256 byte pieces,
  identity normalization, no dummy prefix, digits split, whitespace-only
  pieces), deterministic: the same bytes on every run (one thread, no
  shuffling, a fixed seed).
- ``gemma_tokenizer_files(out_dir)``: ``GemmaTokenizerFast`` over that model
  with the Gemma 2 chat template, ``save_pretrained`` (tokenizer.model,
  tokenizer.json, tokenizer_config.json, special_tokens_map.json,
  chat_template.jinja). The converter reads the SentencePiece model (it
  needs the ``sentencepiece`` package, and HF's slow-to-fast conversion
  needs ``protobuf``).
- ``make_hf_gemma(out_dir, arch=, seed=, **fields)`` (``SHAPES[shape]``
  holds ``arch`` and the fields): the HF model (vocab ``sp_vocab_size()``,
  512; float32) plus the tokenizer files.
- ``hf_dir(shape, seed)`` / ``gguf_path(shape, seed, outtype)``: the same,
  cached under ``$TOY_TEST_GEMMA_CACHE`` (default ``~/.cache/toy-test-gemma``)
  in a folder keyed by the recipe (``SHAPES[shape]``, seed, outtype) and a
  digest of this file, gpt2_ref.py (the converter driver), the sdist and the
  torch/transformers/tokenizers/sentencepiece/protobuf versions.
- ``hf_logits(hf_dir, ids, **config)`` (float32 ``(T, V)``) and
  ``hf_greedy(hf_dir, ids, n, **config)`` from the HF model in float32 with
  eager attention (HF's default SDPA attention drops Gemma 2's attention
  soft-cap); ``config`` overrides config fields at load time (e.g.
  ``sliding_window=64`` to see what the window changes).
- ``hf_tokenizer(hf_dir)``: the ``GemmaTokenizerFast``;
  ``chat_template_text()``: the Gemma 2 template (llama.cpp's
  ``models/templates/google-gemma-2-2b-it.jinja``; there is no Gemma 3
  template offline, and the text-only formats are the same).
- ``gguf_name(hf_name)``: the converter's tensor name of an HF Gemma
  parameter (``GGUF_LAYER_NAMES``: a layer's modules).

The cache machinery and the HF forward are gpt2_ref's (``recipe_hf_dir``,
``recipe_gguf``, ``cached_tokenizer``, ``load_causal_lm``, ...).

The shapes follow the checklist that makes llama.cpp and HF compute the same
function: ``query_pre_attn_scalar = head_dim``; Gemma 2 with rope_theta
10000, tied output, both soft-caps set, a layer count other than 46; Gemma 3
with no attention soft-cap, 7 layers (local 0-4, global 5, local 6) and the
default sliding-window pattern (no ``layer_types``), linear RoPE scaling on
the global layers, ``use_bidirectional_attention`` False; GELU tanh; a
sliding window of 8, shorter than the test sequences. The soft-caps are
small powers of two (attention 8, final 4: ggml multiplies by ``1/cap``,
exact for these) and bite: on seed 0, dropping the final cap moves the top
logit from 3.7 to 6.7, dropping the attention cap moves logits by up to 3.2
(on test_gemma_ref's 56-token text).

The random weights: after ``torch.manual_seed(seed)``, every parameter is
drawn anew in ``named_parameters`` order from torch's stream (a tied output
matrix is the embedding, listed once): the embedding (and the untied
``lm_head``) N(0, 0.1²) (``EMBD_STD``); every Linear weight (Gemma has no
biases) N(0, (1/sqrt(fan_in))²) (``WEIGHT_GAIN`` 1); every RMSNorm weight
``w``, which HF applies as ``1 + w`` and the converter stores as ``1 + w``,
N(1, 0.2²) (``NORM_MEAN``, ``NORM_STD``): a scale of about 2, so a missing
``+1`` halves it. HF's own init (zero norm weights, N(0, 0.02²) matrices)
makes a weak test, and so do norm weights near 0: with a norm scale of 1
the post-block norms give each block an output of RMS 1, the logits stay
within about ±3, the soft-caps barely bite (the attention cap changes logits
by 0.2) and greedy text cycles through 3 tokens in 24 steps (gemma2-tiny;
with embeddings N(0, 0.5²) the tied head predicts the last token again, one
token repeated); with a scale of 2 the logits spread over a few units
(std 1.4 to 1.6) and greedy decoding moves on: 10, 15 and 16 distinct tokens
in 16 steps (gemma2-tiny, gemma3-tiny, gemma3-tiny-untied, seed 0), with
top-1 minus top-2 margins of at least 1.1e-3, 5.8e-2 and 3.1e-2.

Nothing is ever fetched from a model hub: ``gpt2_ref``, imported first,
sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE. Tests, benchmarks and the
recorders in tools/fixtures import it as ``from toy_testsupport import
gemma_ref`` (the package is installed in the development environment).
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
from pathlib import Path

import numpy as np

from toy_testsupport import gpt2_ref  # sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE on import

OUTTYPES = gpt2_ref.OUTTYPES
# the converter's general.name
MODEL_NAME = "toy-test-gemma"
TEMPLATE = "models/templates/google-gemma-2-2b-it.jinja"  # inside gpt2_ref.llama_cpp_dir()

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "head_dim": 16,
    "sliding_window": 8,
    "max_position_embeddings": 256,
}
SHAPES = {
    "gemma2-tiny": {
        "arch": "gemma2",
        **_COMMON,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "attn_logit_softcapping": 8.0,
        "final_logit_softcapping": 4.0,
        "tie_word_embeddings": True,
    },
    "gemma3-tiny": {
        "arch": "gemma3",
        **_COMMON,
        "num_hidden_layers": 7,
        "num_key_value_heads": 1,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_local_base_freq": 10_000.0,
    },
    "gemma3-tiny-untied": {
        "arch": "gemma3",
        **_COMMON,
        "num_hidden_layers": 7,
        "num_key_value_heads": 1,
        "final_logit_softcapping": 4.0,
        "tie_word_embeddings": False,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_local_base_freq": 10_000.0,
    },
}
# torch threads for the HF forward (restored afterwards): the models are tiny, and more threads
# only add synchronisation (16 greedy steps: 0.2 s on one thread, 0.5-3.6 s on two of a busy 2-core machine)
TORCH_THREADS = 1
# the random weights (see make_hf_gemma)
EMBD_STD = 0.1  # embed_tokens (and lm_head when untied)
WEIGHT_GAIN = 1.0  # Linear weights: N(0, (WEIGHT_GAIN / sqrt(fan_in))²)
NORM_MEAN = 1.0  # RMSNorm weights w: N(NORM_MEAN, NORM_STD²), a scale 1 + w of about 2
NORM_STD = 0.2
# the converter's names of a layer's tensors, by HF module
GGUF_LAYER_NAMES = {
    **gpt2_ref.ATTN_GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

# ------------------------------------------------------------ tokenizer

SPECIAL_PIECES = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, Gemma's layout
USER_SYMBOLS = ("<mask>", "[@BOS@]", "<start_of_turn>", "<end_of_turn>")  # ids 4..7
SP_VOCAB_SIZE = 512  # asked of the trainer (hard_vocab_limit=False: at most this)
SP_SEED = 1234

# what the SentencePiece model is trained on: English prose, code, numbers,
# punctuation, runs of spaces, tabs, accented Latin, CJK and emoji (the rarer
# characters get their own pieces at character_coverage=1.0; characters that
# are not in it at all fall back to <0xXX> byte pieces)
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "Hello world! How are you today? I am fine, thank you.",
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Gemma is a family of lightweight, open models built from research and technology.",
    "A language model predicts the next token from the tokens before it.",
    "The weather was cold and windy, so we stayed inside and read books all afternoon.",
    'She said: "Don\'t forget to bring the keys, the map, and the water bottles!"',
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2024, 3.14159, -7.5e-3 and 1,000,000.",
    "The meeting starts at 09:30 on 2024-06-15; room 101 (second floor).",
    "Prices rose by 12% in 2023: $4.99 became $5.59, and \u20ac3.50 became \u20ac3.92.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i * i)\n",
    "if (x > 0 && y < 10) { return x * y; } else { return -1; }",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\n",
    "SELECT name, age FROM users WHERE age >= 18 ORDER BY name;",
    "key\tvalue\tcomment\nalpha\t1\tfirst\nbeta\t2\tsecond\n",
    "Two  spaces,   three   spaces,    and four    spaces in a row.",
    "    indented line\n        more indented line\n",
    "Questions? Answers! Ellipses... dashes - and -- and (parentheses) [brackets] {braces}.",
    "Email: someone@example.com, web: https://example.org/path?q=1&r=2#top",
    "\u00dcber die Br\u00fccke gehen wir zum Caf\u00e9, sagte der M\u00fcller.",
    "Le gar\u00e7on na\u00eff a mang\u00e9 une cr\u00e8me br\u00fbl\u00e9e \u00e0 No\u00ebl.",
    "El ni\u00f1o espa\u00f1ol comi\u00f3 jam\u00f3n y bebi\u00f3 caf\u00e9 con az\u00facar.",
    "S\u00e3o Paulo, Z\u00fcrich, Krak\u00f3w, \u00c5lesund and Reykjav\u00edk are cities.",
    "\u4eca\u65e5\u306f\u3044\u3044\u5929\u6c17\u3067\u3059\u306d\u3002\u6771\u4eac\u306b\u884c\u304d\u307e\u3059\u3002",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u6211\u4eec\u5728\u5b66\u4e60\u4e2d\u6587\u3002",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "Emoji: \U0001f600 \U0001f680 \U0001f389 \u2764\ufe0f \U0001f44d and more \U0001f600\U0001f600.",
    "<start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n<start_of_turn>model\nRome.<end_of_turn>\n",
    "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "The sea is wide, the sea is deep, the waves roll in while sailors sleep.",
    "Training a model needs data, a loss function, gradients and an optimizer such as AdamW.",
    "Attention lets every position look at the positions before it, within a sliding window.",
    "The children played in the garden while their parents cooked dinner in the kitchen.",
    "He opened the window, looked at the mountains, and smiled at the morning light.",
    "Water boils at 100 degrees Celsius and freezes at 0 degrees at sea level.",
    "The library closes at 8 pm on weekdays and at 5 pm on Saturdays and Sundays.",
    "Please read the instructions carefully before you start the test.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
)


def cache_root() -> Path:
    return Path(os.environ.get("TOY_TEST_GEMMA_CACHE") or Path.home() / ".cache" / "toy-test-gemma")


def corpus_lines() -> list[str]:
    """The training sentences: ``CORPUS`` several times, each copy with a
    line number (so digits and the common words dominate the merges)."""
    return [f"{s} ({i})" if i % 3 else s for i in range(6) for s in CORPUS]


def sp_model_bytes() -> bytes:
    """The serialized SentencePiece model (``tokenizer.model``), trained
    in-process on ``corpus_lines()``; the same bytes on every call."""
    import sentencepiece as spm

    spm.set_random_generator_seed(SP_SEED)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=buf,
        vocab_size=SP_VOCAB_SIZE,
        model_type="bpe",  # llama.cpp's SPM tokenizer merges by score, as SentencePiece BPE does
        byte_fallback=True,  # llama.cpp needs every <0xXX> piece
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece=SPECIAL_PIECES[0],
        eos_piece=SPECIAL_PIECES[1],
        bos_piece=SPECIAL_PIECES[2],
        unk_piece=SPECIAL_PIECES[3],
        user_defined_symbols=list(USER_SYMBOLS),
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


def gemma_tokenizer_files(out_dir) -> Path:
    """Write the tokenizer (``GemmaTokenizerFast.save_pretrained`` over
    ``sp_model_bytes()`` with the Gemma 2 chat template) into ``out_dir``.
    Built once into the cache, then copied."""
    return gpt2_ref.cached_tokenizer(cache_root(), _digest(), _write_tokenizer, out_dir)


def _write_tokenizer(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tokenizer.model"
        model.write_bytes(sp_model_bytes())
        from transformers import GemmaTokenizerFast

        tok = GemmaTokenizerFast(vocab_file=str(model))  # slow -> fast: sentencepiece + protobuf
        tok.chat_template = chat_template_text()
        tok.save_pretrained(str(out))
    if not (out / "tokenizer.model").is_file():
        raise RuntimeError("GemmaTokenizerFast.save_pretrained wrote no tokenizer.model")


def sp_vocab_size() -> int:
    """The number of pieces of the trained model (``config.vocab_size``)."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=sp_model_bytes()).vocab_size()


def chat_template_text() -> str:
    """llama.cpp's Gemma 2 chat template (google-gemma-2-2b-it.jinja)."""
    return (gpt2_ref.llama_cpp_dir() / TEMPLATE).read_text(encoding="utf-8")


def hf_tokenizer(hf_dir):
    """The ``GemmaTokenizerFast`` saved in ``hf_dir``."""
    from transformers import GemmaTokenizerFast

    return GemmaTokenizerFast.from_pretrained(str(hf_dir), local_files_only=True)


# ------------------------------------------------------------ HF model


def hf_config(arch: str, *, vocab_size: int, **fields):
    """The HF config of a shape (``SHAPES[shape]`` without ``arch``)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    fields = copy.deepcopy(fields)
    common = dict(
        vocab_size=vocab_size,
        query_pre_attn_scalar=fields["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim)
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="eager",
        dtype="float32",
    )
    if arch == "gemma2":
        cfg = Gemma2Config(**common, rope_theta=10_000.0, **fields)
        cfg.architectures = ["Gemma2ForCausalLM"]
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(**common, attn_logit_softcapping=None, use_bidirectional_attention=False, **fields)
        cfg.architectures = ["Gemma3ForCausalLM"]
    else:
        raise ValueError(f"arch must be gemma2 or gemma3, not {arch!r}")
    return cfg


def make_hf_gemma(out_dir, *, arch: str, seed: int, vocab_size: int | None = None, **fields) -> Path:
    """A seeded random ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` saved in
    ``out_dir`` (float32 safetensors) with the tokenizer files. ``vocab_size``
    (default: the tokenizer's) may be larger: the converter pads the
    vocabulary with unused tokens (the benchmarks' full-size shapes)."""
    import torch
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

    out = Path(out_dir)
    gemma_tokenizer_files(out)
    cfg = hf_config(arch, vocab_size=vocab_size or sp_vocab_size(), **fields)
    torch.manual_seed(seed)
    model = (Gemma2ForCausalLM if arch == "gemma2" else Gemma3ForCausalLM)(cfg).float().eval()
    # every parameter drawn anew in named_parameters order from one torch
    # stream (see the module docstring)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(NORM_MEAN, NORM_STD)
            elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                p.normal_(0.0, EMBD_STD)
            elif p.ndim == 2:
                p.normal_(0.0, WEIGHT_GAIN / p.shape[1] ** 0.5)
            else:
                raise RuntimeError(f"no rule for the parameter {name} {tuple(p.shape)}")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


hf_state_dict = gpt2_ref.hf_state_dict  # the saved tensors as float32 NumPy arrays (HF names and layout)


def hf_logits(hf_dir, ids, **config) -> np.ndarray:
    """Float32 logits ``(T, V)`` of ``ids`` at positions 0..T-1 (after the
    final soft-cap), on ``TORCH_THREADS``. ``config``: config fields changed
    at load time."""
    return gpt2_ref.model_logits(gpt2_ref.load_causal_lm(hf_dir, **config), ids, TORCH_THREADS)


def hf_greedy(hf_dir, ids, n: int, **config) -> list[int]:
    """``n`` greedy tokens after ``ids`` (the argmax of the last position's
    logits, fed back; full recompute each step, no KV cache)."""
    return gpt2_ref.model_greedy(gpt2_ref.load_causal_lm(hf_dir, **config), ids, n, TORCH_THREADS)


def gguf_name(hf_name: str) -> str:
    """The converter's GGUF tensor of a Hugging Face Gemma parameter."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, n, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{n}.{GGUF_LAYER_NAMES[rest.rsplit('.', 1)[0]]}.weight"


# ------------------------------------------------------------ cached recipes


def _digest() -> str:
    return gpt2_ref.versions_digest(
        [__file__, gpt2_ref.__file__], "torch", "transformers", "tokenizers", "sentencepiece", "protobuf"
    )


def hf_dir(shape: str = "gemma2-tiny", seed: int = 0) -> Path:
    """The cached HF model folder of ``SHAPES[shape]`` and ``seed``."""
    return gpt2_ref.recipe_hf_dir(cache_root(), "gemma", SHAPES, shape, seed, _digest(), make_hf_gemma)


def gguf_path(shape: str = "gemma2-tiny", seed: int = 0, outtype: str = "f32") -> Path:
    """The cached GGUF of ``SHAPES[shape]``, ``seed`` and ``outtype``
    (converted by llama.cpp's convert_hf_to_gguf.py)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    return gpt2_ref.recipe_gguf(hf_dir(shape, seed), "gemma", shape, seed, outtype, MODEL_NAME)


def recipe(shape: str, seed: int, outtype: str) -> dict:
    return {
        "shape": shape,
        **copy.deepcopy(SHAPES[shape]),
        "seed": seed,
        "outtype": outtype,
        "embd_std": EMBD_STD,
        "weight_gain": WEIGHT_GAIN,
        "norm_mean": NORM_MEAN,
        "norm_std": NORM_STD,
    }
