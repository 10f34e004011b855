# Buffers, contexts (the tensor-creating half) and tensors.
#
# Shapes are in NumPy order everywhere in Python: a tensor of NumPy shape
# (B, T, C) is ggml ne = [C, T, B, 1]. Tensors remember how many dimensions
# they were made with (ggml only stores four extents).
#
# Contexts never hold tensor data (ggml no_alloc mode): data lives in backend
# buffers, allocated with Context.allocate(), bound from user memory with
# Tensor.bind(), or placed by a Runtime's scheduler when a graph is computed.

from toy_ggml.dtypes import GGMLType

cdef set _readonly_buffers = set()   # addresses of ggml buffers over read-only memory

_NP_OF_TYPE = {
    <int>GGML_TYPE_F32: np.float32, <int>GGML_TYPE_F16: np.float16, 28: np.float64,
    24: np.int8, 25: np.int16, <int>GGML_TYPE_I32: np.int32, <int>GGML_TYPE_I64: np.int64,
}

DEF TENSOR_ALIGNMENT = 32  # ggml's CPU buffer alignment


cdef class Buffer(_Handle):
    """A ggml backend buffer: the memory tensors point into.

    Made by Context.allocate() (owned by that context) or by
    buffer_from_memory() over Python memory such as an mmap (zero-copy; the
    Python object is kept alive as long as the buffer)."""
    cdef ggml_backend_buffer_t ptr
    cdef bint _readonly
    cdef Py_buffer _view
    cdef bint _has_view

    def __cinit__(self):
        self.ptr = NULL
        self._has_view = False

    cdef void _free_resources(self) noexcept:
        if self.ptr != NULL:
            _readonly_buffers.discard(<uintptr_t>self.ptr)
            ggml_backend_buffer_free(self.ptr)
            self.ptr = NULL
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False

    def __dealloc__(self):
        if not self._freed:
            self._freed = True
            self._free_resources()

    @property
    def name(self):
        self._check_open()
        return ggml_backend_buffer_name(self.ptr).decode()

    @property
    def size(self):
        self._check_open()
        return ggml_backend_buffer_get_size(self.ptr)

    @property
    def is_host(self):
        self._check_open()
        return bool(ggml_backend_buffer_is_host(self.ptr))

    @property
    def readonly(self):
        return self._readonly

    def __repr__(self):
        if self._closed:
            return "<Buffer closed>"
        return f"<Buffer {self.name} {self.size} bytes{' read-only' if self._readonly else ''}>"


cdef Buffer _wrap_buffer(ggml_backend_buffer_t ptr, bint readonly):
    cdef Buffer b = Buffer.__new__(Buffer)
    b.ptr = ptr
    b._readonly = readonly
    if readonly:
        _readonly_buffers.add(<uintptr_t>ptr)
    return b


