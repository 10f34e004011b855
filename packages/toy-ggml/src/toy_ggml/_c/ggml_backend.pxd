# cython: language_level=3
# Extern declarations for ggml-backend.h (only what toy binds). No logic here.
from libc.stdint cimport uint8_t
from toy_ggml._c.ggml cimport ggml_tensor, ggml_cgraph, ggml_status, ggml_backend_buffer

cdef extern from "<stdbool.h>" nogil:
    ctypedef bint c_bool "bool"   # C's bool (a callback's type must match it exactly)

cdef extern from "ggml-backend.h" nogil:
    # Opaque handles: C typedefs of struct pointers; Cython only passes them on.
    ctypedef void * ggml_backend_buffer_type_t
    ctypedef ggml_backend_buffer * ggml_backend_buffer_t
    ctypedef void * ggml_backend_t
    ctypedef void * ggml_backend_dev_t
    ctypedef void * ggml_backend_reg_t
    ctypedef void * ggml_backend_sched_t

    cdef enum ggml_backend_dev_type_e "ggml_backend_dev_type":
        GGML_BACKEND_DEVICE_TYPE_CPU
        GGML_BACKEND_DEVICE_TYPE_GPU
        GGML_BACKEND_DEVICE_TYPE_IGPU
        GGML_BACKEND_DEVICE_TYPE_ACCEL
        GGML_BACKEND_DEVICE_TYPE_META

    cdef enum ggml_backend_buffer_usage:
        GGML_BACKEND_BUFFER_USAGE_ANY
        GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        GGML_BACKEND_BUFFER_USAGE_COMPUTE

    # buffer types and buffers
    const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft)
    const char * ggml_backend_buffer_name(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_free(ggml_backend_buffer_t buffer)
    void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer)
    size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value)
    bint ggml_backend_buffer_is_host(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, ggml_backend_buffer_usage usage)
    ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer)

    # backends
    const char * ggml_backend_name(ggml_backend_t backend)
    void ggml_backend_free(ggml_backend_t backend)
    ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend)
    void ggml_backend_tensor_set(ggml_tensor * tensor, const void * data, size_t offset, size_t size)
    void ggml_backend_tensor_get(const ggml_tensor * tensor, void * data, size_t offset, size_t size)
    void ggml_backend_synchronize(ggml_backend_t backend)
    ggml_status ggml_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph)
    bint ggml_backend_supports_op(ggml_backend_t backend, const ggml_tensor * op)
    bint ggml_backend_supports_buft(ggml_backend_t backend, ggml_backend_buffer_type_t buft)
    ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend)

    # devices
    size_t ggml_backend_dev_count()
    ggml_backend_dev_t ggml_backend_dev_get(size_t index)
    const char * ggml_backend_dev_name(ggml_backend_dev_t device)
    const char * ggml_backend_dev_description(ggml_backend_dev_t device)
    void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total)
    ggml_backend_dev_type_e ggml_backend_dev_type(ggml_backend_dev_t device)
    ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params)
    bint ggml_backend_dev_supports_op(ggml_backend_dev_t device, const ggml_tensor * op)
    ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device)
    ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device)
    const char * ggml_backend_reg_name(ggml_backend_reg_t reg)
    void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name)
    size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg)
    ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index)
    size_t ggml_backend_reg_count()
    ggml_backend_reg_t ggml_backend_reg_get(size_t index)

    # dynamic backends (GGML_BACKEND_DL): load a backend module and register it
    ggml_backend_reg_t ggml_backend_load(const char * path)

    # scheduler
    ggml_backend_sched_t ggml_backend_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts, int n_backends, size_t graph_size, bint parallel, bint op_offload)
    void ggml_backend_sched_free(ggml_backend_sched_t sched)
    bint ggml_backend_sched_reserve(ggml_backend_sched_t sched, ggml_cgraph * measure_graph)
    int ggml_backend_sched_get_n_splits(ggml_backend_sched_t sched)
    bint ggml_backend_sched_alloc_graph(ggml_backend_sched_t sched, ggml_cgraph * graph)
    ggml_status ggml_backend_sched_graph_compute(ggml_backend_sched_t sched, ggml_cgraph * graph)
    void ggml_backend_sched_reset(ggml_backend_sched_t sched)
    void ggml_backend_sched_set_tensor_backend(ggml_backend_sched_t sched, ggml_tensor * node, ggml_backend_t backend)
    # called with ask=true before each node (true: compute up to it and call again with ask=false)
    ctypedef c_bool (*ggml_backend_sched_eval_callback)(ggml_tensor * t, c_bool ask, void * user_data) noexcept
    void ggml_backend_sched_set_eval_callback(ggml_backend_sched_t sched, ggml_backend_sched_eval_callback callback, void * user_data)

    # CPU buffers over user memory (zero-copy mmap)
    ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size)
    ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type()
    ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, ggml_tensor * tensor, void * addr)
    ggml_status ggml_backend_view_init(ggml_tensor * tensor)
