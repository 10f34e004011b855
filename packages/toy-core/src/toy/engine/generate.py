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

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy import models, store
from toy.adapters import load_lora, lora_items, named_items, split_terms
from toy.engine import constrain
from toy.engine.decoding import DecodeState, reuse_prefix
from toy.engine.llm import ContextOverflowError, LLMEngine
from toy.engine.sampling import SamplingParams, TokenLogprob
from toy.errors import BadInputError
from toy.gguf import GGUFFile, bind_tensors
from toy.tokenizer import ChatTemplate, Tokenizer

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
        self._gen.close()  # type: ignore[attr-defined]  # a generator: Model and Chat set one after construction

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
                msg = f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.n_vocab - 1})"
                raise BadInputError(msg, field="prompt")
        else:
            raise BadInputError(
                f"a prompt is a str, a list of token ids or a list of messages, not {type(prompt).__name__}",
                field="prompt",
            )
        if not ids:
            raise BadInputError("the prompt is empty (no tokens)", field="prompt")
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
            raise ContextOverflowError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceed the context "
                f"of {self.n_ctx} tokens",
                hint="shorten the prompt, lower max_tokens, or load with a larger n_ctx",
                field="prompt",
            )
        if params.constraint is not None:  # a schema or grammar that cannot compile fails here, not mid-stream
            constrain.check(params.constraint, self.tokenizer)
        stream = Stream(iter(()))
        stream._gen = self._run(ids, params, cache_prompt, stream, which)
        return stream

    def _run(
        self, ids: list[int], params: SamplingParams, cache_prompt: bool, stream: Stream, which: int | None = None
    ) -> Iterator[str]:
        # The token step and the prefix rule are the server worker's too (toy.engine.decoding; see
        # docs/concepts/architecture.md): this loop only runs the forwards of slot 0 and collects the result.
        eng, slot = self.engine, 0
        t0 = time.perf_counter()
        state = DecodeState(params, self.tokenizer, self.cfg.n_vocab, ids)
        keep = reuse_prefix(eng.cache, [slot], ids, eng.slot_adapter, which)[1] if cache_prompt else 0
        eng.cache.truncate(slot, keep)
        if eng.adapters:
            eng.slot_adapter[slot] = which
        text: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        cancelled = False
        timings: dict[str, float] = {"prompt_tokens": len(ids), "prompt_cached": keep}
        t_decode, n_steps = 0.0, 0
        try:
            logits = eng.prefill(slot, ids[keep:])
            t1 = time.perf_counter()
            timings["prefill_s"] = t1 - t0
            while True:
                step = state.advance(logits)
                if step.token is None:  # max_tokens=0: nothing sampled
                    break
                if "ttft_s" not in timings:
                    timings["ttft_s"] = time.perf_counter() - t0
                if logprobs is not None and step.logprob is not None:
                    logprobs.append(step.logprob)
                if step.text:
                    text.append(step.text)
                    yield step.text
                if step.finish_reason is not None:
                    break
                td = time.perf_counter()
                logits = eng.decode([slot], [step.token])[0]
                t_decode += time.perf_counter() - td
                n_steps += 1
            tail = state.finish()  # what was held back (nothing after a stop string)
            if tail:
                text.append(tail)
                yield tail
        except GeneratorExit:  # closed early: the held-back text is left out
            cancelled = True
        finally:
            finish, stop_by = ("stop", "cancelled") if cancelled else (state.finish_reason or "length", state.stop)
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
                tokens=state.tokens,
                prompt_tokens=len(ids),
                finish_reason=finish,
                stop=stop_by,
                logprobs=logprobs,
                seed=state.seed,
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


def _resolve(model, fetch: bool) -> Path:
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
    apply, a list of ``(path or toy.adapters.Adapter, scale)`` (a bare
    path or Adapter means scale 1); each adapted weight's product gains
    ``alpha/rank · scale · B (A x)``, as ``llama-cli --lora-scaled`` does.
    ``AdapterError`` when an adapter is not one, or not for this model.
    ``adapters``: selectable LoRA adapters, ``{name: path or Adapter or
    (path, scale)}``; a generation uses the one it names
    (``generate(..., adapter=name)``; the server per request), and sequences
    with different adapters batch together (see ``toy.engine.llm``)."""
    path = _resolve(model, fetch)
    if threads is not None and threads < 1:
        raise BadInputError(f"threads={threads} must be >= 1", field="threads")
    items = lora_items(lora)
    named = named_items(adapters)
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
            msg = f"n_ctx={ctx} must be between 1 and the model's context length {limit}"
            raise BadInputError(msg, field="n_ctx")
        lora_ctx, terms, applied = load_lora(items, gf, runtime)
        named_terms, selectable = [], []
        if named:
            named_ctx, all_terms, loaded = load_lora([(src, sc) for _, src, sc in named], gf, runtime)
            named_terms = split_terms(all_terms, len(named))
            selectable = [(n, p, sc) for (n, _, _), (p, sc) in zip(named, loaded)]
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
        Path(path), cfg, gf, weights, runtime, engine, tokenizer, template, lora_ctx, applied, selectable, named_ctx
    )


__all__ = ["Chat", "Generation", "Model", "Stream", "load"]
