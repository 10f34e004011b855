"""Errors raised by toy_ggml.

Everything that ggml would answer with an abort (a failed GGML_ASSERT) is
checked before the call and raised as ``ValueError``/``TypeError`` (bad
arguments) or one of these (state and runtime failures).
"""


class GGMLError(Exception):
    """A ggml call failed or cannot be made (status codes, unsupported ops,
    graphs without room, backward through an op without a gradient)."""


class ClosedError(GGMLError):
    """A handle (context, buffer, runtime) was used after ``close()``."""


class UnsupportedBackwardError(GGMLError):
    """A backward graph would pass through an op that has no gradient in
    ggml; ggml itself would abort the process."""
