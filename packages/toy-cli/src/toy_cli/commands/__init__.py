"""Subcommand modules of ``toy``. Each exposes ``register(app)``; none imports
``toy`` or ``toy_ggml`` at module level, so ``toy --help`` stays fast."""
