# Graphs: forward and backward building with the checks ggml would abort on.
#
# ggml asserts when a graph overflows its node capacity and aborts when a
# backward pass meets an op without a gradient. Both are checked here first:
# build_forward counts the tensors it is about to add, and build_backward
# walks the graph against an allow-list (BACKWARD_OPS / BACKWARD_UNARY_OPS,
# which mirror the cases of ggml_compute_backward in our patched tree; a test
# parses that source and compares).

from toy_ggml.errors import UnsupportedBackwardError

# ggml_op_name() names of ops whose backward ggml 0.25.3 (+ toy patches) has.
BACKWARD_OPS = frozenset({
    "NONE", "DUP", "ADD", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG",
    "SIN", "COS", "SUM", "SUM_ROWS", "MEAN", "REPEAT", "REPEAT_BACK", "RMS_NORM",
    "NORM", "MUL_MAT", "SCALE", "SET", "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE",
    "TRANSPOSE", "GET_ROWS", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "ROPE",
    "IM2COL", "POOL_2D", "CROSS_ENTROPY_LOSS", "UNARY", "GLU", "MUL_MAT_ID", "CLAMP",
})
# ggml_unary_op_name() names with a backward case.
BACKWARD_UNARY_OPS = frozenset({
    "ABS", "SGN", "NEG", "STEP", "RELU", "SILU", "EXP", "EXPM1", "SOFTPLUS", "GELU",
    "GELU_ERF", "TANH",
})
# ggml_glu_op_name() names with a backward case (split form only).
BACKWARD_GLU_OPS = frozenset({"SWIGLU"})

# Tensors a backward pass may create per forward node (upper bounds: GELU's
# composed derivative makes about 14, NORM's about 12, GELU_ERF's about 10).
cdef int _BACKWARD_TENSORS_PER_NODE = 24

cdef dict _OP_ID = {}
cdef dict _UNARY_ID = {}
cdef dict _GLU_ID = {}
for _i in range(<int>GGML_OP_COUNT):
    _OP_ID[ggml_op_name(<ggml_op>_i).decode()] = _i
for _i in range(<int>GGML_UNARY_OP_COUNT):
    _UNARY_ID[ggml_unary_op_name(<ggml_unary_op>_i).decode()] = _i
for _i in range(<int>GGML_GLU_OP_COUNT):
    _GLU_ID[ggml_glu_op_name(<ggml_glu_op>_i).decode()] = _i

