# Loading the dynamic backends (GGML_BACKEND_DL). The CPU backend exists once
# per x86-64 level (libggml-cpu-<tag>.so beside libggml); the policy of which
# one to load lives in toy_ggml/_dispatch.py. Here: where the libraries are,
# a variant's score (ggml's own test of this CPU, without registering it),
# loading one backend module, and the CPU entry points the loaded module
# hands out (Runtime uses them); likewise the RPC module's (toy patch 0023).

cdef extern from "<dlfcn.h>" nogil:
    ctypedef struct Dl_info:
        const char * dli_fname
        void * dli_fbase
        const char * dli_sname
        void * dli_saddr
    int dladdr(const void * addr, Dl_info * info)
    void * dlopen(const char * filename, int flags)
    void * dlsym(void * handle, const char * symbol)
    int dlclose(void * handle)
    char * dlerror()
    int RTLD_NOW
    int RTLD_LOCAL

cdef ggml_backend_reg_t _cpu_reg = NULL
cdef ggml_backend_dev_t _cpu_dev = NULL
cdef ggml_backend_set_n_threads_t _cpu_set_n_threads = NULL
cdef toy_threadpool_new_t _tp_new = NULL
cdef toy_threadpool_free_t _tp_free = NULL
cdef toy_cpu_set_threadpool_t _cpu_set_tp = NULL


def library_path():
    """The file libggml was loaded from (the backend modules lie beside it)."""
    cdef Dl_info info
    if dladdr(<const void *>ggml_backend_load, &info) == 0 or info.dli_fname == NULL:
        raise GGMLError("cannot tell where libggml was loaded from")
    return info.dli_fname.decode()


def backend_score(path):
    """ggml's score of a backend module for this machine: 0 when it cannot
    run here, higher for a better fit, -1 for a module without a score. The
    module is opened and closed again, not registered."""
    cdef bytes p = str(path).encode()
    cdef void * h = dlopen(p, RTLD_NOW | RTLD_LOCAL)
    cdef toy_backend_score_t f
    cdef int s
    if h == NULL:
        err = dlerror()
        raise GGMLError(f"cannot open {path}: {err.decode() if err != NULL else 'unknown error'}")
    f = <toy_backend_score_t>dlsym(h, "ggml_backend_score")
    s = f() if f != NULL else -1
    dlclose(h)
    return s


def load_backend(path):
    """Load and register one backend module; returns its registry name. For
    the CPU backend this also takes its entry points (one CPU backend per
    process: a second raises); for the RPC backend, toy's (patch 0023)."""
    global _cpu_reg, _cpu_dev, _cpu_set_n_threads, _tp_new, _tp_free, _cpu_set_tp
    global _rpc_reg, _rpc_connect, _rpc_backend_error, _rpc_buffer_error, _rpc_serve
    cdef bytes p = str(path).encode()
    cdef ggml_backend_reg_t reg
    cdef ggml_backend_dev_t d
    cdef size_t i
    if _cpu_reg != NULL and str(path).replace("\\", "/").rpartition("/")[2].startswith("libggml-cpu"):
        raise GGMLError("a CPU backend is already loaded in this process")
    reg = ggml_backend_load(p)
    if reg == NULL:
        raise GGMLError(f"ggml could not load the backend {path}")
    name = ggml_backend_reg_name(reg).decode()
    for i in range(ggml_backend_reg_dev_count(reg)):
        d = ggml_backend_reg_dev_get(reg, i)
        if ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU and _cpu_reg == NULL:
            _cpu_set_n_threads = <ggml_backend_set_n_threads_t>ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
            _tp_new = <toy_threadpool_new_t>ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new")
            _tp_free = <toy_threadpool_free_t>ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free")
            _cpu_set_tp = <toy_cpu_set_threadpool_t>ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_threadpool")
            if _cpu_set_n_threads == NULL or _tp_new == NULL or _tp_free == NULL or _cpu_set_tp == NULL:
                raise GGMLError(f"{path} lacks the CPU backend's entry points")
            _cpu_reg = reg
            _cpu_dev = d
    if name == "RPC" and _rpc_reg == NULL:
        _rpc_connect = <toy_rpc_connect_t>ggml_backend_reg_get_proc_address(reg, "toy_rpc_connect")
        _rpc_backend_error = <toy_rpc_backend_error_t>ggml_backend_reg_get_proc_address(reg, "toy_rpc_backend_error")
        _rpc_buffer_error = <toy_rpc_buffer_error_t>ggml_backend_reg_get_proc_address(reg, "toy_rpc_buffer_error")
        _rpc_serve = <toy_rpc_serve_t>ggml_backend_reg_get_proc_address(reg, "toy_rpc_serve")
        if _rpc_connect == NULL or _rpc_backend_error == NULL or _rpc_buffer_error == NULL or _rpc_serve == NULL:
            _rpc_connect = NULL
            _rpc_backend_error = NULL
            _rpc_buffer_error = NULL
            _rpc_serve = NULL
            raise GGMLError(f"{path} lacks toy's RPC entry points (toy patch 0023): not toy's RPC backend")
        _rpc_reg = reg
    return name


def cpu_backend_features():
    """What the loaded CPU variant reports (ggml_backend_get_features):
    feature name -> value, e.g. {"AVX2": "1", "AVX512": "1", ...}; {} when no
    CPU backend is loaded."""
    cdef ggml_backend_get_features_t f
    cdef ggml_backend_feature * feats
    out = {}
    if _cpu_reg == NULL:
        return out
    f = <ggml_backend_get_features_t>ggml_backend_reg_get_proc_address(_cpu_reg, "ggml_backend_get_features")
    if f == NULL:
        return out
    feats = f(_cpu_reg)
    while feats != NULL and feats.name != NULL:
        out[feats.name.decode()] = feats.value.decode() if feats.value != NULL else ""
        feats += 1
    return out


cdef int _require_cpu() except -1:
    if _cpu_reg == NULL:
        raise GGMLError("no CPU backend is loaded (toy_ggml loads one at import; see toy_ggml.cpu_variant())")
    return 0


def proc_address(reg_name, fn_name):
    """The address of the entry point ``fn_name`` that the registered backend
    ``reg_name`` hands out (ggml_backend_reg_get_proc_address), as an integer;
    0 when that backend has none by that name. For calling a backend's own
    extensions from Python (ctypes), such as the CUDA module's
    toy_cuda_supports_op (patch 0024, tools/cuda_fallbacks.py). Raises
    GGMLError when no backend of that name is registered."""
    cdef bytes f = str(fn_name).encode()
    cdef ggml_backend_reg_t reg = NULL
    cdef size_t i
    for i in range(ggml_backend_reg_count()):
        if ggml_backend_reg_name(ggml_backend_reg_get(i)).decode() == str(reg_name):
            reg = ggml_backend_reg_get(i)
            break
    if reg == NULL:
        raise GGMLError(f"no backend named {reg_name!r} is registered")
    return <uintptr_t>ggml_backend_reg_get_proc_address(reg, f)
