"""Small NumPy reference implementations, used only by tests (independent of ggml)."""
