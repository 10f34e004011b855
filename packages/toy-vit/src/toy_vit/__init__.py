"""toy-vit: a ViT image classifier on toy's engine (model, data, recipe, CLI)."""

__version__ = "0.1.0"
