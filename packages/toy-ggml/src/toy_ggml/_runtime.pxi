# Devices and the Runtime: a chosen backend plus the CPU backend (always the
# fallback) under one ggml scheduler, with a persistent CPU thread pool; and
# optionally extra devices (remote ones over RPC, _rpc.pxi) in the same
# scheduler, which runs each op where its weights live.
#
# The device is data: Runtime(device="CUDA0") or "cpu" or "auto"; model code
# never branches on it. Tensors the scheduler gave memory (op results without
# memory of their own) stay readable until the Runtime allocates another
# graph; then they lose it (reading raises) and get it back when their graph is
# computed again.

import weakref

_KIND = {GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
         GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
         GGML_BACKEND_DEVICE_TYPE_META: "meta"}


def devices_raw():
    """[(index, name, description, kind, free_bytes, total_bytes, backend)]"""
    cdef size_t i, free_b, total_b
    cdef ggml_backend_dev_t d
    out = []
    for i in range(ggml_backend_dev_count()):
        d = ggml_backend_dev_get(i)
        free_b = 0; total_b = 0
        ggml_backend_dev_memory(d, &free_b, &total_b)
        out.append((i, ggml_backend_dev_name(d).decode(), ggml_backend_dev_description(d).decode(),
                    _KIND.get(<int>ggml_backend_dev_type(d), "other"), free_b, total_b,
                    ggml_backend_reg_name(ggml_backend_dev_backend_reg(d)).decode()))
    return out


_OLD_FEATURE_KEYS = ("sse3", "avx", "avx2", "f16c", "fma", "avx512", "avx512_vnni", "avx512_bf16",
                     "amx_int8", "neon", "llamafile")


def cpu_features():
    """CPU features the loaded CPU backend variant was compiled with and uses
    (name -> bool; lower-case names of ggml's feature list)."""
    feats = {k.lower(): v not in ("", "0") for k, v in cpu_backend_features().items()}
    out = {k: feats.get(k, False) for k in _OLD_FEATURE_KEYS}
    out.update({k: v for k, v in feats.items() if k not in out})
    return out


cdef struct _NodeTimes:
    int n, cap
    int64_t start
    ggml_tensor ** nodes
    int64_t * ns


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef c_bool _time_node(ggml_tensor * t, c_bool ask, void * user_data) noexcept nogil:
    """The scheduler's eval callback for Runtime.compute(profile=True): ask
    for every node (so each is computed alone), time from the ask to the
    call after its compute."""
    cdef _NodeTimes * p = <_NodeTimes *>user_data
    if ask:
        p.start = _now_ns()
        return True
    if p.n < p.cap:
        p.nodes[p.n] = t
        p.ns[p.n] = _now_ns() - p.start
        p.n += 1
    return True


ctypedef ggml_backend_buffer_type_t * (*_extra_bufts_fn)(ggml_backend_dev_t) noexcept nogil


cdef bint _repack_layout(ggml_backend_buffer_type_t buft, int t, int64_t ne0, int64_t ne1, int64_t ne2) except -1:
    """Whether ggml's CPU_REPACK buffer type ``buft`` gives a tensor of type ``t`` and extents
    ``ne0..ne2`` a repacked layout: a metadata-only tensor is allocated in it (the pages are never
    touched) and its ``extra`` (the layout's traits, set by the buffer's init_tensor) read."""
    if t < 0 or t >= GGML_TYPE_COUNT or ggml_blck_size(<ggml_type>t) == 0 or ne0 % ggml_blck_size(<ggml_type>t):
        return False
    cdef ggml_init_params params
    params.mem_size = 2 * ggml_tensor_overhead() + 256
    params.mem_buffer = NULL
    params.no_alloc = True
    cdef ggml_context * ctx = ggml_init(params)
    if ctx == NULL:
        raise MemoryError("ggml_init failed")
    cdef int64_t ne[3]
    ne[0] = ne0
    ne[1] = ne1
    ne[2] = ne2
    cdef ggml_tensor * p = ggml_new_tensor(ctx, <ggml_type>t, 3, ne)
    cdef ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    cdef bint ok = buf != NULL and p.extra != NULL
    if buf != NULL:
        ggml_backend_buffer_free(buf)
    ggml_free(ctx)
    return ok


