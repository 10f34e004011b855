"""toy: train, fine-tune, evaluate and serve small transformers from and to GGUF.

This package holds the library (models, engines, recipes, GGUF IO). Tensor
ops run in ggml through ``toy_ggml``; nothing here touches a C pointer.
"""

from typing import Any

from toy.errors import ToyError

__version__ = "0.1.0"

__all__ = ["ToyError", "__version__", "load"]


def __getattr__(name: str) -> Any:
    # ``toy.load`` imports the engine (and ggml) on first use, so `import toy`
    # stays cheap for code that only reads GGUF files or tokenizes.
    if name == "load":
        from toy.engine.generate import load  # lazy: the engine loads ggml; `import toy` must not

        return load
    raise AttributeError(f"module 'toy' has no attribute {name!r}")
