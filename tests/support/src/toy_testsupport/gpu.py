"""What the GPU tests (tests/gpu/) share: comparing a device's outputs with the CPU's.

- ``check_greedy(got, want, want_rows, tie_tol, what)``: greedy tokens of the device (``got``) against
  the CPU's (``want``). They must be equal, except that they may part at a near tie: where the CPU's
  logits for its own token and for the device's token are within ``tie_tol`` (the logit tolerance the
  test allows between the devices: a difference that small may flip the pick). Everything before the
  parting point must be equal. Returns the parting index, or None when the sequences are equal.
- ``max_rel_diff(got, want)``: the largest ``|got - want| / |want|`` over matching keys of two
  ``{step: loss}`` maps (the keys must be the same).
- ``checkpoint_tensors(path)``: every tensor of a GGUF file as float32 arrays (two device runs are
  compared tensor by tensor, since a checkpoint's metadata carries its run id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def check_greedy(
    got: Sequence[int], want: Sequence[int], want_rows: np.ndarray, tie_tol: float, what: str
) -> int | None:
    """See the module docstring; ``want_rows[i]`` are the CPU's logits that picked ``want[i]``."""
    assert len(got) == len(want), f"{what}: {len(got)} tokens against the CPU's {len(want)}"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None
    row = np.asarray(want_rows[i], np.float64)
    gap = float(row[want[i]] - row[got[i]])
    assert gap <= tie_tol, (
        f"{what}: the device's greedy token {i} is {got[i]}, the CPU's {want[i]}, and the CPU's logits "
        f"separate them by {gap:.4g} > {tie_tol:.4g} (not a near tie); device {list(got)} cpu {list(want)}"
    )
    return i


def max_rel_diff(got: Mapping[int, float], want: Mapping[int, float]) -> float:
    assert sorted(got) == sorted(want), f"steps {sorted(got)} against the CPU's {sorted(want)}"
    return max(abs(got[k] - want[k]) / abs(want[k]) for k in want)


def checkpoint_tensors(path) -> dict[str, np.ndarray]:
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        return {n: np.array(gf.tensor_to_float(n), np.float32) for n in gf.tensors}


__all__ = ["check_greedy", "checkpoint_tensors", "max_rel_diff"]
