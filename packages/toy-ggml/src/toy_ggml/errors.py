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


class RPCError(GGMLError):
    """A remote device (ggml's RPC backend, ``toy rpc-server``) failed: its
    server could not be reached, refused the protocol, or the connection was
    lost or went silent for TOY_RPC_TIMEOUT seconds. ``endpoint`` is the
    server's ``HOST:PORT``. A connection that failed stays failed: every later
    compute on it raises; connect again and make a new Runtime."""

    def __init__(self, message: str, endpoint: str = "") -> None:
        super().__init__(message)
        self.endpoint = endpoint

    def __reduce__(self) -> tuple[type[GGMLError], tuple[str, str]]:  # keep the endpoint when pickled
        return (type(self), (str(self), self.endpoint))
