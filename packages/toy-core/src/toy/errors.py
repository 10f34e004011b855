"""The base error of the toy library. Library code raises; it never prints
or exits (the CLI turns these into ``error:`` lines and exit codes)."""


class ToyError(Exception):
    """Base of every error toy raises on purpose. ``hint`` (optional) says
    what the user can do about it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
