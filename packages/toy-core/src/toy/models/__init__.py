"""Model architectures: one module per family (a Config dataclass and graph
building), keyed by GGUF ``general.architecture``; ``toy.models.card``
summarizes any GGUF model and writes its forward pass as pseudocode.

Nothing is imported here, so ``import toy.models.card`` stays light.
"""
