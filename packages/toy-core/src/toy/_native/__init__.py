"""Compiled helpers for hot loops in pure-Python modules (no ggml here)."""
