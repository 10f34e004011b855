"""Merge LoRA adapters into a base model's weights (``toy merge``).

A workflow over the whole library (the top layer of toy-core, see
``docs/concepts/architecture.md``): it reads adapters (``toy.adapters``),
writes and re-quantizes GGUF, and checks the result with the engine and
``toy.eval``.

``merge_adapters(base, [(adapter, scale), ...], out)`` writes a plain model
that needs no adapter at inference:

- every adapted weight ``W`` (NumPy shape (out, in)) becomes
  ``W' = W + Σ_k scale_k · alpha_k/rank_k · B_k @ A_k``, computed in float64
  from the dequantized ``W`` (A (r, in), B (out, r), as in the adapter file)
  and written as F32; the scale of each product is llama.cpp's
  (``Adapter.scale``) times the user's, exactly what ``toy.load(base,
  lora=...)`` and ``llama-cli --lora-scaled`` apply at inference;
- every other tensor is copied byte for byte (quantized ones stay
  quantized, in the same order), and all metadata is copied with its
  on-disk types, so ``general.type`` stays absent (or "model") and
  llama.cpp loads the result as an ordinary model — except
  ``general.file_type``, which says what was written
  (``toy.gguf.convert.file_type_of``: the type holding most of the weights'
  parameters, so merged F32 weights in a Q4_1 base leave it "mostly Q4_1"
  while an F32-majority merge says F32);
- with ``dtype`` (e.g. "Q8_0") that merge goes to a temporary file beside
  ``out`` and is re-quantized with ``toy.gguf.quantize_model`` (a plain
  type for every 2-D weight, or llama.cpp's per-tensor mix for the K-quant
  targets, fallbacks as llama.cpp's); the temporary is removed.

The output appears atomically (``GGUFWriter``); ``out`` may not be the base.
Memory: the merged weights are held as float32 until the file is written
(one F32 copy of the adapted tensors; the float64 work is one tensor at a
time).

Afterwards the merge is checked against what it replaces: the base with the
adapters applied (A) and the merged file (B) are loaded with ``toy.load``
(F32 KV cache, so only the weights differ) and run over a fixed sample —
``SAMPLE_TEXT`` in the model's own tokenizer (or ``sample``: other text or
token ids; a tokenizer that makes fewer than ``MIN_SAMPLE`` tokens of the
text, such as a test model's, gets seeded random ids instead). The report
gives ``toy.eval.compare``'s KL(A ‖ B) mean and max and top-1 agreement over
one window of the sample (every position but the last two scored), plus the
largest absolute logit difference over every position. An F32 merge of an
F32 base drifts by float32 rounding only (KL ~ 1e-12); a quantized base or
a re-quantized merge shows the rounding of its weights (and of ggml's
quantized dot products' activations).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy import models
from toy.adapters import read_adapters
from toy.engine.generate import load
from toy.errors import BadInputError
from toy.eval.score import compare, text_ids, window_logits
from toy.gguf import GGUFFile, GGUFWriter, TypeInfo, ValueType, copy_metadata, quantize_model
from toy.gguf.convert import file_type_of, parse_target
from toy.store import resolve_model
from toy_ggml import GGMLType

# (phase, done, total): phase is "merging", "quantizing" or "checking"
Progress = Callable[[str, int, int], None]

SAMPLE_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him. There were one hundred and twelve of them, worn smooth in the middle by a "
    "century of boots. At the top he trimmed the wick, polished the great lens with a soft cloth, and "
    "wrote the weather in a leather book: wind from the north-west, a light swell, clouds gathering over "
    "the headland. Ships no longer needed him, strictly speaking. Satellites told them where they were "
    "to within a few metres, and the harbour office sent warnings by radio long before a storm arrived. "
    "Still, the light turned, and the keeper stayed.\n\n"
    "In the mornings he walked to the village to buy bread and the newspaper. The baker asked whether "
    "anything had happened in the night, and he always answered the same way: a tanker heading south, "
    "two fishing boats, a seal on the rocks below the tower. Children sometimes followed him back along "
    "the cliff path, asking how the lamp worked and whether it was lonely up there. He explained that "
    "the lens gathered the light of a small bulb into a beam strong enough to be seen thirty kilometres "
    "away, and that loneliness depended less on the number of people around you than on whether you had "
    "something worth doing.\n\n"
    "One winter a letter came from the maritime authority. The light would be automated in the spring; "
    "a technician would visit twice a year. The keeper read it twice, folded it carefully, and put it in "
    "the leather book between the pages for January and February. Then he went up the stairs, counting "
    "as always, and lit the lamp."
)
MIN_SAMPLE = 32  # fewer tokens than this and the sample is seeded random ids
MAX_SAMPLE = 512  # the most sample tokens scored


@dataclass
class MergeDrift:
    """The merged model (B) against the base with the adapters (A) on the sample."""

    sample: str  # "text" or "ids" (random ids: the tokenizer could not encode the text)
    n_tokens: int  # sample tokens run
    n_scored: int  # positions in the KL / top-1 figures
    kl_mean: float
    kl_max: float
    top1_agreement: float
    max_abs_logit_diff: float
    max_abs_logit: float  # the largest |logit| of A over the sample, to read the difference against
    ppl_a: float
    ppl_b: float


@dataclass
class MergeReport:
    base: Path
    out: Path
    adapters: list[tuple[str | None, float]]  # (adapter file, user scale), in the order applied
    dtype: str | None  # the type the merge was re-quantized to; None: adapted weights F32, the rest as in base
    merged: list[str] = field(default_factory=list)  # the weights the adapters changed
    n_tensors: int = 0
    copied: int = 0  # tensors copied byte for byte (without dtype)
    bytes_out: int = 0
    drift: MergeDrift | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["base"], d["out"] = str(self.base), str(self.out)
        d["adapters"] = [{"path": p, "scale": s} for p, s in self.adapters]
        return d


def _adapters(items, gf) -> list[tuple[Any, float]]:
    """(Adapter, user scale) of each item (a path, an Adapter, or a pair), checked against ``gf``."""
    out = read_adapters(items, gf)
    if not out:
        raise BadInputError("no adapter to merge", hint="pass at least one (adapter.gguf, scale)")
    return out


def merged_weights(gf, adapters: Sequence[tuple[Any, float]]) -> dict[str, np.ndarray]:
    """name -> float32 W + Σ scale · alpha/rank · B @ A (float64 arithmetic)
    for every weight an adapter touches, from the open base ``gf``."""
    names: list[str] = []
    for ad, _ in adapters:
        names += [n for n in ad.pairs if n not in names]
    out = {}
    for name in names:
        w = gf.tensor_to_float(name).astype(np.float64)
        for ad, scale in adapters:
            if name in ad.pairs:
                a, b = ad.pairs[name]
                w += (ad.scale(name) * scale) * (b.astype(np.float64) @ a.astype(np.float64))
        out[name] = w.astype(np.float32)
    return out


def _write_merge(gf, merged: dict[str, np.ndarray], path: Path, report: MergeReport, progress) -> None:
    writer = GGUFWriter(path, alignment=gf.alignment)
    written = [(info.shape, GGMLType.F32 if name in merged else info.dtype) for name, info in gf.tensors.items()]
    ftype = file_type_of(written)
    copy_metadata(gf, writer, override={"general.file_type": ftype})
    if "general.file_type" not in gf.metadata:
        writer.add("general.file_type", ftype, TypeInfo(ValueType.UINT32))
    total = len(gf.tensors)
    for i, (name, info) in enumerate(gf.tensors.items()):
        if name in merged:
            data = merged[name]
            writer.add_tensor_bytes(name, info.shape, GGMLType.F32, data)
            report.bytes_out += data.nbytes
        else:
            writer.add_tensor_bytes(name, info.shape, info.dtype, gf.tensor_bytes(name))
            report.copied += 1
            report.bytes_out += info.nbytes
        if progress:
            progress("merging", i + 1, total)
    writer.write()
    del writer  # drops the views into gf's mapping before gf closes


def _sample_ids(model, sample) -> tuple[str, list[int]]:
    limit = min(MAX_SAMPLE, model.n_ctx)
    if sample is not None and not isinstance(sample, str):
        ids = [int(i) for i in sample]
        if len(ids) < 8:
            raise BadInputError(f"the drift sample has {len(ids)} tokens; it needs at least 8")
        return "ids", ids[:limit]
    ids = text_ids(model, SAMPLE_TEXT if sample is None else sample)
    if len(ids) >= MIN_SAMPLE:
        return "text", ids[:limit]
    rng = np.random.default_rng(0)
    return "ids", [int(i) for i in rng.integers(0, model.cfg.n_vocab, size=min(256, limit))]


def measure_drift(
    base: Path,
    adapters: Sequence[tuple[Any, float]],
    merged: Path,
    *,
    sample: str | Sequence[int] | None = None,
    threads: int | None = None,
    device: str | None = None,
    progress: Progress | None = None,
) -> MergeDrift:
    """The merged file against the base with the adapters (see the module docstring)."""
    with GGUFFile(merged) as gf:
        limit = models.config_from_gguf(gf).context_length
    n_ctx = min(MAX_SAMPLE, limit or MAX_SAMPLE)
    kw: dict[str, Any] = dict(kv_type="f32", n_ctx=n_ctx, threads=threads, device=device, fetch=False)
    a = load(base, lora=list(adapters), **kw)
    try:
        b = load(merged, **kw)
        try:
            kind, ids = _sample_ids(a, sample)
            n = len(ids)
            # one window of the first n-1 tokens whose every position but the last is scored
            cmp = compare(a, b, ids, context=n - 1, stride=n - 2)
            if progress:
                progress("checking", 1, 2)
            la = window_logits(a, np.asarray(ids, np.int32)).astype(np.float64)
            lb = window_logits(b, np.asarray(ids, np.int32)).astype(np.float64)
            if progress:
                progress("checking", 2, 2)
        finally:
            b.close()
    finally:
        a.close()
    return MergeDrift(
        sample=kind,
        n_tokens=n,
        n_scored=cmp.n_scored,
        kl_mean=cmp.kl_mean,
        kl_max=cmp.kl_percentiles["max"],
        top1_agreement=cmp.top1_agreement,
        max_abs_logit_diff=float(np.abs(la - lb).max()),
        max_abs_logit=float(np.abs(la).max()),
        ppl_a=cmp.ppl_a,
        ppl_b=cmp.ppl_b,
    )


def merge_adapters(
    base_path: str | os.PathLike,
    adapters: Sequence[Any],
    out_path: str | os.PathLike,
    dtype: str | None = None,
    progress: Progress | None = None,
    *,
    drift: bool = True,
    sample: str | Sequence[int] | None = None,
    threads: int | None = None,
    device: str | None = None,
) -> MergeReport:
    """Write ``out_path``: ``base_path`` with ``adapters`` ((path or Adapter,
    scale) pairs, or bare paths: scale 1) merged in, re-quantized to
    ``dtype`` when given; then, unless ``drift`` is False, measure the
    drift on the sample (``MergeReport.drift``)."""
    base = Path(resolve_model(base_path))
    out = Path(out_path)
    target = None
    if dtype is not None:
        try:
            target = parse_target(dtype)
        except ValueError as e:
            raise BadInputError(str(e), hint="for example Q8_0, Q4_K or F16") from None
    if out.is_dir():
        raise BadInputError(f"{out}: is a folder", hint="OUT is the model file to write, e.g. merged.gguf")
    if out.exists() and out.resolve() == base.resolve():
        raise BadInputError(f"{out} is the base model", hint="write the merge to another file")
    with GGUFFile(base) as gf:
        kind = gf.metadata.get("general.type")
        if kind not in (None, "model"):
            raise BadInputError(f"{base}: general.type is {kind!r}; the base must be a model")
        ads = _adapters(adapters, gf)
        report = MergeReport(
            base,
            out,
            [(str(ad.path) if ad.path is not None else None, s) for ad, s in ads],
            target.name if target is not None else None,
            n_tensors=len(gf.tensors),
        )
        merged = merged_weights(gf, ads)
        report.merged = list(merged)
        if target is None:
            _write_merge(gf, merged, out, report, progress)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".merge-f32.gguf", dir=out.parent)
            os.close(fd)
            try:
                _write_merge(gf, merged, Path(tmp), report, progress)
                report.copied, report.bytes_out = 0, 0
                del merged
                q = quantize_model(
                    tmp, out, target, progress=(lambda i, n, _: progress("quantizing", i, n)) if progress else None
                )
                report.bytes_out = q.bytes_out
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    if drift:
        report.drift = measure_drift(base, ads, out, sample=sample, threads=threads, device=device, progress=progress)
    return report


__all__ = [
    "MIN_SAMPLE",
    "SAMPLE_TEXT",
    "MergeDrift",
    "MergeReport",
    "measure_drift",
    "merge_adapters",
    "merged_weights",
]
