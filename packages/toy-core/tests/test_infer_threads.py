"""Inference's default thread count follows the machine's load (issue 41):
``toy.load`` without ``threads`` gets an adaptive Runtime, whose thread
count may change from one compute to the next. That is sound only if no
logit depends on the thread count.

Expected values: the same model loaded with one thread, bit for bit (the
logits of a prefill, a greedy generation's tokens and logprobs), against a
default Runtime whose load sampler answers 1, 2, 1, 2, ... (one answer per
compute; two physical cores assumed, so that the default is adaptive on any
machine). With ``flash_attn`` the prompt is longer than 512 tokens, where
ggml's split-key kernel would sum in an order set by the thread count: an
adaptive runtime uses the one-row kernel (toy-ggml patch 0020) instead, so
there the reference is the adaptive runtime held at one thread.
"""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

import toy

pytestmark = pytest.mark.model


@pytest.fixture
def answers(monkeypatch):
    """``answers(seq)``: from then on the load sampler answers seq's counts in a
    cycle (one per compute); returns the list of answers given."""
    from toy_ggml import load

    monkeypatch.delenv("TOY_THREADS", raising=False)
    monkeypatch.setattr(importlib.import_module("toy_ggml.devices"), "physical_cores", lambda: 2)

    def set_answers(seq):
        cycle = itertools.cycle(seq)
        given: list[int] = []

        def threads(n_max: int) -> int:
            given.append(next(cycle))
            return given[-1]

        monkeypatch.setattr(load.shared_sampler(), "threads", threads, raising=False)
        return given

    return set_answers


def _run(path, threads, flash_attn: bool, ids: list[int]):
    with toy.load(path, threads=threads, n_ctx=1024, flash_attn=flash_attn, n_batch=256) as m:
        assert m.runtime.adaptive == (threads is None)
        logits = m.logits(ids[:80])
        g = m.generate(ids, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
        return logits.tobytes(), list(g.tokens), [(lp.logprob, [tuple(t) for t in lp.top]) for lp in g.logprobs]


@pytest.mark.parametrize("flash_attn", [False, True])
def test_switching_threads_changes_no_logit(smollm2_path, answers, flash_attn):
    ids = [int(i) for i in np.random.default_rng(5).integers(100, 20000, 530)]  # > 512 keys: the split kernel's range
    given = answers([1, 2])
    switching = _run(smollm2_path, None, flash_attn, ids)
    assert set(given) == {1, 2}, "the default Runtime was not adaptive"
    answers([1])
    assert _run(smollm2_path, None, flash_attn, ids) == switching  # the adaptive runtime held at one thread
    if not flash_attn:  # a fixed runtime: the same kernels (with flash attention ggml picks its own)
        assert _run(smollm2_path, 1, flash_attn, ids) == switching
