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

Test modules load it with ``load_helper("gpt2_ref")`` of
test_gpt2_reference.py or, once the root conftest.py registers it, as
``import gpt2_ref``.
"""

from __future__ import annotations

import hashlib
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

ROOT = Path(__file__).resolve().parents[3]
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


def cache_root() -> Path:
    return Path(os.environ.get("TOY_TEST_GPT2_CACHE") or Path.home() / ".cache" / "toy-test-gpt2")


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------ llama.cpp sdist


def _sdist() -> Path:
    """The hash-checked sdist: fetch_ggml's cache, this cache, or pip."""
    for p in (SDIST_CACHED, cache_root() / SDIST_NAME):
        if p.is_file() and sha256(p) == SDIST_SHA256:
            return p
    spec = importlib.util.spec_from_file_location("_toy_fetch_ggml", ROOT / "tools" / "fetch_ggml.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        got = fetch.download(Path(tmp))
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
    dest = cache_root() / f"llama.cpp-{SDIST_VERSION}-{SDIST_SHA256[:12]}-{listed}"
    if (dest / ".complete").is_file():
        return dest
    cache_root().mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=cache_root()))
    try:
        with tarfile.open(_sdist(), "r:gz") as tar:
            for m in tar.getmembers():
                if not m.isfile() or not m.name.startswith(_PREFIX):
                    continue
                rel = m.name[len(_PREFIX) :]
                if ".." in Path(rel).parts or not any(
                    rel == e or (e.endswith("/") and rel.startswith(e)) for e in _EXTRACT
                ):
                    continue
                target = stage / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f)
        (stage / ".complete").write_text(SDIST_SHA256 + "\n")
        try:
            stage.rename(dest)
        except OSError:  # another process won the race
            if not (dest / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return dest


# ------------------------------------------------------------ tokenizer


def gpt2_tokenizer_files(out_dir) -> Path:
    """Write GPT-2's tokenizer (vocab.json, merges.txt, and what
    ``GPT2TokenizerFast.save_pretrained`` adds: tokenizer.json,
    tokenizer_config.json, special_tokens_map.json) into ``out_dir``, rebuilt
    from llama.cpp's vocab-only ggml-vocab-gpt-2.gguf (read with ``gguf``).
    Built once into the cache (reading the vocab file takes seconds), then
    copied."""
    src = cache_root() / f"tokenizer-{_digest()}"
    if not (src / "tokenizer.json").is_file():
        _prune("tokenizer-*", src)
        cache_root().mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache_root()))
        try:
            _write_tokenizer(stage / "tok")
            try:
                (stage / "tok").rename(src)
            except OSError:
                if not (src / "tokenizer.json").is_file():
                    raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, out / f.name)
    return out


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
    import torch

    model = _load_hf(hf_dir)
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_greedy(hf_dir, ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` (the argmax of the last position's
    logits, fed back; full recompute each step, no KV cache)."""
    import torch

    model = _load_hf(hf_dir)
    seq = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], dtype=torch.long)).logits[0, -1]
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


def _digest() -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(f"{SDIST_SHA256} torch={torch.__version__} transformers={transformers.__version__}".encode())
    return h.hexdigest()[:12]


def _folder(shape: str, seed: int) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, not {shape!r}")
    return cache_root() / f"gpt2-{shape}-seed{seed}-{_digest()}"


def _prune(pattern: str, keep: Path) -> None:
    """Remove the cache folders of older recipes (a small124m folder holds
    about 1 GB)."""
    for old in cache_root().glob(pattern):
        if old != keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def hf_dir(shape: str = "tiny", seed: int = 0) -> Path:
    """The cached HF model folder of ``SHAPES[shape]`` and ``seed``."""
    folder = _folder(shape, seed)
    done = folder / "hf"
    if (done / "model.safetensors").is_file():
        return done
    _prune(f"gpt2-{shape}-seed{seed}-*", folder)
    folder.mkdir(parents=True, exist_ok=True)
    # built under a fixed name, then moved: the converter sees the same path
    # contents whichever process built it
    stage = Path(tempfile.mkdtemp(prefix=".hf-", dir=folder))
    try:
        make_hf_gpt2(stage / "hf", seed=seed, **SHAPES[shape])
        try:
            (stage / "hf").rename(done)
        except OSError:
            if not (done / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return done


def gguf_path(shape: str = "tiny", seed: int = 0, outtype: str = "f32") -> Path:
    """The cached GGUF of ``SHAPES[shape]``, ``seed`` and ``outtype``."""
    src = hf_dir(shape, seed)
    out = src.parent / f"gpt2-{shape}-seed{seed}-{outtype}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    try:
        convert_to_gguf(src, tmp, outtype)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def recipe(shape: str, seed: int, outtype: str) -> dict:
    return {"shape": shape, **SHAPES[shape], "seed": seed, "outtype": outtype, "n_vocab": N_VOCAB, "tie": True}
