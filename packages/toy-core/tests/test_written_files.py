"""Every kind of GGUF file toy writes, read by other programs: the ``gguf``
package (llama.cpp's own Python reader, ``gguf.GGUFReader``, and its
``gguf-dump`` command) and Hugging Face ``transformers``
(``AutoModelForCausalLM`` from the GGUF), whose logits must be toy's.

The files, made once here (~15 s): on a counting corpus (English number
words counting up, 320-token BPE), for both architectures toy trains
(``llama`` and ``gpt2``, preset ``tiny``):

- ``scratch``: a 40-step from-scratch checkpoint (``toy train from-scratch``);
- ``q8_0``: ``quantize_model(scratch, out, "Q8_0")`` (what ``toy quantize
  --type Q8_0`` runs);
- ``merge``: ``merge_adapters(scratch, [(adapter, 1.0)], out)`` (what ``toy
  merge`` runs), the adapter a seeded random one on every LoRA target
  (``adapter``, written with ``save_adapter``), large enough to move the
  logits well beyond the tolerances; ``merge-q8_0`` the same re-quantized
  (``toy merge --type Q8_0``);
- ``full``: a 3-step full fine-tune of ``scratch`` (``toy train full``);
- ``lora-run``: the adapter of a 3-step LoRA run on the llama checkpoint
  (``toy train lora``; adapters are checked with the reader only).

The CLI commands are thin wrappers over those library calls
(toy_cli.commands.merge / models), and toy-core's tests do not import
toy_cli, so the calls are made directly.

Checks, per file:

- ``GGUFReader``: ``general.type`` ("model", or "adapter" with
  ``adapter.type`` "lora" and ``adapter.lora.alpha`` FLOAT32, what
  llama.cpp's ``llama_adapter_lora_init`` reads), ``general.architecture``,
  ``general.quantization_version`` (UINT32 2) on models, and
  ``general.file_type`` against the tensors the reader sees (worked out
  here: the ggml type holding most parameters of the 2-D weights, 0 for
  F32, 7 for Q8_0); the architecture keys llama.cpp reads, with the types
  its converter writes (UINT32 counts, FLOAT32 epsilons) and values
  matching the tensor shapes; adapter pairs (``lora_a`` ne [in, r],
  ``lora_b`` ne [r, out]) matching the base's weights;
- ``gguf-dump --json``: the same metadata through the gguf package's command
  (the installed entry point on one file, its ``main()`` on every file);
- transformers (models only; ``llama`` and ``gpt2`` are in its
  ``GGUF_SUPPORTED_ARCHITECTURES``): logits of one sentence against toy's
  (``kv_type="f32"``), relative to the largest |logit|, within ``HF_TOL``
  (1e-4) for F32 weights and ``HF_TOL_Q8`` (5e-3) for Q8_0; and
  transformers' tokenizer built from the GGUF must give toy's ids.

Tolerances, measured (relative to the largest |logit|, ~4.4 here). llama,
F32: 3.3e-7 (scratch, full), 5.4e-7 (merge): float32 rounding. gpt2: ggml's
CPU GELU reads a float16 table (f16(gelu(f16(x))), see test_gpt2_train.py)
while transformers' ``gelu_new`` is the formula; that alone gives 2.3e-5
to 3.0e-5, so the GPT-2 blocks' activation is swapped for the table's value
(``gelu_f16_table``), leaving 1.7e-6 / 2.2e-6 / 2.2e-6 (scratch / full /
merge). Q8_0: 1.5e-3 (llama) and 1.6e-3 (gpt2), merge-q8_0 2.5e-3 and
1.5e-3: transformers dequantizes the weights to float32, ggml also rounds
the activations to 8 bits for its Q8_0 dot products (the weights
themselves are compared exactly: the gguf package's ``dequantize`` of
every tensor equals toy's). How much the F32 check can see: llama's Q and
K rows in the other order (the un-permutation transformers applies,
skipped) move the logits by 6.5e-3 (scratch) and 8.4e-3 (merge), 65 x
HF_TOL; the merge differs from its base by 7.9e-2 (llama) and 5.0e-2
(gpt2), more than 100 x HF_TOL (asserted). A 4 x larger adapter (std 0.2)
made a merged model whose own Q8_0 rounding moved its logits by 5 %
(transformers alone, F32 against Q8_0 weights): quantization noise, not a
reading error, but too close to call with one tolerance, hence std 0.05.

How transformers loads them. ``from_pretrained(dir, gguf_file=...)``
requires ``accelerate`` for GGUF files (transformers 4.57.6 raises
"accelerate is required when loading a GGUF file"), which is not a toy dev
requirement. Without it the model is loaded the way from_pretrained does
it, model only: ``AutoConfig.from_pretrained(dir, gguf_file=...)``,
``AutoModelForCausalLM.from_config``, then the tensors from
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path,
return_tensors=True, model_to_load=model)`` (its GGUF -> HF renames, the
llama Q/K un-permutation, dequantization) into ``load_state_dict`` (only a
tied ``lm_head.weight`` may be missing). With accelerate installed,
``test_model_only_load_is_from_pretrained`` checks the two give the same
logits. For GPT-2, transformers maps ``gpt2.context_length`` to the legacy
``n_ctx`` and leaves ``n_positions`` (the rows of ``wpe``) at its default
1024, so any GGUF GPT-2 whose ``position_embd`` has other than 1024 rows —
toy's (one row per training position) and llama.cpp's own conversion of a
128-position model alike — fails with a size mismatch; ``n_positions`` is
set from the file's ``position_embd.weight`` rows (a transformers
limitation, not a file defect: llama.cpp reads ``gpt2.context_length``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

gguf = pytest.importorskip("gguf")  # a dev requirement

HF_TOL = 1e-4  # F32 weights: |toy - transformers| / max|logit|; measured <= 2.8e-5 (module docstring)
HF_TOL_Q8 = 5e-3  # Q8_0 weights (activations rounded to 8 bits in ggml only); measured <= 1.6e-3
ARCHS = ("llama", "gpt2")
MODEL_KINDS = ("scratch", "q8_0", "merge", "merge-q8_0", "full")
SENTENCE = "thirty-one thirty-two thirty-three thirty-four thirty-five thirty-six."
STEPS = 40
# the ggml types of 2-D weights a file may hold -> llama.cpp's general.file_type (LLAMA_FTYPE_*)
FTYPE = {"F32": 0, "F16": 1, "Q8_0": 7}
# architecture keys llama.cpp reads, with the type its converter writes
ARCH_KEYS = {
    "llama": {
        "vocab_size": "UINT32",
        "context_length": "UINT32",
        "embedding_length": "UINT32",
        "block_count": "UINT32",
        "feed_forward_length": "UINT32",
        "attention.head_count": "UINT32",
        "attention.head_count_kv": "UINT32",
        "rope.dimension_count": "UINT32",
        "rope.freq_base": "FLOAT32",
        "attention.layer_norm_rms_epsilon": "FLOAT32",
    },
    "gpt2": {
        "context_length": "UINT32",
        "embedding_length": "UINT32",
        "block_count": "UINT32",
        "feed_forward_length": "UINT32",
        "attention.head_count": "UINT32",
        "attention.layer_norm_epsilon": "FLOAT32",
    },
}

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_word(n: int) -> str:
    return _ONES[n] if n < 20 else _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")


def counting_lines(n: int) -> list[str]:
    """Line i counts up from 37 i mod 85 for 6 + 7 i mod 11 numbers (at most 99)."""
    out = []
    for i in range(n):
        s, k = (37 * i) % 85, 6 + (7 * i) % 11
        out.append(" ".join(number_word(j) for j in range(s, min(s + k, 100))) + ".")
    return out


# -- the files ------------------------------------------------------------------------


def _train(values: dict):
    from toy.train import config as C
    from toy.train.lmrun import train

    recipe = values.pop("recipe", "from-scratch")
    res = train(C.override(C.defaults(recipe), **values))
    assert res.reason == "completed", res.reason
    return Path(res.checkpoint)


def _random_adapter(base: Path, out: Path, seed: int) -> Path:
    """Rank 4 on every LoRA target of every layer, A and B 0.05 N(0, 1), alpha 4
    (it moves the logits by 5-8 % of their range: far beyond the tolerances,
    while the model stays one whose Q8_0 rounding is like its base's)."""
    from toy import models
    from toy.adapters import save_adapter
    from toy.gguf import GGUFFile

    with GGUFFile(base) as gf:
        cfg = models.config_from_gguf(gf)
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    targets = models.of(cfg).lora_targets(cfg)
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in range(cfg.n_layer):
        for t in targets.values():
            name = f"blk.{i}.{t.stem}.weight"
            d_out, d_in = shapes[name]
            a = (0.05 * rng.standard_normal((4, d_in))).astype(np.float32)
            b = (0.05 * rng.standard_normal((d_out, 4))).astype(np.float32)
            pairs[name] = (a, b)
    return save_adapter(
        out, architecture=cfg.architecture, pairs=pairs, alpha=4.0, rank=4, targets=list(targets), base=base.name
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """kind -> path: ``<arch>-<model kind>``, ``<arch>-adapter`` and ``llama-lora-run``."""
    from toy.gguf import quantize_model
    from toy.merge import merge_adapters

    d = tmp_path_factory.mktemp("written")
    lines = counting_lines(1500)
    (d / "corpus.txt").write_text("\n".join(lines) + "\n")
    (d / "data.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in lines[:200]))
    common = {"steps": STEPS, "batch_size": 4, "context": 64, "seed": 0, "threads": 1, "eval_every": 0,
              "save_every": 0, "sample_tokens": 0}  # fmt: skip
    out: dict[str, Path] = {}
    for arch in ARCHS:
        out[f"{arch}-scratch"] = _train(
            {**common, "model.arch": arch, "model.preset": "tiny", "tokenizer.vocab_size": 320,
             "data.paths": [str(d / "corpus.txt")], "data.cache_dir": str(d / "cache"), "out": str(d / arch)}
        )  # fmt: skip
        scratch = out[f"{arch}-scratch"]
        quantize_model(scratch, d / f"{arch}-q8_0.gguf", "Q8_0")
        out[f"{arch}-q8_0"] = d / f"{arch}-q8_0.gguf"
        out[f"{arch}-adapter"] = _random_adapter(scratch, d / f"{arch}-adapter.gguf", seed=7)
        rep = merge_adapters(scratch, [(out[f"{arch}-adapter"], 1.0)], d / f"{arch}-merge.gguf", threads=1)
        assert rep.drift.max_abs_logit_diff < 1e-3 * rep.drift.max_abs_logit  # F32: rounding only
        out[f"{arch}-merge"] = d / f"{arch}-merge.gguf"
        merge_adapters(scratch, [(out[f"{arch}-adapter"], 1.0)], d / f"{arch}-merge-q8_0.gguf", "Q8_0", threads=1)
        out[f"{arch}-merge-q8_0"] = d / f"{arch}-merge-q8_0.gguf"
        out[f"{arch}-full"] = _train(
            {**common, "recipe": "full", "base": str(scratch), "steps": 3, "batch_size": 2, "context": 32,
             "data.paths": [str(d / "data.jsonl")], "out": str(d / f"{arch}-full")}
        )  # fmt: skip
    out["llama-lora-run"] = _train(
        {**common, "recipe": "lora", "base": str(out["llama-scratch"]), "steps": 3, "batch_size": 2, "context": 32,
         "data.paths": [str(d / "data.jsonl")], "out": str(d / "lora"), "lora.targets": ["q", "k", "v", "o", "up"]}
    )  # fmt: skip
    return out


# -- the gguf reader ------------------------------------------------------------------


def fields(path: Path) -> tuple[dict, dict, gguf.GGUFReader]:
    """(key -> value, key -> type name of the value (arrays: "ARRAY"), the reader)."""
    r = gguf.GGUFReader(str(path))
    values = {k: f.contents() for k, f in r.fields.items()}
    types = {k: f.types[0].name for k, f in r.fields.items()}
    return values, types, r


def expected_file_type(reader) -> int:
    """The ggml type holding most parameters of the 2-D (and larger) float
    weights, as llama.cpp's ``general.file_type``."""
    count: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            count[t.tensor_type.name] = count.get(t.tensor_type.name, 0) + int(t.n_elements)
    return FTYPE[max(count, key=count.get)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_models_read_by_gguf_reader(files, arch, kind):
    path = files[f"{arch}-{kind}"]
    md, types, r = fields(path)
    assert md["general.type"] == "model" and md["general.architecture"] == arch
    assert types["general.quantization_version"] == "UINT32" and md["general.quantization_version"] == 2
    assert types["general.file_type"] == "UINT32"
    assert md["general.file_type"] == expected_file_type(r) == (7 if kind.endswith("q8_0") else 0)
    for key, t in ARCH_KEYS[arch].items():
        assert types[f"{arch}.{key}"] == t, key
    assert md["tokenizer.ggml.model"] == "gpt2" and len(md["tokenizer.ggml.tokens"]) == 320
    tensors = {t.name: t for t in r.tensors}
    emb = tensors["token_embd.weight"]
    assert [int(x) for x in emb.shape] == [md[f"{arch}.embedding_length"], 320]  # ggml ne: [d, V]
    n_blocks = len({n.split(".")[1] for n in tensors if n.startswith("blk.")})
    assert n_blocks == md[f"{arch}.block_count"] == 4
    if arch == "llama":
        assert md["llama.vocab_size"] == 320
        assert tensors["blk.0.attn_k.weight"].shape[1] == md["llama.attention.head_count_kv"] * 32
        assert tensors["blk.0.ffn_gate.weight"].shape[1] == md["llama.feed_forward_length"]
    else:
        assert tensors["position_embd.weight"].shape[1] == md["gpt2.context_length"] == 64
        assert tensors["blk.0.attn_qkv.weight"].shape[1] == 3 * md["gpt2.embedding_length"]
        assert tensors["blk.0.ffn_up.weight"].shape[1] == md["gpt2.feed_forward_length"]
    want = {"F32", "Q8_0"} if kind.endswith("q8_0") else {"F32"}
    assert {t.tensor_type.name for t in r.tensors} == want
    for t in r.tensors:
        if len(t.shape) == 1 or (len(t.shape) == 2 and t.shape[1] == 1):
            assert t.tensor_type.name == "F32", t.name  # norms and biases stay F32
    if kind.endswith("q8_0") and arch == "gpt2":
        assert tensors["position_embd.weight"].tensor_type.name == "F32"  # as llama.cpp's quantizer keeps it
    if kind in ("scratch", "full"):
        assert isinstance(md["toy.train.step"], int) and md["toy.train.run_id"]
    if kind.startswith("merge"):
        assert md["general.name"] == fields(files[f"{arch}-scratch"])[0]["general.name"]  # metadata copied
    # every tensor, decoded by the gguf package (transformers' dequantize), is what toy reads
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        assert set(gf.tensors) == set(tensors)
        for name, t in tensors.items():
            mine = np.asarray(gf.tensor_to_float(name), np.float32)
            theirs = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape(mine.shape)
            np.testing.assert_array_equal(theirs, mine, err_msg=name)


@pytest.mark.parametrize("kind", ["llama-adapter", "gpt2-adapter", "llama-lora-run"])
def test_adapters_read_by_gguf_reader(files, kind):
    """What llama.cpp's llama_adapter_lora_init reads, and pairs that fit the base."""
    path = files[kind]
    arch = kind.split("-")[0]
    md, types, r = fields(path)
    assert md["general.type"] == "adapter" and md["adapter.type"] == "lora"
    assert md["general.architecture"] == arch
    assert types["adapter.lora.alpha"] == "FLOAT32"
    base = {t.name: [int(x) for x in t.shape] for t in gguf.GGUFReader(str(files[f"{arch}-scratch"])).tensors}
    halves: dict[str, dict[str, list[int]]] = {}
    for t in r.tensors:
        assert t.tensor_type.name == "F32", t.name
        stem, _, half = t.name.rpartition(".")
        assert half in ("lora_a", "lora_b"), t.name
        halves.setdefault(stem, {})[half] = [int(x) for x in t.shape]
    assert halves
    ranks = set()
    for stem, h in halves.items():
        assert set(h) == {"lora_a", "lora_b"}, stem
        d_in, d_out = base[stem]  # ggml ne of the base weight: [in, out]
        (a_in, rank), (b_rank, b_out) = h["lora_a"], h["lora_b"]
        assert (a_in, b_rank, b_out) == (d_in, rank, d_out), stem
        ranks.add(rank)
    assert md["toy.lora.rank"] in ranks and len(ranks) == 1
    assert md["adapter.lora.alpha"] == pytest.approx(md["toy.lora.alpha"])  # plain LoRA: the same alpha
    if kind == "llama-lora-run":
        assert md["toy.lora.targets"] == ["q", "k", "v", "o", "up"]
        assert {s.split(".")[2] for s in halves} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_up"}
        assert len(halves) == 4 * 5


def gguf_dump_exe() -> str | None:
    exe = Path(sys.executable).with_name("gguf-dump")
    return str(exe) if exe.is_file() else shutil.which("gguf-dump")


# gguf-dump's own main() (what the entry point runs) on each file of argv, one
# process for all: a JSON document per file, separated by a form feed
_DUMP_ALL = """
import sys
from gguf.scripts.gguf_dump import main
files = sys.argv[1:]
for f in files:
    sys.argv = ["gguf-dump", "--json", f]
    main()
    sys.stdout.write("\\f")
    sys.stdout.flush()
"""


def test_gguf_dump_reads_every_file(files):
    """``gguf-dump --json`` (the gguf package's command) on every file: the
    installed entry point on one, its main() on all (one process, to keep
    this test fast)."""
    kinds = sorted(files)
    exe = gguf_dump_exe()
    if exe is not None:
        proc = subprocess.run([exe, "--json", str(files[kinds[0]])], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["metadata"]["general.architecture"]["value"] == kinds[0].split("-")[0]
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP_ALL, *(str(files[k]) for k in kinds)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    docs = proc.stdout.split("\f")[:-1]
    assert len(docs) == len(kinds)
    for kind, text in zip(kinds, docs):
        dump = json.loads(text)
        md = {k: v.get("value") for k, v in dump["metadata"].items()}  # arrays: no value without --json-array
        assert md["general.architecture"] == kind.split("-")[0], kind
        n = len(gguf.GGUFReader(str(files[kind])).tensors)
        assert md["GGUF.tensor_count"] == len(dump["tensors"]) == n, kind
        if "adapter" in kind or "lora" in kind:
            assert md["general.type"] == "adapter" and dump["metadata"]["adapter.lora.alpha"]["type"] == "FLOAT32"
        else:
            assert md["general.type"] == "model" and md["general.quantization_version"] == 2, kind
            assert dump["metadata"]["general.file_type"]["type"] == "UINT32"
            assert md["general.file_type"] == (7 if kind.endswith("q8_0") else 0), kind
            types = {t["type"] for t in dump["tensors"].values()}
            assert types == ({"F32", "Q8_0"} if kind.endswith("q8_0") else {"F32"}), kind


# -- transformers ---------------------------------------------------------------------


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def hf_model(path: Path, how: str | None = None):
    """(transformers' model of the GGUF, how it was loaded): ``from_pretrained``
    with accelerate, else model only (see the module docstring)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    how = how or ("from_pretrained" if _has_accelerate() else "model-only")
    folder, name = str(path.parent), path.name
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    extra = {}
    if cfg.model_type == "gpt2":  # transformers leaves n_positions at 1024 (module docstring)
        rows = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["position_embd.weight"].shape[1]
        extra["n_positions"] = int(rows)
    if how == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **extra)
    else:
        for k, v in extra.items():
            setattr(cfg, k, v)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        res = model.load_state_dict(tensors, strict=False)
        assert not res.unexpected_keys, res.unexpected_keys
        assert set(res.missing_keys) <= {"lm_head.weight"} and cfg.tie_word_embeddings, res.missing_keys
        model.tie_weights()
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() == emb.data_ptr()  # toy's checkpoints tie the head (no output.weight)
    if cfg.model_type == "gpt2":
        assert cfg.activation_function == "gelu_new"  # the tanh form, as ggml's
        for block in model.transformer.h:
            block.mlp.act = gelu_f16_table()
    return model.eval(), how


def gelu_f16_table():
    """A module computing ggml's CPU GELU: the value of its float16 table,
    f16(gelu(f16(x))), as the torch reference of test_gpt2_train.py emulates it."""
    import torch
    from transformers.activations import NewGELUActivation

    class GeluF16Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gelu = NewGELUActivation()

        def forward(self, x):
            return self.gelu(x.half().float()).half().float()

    return GeluF16Table()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].double().numpy()


def toy_logits(path: Path) -> tuple[list[int], np.ndarray]:
    import toy

    with toy.load(path, kv_type="f32", threads=1) as m:
        ids = m.tokenize(SENTENCE, add_special=False)
        return ids, np.asarray(m.logits(ids), np.float64)


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_transformers_logits_equal_toys(files, arch, kind):
    path = files[f"{arch}-{kind}"]
    ids, got = toy_logits(path)
    assert len(ids) >= 12
    model, _ = hf_model(path)
    want = hf_logits(model, ids)
    tol = HF_TOL_Q8 if kind.endswith("q8_0") else HF_TOL
    err = rel_err(got, want)
    assert err < tol, f"{arch} {kind}: relative logit difference {err:.3g} >= {tol}"
    if kind == "merge":  # the merge moved the logits far beyond the tolerance: the merged weights were read
        _, scratch = toy_logits(files[f"{arch}-scratch"])
        assert rel_err(scratch, want) > 100 * tol


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_tokenizer_from_the_gguf_gives_toys_ids(files, arch):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    import toy

    path = files[f"{arch}-scratch"]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with toy.load(path, threads=1) as m:
        for text in (SENTENCE, "ninety-nine.\nzero one", "  twenty  two"):
            assert tok.encode(text, add_special_tokens=False) == m.tokenize(text, add_special=False), text


def test_model_only_load_is_from_pretrained(files):
    """The fallback path loads what from_pretrained loads (needs accelerate)."""
    pytest.importorskip("accelerate")
    for kind in ("llama-scratch", "gpt2-q8_0"):
        path = files[kind]
        ids, _ = toy_logits(path)
        a = hf_logits(hf_model(path, "from_pretrained")[0], ids)
        b = hf_logits(hf_model(path, "model-only")[0], ids)
        np.testing.assert_array_equal(a, b)
