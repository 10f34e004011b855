# cython: language_level=3
# The CPU backend's entry points. The CPU backend is a dynamically loaded
# module (GGML_BACKEND_DL, one per x86-64 level), so nothing here is linked:
# these are the function types its registry hands out through
# ggml_backend_reg_get_proc_address under the names in the comments. No logic here.
from toy_ggml._c.ggml_backend cimport ggml_backend_t, ggml_backend_reg_t

cdef extern from "ggml.h" nogil:
    struct ggml_threadpool_params:
        int n_threads
        unsigned int poll
    ctypedef void * ggml_threadpool_t
    ggml_threadpool_params ggml_threadpool_params_default(int n_threads)

cdef extern from "ggml-backend.h" nogil:
    struct ggml_backend_feature:
        const char * name
        const char * value
    # "ggml_backend_set_n_threads"
    ctypedef void (*ggml_backend_set_n_threads_t)(ggml_backend_t backend, int n_threads)
    # "ggml_backend_get_features": a list ending with a NULL name
    ctypedef ggml_backend_feature * (*ggml_backend_get_features_t)(ggml_backend_reg_t reg)

ctypedef ggml_threadpool_t (*toy_threadpool_new_t)(ggml_threadpool_params * params) noexcept nogil      # "ggml_threadpool_new"
ctypedef void (*toy_threadpool_free_t)(ggml_threadpool_t threadpool) noexcept nogil                     # "ggml_threadpool_free"
ctypedef void (*toy_cpu_set_threadpool_t)(ggml_backend_t backend, ggml_threadpool_t tp) noexcept nogil  # "ggml_backend_cpu_set_threadpool"
# a variant's score: 0 when this CPU cannot run it, higher for a better fit ("ggml_backend_score")
ctypedef int (*toy_backend_score_t)() noexcept nogil
