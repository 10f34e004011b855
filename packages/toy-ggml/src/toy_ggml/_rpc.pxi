# Remote devices over ggml's RPC backend (libggml-rpc.so, toy patch 0023).
#
# rpc_connect_raw("HOST:PORT") connects to a toy rpc-server, checks its
# protocol and returns its devices ("RPC0", "RPC1"... numbered in connection
# order within this process). They are not put in ggml's device registry, so
# devices() and Runtime(device="auto") never see them (an RPC device reports
# itself as a GPU); a Runtime takes them by name through extra_devices. The
# connection is made on demand and shared by everything on one endpoint; the
# patch marks it dead when a command fails or times out (TOY_RPC_TIMEOUT), and
# Runtime and Tensor turn that into RPCError. rpc_serve_raw serves this
# process's CPU backend to such clients.

cdef dict _rpc_devices = {}   # lower-case device name -> ggml_backend_dev_t (address)


cdef bint _dev_is_rpc(ggml_backend_dev_t d) noexcept:
    return _rpc_reg != NULL and d != NULL and ggml_backend_dev_backend_reg(d) == _rpc_reg


cdef ggml_backend_dev_t _find_device(str name) noexcept:
    """A device by name (any case): a connected remote one, else one of ggml's registry."""
    cdef size_t i
    cdef ggml_backend_dev_t d
    want = name.lower()
    a = _rpc_devices.get(want)
    if a is not None:
        return <ggml_backend_dev_t><uintptr_t>a
    for i in range(ggml_backend_dev_count()):
        d = ggml_backend_dev_get(i)
        if ggml_backend_dev_name(d).decode().lower() == want:
            return d
    return NULL


cdef ggml_backend_t _start_device(ggml_backend_dev_t d) noexcept:
    """ggml_backend_dev_init; for a remote device, on a connection proven
    alive by one round trip (one opened earlier may have died unnoticed:
    then a fresh one)."""
    cdef ggml_backend_t b
    cdef size_t free_b = 0, total_b = 0
    cdef int attempt
    with nogil:
        b = ggml_backend_dev_init(d, NULL)
    if b == NULL or not _dev_is_rpc(d):
        return b
    for attempt in range(2):
        with nogil:
            ggml_backend_dev_memory(d, &free_b, &total_b)
        if _rpc_backend_error(b) == NULL:
            return b
        ggml_backend_free(b)
        with nogil:
            b = ggml_backend_dev_init(d, NULL)
        if b == NULL:
            return NULL
    return b


def _known_device_names():
    cdef size_t i
    names = [ggml_backend_dev_name(ggml_backend_dev_get(i)).decode() for i in range(ggml_backend_dev_count())]
    names += [ggml_backend_dev_name(<ggml_backend_dev_t><uintptr_t>a).decode() for a in _rpc_devices.values()]
    return names


cdef str _rpc_reconnect_error(str endpoint):
    """Why a connection to ``endpoint`` cannot be made now (a fresh try)."""
    cdef char err[512]
    cdef bytes ep = endpoint.encode()
    cdef const char * cep = ep
    cdef ggml_backend_reg_t reg
    err[0] = 0
    with nogil:
        reg = _rpc_connect(cep, err, sizeof(err))
    if reg != NULL:
        return "the connection failed and a new one works: make a new Runtime"
    return err.decode("utf-8", "replace") or "cannot connect"


def rpc_available():
    """Whether this build carries ggml's RPC backend (toy's, patch 0023)."""
    return _rpc_reg != NULL


cdef int _require_rpc() except -1:
    if _rpc_reg == NULL:
        raise GGMLError("this toy_ggml build has no RPC backend (libggml-rpc.so beside libggml); "
                        "rebuild toy-ggml")
    return 0


def rpc_connect_raw(str endpoint):
    """Connect to a toy rpc-server at ``endpoint`` ("HOST:PORT") and return
    its devices as devices_raw() rows (kind "rpc"). RPCError says why not."""
    _require_rpc()
    cdef char err[512]
    cdef bytes ep = endpoint.encode()
    cdef const char * cep = ep
    cdef ggml_backend_reg_t reg
    cdef ggml_backend_dev_t d
    cdef size_t i, free_b, total_b
    err[0] = 0
    with nogil:
        reg = _rpc_connect(cep, err, sizeof(err))
    if reg == NULL:
        raise RPCError(f"RPC server {endpoint}: {err.decode('utf-8', 'replace') or 'cannot connect'}", endpoint)
    rows = []
    reg_name = ggml_backend_reg_name(reg).decode()
    for i in range(ggml_backend_reg_dev_count(reg)):
        d = ggml_backend_reg_dev_get(reg, i)
        name = ggml_backend_dev_name(d).decode()
        free_b = 0
        total_b = 0
        with nogil:
            ggml_backend_dev_memory(d, &free_b, &total_b)
        _rpc_devices[name.lower()] = <uintptr_t>d
        index = int(name[3:]) if name[3:].isdigit() else -1
        rows.append((index, name, ggml_backend_dev_description(d).decode(), "rpc", free_b, total_b, reg_name))
    return rows


cdef void _rpc_ready(void * user_data) noexcept with gil:
    try:
        (<object>user_data)()
    except BaseException:
        _log.exception("rpc_serve: the on_ready callback failed")


def rpc_serve_raw(str endpoint, int threads, cache_dir=None, on_ready=None):
    """Serve this process's CPU backend on ``endpoint`` ("IPv4:PORT") with
    ``threads`` threads, the GIL released; ``on_ready()`` is called once
    listening. Returns only by raising (GGMLError: cannot listen...)."""
    _require_rpc()
    _require_cpu()
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    cdef char err[512]
    cdef bytes ep = endpoint.encode()
    cdef bytes cd = str(cache_dir).encode() if cache_dir is not None else b""
    cdef const char * cep = ep
    cdef const char * ccd = NULL
    cdef ggml_backend_dev_t devs[1]
    cdef toy_rpc_ready_t ready = NULL
    cdef void * ud = <void *>on_ready
    cdef size_t n = threads
    cdef int rc
    if cache_dir is not None:
        ccd = cd
    if on_ready is not None:
        ready = <toy_rpc_ready_t>_rpc_ready
    devs[0] = _cpu_dev
    err[0] = 0
    with nogil:
        rc = _rpc_serve(cep, ccd, n, 1, devs, ready, ud, err, sizeof(err))
    raise GGMLError(f"RPC server on {endpoint}: {err.decode('utf-8', 'replace') or f'stopped (status {rc})'}")
