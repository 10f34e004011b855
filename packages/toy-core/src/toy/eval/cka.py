"""Linear CKA between two models' residual streams, layer by layer, on one
text (Kornblith et al. 2019, "Similarity of Neural Network Representations
Revisited").

For activations X (T, d_x) and Y (T, d_y) of the same T tokens, with the
column means removed (X_c, Y_c) and the linear Gram matrices
K = X_c X_cᵀ, L = Y_c Y_cᵀ (T × T):

    CKA(X, Y) = ⟨K, L⟩_F / (‖K‖_F ‖L‖_F)

(the biased HSIC estimator: the 1/(T−1)² factors cancel). It is 1 for
identical representations, invariant to orthogonal transforms and isotropic
scaling of either side, and in [0, 1].

Invariants and decisions:

- Everything is float64 (the activations are float32, from
  ``toy.eval.lens.residual_streams``: the stream after each block, 0-based).
- The result is always the full matrix, layers of A × layers of B: the
  layer counts may differ (a model against its pruned or grown self, two
  sizes of a family). When they are equal the diagonal (layer i against
  layer i) is also given. Gram matrices are T × T per layer, so memory is
  about (layers of B + 1) · T² · 8 bytes (a 512-token text: 2 MB a layer).
- The two models must tokenize the text to the same ids (same vocabulary,
  and A's and B's prompt tokenization agree); otherwise the rows would not
  be the same tokens and CKA would be meaningless, so it is refused.
- A layer whose activations are constant over the tokens has no Gram
  matrix to compare: its CKA is NaN (None in JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toy.errors import BadInputError
from toy.eval.lens import residual_streams, text_ids
from toy.eval.score import Scorable, same_vocabulary


def centered_gram(x: np.ndarray) -> np.ndarray:
    """The linear Gram matrix (T, T) float64 of x (T, d) with its column means removed."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise BadInputError(f"activations must be (tokens, features), got shape {x.shape}")
    xc = x - x.mean(axis=0, keepdims=True)
    gram: np.ndarray = xc @ xc.T
    return gram


def _unit(gram: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(gram)
    return gram / norm if norm > 0 else np.full_like(gram, np.nan)


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA of x (T, d_x) and y (T, d_y): rows are the same T inputs."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise BadInputError(f"CKA needs (T, d) activations of the same T rows, got {x.shape} and {y.shape}")
    return float((_unit(centered_gram(x)) * _unit(centered_gram(y))).sum())


def cka_matrix(acts_a: Sequence[np.ndarray], acts_b: Sequence[np.ndarray]) -> np.ndarray:
    """CKA (len(acts_a), len(acts_b)) float64 of every pair of layers."""
    if not acts_a or not acts_b:
        raise BadInputError("CKA needs at least one layer on each side")
    t = {np.asarray(a).shape[0] for a in (*acts_a, *acts_b)}
    if len(t) != 1:
        raise BadInputError(f"CKA needs activations of the same tokens, got row counts {sorted(t)}")
    gb = np.stack([_unit(centered_gram(b)).ravel() for b in acts_b])  # (n_b, T²)
    out = np.empty((len(acts_a), len(acts_b)))
    for i, a in enumerate(acts_a):
        out[i] = gb @ _unit(centered_gram(a)).ravel()
    return out


@dataclass
class CKAResult:
    matrix: np.ndarray  # (layers of A, layers of B)
    n_tokens: int

    @property
    def diagonal(self) -> list[float] | None:
        """CKA of layer i of A with layer i of B, when both have as many layers."""
        a, b = self.matrix.shape
        return [float(self.matrix[i, i]) for i in range(a)] if a == b else None

    def to_dict(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return None if not np.isfinite(v) else float(v)

        d = self.diagonal
        return {
            "n_tokens": self.n_tokens,
            "layers_a": int(self.matrix.shape[0]),
            "layers_b": int(self.matrix.shape[1]),
            "matrix": [[num(v) for v in row] for row in self.matrix],
            "diagonal": None if d is None else [num(v) for v in d],
        }


def layer_cka(
    model_a: Scorable, model_b: Scorable, text: str | Sequence[int], max_tokens: int | None = None
) -> CKAResult:
    """Linear CKA of every layer of A against every layer of B on ``text``
    (a str, tokenized like a prompt by both models, or token ids); only its
    first ``max_tokens`` tokens when given."""
    same_vocabulary(model_a, model_b)
    ids = text_ids(model_a, text, max_tokens)
    if isinstance(text, str):
        other = text_ids(model_b, text, max_tokens)
        if other != ids:
            at = next((i for i, (x, y) in enumerate(zip(ids, other)) if x != y), min(len(ids), len(other)))
            raise BadInputError(
                f"the models tokenize the text differently (from token {at}: {len(ids)} vs {len(other)} tokens)",
                hint="CKA compares the same tokens: use two checkpoints of one model family and tokenizer",
            )
    if len(ids) < 2:
        raise BadInputError(f"CKA needs at least 2 tokens, the text has {len(ids)}", hint="give a longer text")
    acts_a, _ = residual_streams(model_a, ids, logits=False)
    acts_b, _ = residual_streams(model_b, ids, logits=False)
    return CKAResult(cka_matrix(acts_a, acts_b), len(ids))


__all__ = ["CKAResult", "centered_gram", "cka_matrix", "layer_cka", "linear_cka"]
