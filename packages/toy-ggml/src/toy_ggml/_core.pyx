# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""toy_ggml._core: the one extension module that links ggml.

ggml keeps global state (backend registry, CPU feature tables, quantization
tables), so a process holds exactly one copy: this module links ggml
statically and every binding lives here. The source is split into .pxi files
by concern (handles and tensors, ops, graphs, backend loading, remote devices,
runtime, quantization); they are textually included below and compiled as one
module.

Invariants (see docs/concepts/architecture.md, "The Cython boundary is thin"):
- every check that would be a GGML_ASSERT (an abort) is done here first and
  raises ValueError / TypeError / GGMLError naming the offending value;
- handles are owned: close() is idempotent, use after close raises, and an
  object that other objects still point into is kept alive (and its memory
  kept) until the last of them is gone;
- compute runs with the GIL released.
"""

include "_handles.pxi"
include "_tensor.pxi"
include "_ops.pxi"
include "_graph.pxi"
include "_dispatch.pxi"
include "_rpc.pxi"
include "_runtime.pxi"
include "_quant.pxi"
