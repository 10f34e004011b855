"""toy-serve: an OpenAI-compatible HTTP server over toy's engine, with continuous batching.

``create_app(settings, model=None)`` builds the FastAPI app; ``Settings``
holds its configuration; ``toy serve MODEL`` (``toy_serve.cli.serve``) runs
it under uvicorn.

Decision: ``create_app`` is imported lazily (module ``__getattr__``), so
``import toy_serve.cli`` (which the ``toy`` command does for every
invocation, to register ``serve``) does not import FastAPI, uvicorn or the
engine, and ``Settings`` is imported lazily too (it pulls in ``toy``):
``toy --help`` imports nothing of toy's library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toy_serve.app import create_app
    from toy_serve.settings import Settings

__version__ = "0.1.0"

__all__ = ["Settings", "__version__", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from toy_serve.app import create_app

        return create_app
    if name == "Settings":
        from toy_serve.settings import Settings

        return Settings
    raise AttributeError(f"module 'toy_serve' has no attribute {name!r}")
