"""toy-vit: a ViT image classifier on toy's engine (model, data, recipe, CLI).

``toy_vit.load(path)`` opens a classifier GGUF (``Classifier``: ``logits``,
``classify``); ``ViTConfig`` and ``PRESETS`` describe models. The names are
imported on first use, so ``import toy_vit`` stays light (no ggml, no NumPy).
"""

__version__ = "0.1.0"

__all__ = ["PRESETS", "Classifier", "ViTConfig", "__version__", "load"]

_LAZY = {
    "load": "toy_vit.api",
    "Classifier": "toy_vit.api",
    "ViTConfig": "toy_vit.config",
    "PRESETS": "toy_vit.config",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'toy_vit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