cdef set _BW_OPS = {_OP_ID[n] for n in BACKWARD_OPS}
cdef set _BW_UNARY = {_UNARY_ID[n] for n in BACKWARD_UNARY_OPS}
cdef set _BW_GLU = {_GLU_ID[n] for n in BACKWARD_GLU_OPS}
cdef set _VIEW_OPS = {_OP_ID[n] for n in ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")}
cdef int _OP_GET_ROWS = _OP_ID["GET_ROWS"]
cdef int _OP_SET_ROWS = _OP_ID["SET_ROWS"]
cdef int _OP_MUL_MAT_ID = _OP_ID["MUL_MAT_ID"]
cdef int _OP_SOFT_MAX = _OP_ID["SOFT_MAX"]
cdef int _OP_ROPE = _OP_ID["ROPE"]
cdef int _OP_XENT = _OP_ID["CROSS_ENTROPY_LOSS"]
cdef int _OP_OPT_ADAMW = _OP_ID["OPT_STEP_ADAMW"]
cdef int _OP_SUB = _OP_ID["SUB"]
cdef int _OP_DIV = _OP_ID["DIV"]
cdef int _OP_MUL_MAT = _OP_ID["MUL_MAT"]
# views and the in-place ops ggml's backward accepts (ggml_build_backward_expand)
cdef set _INPLACE_OK = {_OP_ID[n] for n in ("CPY", "SET_ROWS", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")}
# ops whose I32 output is an index into their input's rows: (op id -> index bound = src0.ne[0])
cdef set _INDEX_PRODUCERS = {_OP_ID[n] for n in ("ARGMAX", "TOP_K", "ARGSORT")}
cdef set _INDEX_PASSTHROUGH = {_OP_ID[n] for n in ("VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "CONT", "CPY",
                                                  "REPEAT")}
# indices counted by ARANGE (start, stop, step in its op params): the backward of patch 0025 makes them
cdef int _OP_ARANGE = _OP_ID["ARANGE"]
# srcs whose gradient ggml never computes (indices, positions, copy targets)
cdef dict _IGNORED_SRC = {
    _OP_ID["CPY"]: (1,), _OP_GET_ROWS: (1,), _OP_ID["GET_ROWS_BACK"]: (1,), _OP_ROPE: (1,),
    _OP_ID["IM2COL"]: (0,), _OP_ID["IM2COL_BACK"]: (0,), _OP_MUL_MAT_ID: (2,),
}


cdef str _node_desc(ggml_tensor * t):
    cdef str op = ggml_op_name(t.op).decode()
    if t.op == GGML_OP_UNARY:
        op = "UNARY:" + ggml_unary_op_name(ggml_get_unary_op(t)).decode()
    elif t.op == GGML_OP_GLU:
        op = "GLU:" + ggml_glu_op_name(ggml_get_glu_op(t)).decode()
    name = t.name.decode("utf-8", "replace")
    return f"{op} ({name!r})" if name else op


cdef class Graph:
    """A ggml compute graph in a Context. ``size``: node capacity;
    ``grads``: room for gradients (needed by build_backward)."""
    cdef ggml_cgraph * ptr
    cdef readonly Context ctx
    cdef readonly int size
    cdef readonly bint grads
    cdef set _seen
    cdef int _n_nodes
    cdef int _n_leafs
    cdef bint _has_backward
    cdef public int version            # bumped on every change (runtimes re-allocate)
    cdef object _validated_for         # Runtime the graph was last checked for
    cdef list _index_checks            # [(Tensor idx, bound, desc)] data-dependent ranges
    cdef list _sched_owned             # addresses of tensors a Runtime's scheduler gave memory
    cdef list _src_record              # each node's src pointers before a scheduler split the graph
    cdef object __weakref__

    def __init__(self, Context ctx, int size=2048, bint grads=False):
        ctx._check_open()
        if size < 1 or size > 10_000_000:
            raise ValueError(f"graph size {size} must be in 1..10000000")
        cdef size_t need = ggml_graph_overhead_custom(size, grads)
        if ggml_get_mem_size(ctx.ptr) - ggml_used_mem(ctx.ptr) < need:
            raise GGMLError(f"Context has no room for a graph of size {size} ({need} bytes); "
                            "create the Context with a larger graph_size or max_tensors")
        self.ctx = ctx
        self.size = size
        self.grads = grads
        self.ptr = ggml_new_graph_custom(ctx.ptr, size, grads)
        self._seen = set()
        self._n_nodes = 0
        self._n_leafs = 0
        self._has_backward = False
        self.version = 0
        self._validated_for = None
        self._index_checks = None
        self._sched_owned = []
        self._src_record = None

    cdef inline int _ok(self) except -1:
        if self.ctx._closed:
            raise ClosedError("the graph's Context is closed")
        return 0

    def build_forward(self, *tensors):
        """Add ``tensors`` and everything they depend on, in dependency order."""
        self._ok()
        cdef Tensor t
        cdef ggml_tensor * p
        cdef ggml_tensor * s
        cdef int i, add_nodes = 0, add_leafs = 0
        cdef list stack
        cdef set new = set()
        for obj in tensors:
            t = <Tensor?>obj
            t._ok()
            self.ctx._use(t)
            stack = [<uintptr_t>t.ptr]
            while stack:
                addr = stack.pop()
                if addr in self._seen or addr in new:
                    continue
                new.add(addr)
                p = <ggml_tensor *><uintptr_t>addr
                if p.op == GGML_OP_NONE and not (p.flags & GGML_TENSOR_FLAG_PARAM):
                    add_leafs += 1
                else:
                    add_nodes += 1
                for i in range(GGML_MAX_SRC):
                    s = p.src[i]
                    if s != NULL:
                        stack.append(<uintptr_t>s)
        if self._n_nodes + add_nodes >= self.size or self._n_leafs + add_leafs >= self.size:
            raise GGMLError(f"graph of size {self.size} cannot hold {self._n_nodes + add_nodes} nodes and "
                            f"{self._n_leafs + add_leafs} leafs; create the Graph with a larger size")
        for obj in tensors:
            ggml_build_forward_expand(self.ptr, (<Tensor>obj).ptr)
        self._seen |= new
        self._n_nodes = ggml_graph_n_nodes(self.ptr)
        self._n_leafs += add_leafs
        self.version += 1
        return self

    def build_backward(self):
        """Add the backward pass for the loss tensor(s) (set_loss) with respect
        to every parameter (set_param). Raises UnsupportedBackwardError naming
        the op where ggml has no gradient, instead of letting ggml abort."""
        self._ok()
        if not self.grads:
            raise GGMLError("build_backward needs a Graph made with grads=True")
        if self._has_backward:
            raise GGMLError("the backward pass is already built")
        cdef int n = ggml_graph_n_nodes(self.ptr), i, j
        if n == 0:
            raise GGMLError("build_backward: the graph is empty; call build_forward(loss) first")
        cdef ggml_tensor * node
        cdef ggml_tensor * s
        cdef bint any_param = False, any_loss = False
        needs = set()     # addresses of nodes depending on a parameter
        for i in range(n):
            node = ggml_graph_node(self.ptr, i)
            if node.flags & GGML_TENSOR_FLAG_PARAM:
                any_param = True
                needs.add(<uintptr_t>node)
            if node.flags & GGML_TENSOR_FLAG_LOSS:
                any_loss = True
            if node.type == GGML_TYPE_I32:
                continue
            ignored = _IGNORED_SRC.get(<int>node.op, ())
            if node.op == GGML_OP_UNARY and ggml_unary_op_name(ggml_get_unary_op(node)) in (b"SGN", b"STEP"):
                ignored = (0,)
            for j in range(GGML_MAX_SRC):
                s = node.src[j]
                if s != NULL and j not in ignored and (<uintptr_t>s) in needs:
                    if s.type != GGML_TYPE_F32 and s.type != GGML_TYPE_F16:
                        raise UnsupportedBackwardError(
                            f"gradient would flow into a {ggml_type_name(s.type).decode()} tensor at "
                            f"{_node_desc(node)}; only F32/F16 tensors take gradients")
                    needs.add(<uintptr_t>node)
                    break
            if ((<uintptr_t>node) in needs or (node.flags & GGML_TENSOR_FLAG_LOSS)) and node.view_src != NULL \
                    and <int>node.op not in _INPLACE_OK:
                raise UnsupportedBackwardError(
                    f"{_node_desc(node)} writes in place into a tensor that needs a gradient; "
                    "ggml's backward does not support in-place ops")
        if not any_param:
            raise GGMLError("build_backward: no parameter in the graph (call set_param on the weights)")
        if not any_loss:
            raise GGMLError("build_backward: no loss in the graph (call set_loss on the loss)")
        # nodes that lead to a loss
        reaches = set()
        for i in range(n - 1, -1, -1):
            node = ggml_graph_node(self.ptr, i)
            if (node.flags & GGML_TENSOR_FLAG_LOSS) or (<uintptr_t>node) in reaches:
                reaches.add(<uintptr_t>node)
                for j in range(GGML_MAX_SRC):
                    if node.src[j] != NULL:
                        reaches.add(<uintptr_t>node.src[j])
        cdef int n_bw = 0
        for i in range(n):
            node = ggml_graph_node(self.ptr, i)
            a = <uintptr_t>node
            if a not in needs or a not in reaches:
                continue
            n_bw += 1
            _check_backward_node(node, needs)
        if ggml_get_mem_size(self.ctx.ptr) - ggml_used_mem(self.ctx.ptr) < \
                <size_t>(n_bw * _BACKWARD_TENSORS_PER_NODE) * ggml_tensor_overhead():
            raise GGMLError(f"Context has too little room for the backward pass of {n_bw} nodes; "
                            f"create it with max_tensors >= {n_bw * _BACKWARD_TENSORS_PER_NODE + n}")
        if n + n_bw * _BACKWARD_TENSORS_PER_NODE >= self.size:
            raise GGMLError(f"graph of size {self.size} may be too small for the backward pass; "
                            f"create it with size >= {n + n_bw * _BACKWARD_TENSORS_PER_NODE + 1}")
        # toy patch 0025: a context whose ops are for backends without toy's own (a GPU) gets a
        # backward of standard ops only
        ggml_toy_set_standard_backward(self.ctx.ptr, not self.ctx.toy_ops)
        ggml_build_backward_expand(self.ctx.ptr, self.ptr, NULL)
        self._has_backward = True
        self._n_nodes = ggml_graph_n_nodes(self.ptr)
        # backward tensors are new: later build_forward must not count them
        # twice, and the Runtime must know every tensor the scheduler gives
        # memory to, the new leafs included (the loss gradient seed): one it
        # did not know would keep a stale pointer into scheduler memory after
        # another graph was allocated, and the next compute would read or
        # write whatever now lives there
        for i in range(self._n_nodes):
            node = ggml_graph_node(self.ptr, i)
            self._seen.add(<uintptr_t>node)
            for j in range(GGML_MAX_SRC):
                if node.src[j] != NULL:
                    self._seen.add(<uintptr_t>node.src[j])
        self.version += 1
        return self

    def grad(self, Tensor t):
        """The gradient tensor of ``t`` (after build_backward), or None."""
        self._ok()
        if not self._has_backward:
            raise GGMLError("no backward pass built")
        cdef ggml_tensor * g = ggml_graph_get_grad(self.ptr, t.ptr)
        if g == NULL:
            return None
        return _wrap(self.ctx, g, t._ndim)

    def reset(self):
        """Zero the gradients and set the loss gradient to 1 (the graph must
        be allocated, e.g. by Runtime.allocate)."""
        self._ok()
        if not self._has_backward:
            raise GGMLError("no backward pass built")
        cdef int i
        cdef ggml_tensor * g
        for i in range(ggml_graph_n_nodes(self.ptr)):
            node = ggml_graph_node(self.ptr, i)
            g = ggml_graph_get_grad(self.ptr, node)
            if g != NULL and (g.buffer == NULL or g.data == NULL):
                raise GGMLError("reset: the graph's gradients have no memory yet (Runtime.allocate first)")
        ggml_graph_reset(self.ptr)

    def log(self):
        """Describe the graph (nodes, shapes, ops) through ggml's own printer,
        which writes to the ``toy_ggml`` logger at INFO level."""
        self._ok()
        ggml_graph_print(self.ptr)

    @property
    def n_nodes(self):
        self._ok()
        return ggml_graph_n_nodes(self.ptr)

    @property
    def nodes(self):
        """The graph's nodes (op results and parameters) in compute order."""
        self._ok()
        cdef int i
        cdef ggml_tensor * p
        out = []
        for i in range(ggml_graph_n_nodes(self.ptr)):
            p = ggml_graph_node(self.ptr, i)
            out.append(_wrap(self.ctx, p, max(1, ggml_n_dims(p))))
        return out

    cdef int _validate(self, list backends, object runtime) except -1:
        """Once per (graph version, runtime): every node runs somewhere, every
        tensor with memory lives where a device of the runtime can use it,
        no node writes into read-only memory, collect data-dependent index
        checks."""
        cdef int i, k
        cdef ggml_tensor * node
        cdef ggml_tensor * root
        cdef ggml_backend_buffer_t tbuf
        cdef uintptr_t b
        cdef bint ok
        checks = []
        # ggml's scheduler aborts on a tensor in a buffer no backend of it takes
        # (memory of another device: a remote one this runtime was not given)
        for a in self._seen:
            node = <ggml_tensor *><uintptr_t>a
            tbuf = node.view_src.buffer if node.view_src != NULL else node.buffer
            if tbuf == NULL:
                continue
            ok = False
            for k in range(len(backends)):
                if (ggml_backend_supports_buft(<ggml_backend_t><uintptr_t>backends[k], ggml_backend_buffer_get_type(tbuf))
                        and ggml_backend_supports_op(<ggml_backend_t><uintptr_t>backends[k], node)):
                    ok = True
                    break
            if not ok:
                raise GGMLError(f"tensor {node.name.decode('utf-8', 'replace')!r} lives in a "
                                f"{ggml_backend_buffer_name(tbuf).decode()} buffer, which no device of this runtime "
                                f"can use for {_node_desc(node)}; give the runtime that device (extra_devices)")
        for i in range(ggml_graph_n_nodes(self.ptr)):
            node = ggml_graph_node(self.ptr, i)
            if node.op == GGML_OP_NONE:
                continue
            ok = False
            for k in range(len(backends)):
                if ggml_backend_supports_op(<ggml_backend_t><uintptr_t>backends[k], node):
                    ok = True
                    break
            if not ok:
                srcs = ", ".join(ggml_type_name(node.src[k].type).decode() for k in range(GGML_MAX_SRC) if node.src[k] != NULL)
                raise GGMLError(f"no device of this runtime can run {_node_desc(node)} with inputs ({srcs})")
            # writes into read-only memory
            if <int>node.op not in _VIEW_OPS:
                targets = []
                if node.view_src != NULL:
                    targets.append(<uintptr_t>node.view_src)
                if <int>node.op == _OP_OPT_ADAMW:
                    for k in (0, 2, 3):
                        targets.append(<uintptr_t>node.src[k])
                for ta in targets:
                    root = <ggml_tensor *><uintptr_t>ta
                    while root.view_src != NULL:
                        root = root.view_src
                    if root.buffer != NULL and (<uintptr_t>root.buffer) in _readonly_buffers:
                        raise GGMLError(f"{_node_desc(node)} would write into read-only memory "
                                        f"(tensor {root.name.decode('utf-8', 'replace')!r})")
            # data-dependent indices (ggml asserts on them mid-compute)
            if <int>node.op == _OP_GET_ROWS:
                _index_check(checks, node, node.src[1], node.src[0].ne[1])
            elif <int>node.op == _OP_SET_ROWS:
                # ggml_set_rows stores src = (rows, indices, destination)
                _index_check(checks, node, node.src[1], node.src[2].ne[1])
            elif <int>node.op == _OP_MUL_MAT_ID:
                _index_check(checks, node, node.src[2], node.src[0].ne[2])
        self._index_checks = checks
        self._validated_for = (runtime, self.version)
        return 0

    cdef int _check_indices(self) except -1:
        cdef ggml_tensor * t
        cdef cnp.ndarray arr
        for addr, bound, desc in self._index_checks:
            t = <ggml_tensor *><uintptr_t>addr
            if t.buffer == NULL or t.data == NULL:
                raise GGMLError(f"{desc}: index tensor {t.name.decode('utf-8', 'replace')!r} has no data")
            n = ggml_nelements(t)
            if n == 0:
                continue
            arr = np.empty(n, dtype=np.int32 if t.type == GGML_TYPE_I32 else np.int64)
            ggml_backend_tensor_get(t, cnp.PyArray_DATA(arr), 0, ggml_nbytes(t))
            lo = arr.min(); hi = arr.max()
            if lo < 0 or hi >= bound:
                raise IndexError(f"{desc}: index {lo if lo < 0 else hi} in "
                                 f"{t.name.decode('utf-8', 'replace')!r} is out of range 0..{bound - 1}")
        return 0

    def __repr__(self):
        if self.ctx._closed:
            return "<Graph (context closed)>"
        return f"<Graph {ggml_graph_n_nodes(self.ptr)}/{self.size} nodes{' +backward' if self._has_backward else ''}>"


cdef void _forget_sched_memory(Graph g) noexcept:
    """Drop the pointers a scheduler set in g's tensors: that memory is about
    to be reused or freed. Reading such a tensor then raises instead of
    touching freed memory, and the next allocation gives it memory again.
    Also give its nodes back the sources a scheduler's split replaced."""
    cdef ggml_tensor * t
    if g is None or g.ctx is None or g.ctx._freed:
        return
    for a in g._sched_owned:
        t = <ggml_tensor *><uintptr_t>a
        t.data = NULL
        t.buffer = NULL
    g._sched_owned = []
    _restore_srcs(g)


cdef void _record_srcs(Graph g) noexcept:
    """Remember every node's sources before a scheduler over several backends
    allocates g: its split points a node's source that lives on another
    backend at a copy in the scheduler's own context
    (ggml_backend_sched_split_graph), which the next graph's allocation
    frees; _restore_srcs undoes that before g is allocated again."""
    cdef int i, j, n = ggml_graph_n_nodes(g.ptr)
    cdef ggml_tensor * node
    rec = []
    for i in range(n):
        node = ggml_graph_node(g.ptr, i)
        rec.append(tuple([<uintptr_t>node.src[j] for j in range(GGML_MAX_SRC)]))
    g._src_record = rec


cdef void _restore_srcs(Graph g) noexcept:
    cdef int i, j, n
    cdef ggml_tensor * node
    if g._src_record is None:
        return
    n = min(len(g._src_record), ggml_graph_n_nodes(g.ptr))  # nodes added since were never split
    for i in range(n):
        node = ggml_graph_node(g.ptr, i)
        srcs = g._src_record[i]
        for j in range(GGML_MAX_SRC):
            node.src[j] = <ggml_tensor *><uintptr_t>srcs[j]
    g._src_record = None


cdef int _index_check(list checks, ggml_tensor * node, ggml_tensor * idx, int64_t bound) except -1:
    """Plan the range check of ``idx`` (values must lie in 0..bound-1).
    Views, copies and conts pass values through: check the leaf they come
    from (its whole data, a superset). ARGMAX/TOP_K/ARGSORT yield indices
    below their input's row length: check that length statically; ARANGE's
    are known from its parameters (REPEAT passes them through). Indices
    computed any other way cannot be checked and are refused."""
    cdef ggml_tensor * src = idx
    while <int>src.op in _INDEX_PASSTHROUGH:
        src = src.src[0]
    if src.op == GGML_OP_NONE:
        # a plain view/reshape of a leaf can be read directly once allocated
        checks.append((<uintptr_t>(idx if idx.op == GGML_OP_NONE or (<int>idx.op in _VIEW_OPS and ggml_is_contiguous(idx)
                                   and _only_views(idx)) else src), bound, _node_desc(node)))
        return 0
    if <int>src.op in _INDEX_PRODUCERS:
        if src.src[0].ne[0] > bound:
            raise GGMLError(f"{_node_desc(node)}: indices from {_node_desc(src)} range up to "
                            f"{src.src[0].ne[0] - 1}, past the {bound} rows they index")
        return 0
    cdef float a0, a_step
    if <int>src.op == _OP_ARANGE:
        a0 = (<float *>src.op_params)[0]
        a_step = (<float *>src.op_params)[2]
        ends = (a0, a0 + (src.ne[0] - 1) * a_step)
        if a0 != <int64_t>a0 or a_step != <int64_t>a_step or min(ends) < 0 or max(ends) >= bound:
            raise GGMLError(f"{_node_desc(node)}: indices from {_node_desc(src)} range over {ends[0]:g}..{ends[1]:g}, "
                            f"not whole row numbers below {bound}")
        return 0
    raise GGMLError(f"{_node_desc(node)}: its indices are computed by {_node_desc(src)}, which toy cannot "
                    "range-check before compute; feed indices from an input tensor")


cdef bint _only_views(ggml_tensor * t) noexcept:
    while t.op != GGML_OP_NONE:
        if <int>t.op not in _VIEW_OPS:
            return False
        t = t.src[0]
    return True


cdef int _check_backward_node(ggml_tensor * node, set needs) except -1:
    cdef int op = <int>node.op
    if op not in _BW_OPS:
        raise UnsupportedBackwardError(f"ggml has no backward for {_node_desc(node)}")
    if node.op == GGML_OP_UNARY and <int>ggml_get_unary_op(node) not in _BW_UNARY:
        raise UnsupportedBackwardError(f"ggml has no backward for {_node_desc(node)}")
    if node.op == GGML_OP_GLU:
        if <int>ggml_get_glu_op(node) not in _BW_GLU or node.src[1] == NULL:
            raise UnsupportedBackwardError(f"ggml has no backward for {_node_desc(node)} (only split SWIGLU)")
    if op == _OP_SOFT_MAX and node.src[1] != NULL and (<uintptr_t>node.src[1]) in needs:
        raise UnsupportedBackwardError(f"{_node_desc(node)}: no gradient for the softmax mask")
    if op == _OP_ROPE and node.src[2] != NULL and (<uintptr_t>node.src[2]) in needs:
        raise UnsupportedBackwardError(f"{_node_desc(node)}: no gradient for rope frequency factors")
    if op == _OP_XENT and node.src[1] != NULL and (<uintptr_t>node.src[1]) in needs:
        raise UnsupportedBackwardError(f"{_node_desc(node)}: no gradient for cross-entropy labels")
    cdef ggml_tensor * a = node.src[0]
    cdef ggml_tensor * b = node.src[1]
    if (op == _OP_SUB or op == _OP_DIV) and (<uintptr_t>b) in needs and not ggml_are_same_shape(a, b):
        raise UnsupportedBackwardError(
            f"{_node_desc(node)}: ggml has no gradient for a broadcast second operand of SUB/DIV")
    if op == _OP_GET_ROWS and (<uintptr_t>a) in needs and not (a.ne[3] == 1 and b.ne[2] == 1):
        raise UnsupportedBackwardError(
            f"{_node_desc(node)}: ggml's GET_ROWS gradient needs a table of at most 3 axes and indices of at most 2"
            " (toy-ggml patch 0016)")
    if op == _OP_MUL_MAT and (<uintptr_t>a) in needs and (a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3]) \
            and b.ne[3] != 1:
        raise UnsupportedBackwardError(
            f"{_node_desc(node)}: ggml's MUL_MAT gradient for a broadcast first operand needs a 3-D second operand")
    return 0
