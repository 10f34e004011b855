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
- Selectable adapters (``toy.load(adapters={name: file})``, one per
  generation: ``adapter=name``) can also be loaded and unloaded while the
  model is open: ``load_adapter`` / ``unload_adapter`` (on the thread that
  uses the model; ``prepare_adapter``, safe on any thread, does the slow
  part: read, hash, check, and on the CPU the tensors). Each has its own
  context, so any of them (start-up ones too) frees its memory alone, and
  gives bit for bit what it gives loaded at start-up. ``adapter_identity``
  names what K/V computed with one depend on (sha256 of the file, scale).
- Split across hosts (``toy.load(rpc=["HOST:PORT", ...])``): each endpoint's
  devices (``toy rpc-server``) join the runtime, and the layers go to the
  local device and then to each remote in contiguous blocks
  (``toy.engine.split``: by free memory, or ``tensor_split``). The tokens and
  logits are the one-host run's, bit for bit, when every device runs toy's
  CPU kernels. ``Model.placement`` / ``describe()`` say where the layers
  went; a remote device that fails raises ``RemoteDeviceError``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy import models, store
from toy.adapters import AdapterNameError, SelectableAdapter, load_lora, lora_items, named_items, read_selectable
from toy.engine import constrain, split
from toy.engine import speculative as spec
from toy.engine.decoding import DecodeState, reuse_prefix
from toy.engine.llm import ContextOverflowError, LLMEngine
from toy.engine.sampling import SamplingParams, TokenLogprob
from toy.engine.split import RemoteDeviceError
from toy.errors import BadInputError
from toy.gguf import GGUFFile, bind_tensors
from toy.gguf.bind import REPACK_CHOICES
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
        named: Sequence[SelectableAdapter] = (),
        placement: split.Placement | None = None,
    ):
        self.path, self.cfg, self.runtime, self.engine = path, cfg, runtime, engine
        self._placement = placement
        self._gguf, self._weights = gguf, weights
        self.tokenizer = tokenizer
        self.chat_template = template
        self.n_ctx = engine.n_ctx
        self._lora_context = lora_context
        #: the LoRA adapters applied, in order: (file path or None for an in-memory Adapter, user scale)
        self.adapters: list[tuple[str | None, float]] = list(adapters)
        # the selectable adapters by engine index (None: unloaded, a hole a later load may fill)
        self._named: list[SelectableAdapter | None] = list(named)
        #: draft models loaded from a path for speculative decoding (``generate(speculative=...)``), owned
        self._drafts: dict[str, Model] = {}
        #: measured seconds of this model's decode/verify steps by row count (the speculation controller's)
        self.step_costs = spec.StepCosts()

    @property
    def placement(self) -> split.Placement:
        """Which device holds each layer (``toy.engine.split``; every layer on the runtime's device without
        ``rpc``)."""
        if self._placement is None:
            self._placement = split.Placement(
                (self.runtime.backends[0],), (self.runtime.device,), (0,) * self.cfg.n_layer
            )
        return self._placement

    def describe(self) -> str:
        """Where the layers run: "layers 0-29 CPU", or a split's blocks
        ("layers 0-14 CPU, 15-29 RPC[10.0.0.2:50052]")."""
        return self.placement.describe()

    @property
    def named_adapters(self) -> list[tuple[str, str | None, float]]:
        """The selectable adapters loaded, in engine order: (name, file path or None, user scale)."""
        return [(a.name, a.path, a.scale) for a in self._named if a is not None]

    def selectable_adapters(self) -> dict[str, SelectableAdapter]:
        """The selectable adapters loaded, by name (engine order)."""
        return {a.name: a for a in self._named if a is not None}

    def adapter_index(self, name: str | None) -> int | None:
        """The engine index of the selectable adapter ``name`` (None for None: the base)."""
        if name is None:
            return None
        for j, a in enumerate(self._named):
            if a is not None and a.name == name:
                return j
        known = ", ".join(n for n, _, _ in self.named_adapters) or "none were loaded"
        raise BadInputError(f"no adapter named {name!r}", hint=f"adapters: {known}", field="adapter")

    def adapter_identity(self, index: int | None) -> str:
        """What K/V computed with engine adapter ``index`` depend on: "" for
        the base (None); for a selectable adapter the sha256 of its file's bytes
        (of an in-memory Adapter's values) and its scale, as "<hex>:<scale>".
        Equal identities give equal bits, in any process."""
        if index is None:
            return ""
        a = self._named[index] if 0 <= index < len(self._named) else None
        if a is None:
            raise BadInputError(f"no selectable adapter at index {index}")
        return a.identity

    # -- selectable adapters at run time

    def prepare_adapter(self, name: str, adapter, scale: float = 1.0) -> SelectableAdapter:
        """The slow, engine-free part of ``load_adapter``: read ``adapter`` (a
        path or a ``toy.adapters.Adapter``), hash it, check it against this
        model (``AdapterError`` naming the mismatch) and, on the CPU, put its
        tensors on the runtime. Safe on any thread; ``attach_adapter`` then
        makes it selectable. ``AdapterNameError`` when ``name`` is taken."""
        self._check_free(name)
        prepared = read_selectable(name, adapter, scale, self._gguf)
        if self.runtime.device == "CPU":  # host memory: no device queue shared with the engine's thread
            prepared.allocate(self.runtime)
        return prepared

    def attach_adapter(self, prepared: SelectableAdapter) -> int:
        """Make a ``prepare_adapter`` result selectable under its name; returns
        its engine index (the first one an unloaded adapter left, or a new
        one). Call between steps on the thread that uses the engine. On error
        the prepared adapter is closed."""
        try:
            self._check_free(prepared.name)
            prepared.allocate(self.runtime)
            j = self.engine.add_adapter(prepared.terms or {})
        except BaseException:
            prepared.close()
            raise
        if j == len(self._named):
            self._named.append(prepared)
        else:
            self._named[j] = prepared
        return j

    def load_adapter(self, name: str, adapter, scale: float = 1.0) -> int:
        """Load a selectable adapter while the model is open: ``adapter`` (a
        path or a ``toy.adapters.Adapter``) at user ``scale``, used by the
        generations that name it (``generate(..., adapter=name)``), bit for bit
        as if given to ``toy.load(adapters=...)``. Returns its engine index.
        Call on the thread that uses the model (a server: its engine worker;
        ``prepare_adapter`` + ``attach_adapter`` split off the slow part)."""
        return self.attach_adapter(self.prepare_adapter(name, adapter, scale))

    def unload_adapter(self, name: str) -> None:
        """Unload the selectable adapter ``name`` and free its memory. Its index
        stays free for a later load; the other adapters keep theirs. No
        generation may be using it; call on the thread that uses the model."""
        j = self.adapter_index(name)
        assert j is not None
        a = self._named[j]
        self.engine.remove_adapter(j)
        self._named[j] = None
        if a is not None:
            a.close()  # after the engine dropped its graphs: they point at these tensors

    def _check_free(self, name: str) -> None:
        if any(a is not None and a.name == name for a in self._named):
            raise AdapterNameError(f"an adapter named {name!r} is already loaded", hint="unload it first", field="name")

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
        speculative=None,
        **kw,
    ):
        """Generate a continuation: returns a ``Generation``. Sampling options
        come as a ``SamplingParams`` and/or keyword arguments (which win).
        ``adapter``: a selectable adapter's name (``toy.load(adapters=...)``).
        ``speculative``: None or "none" (plain decoding), "ngram" or
        ``{"type": "ngram", "n": 3, "n_min": 1, "k": 8}`` (prompt lookup), or
        ``{"type": "draft", "model": Model or path, "k": 4}`` (a draft model with
        this model's vocabulary; a path is loaded once and kept). The output is
        the same as without it, token for token, greedy or seeded (see
        ``toy.engine.speculative``); the timings gain ``draft_tokens`` and
        ``draft_accepted``."""
        stream = self.stream(
            prompt,
            sampling,
            cache_prompt=cache_prompt,
            special_in_content=special_in_content,
            adapter=adapter,
            speculative=speculative,
            **kw,
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
        speculative=None,
        **kw,
    ) -> Stream:
        """Like ``generate`` but returns a ``Stream`` of text chunks. The prompt
        is checked (tokens, budget) before this returns."""
        params = self._params(sampling, kw)
        proposer = self._proposer(speculative)
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
            # compiled once (guarded: toy.engine.constrain.prepare); the Sampler copies the compiled matcher
            params = replace(params, constraint=constrain.prepare(params.constraint, self.tokenizer))
        stream = Stream(iter(()))
        stream._gen = self._run(ids, params, cache_prompt, stream, which, proposer)
        return stream

    def _proposer(self, speculative):
        """(proposer, SpecConfig) for ``speculative`` (see ``generate``), or None for plain decoding."""
        cfg = spec.parse_speculative(speculative)
        if not cfg.on:
            return None
        spec.check_engine(self.engine)
        draft = None
        if cfg.type == "draft":
            src = speculative.get("model") if isinstance(speculative, Mapping) else None
            if src is None:
                raise BadInputError(
                    "speculative type 'draft' needs a model",
                    hint='{"type": "draft", "model": path or Model}',
                    field="speculative",
                )
            if isinstance(src, Model):
                draft = src
            else:
                key = str(src)
                if key not in self._drafts:
                    self._drafts[key] = load(src, n_ctx=self.n_ctx, n_slot=1, fetch=False)
                draft = self._drafts[key]
            spec.check_vocab(draft, self)
        return spec.make_proposer(cfg, draft, 0), cfg

    def _run(
        self,
        ids: list[int],
        params: SamplingParams,
        cache_prompt: bool,
        stream: Stream,
        which: int | None = None,
        speculation=None,
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
        t_decode, n_steps, n_forwards = 0.0, 0, 0
        # speculative decoding (toy.engine.speculative): a proposer drafts, one verify forward checks the drafts,
        # ``spec.accept`` runs the same token step over its rows; the controller sizes the drafts
        proposer, ctrl = None, None
        if speculation is not None:
            proposer = speculation[0]
            ctrl = spec.Controller(speculation[1].k, self.step_costs, proposer)
        try:
            rows = eng.prefill(slot, ids[keep:])[None]
            t1 = time.perf_counter()
            timings["prefill_s"] = t1 - t0
            draft: list[int] = []
            base, done = 0, False
            while not done:
                steps = spec.accept(state, rows, draft)
                if draft:  # keep the fed token and the accepted drafts; the rest lies past the length
                    eng.cache.truncate(slot, base + len(steps))
                if ctrl is not None and n_forwards:
                    ctrl.record(len(draft), len(steps))
                if n_forwards:
                    n_steps += len(steps)
                for step in steps:
                    if step.token is None:  # max_tokens=0: nothing sampled
                        done = True
                        break
                    if "ttft_s" not in timings:
                        timings["ttft_s"] = time.perf_counter() - t0
                    if logprobs is not None and step.logprob is not None:
                        logprobs.append(step.logprob)
                    if step.text:
                        text.append(step.text)
                        yield step.text
                    if step.finish_reason is not None:
                        done = True
                        break
                if done:
                    break
                token = steps[-1].token
                assert token is not None  # a step without a token ends generation
                k = min(ctrl.want(), params.max_tokens - len(state.tokens) - 1) if ctrl is not None else 0
                td = time.perf_counter()
                draft = proposer.propose(state.history, k) if proposer is not None and k > 0 else []
                tv = time.perf_counter()
                base = eng.cache.length(slot)
                if draft:
                    rows = eng.verify([slot], [[token, *draft]])[0]
                else:
                    rows = eng.decode([slot], [token])
                t_end = time.perf_counter()
                self.step_costs.record(1 + len(draft), t_end - tv)
                t_decode += t_end - td  # drafting included: decode_tok_s is the throughput a user sees
                n_forwards += 1
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
            if ctrl is not None:
                timings.update(decode_steps=n_forwards, draft_tokens=ctrl.drafted, draft_accepted=ctrl.accepted)
                ctrl.proposer.release()
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
        for d in self._drafts.values():
            d.close()
        self._drafts.clear()
        self.engine.close()
        if self._lora_context is not None:
            self._lora_context.close()  # after the engine: its graphs point at these tensors
        for a in self._named:
            if a is not None:
                a.close()
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
    rpc: str | Sequence[str] = (),
    tensor_split: str | Sequence[float] | None = None,
    repack: bool | str = True,
) -> Model:
    """Open a GGUF model of any registered architecture for generation.

    ``model``: a path or a name ``toy list`` shows (default: the bundled
    SmolLM2-135M-Instruct, once ``toy fetch`` has downloaded it).
    ``device``: flag > TOY_DEVICE > auto. ``n_ctx``: tokens per sequence
    (default: the model's context, at most 4096). ``threads``: default the
    physical cores, fewer while other processes keep cores busy
    (``toy_ggml.runtime_threads``); a count given or TOY_THREADS is used as
    given. ``n_slot``: sequences decoded at
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
    with different adapters batch together (see ``toy.engine.llm``).
    ``rpc``: remote devices, ``HOST:PORT`` endpoints of ``toy rpc-server``
    (a list, or one comma-separated str); the layers are split between the
    local device and them (``toy.engine.split``), by their free memory or by
    ``tensor_split`` (one share per device, local first: ``[3, 1]`` or
    "3,1"). ``RemoteDeviceError`` when an endpoint cannot be used.
    ``repack``: on the CPU (one device), the weights of the types whose
    repacked layout keeps each row's bits and speeds up decode without
    slowing prefill (``toy.gguf.bind.REPACK_TYPES``: Q4_0, IQ4_NL, Q4_1,
    and with AVX-512 VNNI Q8_0; x86 CPUs) are copied once into an
    interleaved layout where this CPU has one, for its faster product
    kernels, as llama.cpp does by default: the projections, a
    separate head or a copy of the embedding a head is tied to, a mixture's
    experts. ``"all"`` adds Q4_K and Q2_K (``REPACK_ALL_TYPES``): faster
    decode, slower prefill of long prompts. The products differ from the
    file's plain layout by float rounding only (Q8_0 and Q4_1: not at all
    from its one-row products). False keeps every weight in
    the mapped file."""
    if repack not in REPACK_CHOICES or not isinstance(repack, (bool, str)):
        raise BadInputError(f"repack={repack!r} must be True, False or 'all'", field="repack")
    endpoints = split.parse_endpoints(rpc)
    shares = split.parse_tensor_split(tensor_split)
    path = _resolve(model, fetch)
    if threads is not None and threads < 1:
        raise BadInputError(f"threads={threads} must be >= 1", field="threads")
    items = lora_items(lora)
    named = named_items(adapters)
    remote = _connect(endpoints)
    n_threads, adaptive = toy_ggml.runtime_threads(threads)  # default: adapts to the machine's load
    try:
        runtime = toy_ggml.Runtime(
            toy_ggml.resolve_device(device),
            threads=n_threads,
            adaptive=adaptive,
            extra_devices=[d.name for _, d in remote],
        )
    except toy_ggml.GGMLError as e:
        raise split.remote_failure(e, "loading the model") or e from None
    gf = lora_ctx = weights = None
    selectable: list[SelectableAdapter] = []
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
        placement = _place(cfg.n_layer, runtime, remote, shares)
        lora_ctx, terms, applied = load_lora(items, gf, runtime)
        for n, src, sc in named:  # each in its own context, so that it can be unloaded alone
            selectable.append(read_selectable(n, src, sc, gf))
            selectable[-1].allocate(runtime)
        weights = bind_tensors(gf, runtime, placement.device_of if placement.split else None, repack=repack)
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
            adapters=[a.terms or {} for a in selectable],
            layer_devices=[placement.devices[d] for d in placement.layers] if placement.split else None,
        )
    except BaseException as e:
        if lora_ctx is not None:
            lora_ctx.close()
        for a in selectable:
            a.close()
        if weights is not None:
            weights.close()
        if gf is not None:
            gf.close()
        runtime.close()
        remote_err = split.remote_failure(e, "loading the model")
        if remote_err is not None:
            raise remote_err from None
        raise
    return Model(
        Path(path), cfg, gf, weights, runtime, engine, tokenizer, template, lora_ctx, applied, selectable, placement
    )


