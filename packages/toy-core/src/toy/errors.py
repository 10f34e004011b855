"""The base error of the toy library. Library code raises; it never prints
or exits (the CLI turns these into ``error:`` lines and exit codes)."""


class ToyError(Exception):
    """Base of every error toy raises on purpose. ``hint`` (optional) says
    what the user can do about it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class BadInputError(ToyError):
    """An argument or input the caller can fix (a value out of range, an
    unknown option, an empty prompt): the CLI exits 2, the server answers 400."""

    exit_code = 2
