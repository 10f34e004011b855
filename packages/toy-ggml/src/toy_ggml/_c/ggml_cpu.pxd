# cython: language_level=3
# Extern declarations for ggml-cpu.h (only what toy binds). No logic here.
from toy_ggml._c.ggml_backend cimport ggml_backend_t, ggml_backend_reg_t

cdef extern from "ggml.h" nogil:
    struct ggml_threadpool_params:
        int n_threads
        unsigned int poll
    ctypedef void * ggml_threadpool_t
    ggml_threadpool_params ggml_threadpool_params_default(int n_threads)

cdef extern from "ggml-cpu.h" nogil:
    void ggml_cpu_init()
    ggml_threadpool_t ggml_threadpool_new(ggml_threadpool_params * params)
    void ggml_threadpool_free(ggml_threadpool_t threadpool)
    ggml_backend_t ggml_backend_cpu_init()
    bint ggml_backend_is_cpu(ggml_backend_t backend)
    void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads)
    void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, ggml_threadpool_t threadpool)
    ggml_backend_reg_t ggml_backend_cpu_reg()
    int ggml_cpu_has_sse3()
    int ggml_cpu_has_avx()
    int ggml_cpu_has_avx2()
    int ggml_cpu_has_f16c()
    int ggml_cpu_has_fma()
    int ggml_cpu_has_avx512()
    int ggml_cpu_has_avx512_vnni()
    int ggml_cpu_has_avx512_bf16()
    int ggml_cpu_has_amx_int8()
    int ggml_cpu_has_neon()
    int ggml_cpu_has_llamafile()
