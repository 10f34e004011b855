# cython: language_level=3
# ggml's RPC backend (libggml-rpc.so, a dynamically loaded module like the CPU
# variants): nothing here is linked. These are the function types of the entry
# points toy patch 0023 adds, handed out by the RPC registry through
# ggml_backend_reg_get_proc_address under the names in the comments. No logic here.
from toy_ggml._c.ggml_backend cimport ggml_backend_t, ggml_backend_reg_t, ggml_backend_dev_t, ggml_backend_buffer_t

# "toy_rpc_connect": connect, check the protocol, register the server's devices; NULL and the reason in err
ctypedef ggml_backend_reg_t (*toy_rpc_connect_t)(const char * endpoint, char * err, size_t err_size) noexcept nogil
# "toy_rpc_backend_error" / "toy_rpc_buffer_error": why the connection is dead, NULL while it works (or not RPC)
ctypedef const char * (*toy_rpc_backend_error_t)(ggml_backend_t backend) noexcept nogil
ctypedef const char * (*toy_rpc_buffer_error_t)(ggml_backend_buffer_t buffer) noexcept nogil
# toy_rpc_serve's callback, called once the server listens
ctypedef void (*toy_rpc_ready_t)(void * user_data) noexcept nogil
# "toy_rpc_serve": serve the devices on endpoint; returns only on failure (-1, the reason in err)
ctypedef int (*toy_rpc_serve_t)(const char * endpoint, const char * cache_dir, size_t n_threads,
                                size_t n_devices, ggml_backend_dev_t * devices,
                                toy_rpc_ready_t on_ready, void * user_data,
                                char * err, size_t err_size) noexcept nogil
