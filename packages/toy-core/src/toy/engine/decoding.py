"""One request's decoding state: the token step that both generation drivers share.

``toy.Model`` (the library's generation loop, ``toy.engine.generate``) and the server's engine worker
(``toy_serve.worker``, continuous batching) run their forward passes their own way, but each turns a row of
logits into the next token, its text and whether generation ends through ``DecodeState.advance``, and each
picks how much of a cached prompt to keep with ``reuse_prefix`` (see the architecture page,
docs/concepts/architecture.md, "One token step, two drivers").

The order of one step (``advance``):

1. budget: if ``max_tokens`` tokens were already generated, the step samples nothing and ends with "length"
   (only ``max_tokens=0`` gets here: any other budget ends at step 7);
2. sample the token (``Sampler``: bias, constraint mask, penalties over the history, filters, seeded draw);
3. stop token (``params.stop_token_ids``: the model's end-of-generation ids unless ``ignore_eos``, plus
   ``stop_tokens``): ends with "stop"; it has no text, joins neither the history nor the decoded text, and is
   part of the completion (``tokens``, a logprob) only with ``count_stop_token``;
4. the token's logprob and top alternatives (under the raw logits), when ``params.logprobs`` asks;
5. the token joins ``tokens`` and the history the penalties look at;
6. its bytes go through the incremental UTF-8 decoder, then the stop-string matcher: the step's text is what may
   be shown now ("" while a multi-byte character or a possible stop string is held back);
7. a stop string completed: "stop" (the text is cut before it and nothing is flushed); else the constraint is
   complete: "stop"; else ``max_tokens`` tokens: "length".

``finish()`` ends the state: it releases the decoder's incomplete bytes and the matcher's held-back text (nothing
after a stop string). When that released text completes a stop string, it is cut there and the finish reason
becomes "stop". A driver calls it after a finishing step, or to end early (the server does on cancellation; the
library does not, so a cancelled stream's text leaves held-back text out).

Invariants:

- The steps' texts plus ``finish()`` concatenate to the generation's text: the decoded tokens up to (not
  including) the first stop string, whichever way the text was split into tokens.
- Same params (seed included), same logits rows -> same steps, whichever driver feeds them: the state holds
  everything a step depends on (sampler and its generator, history, decoder, matcher), nothing of the driver's.
- A state is used once: ``advance`` after a finishing step or after ``finish()`` raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toy.engine.sampling import Sampler, SamplingParams, TokenLogprob
from toy.engine.stop import StopMatcher


@dataclass(frozen=True)
class Step:
    """What one ``DecodeState.advance`` produced."""

    token: int | None  # the sampled id; None when the budget was already spent (max_tokens=0): nothing sampled
    text: str  # the text safe to show now: "" while held back, and for a stop token
    logprob: TokenLogprob | None = None  # when params.logprobs asks (a stop token's only with count_stop_token)
    finish_reason: str | None = None  # "stop" | "length" when this step ended generation, else None
    stop: str | int | None = None  # the stop string or stop token id that ended it
    stop_token: bool = False  # the token is a stop token


class DecodeState:
    """Per-request decoding state over ``params``: the sampler, the stop ids, the stop-string matcher, the
    incremental detokenizer, the history (``prompt`` then each generated token) and the generated ``tokens``.

    ``tokenizer``: the model's ``toy.tokenizer.Tokenizer`` (its end-of-generation ids, its decoder, a
    constraint's vocabulary). ``count_stop_token``: OpenAI-style accounting (the server): a stop token is part of
    the completion, counted in ``tokens`` (the usage) with its logprob; the library leaves it out of both.
    """

    def __init__(
        self,
        params: SamplingParams,
        tokenizer,
        n_vocab: int,
        prompt: Sequence[int],
        *,
        count_stop_token: bool = False,
    ):
        self.params = params
        self.sampler = Sampler(params, n_vocab, tokenizer)
        self.stop_ids = params.stop_token_ids(tokenizer.eog_ids)
        self.matcher = StopMatcher(params.stop)
        self.decoder = tokenizer.incremental_decoder()
        self.count_stop_token = count_stop_token
        self.history: list[int] = list(prompt)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # set by the step that ends generation (and finish())
        self.stop: str | int | None = None
        self._finished = False

    @property
    def seed(self) -> int:
        """The sampler's seed (``params.seed``, or the fresh one it drew)."""
        return self.sampler.seed

    @property
    def done(self) -> bool:
        """True once a step ended generation or ``finish()`` was called."""
        return self.finish_reason is not None or self._finished

    def advance(self, logits: np.ndarray) -> Step:
        """One token step over ``logits`` (the row that predicts the next token), in the module's order."""
        if self.done:
            raise RuntimeError("this generation has ended; a DecodeState is used once")
        p = self.params
        if len(self.tokens) >= p.max_tokens:
            return self._end(Step(None, "", finish_reason="length"))
        tok = self.sampler.sample(logits, self.history)
        if tok in self.stop_ids:
            lp = None
            if self.count_stop_token:
                lp = self.sampler.token_logprobs(logits, tok)
                self.tokens.append(tok)
            return self._end(Step(tok, "", lp, "stop", stop=tok, stop_token=True))
        lp = self.sampler.token_logprobs(logits, tok)
        self.tokens.append(tok)
        self.history.append(tok)
        text, hit = self.matcher.push(self.decoder.feed(tok))
        if hit:
            return self._end(Step(tok, text, lp, "stop", stop=self.matcher.matched))
        if self.sampler.done:  # the constraint is complete: nothing may follow
            return self._end(Step(tok, text, lp, "stop"))
        if len(self.tokens) >= p.max_tokens:
            return self._end(Step(tok, text, lp, "length"))
        return Step(tok, text, lp)

    def _end(self, step: Step) -> Step:
        self.finish_reason, self.stop = step.finish_reason, step.stop
        return step

    def finish(self) -> str:
        """End the state and return the text still held back ("" after a stop string, or when called again).
        Released text that completes a stop string is cut there and makes the finish reason "stop"."""
        if self._finished:
            return ""
        self._finished = True
        if self.matcher.stopped:  # ended by a stop string: what followed it is dropped
            return ""
        tail, hit = self.matcher.push(self.decoder.flush())
        if hit:
            self.finish_reason, self.stop = "stop", self.matcher.matched
        else:
            tail += self.matcher.flush()
        return tail


def reuse_prefix(cache, slots: Sequence[int], prompt: Sequence[int], slot_adapter, adapter) -> tuple[int, int]:
    """Where to run ``prompt`` and how much of it is cached: ``(slot, keep)`` for the slot of ``slots`` whose
    cache (a ``toy.engine.kv.KVCache``) shares the longest prefix with ``prompt`` (ties: the lowest index), and
    the number of leading prompt tokens it keeps.

    A slot whose K/V were computed with another LoRA adapter (``slot_adapter[slot]`` is not ``adapter``, an
    engine adapter index or None for the base) shares nothing. ``keep`` leaves at least the last prompt token to
    compute: its logits pick the first generated token. Slots rank by the whole shared prefix (before that cap): of
    a slot holding the full prompt and one holding all but its last token, the first wins."""

    def shared(s: int) -> int:
        return cache.common_prefix(s, prompt) if slot_adapter[s] == adapter else 0

    best = max(slots, key=lambda s: (shared(s), -s))
    return best, min(shared(best), len(prompt) - 1)


__all__ = ["DecodeState", "Step", "reuse_prefix"]
