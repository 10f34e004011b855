"""A loaded model: ``toy.load(...)`` -> ``Model`` with generate, stream,
tokenize, detokenize and logits.

Decisions (written down because nobody else will):

- A prompt is a str (tokenized with the file's add-BOS flag, control tokens
  such as ``<|im_start|>`` parsed), a list of token ids (used as is), or a
  list of ``{"role", "content"}`` messages (rendered with the model's chat
  template, then tokenized the same way, a doubled BOS dropped), except that
  control-token text inside the messages stays plain text: a user cannot
  write ``<|im_end|><|im_start|>system`` and open a turn
  (``toy.tokenizer.chat``'s injection rule). ``special_in_content=True``
  (``generate``/``stream``/``chat``/``prompt_ids``) parses it as control
  tokens, for callers who mean it.
- ``generate``/``stream`` run on cache slot 0 and, by default, prefill the
  whole prompt: the result then depends only on (prompt, params) and equals
  llama.cpp's greedy output token for token. ``cache_prompt=True`` keeps the
  longest common prefix of what slot 0 already holds (``Chat`` uses it, so a
  chat turn prefills only the new turn); reused positions were computed by
  other kernels (decode vs prefill), so logits can differ in the last bits.
- The budget is explicit: prompt + max_tokens must fit in ``n_ctx`` or
  ``ContextOverflowError`` is raised before any compute.
- Generation ends at a stop token (the model's end-of-generation ids unless
  ``ignore_eos``, plus ``stop_tokens``; the token is not part of the text),
  a stop string (cut from the text; later text dropped) or ``max_tokens``.
  ``finish_reason`` is "stop" or "length".
- ``constraint=`` (a ``toy.engine.constrain.Constraint``: JSON object,
  JSON schema, grammar or regex) keeps the output inside it; generation
  ends when the constraint is complete (see ``toy.engine.constrain``).
- Text is streamed UTF-8 safe: a chunk never ends inside a multi-byte
  character, and text that could be the start of a stop string is held back
  until it is known not to be.
- Timings: ``prefill_s`` (prompt tokens actually computed), ``decode_s``
  (every later forward), ``ttft_s`` (call to first token), tok/s of each.
- LoRA adapters (``lora=[(adapter, scale), ...]``) are applied at inference,
  never merged: each is read and checked against the base (architecture,
  every adapted weight present with the pair's shape, only the attention
  and feed-forward projections the forward can adapt), their A/B tensors
  go to one F32 context on the model's runtime, and every engine graph adds
  ``adapter.scale(name) · scale · B (A x)`` to that weight's product (see
  ``toy.engine.llm``). Several adapters stack. The base weights stay as
  they are (mapped, quantized). ``Model.adapters`` lists (path, scale).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.engine.llm import LLMEngine
from toy.engine.sampling import Sampler, SamplingParams, TokenLogprob
from toy.engine.stop import StopMatcher
from toy.errors import BadInputError

DEFAULT_MAX_CTX = 4096


@dataclass
class Generation:
    """What ``generate`` returns (and ``Stream.result`` after a stream)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    stop: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.tokens),
            "finish_reason": self.finish_reason,
            "stop": self.stop,
            "seed": self.seed,
            "timings": self.timings,
        }
        if self.logprobs is not None:
            d["logprobs"] = [
                {"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in self.logprobs
            ]
        return d


class Stream:
    """Iterate for text chunks; ``result`` is the Generation once done.
    ``close()`` (or leaving a ``with`` block) stops early: the result then
    has finish_reason "stop" and ``stop`` = "cancelled"."""

    def __init__(self, gen: Iterator[str]):
        self._gen = gen
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Model:
    """A GGUF model of any registered architecture ready to generate (see
    ``toy.load``). ``gguf`` (the open file) and ``weights`` (its tensors
    bound on ``runtime``) are owned and closed with the model."""

    def __init__(
        self,
        path: Path,
        cfg,
        gguf,
        weights,
        runtime: toy_ggml.Runtime,
        engine: LLMEngine,
        tokenizer,
        template,
        lora_context: toy_ggml.Context | None = None,
        adapters: Sequence[tuple[str | None, float]] = (),
        named: Sequence[tuple[str, str | None, float]] = (),
        named_context: toy_ggml.Context | None = None,
    ):
        self.path, self.cfg, self.runtime, self.engine = path, cfg, runtime, engine
        self._gguf, self._weights = gguf, weights
        self.tokenizer = tokenizer
        self.chat_template = template
        self.n_ctx = engine.n_ctx
        self._lora_context = lora_context
        #: the LoRA adapters applied, in order: (file path or None for an in-memory Adapter, user scale)
        self.adapters: list[tuple[str | None, float]] = list(adapters)
        #: the selectable adapters, in engine order: (name, file path or None, user scale)
        self.named_adapters: list[tuple[str, str | None, float]] = list(named)
        self._named_context = named_context

    def adapter_index(self, name: str | None) -> int | None:
        """The engine index of the selectable adapter ``name`` (None for None: the base)."""
        if name is None:
            return None
        for j, (n, _, _) in enumerate(self.named_adapters):
            if n == name:
                return j
        known = ", ".join(n for n, _, _ in self.named_adapters) or "none were loaded"
        raise BadInputError(f"no adapter named {name!r}", hint=f"adapters: {known}")

    # -- text <-> ids

    def tokenize(self, text: str, add_special: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, special=special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def prompt_ids(
        self, prompt, special_in_content: bool = False, chat_vars: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Token ids for a str, a list of ids or a list of chat messages (control-token text in messages
        stays text unless ``special_in_content``). ``chat_vars`` are extra template variables (``tools``)."""
        chat_vars = dict(chat_vars or {})
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            if special_in_content:
                ids = self.tokenize(self.render_chat(prompt, **chat_vars))
            else:
                text, spans = self.chat_template.render_protected(prompt, self.tokenizer.special_spans, **chat_vars)
                ids = self.tokenizer.encode_protected(text, spans)
            bos = self.tokenizer.bos_id
            if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # the template wrote BOS and the tokenizer added one
        elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, (str, bytes)):
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.cfg.n_vocab]
            if bad:
                raise BadInputError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.n_vocab - 1})")
        else:
            raise BadInputError(
                f"a prompt is a str, a list of token ids or a list of messages, not {type(prompt).__name__}"
            )
        if not ids:
            raise BadInputError("the prompt is empty (no tokens)")
        return ids

    # -- forward

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (T, n_vocab) float32 of every position of ``ids`` (a fresh
        prefill of slot 0: what generation would compute for that prompt)."""
        ids = self.prompt_ids(list(ids))
        self.engine.cache.clear(0)
        try:
            return self.engine.prefill(0, ids, all_logits=True)
        finally:
            self.engine.cache.clear(0)

    # -- generation

    def _params(self, sampling: SamplingParams | None, kw: dict) -> SamplingParams:
        base = sampling if sampling is not None else SamplingParams()
        return base.replace(**kw) if kw else base.validate()

    def generate(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        cache_prompt: bool = False,
        special_in_content: bool = False,
        adapter: str | None = None,
        **kw,
    ):
        """Generate a continuation: returns a ``Generation``. Sampling options
        come as a ``SamplingParams`` and/or keyword arguments (which win).
        ``adapter``: a selectable adapter's name (``toy.load(adapters=...)``)."""
        stream = self.stream(
            prompt, sampling, cache_prompt=cache_prompt, special_in_content=special_in_content, adapter=adapter, **kw
        )
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        cache_prompt: bool = False,
        special_in_content: bool = False,
        adapter: str | None = None,
        **kw,
    ) -> Stream:
        """Like ``generate`` but returns a ``Stream`` of text chunks. The prompt
        is checked (tokens, budget) before this returns."""
        params = self._params(sampling, kw)
        which = self.adapter_index(adapter)
        ids = self.prompt_ids(prompt, special_in_content)
        need = len(ids) + params.max_tokens
        if need > self.n_ctx:
            from toy.engine.llm import ContextOverflowError

            raise ContextOverflowError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceed the context "
                f"of {self.n_ctx} tokens",
                hint="shorten the prompt, lower max_tokens, or load with a larger n_ctx",
            )
        if params.constraint is not None:  # a schema or grammar that cannot compile fails here, not mid-stream
            from toy.engine import constrain

            constrain.check(params.constraint, self.tokenizer)
        stream = Stream(iter(()))
        stream._gen = self._run(ids, params, cache_prompt, stream, which)
        return stream

    def _run(
        self, ids: list[int], params: SamplingParams, cache_prompt: bool, stream: Stream, which: int | None = None
    ) -> Iterator[str]:
        eng, slot = self.engine, 0
        if eng.adapters:
            if eng.slot_adapter[slot] != which:
                cache_prompt = False  # cached K/V were computed with another adapter
            eng.slot_adapter[slot] = which
        t0 = time.perf_counter()
        sampler = Sampler(params, self.cfg.n_vocab, self.tokenizer)
        stops = params.stop_token_ids(self.tokenizer.eog_ids)
        matcher = StopMatcher(params.stop)
        decoder = self.tokenizer.incremental_decoder()
        keep = eng.cache.common_prefix(slot, ids) if cache_prompt else 0
        keep = min(keep, len(ids) - 1)  # the last prompt token is always computed: its logits pick the first token
        eng.cache.truncate(slot, keep)
        history = list(ids)
        out: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        finish, stop_by = "length", None
        timings = {"prompt_tokens": len(ids), "prompt_cached": keep}
        t_decode, n_steps = 0.0, 0
        try:
            logits = eng.prefill(slot, ids[keep:])
            t1 = time.perf_counter()
            timings["prefill_s"] = t1 - t0
            while len(out) < params.max_tokens:
                tok = sampler.sample(logits, history)
                if not out:
                    timings["ttft_s"] = time.perf_counter() - t0
                if tok in stops:
                    finish, stop_by = "stop", tok
                    break
                if logprobs is not None:
                    logprobs.append(sampler.token_logprobs(logits, tok))
                out.append(tok)
                history.append(tok)
                piece, hit = matcher.push(decoder.feed(tok))
                if piece:
                    text.append(piece)
                    yield piece
                if hit:
                    finish, stop_by = "stop", matcher.matched
                    break
                if sampler.done:  # the constraint is complete: nothing may follow
                    finish = "stop"
                    break
                if len(out) >= params.max_tokens:
                    break
                td = time.perf_counter()
                logits = eng.decode([slot], [tok])[0]
                t_decode += time.perf_counter() - td
                n_steps += 1
            if not isinstance(stop_by, str):  # not ended by a stop string: release what was held back
                tail, hit = matcher.push(decoder.flush())
                if hit:
                    finish, stop_by = "stop", matcher.matched
                else:
                    tail += matcher.flush()
                if tail:
                    text.append(tail)
                    yield tail
        except GeneratorExit:
            finish, stop_by = "stop", "cancelled"
        finally:
            prefilled = len(ids) - keep
            timings.update(
                prefill_tokens=prefilled,
                decode_tokens=n_steps,
                decode_s=t_decode,
                total_s=time.perf_counter() - t0,
            )
            if timings.get("prefill_s"):
                timings["prefill_tok_s"] = prefilled / timings["prefill_s"]
            if t_decode > 0:
                timings["decode_tok_s"] = timings["decode_tokens"] / t_decode
            stream.result = Generation(
                text="".join(text),
                tokens=out,
                prompt_tokens=len(ids),
                finish_reason=finish,
                stop=stop_by,
                logprobs=logprobs,
                seed=sampler.seed,
                timings=timings,
            )

    def chat(self, system: str | None = None, **defaults) -> Chat:
        """A multi-turn chat that keeps the KV cache between turns."""
        return Chat(self, system, defaults)

    # -- lifetime

    def close(self) -> None:
        self.engine.close()
        for c in (self._lora_context, self._named_context):
            if c is not None:
                c.close()  # after the engine: its graphs point at these tensors
        self._weights.close()
        self._gguf.close()
        self.runtime.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        lora = f", lora={self.adapters!r}" if self.adapters else ""
        return (
            f"Model({self.path.name}, {self.cfg.architecture}, n_ctx={self.n_ctx}, "
            f"device={self.runtime.device!r}{lora})"
        )


class Chat:
    """Messages so far plus the model's KV cache of their rendering: a turn
    prefills only what is new (``cache_prompt``). ``reset()`` forgets both."""

    def __init__(self, model: Model, system: str | None, defaults: dict):
        self.model, self.system, self.defaults = model, system, defaults
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.model.engine.cache.clear(0)

    def send(self, text: str, **kw) -> Stream:
        """Stream the assistant's reply to ``text``; the reply joins the
        history when the stream ends (also when it is cancelled early)."""
        self.messages.append({"role": "user", "content": text})
        try:
            inner = self.model.stream(self.messages, cache_prompt=True, **{**self.defaults, **kw})
        except BaseException:
            self.messages.pop()
            raise
        outer = Stream(iter(()))

        def run() -> Iterator[str]:
            try:
                yield from inner
            finally:
                inner.close()
                outer.result = inner.result
                reply = inner.result.text if inner.result is not None else ""
                self.messages.append({"role": "assistant", "content": reply})

        outer._gen = run()
        return outer


# -- LoRA adapters

_BLOCK_WEIGHT = re.compile(r"blk\.\d+\.(\w+)\.weight")
_SCALE_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_lora_arg(text: str) -> tuple[str, float]:
    """``ADAPTER[:SCALE]`` as ``--lora`` takes it -> (path, scale), scale 1 by
    default. The text after the last ``:`` is the scale unless the whole text
    names an existing file or that part holds a path separator (a Windows
    drive). BadInputError for a scale that is not a finite number."""
    text = str(text).strip()
    if not text:
        raise BadInputError("an empty --lora value", hint="--lora ADAPTER.gguf[:SCALE], e.g. --lora a.gguf:0.5")
    head, sep, tail = text.rpartition(":")
    if not sep or not head or os.path.isfile(text) or "/" in tail or "\\" in tail:
        return text, 1.0
    if not _SCALE_RE.fullmatch(tail.strip()):
        raise BadInputError(
            f"--lora {text}: the scale {tail!r} is not a number", hint="--lora ADAPTER.gguf[:SCALE], e.g. a.gguf:0.5"
        )
    scale = float(tail)
    if not math.isfinite(scale):
        raise BadInputError(f"--lora {text}: the scale {tail!r} is not finite")
    return head, scale


def check_lora(adapter, gf) -> None:
    """Raise ``AdapterError`` unless ``adapter`` fits the open base model
    ``gf``: same architecture, every adapted weight present with the pair's
    shape (``Adapter.check_base``), and only weights the architecture's
    forward adapts (its ``lora_targets``)."""
    from toy import models
    from toy.train.adapter import AdapterError

    adapter.check_base({name: tuple(info.shape) for name, info in gf.tensors.items()}, gf.architecture)
    cfg = models.config_from_gguf(gf)
    stems = [t.stem for t in models.of(cfg).lora_targets(cfg).values()]
    bad = next((n for n in adapter.pairs if not ((m := _BLOCK_WEIGHT.fullmatch(n)) and m.group(1) in stems)), None)
    if bad is not None:
        where = f"{adapter.path}: " if adapter.path else ""
        raise AdapterError(
            f"{where}adapts {bad}; toy applies LoRA to the attention and feed-forward projections only",
            hint=f"adapted weights are blk.N.{'/'.join(stems)}.weight",
        )


def lora_items(lora) -> list[tuple[Any, float]]:
    """``lora`` as a list of (path or Adapter, user scale)."""
    from toy.train.adapter import Adapter

    if lora is None:
        return []
    if isinstance(lora, (str, os.PathLike, Adapter)):
        lora = [lora]
    out = []
    for item in lora:
        if isinstance(item, (str, os.PathLike, Adapter)):
            src, scale = item, 1.0
        elif isinstance(item, Sequence) and len(item) == 2:
            src, scale = item
        else:
            raise BadInputError(f"lora: {item!r} is not a path, an Adapter or a (path, scale) pair")
        if not isinstance(src, (str, os.PathLike, Adapter)):
            raise BadInputError(f"lora: {src!r} is not a path or an Adapter")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise BadInputError(f"lora: the scale {scale!r} of {src} is not a finite number")
        out.append((src, float(scale)))
    return out


def _load_lora(items, gf, runtime: toy_ggml.Runtime):
    """Read and check the adapters; their A/B tensors in one allocated F32
    context. Returns (context or None, {weight name: [(a, b, scale, None)]},
    [(path, scale)])."""
    from toy.train.adapter import Adapter, load_adapter

    if not items:
        return None, None, []
    adapters: list[tuple[Adapter, float]] = []
    for src, scale in items:
        ad = src if isinstance(src, Adapter) else load_adapter(src)
        check_lora(ad, gf)
        adapters.append((ad, scale))
    F32 = toy_ggml.GGMLType.F32
    ctx = toy_ggml.Context(max_tensors=2 * sum(len(ad.pairs) for ad, _ in adapters) + 8)
    try:
        made = []
        for j, (ad, scale) in enumerate(adapters):
            for name, (a, b) in ad.pairs.items():
                ta = ctx.tensor(F32, a.shape, name=f"lora{j}.{name}.a")
                tb = ctx.tensor(F32, b.shape, name=f"lora{j}.{name}.b")
                made.append((name, ta, a, tb, b, ad.scale(name) * scale))
        ctx.allocate(runtime)
        terms: dict[str, list] = {}
        for name, ta, a, tb, b, s in made:
            ta.set(np.ascontiguousarray(a, np.float32))
            tb.set(np.ascontiguousarray(b, np.float32))
            terms.setdefault(name, []).append((ta, tb, s, None))
    except BaseException:
        ctx.close()
        raise
    return ctx, terms, [(str(ad.path) if ad.path is not None else None, scale) for ad, scale in adapters]


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _named_items(adapters) -> list[tuple[str, Any, float]]:
    """``adapters`` ({name: path, Adapter or (path, scale)}) as [(name, source, scale)]."""
    if not adapters:
        return []
    if not isinstance(adapters, Mapping):
        raise BadInputError("adapters must map names to adapter files (or (file, scale) pairs)")
    out = []
    for name, item in adapters.items():
        if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
            raise BadInputError(f"adapter name {name!r}: use 1-64 letters, digits, '_', '-' or '.'")
        ((src, scale),) = lora_items([item])
        out.append((name, src, scale))
    return out


def _split_terms(terms: dict, n: int) -> list[dict]:
    """``_load_lora``'s terms of n adapters (one context, names lora{j}.*) as one term map per adapter."""
    per: list[dict] = [{} for _ in range(n)]
    for name, ts in (terms or {}).items():
        for t in ts:
            j = int(t[0].name.split(".", 1)[0].removeprefix("lora"))
            per[j].setdefault(name, []).append(t)
    return per


def _resolve(model, fetch: bool) -> Path:
    from toy import store

    return store.resolve_or_fetch(model) if fetch else store.resolve_model(model)


def load(
    model: str | Path = "smollm2-135m",
    *,
    device: str | None = None,
    n_ctx: int | None = None,
    threads: int | None = None,
    n_batch: int = 512,
    n_slot: int = 1,
    kv_type: str = "f16",
    flash_attn: bool = False,
    fetch: bool = True,
    exact_batching: bool = False,
    lora=None,
    adapters=None,
) -> Model:
    """Open a GGUF model of any registered architecture for generation.

    ``model``: a path or a name ``toy list`` shows (default: the bundled
    SmolLM2-135M-Instruct, once ``toy fetch`` has downloaded it).
    ``device``: flag > TOY_DEVICE > auto. ``n_ctx``: tokens per sequence
    (default: the model's context, at most 4096). ``threads``: default the
    physical cores (TOY_THREADS overrides). ``n_slot``: sequences decoded at
    once. ``kv_type``: f16, f32 or q8_0 (with ``flash_attn``). ``fetch``: a
    registry name not downloaded yet is fetched first (pip, from PyPI).
    ``exact_batching``: prefill products row-invariant too (see
    ``toy.engine.llm``; the server sets it). ``lora``: LoRA adapters to
    apply, a list of ``(path or toy.train.adapter.Adapter, scale)`` (a bare
    path or Adapter means scale 1); each adapted weight's product gains
    ``alpha/rank · scale · B (A x)``, as ``llama-cli --lora-scaled`` does.
    ``AdapterError`` when an adapter is not one, or not for this model.
    ``adapters``: selectable LoRA adapters, ``{name: path or Adapter or
    (path, scale)}``; a generation uses the one it names
    (``generate(..., adapter=name)``; the server per request), and sequences
    with different adapters batch together (see ``toy.engine.llm``)."""
    from toy import models
    from toy.gguf import GGUFFile, bind_tensors
    from toy.tokenizer import ChatTemplate, Tokenizer

    path = _resolve(model, fetch)
    if threads is not None and threads < 1:
        raise BadInputError(f"threads={threads} must be >= 1")
    items = lora_items(lora)
    named_items = _named_items(adapters)
    runtime = toy_ggml.Runtime(toy_ggml.resolve_device(device), threads=threads or toy_ggml.default_threads())
    gf = lora_ctx = named_ctx = weights = None
    try:
        gf = GGUFFile(path)
        models.require_language_model(gf.architecture)
        cfg = models.config_from_gguf(gf)
        tokenizer = Tokenizer.from_gguf(gf.metadata)
        template = ChatTemplate.from_gguf(gf.metadata)
        limit = cfg.context_length or DEFAULT_MAX_CTX
        ctx = min(limit, DEFAULT_MAX_CTX) if n_ctx is None else n_ctx
        if not 1 <= ctx <= limit:
            raise BadInputError(f"n_ctx={ctx} must be between 1 and the model's context length {limit}")
        lora_ctx, terms, applied = _load_lora(items, gf, runtime)
        named_terms, named = [], []
        if named_items:
            named_ctx, all_terms, loaded = _load_lora([(src, sc) for _, src, sc in named_items], gf, runtime)
            named_terms = _split_terms(all_terms, len(named_items))
            named = [(n, p, sc) for (n, _, _), (p, sc) in zip(named_items, loaded)]
        weights = bind_tensors(gf, runtime)
        engine = LLMEngine(
            cfg,
            weights,
            runtime,
            ctx,
            n_slot,
            n_batch,
            kv_type,
            flash_attn,
            exact_batching=exact_batching,
            lora=terms,
            adapters=named_terms,
        )
    except BaseException:
        for c in (lora_ctx, named_ctx):
            if c is not None:
                c.close()
        if weights is not None:
            weights.close()
        if gf is not None:
            gf.close()
        runtime.close()
        raise
    return Model(
        Path(path), cfg, gf, weights, runtime, engine, tokenizer, template, lora_ctx, applied, named, named_ctx
    )


__all__ = ["Chat", "Generation", "Model", "Stream", "check_lora", "load", "lora_items", "parse_lora_arg"]
