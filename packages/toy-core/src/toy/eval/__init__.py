"""Evaluation: per-token logprobs, perplexity the way llama.cpp's
llama-perplexity computes it, the KL divergence and top-1 agreement of two
models (judging a quantization or a merge), and linear mode connectivity
between two checkpoints.

- ``windows``: the scoring windows and the float64 log-softmax;
- ``score``: ``logprobs``, ``perplexity``, ``compare`` over loaded models
  (``toy.load``);
- ``lmc``: the loss along θ(α) = (1 − α) θ_A + α θ_B;
- ``record``: reading eval files and writing ``eval`` run bundles;
- ``lens``: the logit lens, ``logit_lens`` (each layer's residual stream
  through the final norm and head), and ``residual_streams``;
- ``cka``: ``layer_cka``, linear CKA between two models' layers on one text.

The CLI is ``toy eval`` (toy-cli); the figures equal these functions'.
"""

from toy.eval.cka import CKAResult, layer_cka, linear_cka
from toy.eval.lens import LensResult, logit_lens, residual_streams
from toy.eval.lmc import DEFAULT_ALPHAS, LMCPoint, LMCResult, lmc, parse_alphas
from toy.eval.record import check_eval_path, eval_run, read_eval_ids, read_eval_text
from toy.eval.score import (
    CompareResult,
    LogprobsResult,
    PerplexityResult,
    TokenScore,
    compare,
    logprobs,
    perplexity,
    text_ids,
)
from toy.eval.windows import tokens_needed

__all__ = [
    "DEFAULT_ALPHAS",
    "CKAResult",
    "CompareResult",
    "LMCPoint",
    "LMCResult",
    "LensResult",
    "LogprobsResult",
    "PerplexityResult",
    "TokenScore",
    "check_eval_path",
    "compare",
    "eval_run",
    "layer_cka",
    "linear_cka",
    "logit_lens",
    "lmc",
    "logprobs",
    "parse_alphas",
    "perplexity",
    "read_eval_ids",
    "read_eval_text",
    "residual_streams",
    "text_ids",
    "tokens_needed",
]
