# cython: language_level=3
# Extern declarations for ggml-alloc.h (only what toy binds). No logic here.
from toy_ggml._c.ggml cimport ggml_context, ggml_cgraph
from toy_ggml._c.ggml_backend cimport ggml_backend_t, ggml_backend_buffer_t, ggml_backend_buffer_type_t

cdef extern from "ggml-alloc.h" nogil:
    ctypedef void * ggml_gallocr_t

    ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft)
    void ggml_gallocr_free(ggml_gallocr_t galloc)
    bint ggml_gallocr_reserve(ggml_gallocr_t galloc, ggml_cgraph * graph)
    bint ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, ggml_cgraph * graph)
    size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id)
    ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors(ggml_context * ctx, ggml_backend_t backend)
    ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(ggml_context * ctx, ggml_backend_buffer_type_t buft)