def buffer_from_memory(obj, bint weights=False):
    """Wrap Python memory (bytes, bytearray, mmap, NumPy array…) as a CPU
    buffer without copying. Read-only memory gives a read-only buffer: tensors
    bound into it refuse writes. The memory must be 32-byte aligned (mmap
    pages are). ``weights``: mark the buffer as holding weights, so that a
    scheduler with other devices (Runtime's ``extra_devices``) runs the ops
    that read them on the CPU (see ``Context.allocate``)."""
    cdef Buffer b = Buffer.__new__(Buffer)
    PyObject_GetBuffer(obj, &b._view, PyBUF_SIMPLE)
    b._has_view = True
    if b._view.len <= 0:
        b.close()
        raise ValueError("buffer_from_memory: the memory is empty")
    if (<uintptr_t>b._view.buf) % TENSOR_ALIGNMENT != 0:
        addr = <uintptr_t>b._view.buf
        b.close()
        raise ValueError(f"buffer_from_memory: address {addr:#x} is not {TENSOR_ALIGNMENT}-byte aligned")
    b.ptr = ggml_backend_cpu_buffer_from_ptr(b._view.buf, <size_t>b._view.len)
    if b.ptr == NULL:
        b.close()
        raise GGMLError("ggml_backend_cpu_buffer_from_ptr failed")
    b._readonly = bool(b._view.readonly)
    if b._readonly:
        _readonly_buffers.add(<uintptr_t>b.ptr)
    if weights:
        ggml_backend_buffer_set_usage(b.ptr, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
    return b


cdef bint _is_repack_buffer(ggml_backend_buffer * buf) noexcept:
    """Whether ``buf`` is one of ggml's CPU_REPACK buffers (weights in an interleaved layout that
    only the CPU backend's products read; no get_tensor)."""
    return buf != NULL and ggml_backend_buft_name(ggml_backend_buffer_get_type(<ggml_backend_buffer_t>buf)) == b"CPU_REPACK"


cdef int _check_rpc_buffer(ggml_tensor * t) except -1:
    """RPCError when ``t`` lives on a remote device whose connection failed
    (a read then left the data as it was, a write went nowhere)."""
    cdef const char * err
    if _rpc_buffer_error == NULL or t.buffer == NULL:
        return 0
    err = _rpc_buffer_error(t.buffer)
    if err != NULL:
        name = ggml_backend_buffer_name(t.buffer).decode()   # RPC<n>[HOST:PORT]
        endpoint = name[name.find("[") + 1:len(name) - 1] if name.endswith("]") else ""
        raise RPCError(f"RPC buffer {name}: {err.decode('utf-8', 'replace')}", endpoint)
    return 0


# --------------------------------------------------------------------------

cdef inline int _shape_to_ne(object shape, int64_t * ne) except -1:
    """NumPy-order shape -> ggml ne[4]; returns ndim."""
    cdef int nd, i
    cdef int64_t total = 1, v
    if isinstance(shape, int):
        shape = (shape,)
    nd = len(shape)
    if nd < 1 or nd > 4:
        raise ValueError(f"shape {tuple(shape)}: ggml tensors have 1 to 4 dimensions")
    for i in range(4):
        ne[i] = 1
    for i in range(nd):
        v = shape[nd - 1 - i]
        if v < 0:
            raise ValueError(f"shape {tuple(shape)}: negative extent {v}")
        if v > 0 and total > (<int64_t>1 << 62) // v:
            raise ValueError(f"shape {tuple(shape)}: too many elements")
        total *= v
        ne[i] = v
    return nd


cdef class _ContextBase(_Handle):
    """A ggml context: metadata for up to ``max_tensors`` tensors and the
    graphs built over them. See Context for the ops."""
    cdef ggml_context * ptr
    cdef size_t _overhead
    cdef list _buffers
    cdef readonly int max_tensors
    # the default of ``Context.mul_mat``'s ``gemm`` for this context's products
    cdef public bint gemm
    # whether sum_sqr and a scaled opt_step_adamw build toy's own ops (patch 0017; True) or the standard
    # ops they equal (False: for a runtime whose backends lack them, ``Runtime.toy_ops``); False also
    # makes Graph.build_backward build standard ops only (patch 0025)
    cdef public bint toy_ops

    def __cinit__(self, int max_tensors=1024, int graph_size=0, *args, **kwargs):
        self.ptr = NULL
        self._buffers = []
        self.gemm = False
        self.toy_ops = True

    def __init__(self, int max_tensors=1024, int graph_size=0):
        """``max_tensors``: tensors (op results included) the context holds
        at least; ``graph_size``: nodes per graph to reserve room for
        (default: 2 x max_tensors, at least 2048). The memory for two graphs
        with gradients is shared with tensors, so a context with few graphs
        holds more than max_tensors tensors. Running out raises GGMLError."""
        cdef ggml_init_params params
        if max_tensors < 1 or max_tensors > 10_000_000:
            raise ValueError(f"max_tensors={max_tensors}: must be in 1..10000000")
        if graph_size <= 0:
            graph_size = max(2048, 2 * max_tensors)
        self.max_tensors = max_tensors
        self._overhead = ggml_tensor_overhead()
        params.mem_size = max_tensors * self._overhead + 2 * ggml_graph_overhead_custom(graph_size, True) + 4096
        params.mem_buffer = NULL
        params.no_alloc = True
        self.ptr = ggml_init(params)
        if self.ptr == NULL:
            raise MemoryError("ggml_init failed")

    cdef void _free_resources(self) noexcept:
        cdef Buffer b
        for b in self._buffers:
            b._n_dependents -= 1
            b._maybe_free()
        self._buffers = []
        if self.ptr != NULL:
            ggml_free(self.ptr)
            self.ptr = NULL

    def __dealloc__(self):
        if self.ptr != NULL:
            ggml_free(self.ptr)
            self.ptr = NULL

    cdef inline int _room(self, int n_tensors) except -1:
        if self._closed:
            raise ClosedError("Context is closed")
        if ggml_get_mem_size(self.ptr) - ggml_used_mem(self.ptr) < n_tensors * self._overhead:
            raise GGMLError(
                f"Context is full ({ggml_used_mem(self.ptr)} of {ggml_get_mem_size(self.ptr)} bytes of "
                f"tensor metadata used); create it with a larger max_tensors (now {self.max_tensors})")
        return 0

    cdef inline int _use(self, Tensor t) except -1:
        # A tensor from another context: keep that context (and its memory) alive.
        if t.ctx is not self:
            if t.ctx._closed:
                raise ClosedError("tensor's Context is closed")
            self._add_dep(t.ctx)
        return 0

    cdef int _own_buffer(self, Buffer b) except -1:
        for x in self._buffers:
            if x is b:
                return 0
        self._buffers.append(b)
        b._n_dependents += 1
        return 0

    @property
    def used_bytes(self):
        self._check_open()
        return ggml_used_mem(self.ptr)

    @property
    def mem_bytes(self):
        self._check_open()
        return ggml_get_mem_size(self.ptr)

    def tensor(self, dtype, shape, name=None):
        """A new leaf tensor (no data yet) of ggml type ``dtype`` and NumPy
        ``shape``. For block-quantized types the last extent must be a
        multiple of the block size."""
        cdef int64_t ne[4]
        cdef int nd, t = int(dtype)
        if not _type_valid(t):
            raise ValueError(f"unknown ggml type {dtype!r}")
        nd = _shape_to_ne(shape, ne)
        cdef int64_t blck = ggml_blck_size(<ggml_type>t)
        if ne[0] % blck != 0:
            raise ValueError(
                f"shape {tuple(shape)}: last extent {ne[0]} is not a multiple of the "
                f"{ggml_type_name(<ggml_type>t).decode()} block size {blck}")
        self._room(1)
        cdef ggml_tensor * p = ggml_new_tensor(self.ptr, <ggml_type>t, 4, ne)
        cdef Tensor r = _wrap(self, p, nd)
        if name is not None:
            r.name = name
        return r

    def tensors(self):
        """All tensors in this context, in creation order."""
        self._check_open()
        out = []
        cdef ggml_tensor * p = ggml_get_first_tensor(self.ptr)
        while p != NULL:
            out.append(_wrap(self, p, max(1, ggml_n_dims(p))))
            p = ggml_get_next_tensor(self.ptr, p)
        return out

    def get(self, str name):
        """The tensor called ``name``; KeyError if none."""
        self._check_open()
        b = name.encode()
        cdef ggml_tensor * p = ggml_get_tensor(self.ptr, b)
        if p == NULL:
            raise KeyError(name)
        return _wrap(self, p, max(1, ggml_n_dims(p)))

    def allocate(self, runtime=None, device=None, bint weights=False, bint repack=False):
        """Give every tensor of this context that has no memory yet its own
        memory in one buffer on ``runtime``'s primary device (CPU when None),
        or on its device ``device`` (a name from ``runtime.backends``, a
        device name such as "RPC0", or "cpu"). ``weights``: mark the buffer
        as holding weights, so that the scheduler runs the ops that read them
        on their device (how a model is split between devices). ``repack``:
        the buffer is ggml's CPU_REPACK type (``runtime`` needed, no
        ``device``): each tensor's data, set once whole with ``set_raw``, is
        stored in the interleaved layout of the CPU's repacked product
        kernels, which only a product reading the tensor as its first
        operand can use; every tensor must have such a layout
        (``Runtime.repack_layout``) and none can be read back. Returns the
        Buffer (owned by this context), or None if nothing needed memory."""
        self._check_open()
        if device is not None and runtime is None:
            raise ValueError("allocate(device=...) needs the runtime that has that device")
        if repack and (runtime is None or device is not None):
            raise ValueError("allocate(repack=True) needs the runtime and no device (the weights go to its CPU)")
        cdef ggml_backend_buffer_type_t buft
        cdef ggml_backend_buffer_t buf
        cdef ggml_tensor * p = ggml_get_first_tensor(self.ptr)
        cdef bint need = False
        while p != NULL:
            if p.data == NULL and p.view_src == NULL:
                need = True
                break
            p = ggml_get_next_tensor(self.ptr, p)
        if not need:
            return None
        if repack:
            buft = (<Runtime?>runtime)._repack_buft()
            if buft == NULL:
                raise GGMLError("this CPU backend has no repacked layouts (no CPU_REPACK buffer type)")
            p = ggml_get_first_tensor(self.ptr)
            while p != NULL:
                if p.data == NULL and p.view_src == NULL and not _repack_layout(buft, <int>p.type, p.ne[0], p.ne[1], p.ne[2]):
                    raise GGMLError(f"tensor {p.name.decode()!r} ({ggml_type_name(p.type).decode()}, "
                                    f"{p.ne[1]} rows of {p.ne[0]}) has no repacked layout on this CPU")
                p = ggml_get_next_tensor(self.ptr, p)
        elif runtime is None:
            buft = ggml_backend_cpu_buffer_type()
        else:
            buft = (<Runtime?>runtime)._buft_for(device)
        with nogil:
            buf = ggml_backend_alloc_ctx_tensors_from_buft(self.ptr, buft)
        if buf == NULL:
            if runtime is not None:
                (<Runtime>runtime)._check_rpc()
            raise MemoryError("could not allocate a buffer for the context's tensors")
        if weights:
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        cdef Buffer b = _wrap_buffer(buf, False)
        self._own_buffer(b)
        b._closed = True   # freed with the context, never on its own
        if runtime is not None:
            self._add_dep(<Runtime>runtime)
        return b

    def __repr__(self):
        if self._closed:
            return "<Context closed>"
        return f"<Context {ggml_used_mem(self.ptr)}/{ggml_get_mem_size(self.ptr)} bytes>"


# --------------------------------------------------------------------------

@cython.freelist(256)
cdef class Tensor:
    """A tensor of a Context. Holds its context (and so its memory) alive."""
    cdef ggml_tensor * ptr
    cdef _ContextBase ctx
    cdef int _ndim

    def __init__(self):
        raise TypeError("tensors are made by a Context (ctx.tensor(...) or an op)")

    cdef inline int _ok(self) except -1:
        if self.ctx._closed:
            raise ClosedError("the tensor's Context is closed")
        return 0

    @property
    def ndim(self):
        return self._ndim

    @property
    def shape(self):
        self._ok()
        cdef int i
        return tuple([self.ptr.ne[self._ndim - 1 - i] for i in range(self._ndim)])

    @property
    def strides(self):
        """Byte strides in NumPy order (rows of quantized types are blocks)."""
        self._ok()
        cdef int i
        return tuple([self.ptr.nb[self._ndim - 1 - i] for i in range(self._ndim)])

    @property
    def ne(self):
        """ggml's own extents, innermost first, always four."""
        self._ok()
        return (self.ptr.ne[0], self.ptr.ne[1], self.ptr.ne[2], self.ptr.ne[3])

    @property
    def dtype(self):
        self._ok()
        return GGMLType(<int>self.ptr.type)

    @property
    def size(self):
        self._ok()
        return ggml_nelements(self.ptr)

    @property
    def nbytes(self):
        self._ok()
        return ggml_nbytes(self.ptr)

    @property
    def name(self):
        self._ok()
        return ggml_get_name(self.ptr).decode("utf-8", "replace")

    @name.setter
    def name(self, str value):
        self._ok()
        b = value.encode()
        if len(b) >= GGML_MAX_NAME:
            raise ValueError(f"tensor name {value!r} is longer than {GGML_MAX_NAME - 1} bytes")
        ggml_set_name(self.ptr, b)

    @property
    def op(self):
        """Name of the op that makes this tensor ('NONE' for a leaf)."""
        self._ok()
        if self.ptr.op == GGML_OP_UNARY:
            return "UNARY:" + ggml_unary_op_name(ggml_get_unary_op(self.ptr)).decode()
        if self.ptr.op == GGML_OP_GLU:
            return "GLU:" + ggml_glu_op_name(ggml_get_glu_op(self.ptr)).decode()
        return ggml_op_name(self.ptr.op).decode()

    @property
    def is_contiguous(self):
        self._ok()
        return bool(ggml_is_contiguous(self.ptr))

    @property
    def allocated(self):
        """Whether the tensor has memory (a buffer) yet."""
        self._ok()
        return self.ptr.buffer != NULL and self.ptr.data != NULL

    @property
    def readonly(self):
        self._ok()
        return self.ptr.buffer != NULL and (<uintptr_t>self.ptr.buffer) in _readonly_buffers

    @property
    def device(self):
        """Name of the buffer the data lives in, or None before allocation."""
        self._ok()
        if self.ptr.buffer == NULL:
            return None
        return ggml_backend_buffer_name(self.ptr.buffer).decode()

    @property
    def context(self):
        return self.ctx

    @property
    def address(self):
        """The ggml_tensor pointer as an integer (identity across wrappers)."""
        return <uintptr_t>self.ptr

    @property
    def op_params(self):
        """ggml's ``op_params`` of this node: its 16 int32 words, as the op
        stored them (floats by their bits). For reading a graph's switches
        from outside, such as patch 0004's row-invariant hint in word 1 of a
        MUL_MAT (tools/cuda_fallbacks.py)."""
        self._ok()
        cdef int i
        return tuple([self.ptr.op_params[i] for i in range(16)])

    @property
    def sources(self):
        """The tensors this op reads (ggml's ``src``), in order, without the
        empty slots; () for a leaf. For reading a graph's structure (a step
        trace's layer grouping); the wrappers share this tensor's context."""
        self._ok()
        cdef int i
        cdef ggml_tensor * q
        out = []
        for i in range(GGML_MAX_SRC):
            q = self.ptr.src[i]
            if q != NULL:
                out.append(_wrap(self.ctx, q, max(1, ggml_n_dims(q))))
        return tuple(out)

    @property
    def view_source(self):
        """The tensor whose memory this view reads (ggml's ``view_src``), or None."""
        self._ok()
        cdef ggml_tensor * q = self.ptr.view_src
        if q == NULL:
            return None
        return _wrap(self.ctx, q, max(1, ggml_n_dims(q)))

    def __eq__(self, other):
        return isinstance(other, Tensor) and (<Tensor>other).ptr == self.ptr

    def __hash__(self):
        return hash(<uintptr_t>self.ptr)

    # flags
    def set_input(self):
        self._ok(); ggml_set_input(self.ptr); return self

    def set_output(self):
        self._ok(); ggml_set_output(self.ptr); return self

    def set_param(self):
        """Mark as a trainable parameter (gradients are computed for it)."""
        self._ok()
        if self.ptr.type != GGML_TYPE_F32 and self.ptr.type != GGML_TYPE_F16:
            raise TypeError(f"a parameter must be F32 or F16, not {self.dtype.name}")
        ggml_set_param(self.ptr)
        return self

    def set_loss(self):
        """Mark as the loss: a scalar F32 tensor."""
        self._ok()
        if self.ptr.type != GGML_TYPE_F32 or ggml_nelements(self.ptr) != 1:
            raise ValueError(f"the loss must be a scalar F32 tensor, got {self.dtype.name} {self.shape}")
        ggml_set_loss(self.ptr)
        return self

    @property
    def is_param(self):
        self._ok()
        return bool(self.ptr.flags & GGML_TENSOR_FLAG_PARAM)

    # ---- data

    cdef int _need_data(self) except -1:
        self._ok()
        if self.ptr.buffer == NULL or self.ptr.data == NULL:
            raise GGMLError(f"tensor {self.name!r} has no memory yet (allocate its context, bind it, "
                            "or compute its graph on a Runtime)")
        return 0

    cdef int _need_readable(self) except -1:
        self._need_data()
        if _is_repack_buffer(self.ptr.buffer):
            raise GGMLError(f"tensor {self.name!r} holds weights repacked into the CPU's interleaved layout "
                            "(Context.allocate(repack=True)); ggml cannot read them back: read the file instead")
        return 0

    def numpy(self):
        """A copy of the data as a NumPy array of the tensor's shape.
        For BF16 and quantized types use to_float() or raw()."""
        self._need_readable()
        t = <int>self.ptr.type
        npt = _NP_OF_TYPE.get(t)
        if npt is None:
            raise TypeError(f"{self.dtype.name} has no NumPy dtype: use to_float() or raw()")
        if not ggml_is_contiguous(self.ptr):
            raise ValueError("tensor is not contiguous: read a cont() of it")
        out = np.empty(self.shape, dtype=npt)
        cdef cnp.ndarray arr = out
        cdef size_t n = ggml_nbytes(self.ptr)
        with nogil:
            ggml_backend_tensor_get(self.ptr, <void *>cnp.PyArray_DATA(arr), 0, n)
        _check_rpc_buffer(self.ptr)
        return out

    def raw(self):
        """A copy of the bytes as a uint8 array (any type)."""
        self._need_readable()
        if not ggml_is_contiguous(self.ptr):
            raise ValueError("tensor is not contiguous: read a cont() of it")
        cdef size_t n = ggml_nbytes(self.ptr)
        out = np.empty(n, dtype=np.uint8)
        cdef cnp.ndarray arr = out
        with nogil:
            ggml_backend_tensor_get(self.ptr, <void *>cnp.PyArray_DATA(arr), 0, n)
        _check_rpc_buffer(self.ptr)
        return out

    def to_float(self):
        """A float32 copy of the data, dequantized through ggml for quantized
        and half types."""
        self._ok()
        t = <int>self.ptr.type
        if t == <int>GGML_TYPE_F32:
            return self.numpy()
        raw = self.raw()
        return dequantize(raw, t, self.shape)

    def set(self, array):
        """Copy ``array`` (same shape; same kind of number) into the tensor."""
        self._need_data()
        if self.readonly:
            raise ValueError(f"tensor {self.name!r} lives in read-only memory")
        t = <int>self.ptr.type
        npt = _NP_OF_TYPE.get(t)
        if npt is None:
            raise TypeError(f"{self.dtype.name} has no NumPy dtype: use set_raw() or set_float()")
        a = np.asarray(array)
        shape = self.shape
        if a.shape != shape:
            raise ValueError(f"array shape {a.shape} does not match tensor shape {shape}")
        if a.dtype != npt:
            src_kind, dst_kind = a.dtype.kind, np.dtype(npt).kind
            if not (src_kind == dst_kind or (src_kind in "iub" and dst_kind in "iuf")):
                raise TypeError(f"cannot store {a.dtype} data in a {self.dtype.name} tensor")
            if src_kind in "iu" and dst_kind in "iu" and a.size and (
                    a.min() < np.iinfo(npt).min or a.max() > np.iinfo(npt).max):
                raise ValueError(f"values out of range for {self.dtype.name}")
        if not ggml_is_contiguous(self.ptr):
            raise ValueError("tensor is not contiguous")
        cdef cnp.ndarray c = np.ascontiguousarray(a, dtype=npt)
        cdef size_t n = ggml_nbytes(self.ptr)
        with nogil:
            ggml_backend_tensor_set(self.ptr, <const void *>cnp.PyArray_DATA(c), 0, n)
        _check_rpc_buffer(self.ptr)

    def set_raw(self, data):
        """Copy raw bytes (exactly nbytes of them) into the tensor. Quantized
        rows are checked with ggml_validate_row_data first."""
        self._need_data()
        if self.readonly:
            raise ValueError(f"tensor {self.name!r} lives in read-only memory")
        if not ggml_is_contiguous(self.ptr):
            raise ValueError("tensor is not contiguous")
        cdef cnp.ndarray c = np.ascontiguousarray(np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8))
        cdef size_t n = ggml_nbytes(self.ptr)
        if <size_t>c.shape[0] != n:
            raise ValueError(f"got {c.shape[0]} bytes, tensor holds {n}")
        cdef const void * src = <const void *>cnp.PyArray_DATA(c)
        cdef ggml_tensor * t = self.ptr
        cdef bint valid
        with nogil:  # both can take a while on a large weight (a repacked layout is built here): other threads run
            valid = ggml_validate_row_data(t.type, src, n)
            if valid:
                ggml_backend_tensor_set(t, src, 0, n)
        if not valid:
            raise ValueError(f"data is not valid {self.dtype.name} (NaN/inf scales or values)")
        _check_rpc_buffer(self.ptr)

    def set_float(self, array):
        """Store float data, quantizing through ggml for quantized types."""
        a = np.ascontiguousarray(array, dtype=np.float32)
        if a.shape != self.shape:
            raise ValueError(f"array shape {a.shape} does not match tensor shape {self.shape}")
        if <int>self.ptr.type == <int>GGML_TYPE_F32:
            self.set(a)
        else:
            self.set_raw(quantize(a, <int>self.ptr.type))

    def host_view(self):
        """A zero-copy NumPy view of host memory (CPU buffers, mmaps).
        Read-only where the memory is read-only; keeps the tensor (and its
        memory) alive."""
        self._need_data()
        if not ggml_backend_buffer_is_host(self.ptr.buffer):
            raise GGMLError("tensor memory is not on the host: use numpy()")
        t = <int>self.ptr.type
        npt = _NP_OF_TYPE.get(t)
        if npt is None or not ggml_is_contiguous(self.ptr):
            raise TypeError("host_view needs a contiguous tensor of a NumPy-representable type")
        mv = _HostMemory.make(self, self.readonly)
        arr = np.frombuffer(mv, dtype=npt).reshape(self.shape)
        return arr

    def bind(self, Buffer buffer, size_t offset):
        """Point this (unallocated, non-view) tensor at ``offset`` bytes into
        ``buffer`` without copying. The context keeps the buffer alive."""
        self._ok()
        buffer._check_open()
        if self.ptr.buffer != NULL or self.ptr.data != NULL:
            raise GGMLError(f"tensor {self.name!r} already has memory")
        if self.ptr.view_src != NULL:
            raise GGMLError("a view cannot be bound; bind its source")
        cdef size_t n = ggml_nbytes(self.ptr)
        cdef size_t size = ggml_backend_buffer_get_size(buffer.ptr)
        if offset > size or n > size - offset:
            raise ValueError(f"tensor {self.name!r} ({n} bytes at offset {offset}) does not fit "
                             f"in the buffer ({size} bytes)")
        cdef char * base = <char *>ggml_backend_buffer_get_base(buffer.ptr)
        _check_status(ggml_backend_tensor_alloc(buffer.ptr, self.ptr, base + offset), "ggml_backend_tensor_alloc")
        self.ctx._own_buffer(buffer)

    def __repr__(self):
        if self.ctx._closed:
            return "<Tensor (context closed)>"
        return f"<Tensor {self.name!r} {self.dtype.name} {self.shape} op={self.op}>"


cdef class _HostMemory:
    """Exports a tensor's host memory through the buffer protocol."""
    cdef Tensor t
    cdef bint ro

    @staticmethod
    cdef _HostMemory make(Tensor t, bint ro):
        cdef _HostMemory m = _HostMemory.__new__(_HostMemory)
        m.t = t
        m.ro = ro
        # the exported memory pins the context: close() waits for the views
        t.ctx._n_dependents += 1
        return m

    def __dealloc__(self):
        if self.t is not None:
            self.t.ctx._n_dependents -= 1
            self.t.ctx._maybe_free()

    def __getbuffer__(self, Py_buffer * view, int flags):
        if self.ro and (flags & PyBUF_WRITABLE):
            raise BufferError("read-only memory")
        self.t._need_readable()
        view.buf = self.t.ptr.data
        view.len = ggml_nbytes(self.t.ptr)
        view.readonly = 1 if self.ro else 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = NULL
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        view.obj = self

    def __releasebuffer__(self, Py_buffer * view):
        pass


cdef inline Tensor _wrap(_ContextBase ctx, ggml_tensor * p, int ndim):
    cdef Tensor t = Tensor.__new__(Tensor)
    t.ptr = p
    t.ctx = ctx
    t._ndim = ndim
    return t