cdef class Runtime(_Handle):
    """Backends + scheduler + thread pool. ``device``: a device name from
    devices() (case-insensitive), "cpu", or "auto" (the first GPU, else the
    CPU). ``threads``: CPU threads (>= 1). One thread uses a Runtime at a
    time (a second concurrent compute raises). ``poll`` (0..100): how long
    the pool's threads spin waiting for the next graph before they sleep;
    ggml's default 50 keeps a core busy for ~0.2 s after every compute (it
    slows whatever else runs on the machine); 0, toy's default, sleeps at
    once, which costs a thread wake-up (microseconds) per compute.
    ``adaptive``: before each compute, use only as many of the ``threads``
    as the machine's load leaves cores for (``toy_ggml.load``: sampled every
    0.5 s; at least one); for graphs whose result does not depend on the
    thread count (inference), never for training. ``active_threads`` says
    how many the last compute used."""
    cdef ggml_backend_t _primary
    cdef ggml_backend_t _cpu
    cdef list _extras             # extra backends (addresses), in the order given
    cdef ggml_backend_sched_t _sched
    cdef ggml_threadpool_t _tp
    cdef int _sched_size
    cdef readonly int threads
    cdef readonly int active_threads
    cdef readonly bint adaptive
    cdef object _sampler          # toy_ggml.load.LoadSampler when adaptive
    cdef readonly str device
    cdef object _current          # (weakref to graph, version) allocated in the scheduler
    cdef bint _busy               # a compute is running (GIL released)
    cdef list _backend_addrs

    def __cinit__(self, *args, **kwargs):
        self._primary = NULL
        self._cpu = NULL
        self._extras = []
        self._sched = NULL
        self._tp = NULL
        self._current = None
        self._busy = False

    def __init__(self, device="auto", int threads=1, int graph_size=8192, int poll=0, bint adaptive=False,
                 extra_devices=()):
        cdef size_t i
        cdef ggml_backend_dev_t d, chosen = NULL
        cdef ggml_backend_t eb
        if isinstance(extra_devices, str):
            raise TypeError("extra_devices is a sequence of device names, not one string")
        extra_names = [str(x) for x in extra_devices]
        if threads < 1 or threads > 512:
            raise ValueError(f"threads={threads} must be in 1..512")
        if poll < 0 or poll > 100:
            raise ValueError(f"poll={poll} must be in 0..100")
        if device is None:
            device = "auto"
        want = str(device).lower()
        names = []
        for i in range(ggml_backend_dev_count()):
            d = ggml_backend_dev_get(i)
            nm = ggml_backend_dev_name(d).decode()
            names.append(nm)
            dkind = <int>ggml_backend_dev_type(d)
            if want == "auto":
                if chosen == NULL and (dkind == <int>GGML_BACKEND_DEVICE_TYPE_GPU or dkind == <int>GGML_BACKEND_DEVICE_TYPE_IGPU):
                    chosen = d
            elif want == "cpu":
                if dkind == <int>GGML_BACKEND_DEVICE_TYPE_CPU and chosen == NULL:
                    chosen = d
            elif nm.lower() == want:
                chosen = d
        if chosen == NULL and want not in ("auto", "cpu"):
            raise ValueError(f"unknown device {device!r}; available: {', '.join(names) or 'none'}")
        _require_cpu()
        self._cpu = ggml_backend_dev_init(_cpu_dev, NULL)
        if self._cpu == NULL:
            raise GGMLError("could not start the CPU backend")
        if chosen != NULL and ggml_backend_dev_type(chosen) != GGML_BACKEND_DEVICE_TYPE_CPU:
            self._primary = ggml_backend_dev_init(chosen, NULL)
            if self._primary == NULL:
                ggml_backend_free(self._cpu)
                self._cpu = NULL
                raise GGMLError(f"could not start device {ggml_backend_dev_name(chosen).decode()}")
            self.device = ggml_backend_dev_name(chosen).decode()
        else:
            self._primary = self._cpu
            self.device = "CPU"
        # ggml's scheduler takes at most 16 backends (GGML_SCHED_MAX_BACKENDS), the CPU and primary among them
        max_extra = 15 if self._primary == self._cpu else 14
        if len(extra_names) > max_extra:
            raise ValueError(f"at most {max_extra} extra devices here (got {len(extra_names)})")
        seen = {self.device.lower(), "cpu"}
        for nm in extra_names:
            d = _find_device(nm)
            if d == NULL:
                raise ValueError(f"unknown extra device {nm!r}; known: "
                                 f"{', '.join(_known_device_names()) or 'none'} (remote devices come from "
                                 "toy_ggml.rpc_connect(\"HOST:PORT\"))")
            dn = ggml_backend_dev_name(d).decode()
            if dn.lower() in seen:
                raise ValueError(f"device {dn} is given twice (or is the primary device)")
            seen.add(dn.lower())
            eb = _start_device(d)
            if eb == NULL:
                if _dev_is_rpc(d):
                    endpoint = ggml_backend_dev_description(d).decode()
                    raise RPCError(f"RPC device {dn} ({endpoint}): {_rpc_reconnect_error(endpoint)}", endpoint)
                raise GGMLError(f"could not start device {dn}")
            self._extras.append(<uintptr_t>eb)
        self._check_rpc()
        self.threads = threads
        self.active_threads = threads
        self.adaptive = adaptive and threads > 1
        if self.adaptive:
            from toy_ggml.load import shared_sampler  # lazy: a Python module of this package
            self._sampler = shared_sampler()
        _cpu_set_n_threads(self._cpu, threads)
        cdef ggml_threadpool_params tpp
        if threads > 1:
            tpp = ggml_threadpool_params_default(threads)
            tpp.poll = poll
            self._tp = _tp_new(&tpp)
            if self._tp != NULL:
                _cpu_set_tp(self._cpu, self._tp)
        self._backend_addrs = [<uintptr_t>self._primary] + list(self._extras)
        if self._primary != self._cpu:
            self._backend_addrs.append(<uintptr_t>self._cpu)
        self._make_sched(max(graph_size, 1024))

    cdef void _release_current(self) noexcept:
        # the graph allocated last loses its scheduler memory (reused next)
        if self._current is not None:
            _forget_sched_memory(self._current[0]())
            self._current = None

    cdef int _make_sched(self, int size) except -1:
        # priority order: the primary device, the extra devices, the CPU last
        # (ggml's rule: the last backend is the CPU, where anything can run)
        cdef ggml_backend_t bk[16]
        cdef int n = 0
        self._release_current()
        if self._sched != NULL:
            ggml_backend_sched_free(self._sched)
            self._sched = NULL
        if self._primary != self._cpu:
            bk[n] = self._primary
            n += 1
        for a in self._extras:
            bk[n] = <ggml_backend_t><uintptr_t>a
            n += 1
        bk[n] = self._cpu
        n += 1
        self._sched = ggml_backend_sched_new(bk, NULL, n, size, False, True)
        if self._sched == NULL:
            raise GGMLError("could not create the backend scheduler")
        self._sched_size = size
        self._current = None
        return 0

    cdef void _free_resources(self) noexcept:
        if self._sched != NULL:
            ggml_backend_sched_free(self._sched)
            self._sched = NULL
        if self._cpu != NULL and self._tp != NULL:
            _cpu_set_tp(self._cpu, NULL)
        if self._tp != NULL:
            _tp_free(self._tp)
            self._tp = NULL
        # None when the garbage collector cleared this object's attributes before its dealloc (a Runtime
        # in a reference cycle, freed by gc): nothing to iterate then (the process is usually exiting)
        for a in self._extras or ():
            ggml_backend_free(<ggml_backend_t><uintptr_t>a)
        self._extras = []
        if self._primary != NULL and self._primary != self._cpu:
            ggml_backend_free(self._primary)
        self._primary = NULL
        if self._cpu != NULL:
            ggml_backend_free(self._cpu)
            self._cpu = NULL

    def __dealloc__(self):
        if not self._freed:
            self._freed = True
            self._free_resources()

    def close(self):
        """Release the backends (deferred while contexts computed here live)."""
        if self._busy:
            raise GGMLError("cannot close a Runtime while it computes")
        _Handle.close(self)

    cdef ggml_backend_buffer_type_t _primary_buft(self) except NULL:
        self._check_open()
        return ggml_backend_get_default_buffer_type(self._primary)

    cdef list _all_backends(self):
        """Addresses of the backends in the order of ``backends``."""
        out = [<uintptr_t>self._primary] + self._extras
        if self._primary != self._cpu:
            out.append(<uintptr_t>self._cpu)
        return out

    cdef ggml_backend_t _backend_named(self, str name) except NULL:
        """The backend called ``name`` (its backend name as in ``backends``,
        its device name, or "cpu"; any case)."""
        self._check_open()
        cdef ggml_backend_t b
        want = name.lower()
        if want == "cpu":
            return self._cpu
        for a in self._all_backends():
            b = <ggml_backend_t><uintptr_t>a
            if (ggml_backend_name(b).decode().lower() == want
                    or ggml_backend_dev_name(ggml_backend_get_device(b)).decode().lower() == want):
                return b
        raise ValueError(f"this runtime has no device {name!r}; it has {', '.join(self.backends)}")

    cdef ggml_backend_buffer_type_t _repack_buft(self) noexcept:
        """The CPU device's CPU_REPACK extra buffer type (from its registry's
        ggml_backend_dev_get_extra_bufts), or NULL."""
        if self._cpu == NULL:
            return NULL
        cdef ggml_backend_dev_t dev = ggml_backend_get_device(self._cpu)
        cdef void * f = ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                          b"ggml_backend_dev_get_extra_bufts")
        if f == NULL:
            return NULL
        cdef ggml_backend_buffer_type_t * bufts = (<_extra_bufts_fn>f)(dev)
        cdef int i = 0
        while bufts != NULL and bufts[i] != NULL:
            if strcmp(ggml_backend_buft_name(bufts[i]), b"CPU_REPACK") == 0:
                return bufts[i]
            i += 1
        return NULL

    def repack_layout(self, dtype, shape):
        """Whether the CPU backend (the variant loaded for this CPU) stores a
        weight of ``dtype`` and ``shape`` (NumPy order: (rows, columns), or
        (matrices, rows, columns)) in an interleaved layout with its own
        product kernels (ggml's repacked types: Q4_0, IQ4_NL, Q4_K on AVX2
        and AVX-512 x86, Q2_K on AVX-512, MXFP4, ...; rows a multiple of
        the layout's width), as ggml itself decides for the tensor."""
        self._check_open()
        if isinstance(dtype, str):
            from toy_ggml.dtypes import GGMLType
            dtype = GGMLType.parse(dtype)
        cdef int t = int(dtype)
        if not _type_valid(t):
            raise ValueError(f"unknown ggml type {dtype!r}")
        dims = [int(d) for d in shape]
        if not 2 <= len(dims) <= 3 or min(dims) < 1:
            raise ValueError(f"shape {shape!r}: a weight is 2-D or 3-D")
        cdef int64_t ne0 = dims[len(dims) - 1]
        cdef int64_t ne1 = dims[len(dims) - 2]
        cdef int64_t ne2 = dims[0] if len(dims) == 3 else 1
        cdef ggml_backend_buffer_type_t buft = self._repack_buft()
        if buft == NULL:
            return False
        return _repack_layout(buft, t, ne0, ne1, ne2)

    cdef ggml_backend_buffer_type_t _buft_for(self, object device) except NULL:
        """The buffer type of the backend named ``device`` (None: the primary)."""
        self._check_open()
        if device is None:
            return ggml_backend_get_default_buffer_type(self._primary)
        cdef ggml_backend_t b = self._backend_named(str(device))
        self._check_rpc()
        cdef ggml_backend_buffer_type_t buft
        with nogil:
            buft = ggml_backend_get_default_buffer_type(b)
        if buft == NULL:
            self._check_rpc()
            raise GGMLError(f"device {device!r} has no buffer type")
        return buft

    cdef int _check_rpc(self) except -1:
        """RPCError when the connection under a remote device of this runtime
        failed (toy patch 0023 marks it dead: a command failed or timed out)."""
        cdef ggml_backend_t b
        cdef const char * err
        if _rpc_backend_error == NULL:
            return 0
        for a in self._extras:
            b = <ggml_backend_t><uintptr_t>a
            err = _rpc_backend_error(b)
            if err != NULL:
                d = ggml_backend_get_device(b)
                endpoint = ggml_backend_dev_description(d).decode()
                raise RPCError(f"RPC device {ggml_backend_dev_name(d).decode()} ({endpoint}): "
                               f"{err.decode('utf-8', 'replace')}", endpoint)
        return 0

    @property
    def backends(self):
        """Names of the backends: the primary first, then the extra devices
        in the order given, then the CPU when it is not the primary. The
        scheduler prefers them in this order, except that the CPU always
        comes last (a CPU primary runs the ops the others do not take)."""
        self._check_open()
        return [ggml_backend_name(<ggml_backend_t><uintptr_t>a).decode() for a in self._all_backends()]

    @property
    def extra_devices(self):
        """Device names of the extra devices (``extra_devices`` as given,
        in ggml's spelling)."""
        self._check_open()
        return [ggml_backend_dev_name(ggml_backend_get_device(<ggml_backend_t><uintptr_t>a)).decode()
                for a in self._extras]

    def device_memory(self, str name):
        """``(free, total)`` bytes of the device behind backend ``name`` (a
        name from ``backends``, a device name, or "cpu"), as ggml reports
        it; a remote device asks its server (zeros when it cannot)."""
        cdef ggml_backend_t b = self._backend_named(name)
        cdef ggml_backend_dev_t d = ggml_backend_get_device(b)
        cdef size_t free_b = 0, total_b = 0
        with nogil:
            ggml_backend_dev_memory(d, &free_b, &total_b)
        return free_b, total_b

    @property
    def cpu_gemm(self):
        """Whether products hinted for toy's CPU GEMM (``Context.mul_mat``'s
        ``gemm``, patch 0011) run as such here: True when every backend runs
        toy's own CPU kernels, i.e. the CPU is the primary and every extra
        device is remote (a ``toy rpc-server`` serves its CPU); a GPU would
        not know the hint."""
        self._check_open()
        if self._primary != self._cpu:
            return False
        for a in self._extras:
            if not _dev_is_rpc(ggml_backend_get_device(<ggml_backend_t><uintptr_t>a)):
                return False
        return True

    @property
    def toy_ops(self):
        """Whether every backend here has toy's own ops (patch 0017's SUM_SQR
        and OPT_STEP_ADAMW_SCALED): True when every backend runs toy's CPU
        kernels (as ``cpu_gemm``). Graph builders set their contexts'
        ``toy_ops`` from it, so that a GPU gets the standard ops those equal
        (``Context.sum_sqr``, ``Context.opt_step_adamw``) and a backward of
        standard ops (``Graph.build_backward``, patch 0025) instead of nodes
        it would leave to the CPU."""
        return self.cpu_gemm

    cdef int _prepare(self, Graph graph) except -1:
        self._check_open()
        graph._ok()
        self._check_rpc()
        cdef bint current = (self._current is not None and self._current[0]() is graph
                             and self._current[1] == graph.version)
        if not current:
            _restore_srcs(graph)   # before anything reads its nodes' sources
        if graph._validated_for != (self, graph.version):
            graph._validate(self._backend_addrs, self)
        if self._busy:
            raise GGMLError("this Runtime is computing in another thread; use one Runtime per thread")
        if current:
            return 0
        cdef int need = ggml_graph_n_nodes(graph.ptr) + graph._n_leafs + 16
        if need * 2 > self._sched_size:
            self._make_sched(need * 2)
        # A graph allocated earlier keeps pointers into scheduler memory that a
        # later allocation reused or freed; ggml would skip such tensors as
        # "allocated" and compute into freed memory. Forget them first.
        self._release_current()
        _forget_sched_memory(graph)
        cdef ggml_tensor * t
        owned = []
        for a in graph._seen:
            t = <ggml_tensor *><uintptr_t>a
            if t.data == NULL or (t.view_src != NULL and t.buffer == NULL):
                owned.append(a)
        if self._extras or self._primary != self._cpu:
            _record_srcs(graph)   # the split below may repoint sources (undone when released)
        ggml_backend_sched_reset(self._sched)
        cdef bint ok
        self._busy = True
        try:
            with nogil:
                ok = ggml_backend_sched_alloc_graph(self._sched, graph.ptr)
        finally:
            self._busy = False
        if not ok:
            self._current = None
            self._check_rpc()
            raise MemoryError("the scheduler could not allocate the graph's tensors")
        graph._sched_owned = owned
        self._current = (weakref.ref(graph), graph.version)
        graph.ctx._add_dep(self)   # its tensors now point into our buffers
        return 0

    def allocate(self, Graph graph):
        """Give the graph's unallocated tensors memory (so inputs can be set
        before compute). compute() does this itself when needed."""
        self._prepare(graph)

    def compute(self, Graph graph, bint profile=False):
        """Compute the graph (GIL released). Leaf index tensors feeding
        get_rows / set_rows / mul_mat_id are range-checked first.

        ``profile``: compute node by node and return each node's wall time,
        a list of ``(op, name, seconds)`` in graph order (``op`` as ggml
        describes it: ``MUL_MAT``, ``SILU``, ...; views and reshapes take
        ~0). The scheduler then starts the thread pool once per node, so the
        total is somewhat above an unprofiled compute; the shares are what
        the profile is for. Returns None without ``profile``."""
        self._prepare(graph)
        if graph._index_checks:
            graph._check_indices()
        cdef int n_active
        if self._sampler is not None:
            n_active = self._sampler.threads(self.threads)
            if n_active != self.active_threads:
                _cpu_set_n_threads(self._cpu, n_active)
                if self._tp != NULL:
                    # one thread: no pool (its sleeping threads would be woken by
                    # every compute for nothing); ggml pauses it and resumes it
                    # at the next compute that has it again
                    _cpu_set_tp(self._cpu, self._tp if n_active > 1 else NULL)
                self.active_threads = n_active
        cdef ggml_status st
        cdef _NodeTimes prof
        cdef int i
        prof.n = 0
        prof.cap = ggml_graph_n_nodes(graph.ptr) if profile else 0
        prof.nodes = NULL
        prof.ns = NULL
        if profile:
            prof.nodes = <ggml_tensor **>malloc(max(prof.cap, 1) * sizeof(ggml_tensor *))
            prof.ns = <int64_t *>malloc(max(prof.cap, 1) * sizeof(int64_t))
            if prof.nodes == NULL or prof.ns == NULL:
                free(prof.nodes)
                free(prof.ns)
                raise MemoryError("profile buffers")
            ggml_backend_sched_set_eval_callback(self._sched, _time_node, &prof)
        self._busy = True
        try:
            with nogil:
                st = ggml_backend_sched_graph_compute(self._sched, graph.ptr)
        finally:
            self._busy = False
            if profile:
                ggml_backend_sched_set_eval_callback(self._sched, NULL, NULL)
        try:
            # a remote device that failed during the compute (its commands are
            # asynchronous, so the status may still say success)
            if self._extras:
                try:
                    self._check_rpc()
                except RPCError:
                    self._current = None
                    raise
            if st != GGML_STATUS_SUCCESS:
                self._current = None
                _check_status(st, "graph compute")
            if not profile:
                return None
            return [
                (ggml_op_desc(prof.nodes[i]).decode(), ggml_get_name(prof.nodes[i]).decode(errors="replace"),
                 prof.ns[i] * 1e-9)
                for i in range(prof.n)
            ]
        finally:
            free(prof.nodes)
            free(prof.ns)

    def n_splits(self):
        """How many backend splits the last allocated graph needed."""
        self._check_open()
        return ggml_backend_sched_get_n_splits(self._sched)

    def __repr__(self):
        if self._closed:
            return "<Runtime closed>"
        return (f"<Runtime device={self.device} threads={self.threads}{' adaptive' if self.adaptive else ''} "
                f"backends={self.backends}>")