def _connect(endpoints: Sequence[str]) -> list[tuple[str, Any]]:
    """(endpoint, toy_ggml Device) of every device the ``toy rpc-server``s at ``endpoints`` serve, in order;
    ``RemoteDeviceError`` naming the first endpoint that cannot be used."""
    if not endpoints:
        return []
    if not toy_ggml.rpc_available():
        raise BadInputError(
            "this build of toy-ggml has no RPC backend",
            hint="rebuild toy-ggml with ggml's RPC backend (its default build has it)",
            field="rpc",
        )
    out: list[tuple[str, Any]] = []
    for ep in endpoints:
        try:
            devs = toy_ggml.rpc_connect(ep)
        except toy_ggml.GGMLError as e:
            why = str(e) if ep in str(e) else f"RPC server {ep}: {e}"
            raise RemoteDeviceError(
                why,
                hint=f"start `toy rpc-server` there (reachable from here, e.g. through an SSH tunnel) or drop {ep}",
                endpoint=ep,
            ) from None
        out.extend((ep, d) for d in devs)
    return out


def _place(n_layer: int, runtime: toy_ggml.Runtime, remote: Sequence[tuple[str, Any]], shares) -> split.Placement:
    """Where each layer goes: the runtime's primary device, then the remote devices in order
    (``runtime.backends`` lists them right after the primary)."""
    backends = runtime.backends
    names = [backends[0], *backends[1 : 1 + len(remote)]]
    per_host: dict[str, int] = {}
    for ep, _ in remote:
        per_host[ep] = per_host.get(ep, 0) + 1
    labels, seen = [runtime.device], dict.fromkeys(per_host, 0)
    for ep, _ in remote:
        labels.append(f"RPC[{ep}]" if per_host[ep] == 1 else f"RPC[{ep}]#{seen[ep]}")
        seen[ep] += 1
    local = next((d for d in toy_ggml.devices() if d.name.lower() == runtime.device.lower()), None)
    free = [local.memory_free if local is not None else 0, *(d.memory_free for _, d in remote)]
    if shares is not None and len(shares) != len(names):
        raise BadInputError(
            f"the tensor split has {len(shares)} numbers for {len(names)} devices ({', '.join(labels)})",
            hint="give one share per device: the local one first, then each --rpc device in order",
            field="tensor_split",
        )
    return split.plan(n_layer, names, labels, free, shares)


__all__ = ["Chat", "Generation", "Model", "Stream", "load"]
