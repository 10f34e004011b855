#!/usr/bin/env python3
"""Exit 0 when `just test` needs its second pass: the CPU variant toy_ggml
loads here is not the AVX2 one (`haswell`) but this CPU can run that one, so
the tests marked ``avx2_reference`` (outputs recorded on AVX2 kernels) were
skipped in the first pass and must run under TOY_GGML_CPU_VARIANT=haswell.
Exit 1 otherwise (they already ran, or this CPU cannot run AVX2 code: then
the first pass reported them as skipped and says why)."""

from __future__ import annotations

import sys

import toy_ggml

choice = toy_ggml.cpu_variant()
runnable = {c.tag for c in choice.candidates if c.score > 0}
sys.exit(0 if choice.tag != "haswell" and "haswell" in runnable else 1)
