# Context: the op-building half. One method per bound ggml op.
#
# Every method checks what ggml would GGML_ASSERT (shapes, types, ranges)
# before calling into C and raises ValueError/TypeError naming the value.
# Shapes in docstrings are NumPy order. The result lives in this context;
# inputs may come from other contexts (those are then kept alive).

cdef inline int _f32(Tensor a, str op, str arg="a") except -1:
    if a.ptr.type != GGML_TYPE_F32:
        raise TypeError(f"{op}: {arg} must be F32, got {GGMLType(<int>a.ptr.type).name}")
    return 0


cdef inline int _rows_contig(Tensor a, str op) except -1:
    if not ggml_is_contiguous_1(a.ptr):
        raise ValueError(f"{op}: input rows must be contiguous (use cont())")
    return 0


cdef inline int _elems_contig(Tensor a, str op) except -1:
    # the kernel reads each row's elements as consecutive floats
    if a.ptr.nb[0] != ggml_type_size(a.ptr.type):
        raise ValueError(f"{op}: a row's elements must be consecutive (a transposed or strided view: use cont())")
    return 0


cdef inline bint _can_repeat(ggml_tensor * b, ggml_tensor * a) noexcept:
    # ggml_can_repeat(b, a): b broadcasts to a
    cdef int i
    for i in range(4):
        if b.ne[i] == 0 or a.ne[i] % b.ne[i] != 0:
            return False
    return True


cdef inline str _shp(Tensor t):
    return str(t.shape)


cdef inline int _max(int a, int b) noexcept:
    return a if a > b else b


cdef class Context(_ContextBase):
    """A ggml context: makes tensors and ops. Use as ``with Context() as ctx``
    or call close(); see _ContextBase.__init__ for sizing."""

    cdef inline Tensor _r(self, ggml_tensor * p, int nd):
        return _wrap(self, p, nd)

    cdef inline int _in1(self, Tensor a) except -1:
        self._room(2)
        a._ok()
        self._use(a)
        return 0

    cdef inline int _in2(self, Tensor a, Tensor b) except -1:
        self._room(2)
        a._ok(); b._ok()
        self._use(a); self._use(b)
        return 0

    # ---------------------------------------------------------------- binary

    cdef Tensor _binary(self, Tensor a, Tensor b, int which, str name):
        self._in2(a, b)
        _f32(a, name, "a"); _f32(b, name, "b")
        if not _can_repeat(b.ptr, a.ptr):
            raise ValueError(f"{name}: b {_shp(b)} does not broadcast to a {_shp(a)}")
        cdef ggml_tensor * p
        if which == 0:
            p = ggml_add(self.ptr, a.ptr, b.ptr)
        elif which == 1:
            p = ggml_sub(self.ptr, a.ptr, b.ptr)
        elif which == 2:
            p = ggml_mul(self.ptr, a.ptr, b.ptr)
        else:
            p = ggml_div(self.ptr, a.ptr, b.ptr)
        return self._r(p, a._ndim)

    def add(self, Tensor a, Tensor b):
        """a + b, b broadcast over a (each extent of b divides a's)."""
        return self._binary(a, b, 0, "add")

    def sub(self, Tensor a, Tensor b):
        """a - b, b broadcast over a."""
        return self._binary(a, b, 1, "sub")

    def mul(self, Tensor a, Tensor b):
        """a * b elementwise, b broadcast over a."""
        return self._binary(a, b, 2, "mul")

    def div(self, Tensor a, Tensor b):
        """a / b elementwise, b broadcast over a."""
        return self._binary(a, b, 3, "div")

    def scale(self, Tensor a, float s, float bias=0.0):
        """a * s + bias."""
        self._in1(a); _f32(a, "scale")
        _rows_contig(a, "scale")
        if bias == 0.0:
            return self._r(ggml_scale(self.ptr, a.ptr, s), a._ndim)
        return self._r(ggml_scale_bias(self.ptr, a.ptr, s, bias), a._ndim)

    # ---------------------------------------------------------------- unary

    cdef Tensor _unary(self, Tensor a, int which, str name):
        self._in1(a); _f32(a, name)
        _rows_contig(a, name)
        cdef ggml_tensor * p
        if which == 0:
            p = ggml_sqr(self.ptr, a.ptr)
        elif which == 1:
            p = ggml_sqrt(self.ptr, a.ptr)
        elif which == 2:
            p = ggml_exp(self.ptr, a.ptr)
        elif which == 3:
            p = ggml_log(self.ptr, a.ptr)
        elif which == 4:
            p = ggml_neg(self.ptr, a.ptr)
        elif which == 5:
            p = ggml_tanh(self.ptr, a.ptr)
        elif which == 6:
            p = ggml_sigmoid(self.ptr, a.ptr)
        elif which == 7:
            p = ggml_gelu(self.ptr, a.ptr)
        elif which == 8:
            p = ggml_silu(self.ptr, a.ptr)
        elif which == 10:
            p = ggml_gelu_erf(self.ptr, a.ptr)
        elif which == 11:
            p = ggml_erf(self.ptr, a.ptr)
        else:
            p = ggml_relu(self.ptr, a.ptr)
        return self._r(p, a._ndim)

    def sqr(self, Tensor a):
        """a ** 2."""
        return self._unary(a, 0, "sqr")

    def sqrt(self, Tensor a):
        """sqrt(a)."""
        return self._unary(a, 1, "sqrt")

    def exp(self, Tensor a):
        """exp(a)."""
        return self._unary(a, 2, "exp")

    def log(self, Tensor a):
        """natural log of a."""
        return self._unary(a, 3, "log")

    def neg(self, Tensor a):
        """-a."""
        return self._unary(a, 4, "neg")

    def tanh(self, Tensor a):
        """tanh(a)."""
        return self._unary(a, 5, "tanh")

    def sigmoid(self, Tensor a):
        """1 / (1 + exp(-a))."""
        return self._unary(a, 6, "sigmoid")

    def gelu(self, Tensor a):
        """GELU, tanh approximation (the CPU reads a float16 table)."""
        return self._unary(a, 7, "gelu")

    def gelu_erf(self, Tensor a):
        """GELU, exact form 0.5·x·(1 + erf(x/√2)) (float32, no table).

        ggml's CPU kernel (ggml-cpu/vec.h, ggml_vec_gelu_erf_f32) evaluates
        ``0.5f*x*(1.0f + erf(x*SQRT_2_INV))`` in float32 with toy's vector erf
        (patch 0014, see erf()); unlike gelu() it reads no float16 table. For
        x << 0 the 1 + erf cancels, so there the error is absolute (a few
        ulp of 1, times |x|/2), as in PyTorch's float32 erf GELU, which
        computes the same expression.
        """
        return self._unary(a, 10, "gelu_erf")

    def erf(self, Tensor a):
        """erf(a), float32 (the ERF op of patch 0010). On the CPU toy's vector
        erf (patch 0014): within 3 ulp of the exact value, +-1 for |a| >= 4,
        the same bits on every CPU variant."""
        return self._unary(a, 11, "erf")

    def silu(self, Tensor a):
        """a * sigmoid(a)."""
        return self._unary(a, 8, "silu")

    def relu(self, Tensor a):
        """max(a, 0)."""
        return self._unary(a, 9, "relu")

    def clamp(self, Tensor a, float lo, float hi):
        """a clipped to [lo, hi]."""
        self._in1(a); _f32(a, "clamp")
        if not lo <= hi:
            raise ValueError(f"clamp: lo={lo} > hi={hi}")
        return self._r(ggml_clamp(self.ptr, a.ptr, lo, hi), a._ndim)

    def swiglu(self, Tensor a, Tensor b):
        """silu(a) * b (ggml_swiglu_split): a and b of the same shape."""
        self._in2(a, b); _f32(a, "swiglu", "a"); _f32(b, "swiglu", "b")
        if not ggml_are_same_shape(a.ptr, b.ptr):
            raise ValueError(f"swiglu: a {_shp(a)} and b {_shp(b)} differ in shape")
        _rows_contig(a, "swiglu"); _rows_contig(b, "swiglu")
        return self._r(ggml_swiglu_split(self.ptr, a.ptr, b.ptr), a._ndim)

    # ---------------------------------------------------------------- reductions

    def sum(self, Tensor a):
        """Sum of all elements, shape (1,)."""
        self._in1(a); _f32(a, "sum")
        return self._r(ggml_sum(self.ptr, a.ptr), 1)

    def sum_sqr(self, Tensor a):
        """Sum of the squares of all elements, shape (1,): ``sum(sqr(a))`` bit for bit (patch 0017), in
        one pass over ``a`` with its rows spread over the threads and no squared copy. The rows' elements
        must be consecutive. No gradient flows through it. In a context whose
        ``toy_ops`` is False: ``sum(sqr(a))`` itself (the standard ops, for a
        device without SUM_SQR)."""
        self._in1(a); _f32(a, "sum_sqr"); _elems_contig(a, "sum_sqr")
        if not self.toy_ops:
            return self._r(ggml_sum(self.ptr, ggml_sqr(self.ptr, a.ptr)), 1)
        return self._r(ggml_sum_sqr(self.ptr, a.ptr), 1)

    def sum_rows(self, Tensor a):
        """Sum over the last axis, kept with extent 1."""
        self._in1(a); _f32(a, "sum_rows"); _elems_contig(a, "sum_rows")
        return self._r(ggml_sum_rows(self.ptr, a.ptr), a._ndim)

    def mean(self, Tensor a):
        """Mean over the last axis, kept with extent 1."""
        self._in1(a); _f32(a, "mean"); _elems_contig(a, "mean")
        return self._r(ggml_mean(self.ptr, a.ptr), a._ndim)

    def argmax(self, Tensor a):
        """Index of the maximum of each row of a 2-D tensor: shape (rows,), I32."""
        self._in1(a); _f32(a, "argmax"); _elems_contig(a, "argmax")
        if not ggml_is_matrix(a.ptr):
            raise ValueError(f"argmax: a must be 2-D, got {_shp(a)}")
        return self._r(ggml_argmax(self.ptr, a.ptr), 1)

    def top_k(self, Tensor a, int k):
        """Indices (I32) of the k largest values of each row, in no
        particular order: shape (..., k)."""
        self._in1(a); _f32(a, "top_k")
        if k < 1 or k > a.ptr.ne[0]:
            raise ValueError(f"top_k: k={k} must be in 1..{a.ptr.ne[0]}")
        _rows_contig(a, "top_k")
        return self._r(ggml_top_k(self.ptr, a.ptr, k), a._ndim)

    def argsort_top_k(self, Tensor a, int k):
        """Indices (I32) of the k largest values of each row, largest first:
        shape (..., k), a view of a descending argsort (ggml_argsort_top_k,
        what llama.cpp's MoE router uses). Equal values: on the CPU, rows of
        at most 16 give the lower index first (the C++ library's insertion
        sort); longer rows depend on the data (its introsort)."""
        self._in1(a); _f32(a, "argsort_top_k")
        if k < 1 or k > a.ptr.ne[0]:
            raise ValueError(f"argsort_top_k: k={k} must be in 1..{a.ptr.ne[0]}")
        _rows_contig(a, "argsort_top_k")
        return self._r(ggml_argsort_top_k(self.ptr, a.ptr, k), a._ndim)

    # ---------------------------------------------------------------- norms

    def rms_norm(self, Tensor a, float eps):
        """a / sqrt(mean(a**2, last axis) + eps)."""
        self._in1(a); _f32(a, "rms_norm")
        if not eps >= 0.0:
            raise ValueError(f"rms_norm: eps={eps} must be >= 0")
        return self._r(ggml_rms_norm(self.ptr, a.ptr, eps), a._ndim)

    def norm(self, Tensor a, float eps):
        """(a - mean) / sqrt(var + eps) over the last axis (LayerNorm without
        scale and shift)."""
        self._in1(a); _f32(a, "norm")
        if not eps >= 0.0:
            raise ValueError(f"norm: eps={eps} must be >= 0")
        return self._r(ggml_norm(self.ptr, a.ptr, eps), a._ndim)

    # ---------------------------------------------------------------- matmul

    def mul_mat(self, Tensor a, Tensor b, bint row_invariant=False, gemm=None):
        """b @ a.T over the last two axes: a (..., M, K) weights (any type
        with a dot product, quantized included), b (..., N, K) F32 -> (..., N, M)
        F32. a's leading extents must divide b's; b's batch j uses a's batch
        j // (b_extent // a_extent) (repeat-interleave, not NumPy tiling).
        ``row_invariant``: every output row is summed exactly as it would be
        with N = 1 (the CPU's vec_dot kernels for any N, patch 0004), so a
        row does not change with the rows batched beside it; slower for
        large N, where the default lets the CPU use tinyBLAS.
        ``gemm`` (default: the context's ``gemm`` attribute, False unless
        set): an F32 ``a`` is multiplied by toy's CPU GEMM (patch 0011):
        every output is one fused multiply-add chain over K in order, so
        it is also row-invariant, the same on every CPU variant, and fast
        for many rows and any K. It reads ``a`` and ``b`` in place when
        their last or second-to-last axis is contiguous (a transposed or
        permuted view needs no ``cont()``), and its gradients (autograd)
        are toy GEMM products of the operands read transposed, without
        copies. Such a node runs on the CPU backend only: set it where the
        runtime computes on the CPU (``Runtime.cpu_gemm``). A quantized ``a``
        read transposed (``transpose(w)`` of a contiguous quantized ``w``:
        the product ``b @ dequantize(w)``, e.g. an input gradient through a
        frozen quantized weight) goes to the same GEMM, which dequantizes
        ``w`` while packing (patch 0018): bit for bit the product with the
        dequantized F32 ``w`` read transposed. Other types of ``a`` ignore
        it. Not together with ``row_invariant``."""
        self._in2(a, b)
        _f32(b, "mul_mat", "b")
        if not _type_valid(<int>a.ptr.type) or a.ptr.type in (GGML_TYPE_I32, GGML_TYPE_I64) or <int>a.ptr.type in (24, 25):
            raise TypeError(f"mul_mat: a cannot be {GGMLType(<int>a.ptr.type).name}")
        if a.ptr.ne[0] != b.ptr.ne[0]:
            raise ValueError(f"mul_mat: inner extents differ: a {_shp(a)} vs b {_shp(b)}")
        if b.ptr.ne[2] % a.ptr.ne[2] != 0 or b.ptr.ne[3] % a.ptr.ne[3] != 0:
            raise ValueError(f"mul_mat: a {_shp(a)} does not broadcast over b {_shp(b)}")
        use_gemm = self.gemm if gemm is None else bool(gemm)
        if use_gemm and row_invariant:
            if gemm is not None:
                raise ValueError("mul_mat: gemm and row_invariant exclude each other")
            use_gemm = False  # an explicit row_invariant wins over the context's default
        cdef ggml_tensor * r
        if use_gemm and ggml_toy_gemm_quant_t_ok(a.ptr):
            if not ggml_toy_gemm_operand_ok(b.ptr):
                raise ValueError(f"mul_mat (gemm): b {_shp(b)} has neither of its last two axes contiguous (use cont())")
            r = ggml_mul_mat_toy_gemm(self.ptr, a.ptr, b.ptr)  # a quantized a read transposed (patch 0018)
        elif use_gemm and a.ptr.type == GGML_TYPE_F32:
            for t, name in ((a, "a"), (b, "b")):
                if not ggml_toy_gemm_operand_ok(t.ptr):
                    raise ValueError(f"mul_mat (gemm): {name} {_shp(t)} has neither of its last two axes contiguous (use cont())")
            r = ggml_mul_mat_toy_gemm(self.ptr, a.ptr, b.ptr)  # hinted GGML_HINT_TOY_GEMM (patch 0011)
        else:
            if ggml_is_transposed(a.ptr):
                raise ValueError("mul_mat: a must not be transposed (use cont())")
            r = ggml_mul_mat(self.ptr, a.ptr, b.ptr)
            if row_invariant:
                r.op_params[1] = 2  # GGML_HINT_ROW_INVARIANT (patch 0004)
        return self._r(r, _max(2, _max(a._ndim, b._ndim)))

    def mul_mat_id(self, Tensor experts, Tensor b, Tensor ids, bint row_invariant=False):
        """Mixture-of-experts matmul. experts (E, M, K); b (T, U, K) with U the
        experts per token (or 1, broadcast); ids I32 (T, U) in 0..E-1 ->
        (T, U, M) F32: out[t, u] = b[t, u] @ experts[ids[t, u]].T.
        ``row_invariant``: every output row summed by the CPU's vec_dot
        kernels, whatever other rows chose the same expert (patch 0015: no
        tiled K-quant path), so a token does not depend on the batch."""
        self._room(2)
        experts._ok(); b._ok(); ids._ok()
        self._use(experts); self._use(b); self._use(ids)
        _f32(b, "mul_mat_id", "b")
        if ids.ptr.type != GGML_TYPE_I32:
            raise TypeError("mul_mat_id: ids must be I32")
        if experts.ptr.ne[3] != 1 or b.ptr.ne[3] != 1 or ids.ptr.ne[2] != 1 or ids.ptr.ne[3] != 1:
            raise ValueError(f"mul_mat_id: experts {_shp(experts)} and b {_shp(b)} must be 3-D, ids 2-D {_shp(ids)}")
        if ids.ptr.ne[1] != b.ptr.ne[2]:
            raise ValueError(f"mul_mat_id: ids {_shp(ids)} and b {_shp(b)} differ in token count")
        if experts.ptr.ne[0] != b.ptr.ne[0]:
            raise ValueError(f"mul_mat_id: inner extents differ: experts {_shp(experts)} vs b {_shp(b)}")
        if ids.ptr.ne[0] % b.ptr.ne[1] != 0:
            raise ValueError(f"mul_mat_id: b {_shp(b)} does not broadcast over ids {_shp(ids)}")
        if ggml_is_transposed(experts.ptr):
            raise ValueError("mul_mat_id: experts must not be transposed")
        cdef ggml_tensor * r = ggml_mul_mat_id(self.ptr, experts.ptr, b.ptr, ids.ptr)
        if row_invariant:
            r.op_params[1] = 2  # GGML_HINT_ROW_INVARIANT (patches 0004, 0015)
        return self._r(r, 3)

    # ---------------------------------------------------------------- layout

    def cont(self, Tensor a):
        """A contiguous copy of a (after permute/transpose/view)."""
        self._in1(a)
        return self._r(ggml_cont(self.ptr, a.ptr), a._ndim)

    def reshape(self, Tensor a, shape):
        """A view of contiguous a with a new shape (same element count)."""
        self._in1(a)
        cdef int64_t ne[4]
        cdef int nd = _shape_to_ne(shape, ne)
        if not ggml_is_contiguous(a.ptr):
            raise ValueError("reshape: a is not contiguous (use cont())")
        if ne[0] * ne[1] * ne[2] * ne[3] != ggml_nelements(a.ptr):
            raise ValueError(f"reshape: cannot reshape {_shp(a)} to {tuple(shape)}")
        if ne[0] % ggml_blck_size(a.ptr.type) != 0:
            raise ValueError(f"reshape: last extent must stay a multiple of the block size")
        return self._r(ggml_reshape_4d(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3]), nd)

    def view(self, Tensor a, shape, strides=None, size_t offset=0):
        """A view into a's memory: NumPy ``shape``, byte ``strides`` (NumPy
        order, default contiguous) and byte ``offset``; must stay inside a."""
        self._in1(a)
        cdef int64_t ne[4]
        cdef size_t nb[4]
        cdef int nd = _shape_to_ne(shape, ne), i
        cdef size_t ts = ggml_type_size(a.ptr.type)
        cdef int64_t bs = ggml_blck_size(a.ptr.type)
        if ne[0] % bs != 0:
            raise ValueError("view: last extent must be a multiple of the block size")
        nb[0] = ts
        nb[1] = ts * (ne[0] // bs)
        nb[2] = nb[1] * ne[1]
        nb[3] = nb[2] * ne[2]
        if strides is not None:
            if len(strides) != nd:
                raise ValueError(f"view: {len(strides)} strides for {nd} dimensions")
            for i in range(nd):
                if strides[nd - 1 - i] < 0:
                    raise ValueError("view: strides must be >= 0")
                nb[i] = strides[nd - 1 - i]
            if nb[0] != ts:
                raise ValueError(f"view: the innermost stride must be the element size {ts}")
            for i in range(nd, 4):
                nb[i] = nb[i - 1] * ne[i - 1]
        # bytes spanned by the view (ggml's own bound)
        cdef size_t span = 0
        if ne[0] > 0 and ne[1] > 0 and ne[2] > 0 and ne[3] > 0:
            span = ts * (ne[0] // bs)
            for i in range(1, 4):
                span += (ne[i] - 1) * nb[i]
        if offset + span > ggml_nbytes(a.ptr):
            raise ValueError(f"view: {tuple(shape)} at offset {offset} reaches byte {offset + span}, "
                             f"past the end of a ({ggml_nbytes(a.ptr)} bytes)")
        return self._r(ggml_view_4d(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3], nb[1], nb[2], nb[3], offset), nd)

    def permute(self, Tensor a, axes):
        """Like numpy.transpose(a, axes): result axis j is a's axis axes[j]."""
        self._in1(a)
        cdef int nd = a._ndim, j, s
        axes = tuple(int(x) for x in axes)
        if sorted(axes) != list(range(nd)):
            raise ValueError(f"permute: axes {axes} are not a permutation of 0..{nd - 1}")
        cdef int p[4]
        for j in range(4):
            p[j] = j
        # numpy source axis s -> ggml axis nd-1-s goes to ggml position nd-1-j
        for j in range(nd):
            s = axes[j]
            p[nd - 1 - s] = nd - 1 - j
        return self._r(ggml_permute(self.ptr, a.ptr, p[0], p[1], p[2], p[3]), nd)

    def transpose(self, Tensor a):
        """Swap the last two axes (a view; use cont() to materialize)."""
        self._in1(a)
        return self._r(ggml_transpose(self.ptr, a.ptr), _max(2, a._ndim))

    def cpy(self, Tensor a, Tensor b):
        """Copy a into b (same element count; converts, and quantizes, to b's
        type). Supported: same type; F32/F16/BF16 to each other; F32 to I32;
        I32 to F32; F32/F16/BF16 to Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/K-quants/IQ4_NL;
        quantized to F32. The result is b after the copy."""
        self._in2(a, b)
        if ggml_nelements(a.ptr) != ggml_nelements(b.ptr):
            raise ValueError(f"cpy: a {_shp(a)} and b {_shp(b)} differ in element count")
        _check_copy(<int>a.ptr.type, <int>b.ptr.type, "cpy")
        if b.ptr.ne[0] % ggml_blck_size(b.ptr.type) != 0:
            raise ValueError("cpy: b's rows are not whole blocks")
        return self._r(ggml_cpy(self.ptr, a.ptr, b.ptr), b._ndim)

    def cast(self, Tensor a, dtype):
        """a converted to ``dtype``; the conversions cpy() supports."""
        self._in1(a)
        cdef int t = int(dtype)
        if not _type_valid(t):
            raise TypeError(f"cast: unknown target type {dtype!r}")
        _check_copy(<int>a.ptr.type, t, "cast")
        return self._r(ggml_cast(self.ptr, a.ptr, <ggml_type>t), a._ndim)

    def concat(self, Tensor a, Tensor b, int axis):
        """Concatenate along NumPy ``axis`` (other extents equal, same type)."""
        self._in2(a, b)
        cdef int nd = _max(a._ndim, b._ndim), d, i
        if axis < 0:
            axis += nd
        if axis < 0 or axis >= nd:
            raise ValueError(f"concat: axis {axis} out of range for {nd} dimensions")
        d = nd - 1 - axis
        if a.ptr.type != b.ptr.type:
            raise TypeError("concat: a and b differ in type")
        if a.ptr.type != GGML_TYPE_F32 and a.ptr.type != GGML_TYPE_F16 and a.ptr.type != GGML_TYPE_I32:
            raise TypeError(f"concat: unsupported type {a.dtype.name}")
        for i in range(4):
            if i != d and a.ptr.ne[i] != b.ptr.ne[i]:
                raise ValueError(f"concat: a {_shp(a)} and b {_shp(b)} differ off axis {axis}")
        return self._r(ggml_concat(self.ptr, a.ptr, b.ptr, d), nd)

    def repeat(self, Tensor a, shape):
        """Tile a to ``shape`` (each extent of a divides the target's)."""
        self._in1(a); _f32(a, "repeat")
        cdef int64_t ne[4]
        cdef int nd = _shape_to_ne(shape, ne), i
        for i in range(4):
            if a.ptr.ne[i] == 0 or ne[i] % a.ptr.ne[i] != 0:
                raise ValueError(f"repeat: {_shp(a)} does not tile {tuple(shape)}")
        return self._r(ggml_repeat_4d(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3]), _max(nd, a._ndim))

    def pad(self, Tensor a, pads):
        """Zero padding: ``pads`` is one (before, after) pair per NumPy axis."""
        self._in1(a); _f32(a, "pad")
        cdef int nd = a._ndim, i
        if len(pads) != nd:
            raise ValueError(f"pad: {len(pads)} pairs for {nd} dimensions")
        cdef int lp[4]
        cdef int rp[4]
        for i in range(4):
            lp[i] = 0; rp[i] = 0
        for i in range(nd):
            before, after = pads[nd - 1 - i]
            if before < 0 or after < 0 or before > 1 << 20 or after > 1 << 20:
                raise ValueError(f"pad: padding {pads[nd - 1 - i]} out of range")
            lp[i] = before; rp[i] = after
        return self._r(ggml_pad_ext(self.ptr, a.ptr, lp[0], rp[0], lp[1], rp[1], lp[2], rp[2], lp[3], rp[3]), nd)

    # ---------------------------------------------------------------- rows

    def get_rows(self, Tensor a, Tensor idx):
        """Gather rows: a (..., R, C) of any type, idx I32 (..., N) with
        values in 0..R-1 -> (..., N, C) F32 (F32 a keeps F32; others are
        converted). Leading extents of a and idx must match."""
        self._in2(a, idx)
        if idx.ptr.type != GGML_TYPE_I32:
            raise TypeError(f"get_rows: idx must be I32, got {idx.dtype.name}")
        if a.ptr.ne[2] != idx.ptr.ne[1] or a.ptr.ne[3] != idx.ptr.ne[2] or idx.ptr.ne[3] != 1:
            raise ValueError(f"get_rows: a {_shp(a)} and idx {_shp(idx)} do not line up")
        return self._r(ggml_get_rows(self.ptr, a.ptr, idx.ptr), _max(a._ndim, idx._ndim + 1))

    def set_rows(self, Tensor a, Tensor b, Tensor idx):
        """Scatter rows of b into a: a[..., idx[i], :] = b[..., i, :]
        (idx I32 or I64, values in 0..R-1). The result is a after the write."""
        self._room(2)
        a._ok(); b._ok(); idx._ok()
        self._use(a); self._use(b); self._use(idx)
        if idx.ptr.type != GGML_TYPE_I32 and idx.ptr.type != GGML_TYPE_I64:
            raise TypeError("set_rows: idx must be I32 or I64")
        if b.ptr.type != GGML_TYPE_F32 and b.ptr.type != GGML_TYPE_F16:
            raise TypeError("set_rows: b must be F32 or F16")
        if (a.ptr.ne[0] != b.ptr.ne[0] or a.ptr.ne[2] != b.ptr.ne[2] or a.ptr.ne[3] != b.ptr.ne[3]
                or b.ptr.ne[1] != idx.ptr.ne[0] or b.ptr.ne[2] % idx.ptr.ne[1] != 0
                or b.ptr.ne[3] % idx.ptr.ne[2] != 0 or idx.ptr.ne[3] != 1):
            raise ValueError(f"set_rows: a {_shp(a)}, b {_shp(b)} and idx {_shp(idx)} do not line up")
        if not ggml_is_contiguous_rows(a.ptr) or not ggml_is_contiguous_rows(b.ptr):
            raise ValueError("set_rows: rows of a and b must be contiguous")
        return self._r(ggml_set_rows(self.ptr, a.ptr, b.ptr, idx.ptr), a._ndim)

    # ---------------------------------------------------------------- attention

    def diag_mask_inf(self, Tensor a, int n_past):
        """Set a[..., i, j] = -inf where j > n_past + i (causal mask)."""
        self._in1(a); _f32(a, "diag_mask_inf")
        if n_past < 0:
            raise ValueError(f"diag_mask_inf: n_past={n_past} must be >= 0")
        return self._r(ggml_diag_mask_inf(self.ptr, a.ptr, n_past), a._ndim)

    def soft_max(self, Tensor a, Tensor mask=None, float scale=1.0, float max_bias=0.0):
        """softmax(a * scale + mask * slope) over the last axis. mask (F32 or
        F16) has a's last extent, at least a's rows, and leading extents that
        divide a's; ``max_bias`` > 0 turns on ALiBi slopes (needs a mask)."""
        self._in1(a); _f32(a, "soft_max")
        if not ggml_is_contiguous(a.ptr):
            raise ValueError("soft_max: a must be contiguous")
        if max_bias < 0:
            raise ValueError(f"soft_max: max_bias={max_bias} must be >= 0")
        if mask is None:
            if max_bias > 0:
                raise ValueError("soft_max: ALiBi (max_bias > 0) needs a mask")
            return self._r(ggml_soft_max_ext(self.ptr, a.ptr, NULL, scale, max_bias), a._ndim)
        mask._ok(); self._use(mask)
        if mask.ptr.type != GGML_TYPE_F32 and mask.ptr.type != GGML_TYPE_F16:
            raise TypeError("soft_max: mask must be F32 or F16")
        if not ggml_is_contiguous(mask.ptr):
            raise ValueError("soft_max: mask must be contiguous")
        if (mask.ptr.ne[0] != a.ptr.ne[0] or mask.ptr.ne[1] < a.ptr.ne[1]
                or a.ptr.ne[2] % mask.ptr.ne[2] != 0 or a.ptr.ne[3] % mask.ptr.ne[3] != 0):
            raise ValueError(f"soft_max: mask {_shp(mask)} does not fit a {_shp(a)}")
        return self._r(ggml_soft_max_ext(self.ptr, a.ptr, mask.ptr, scale, max_bias), a._ndim)

    def rope(self, Tensor a, Tensor pos, int n_dims, mode="normal", Tensor freq_factors=None,
             float freq_base=10000.0, float freq_scale=1.0, int n_ctx_orig=0,
             float ext_factor=0.0, float attn_factor=1.0, float beta_fast=32.0, float beta_slow=1.0):
        """Rotary embedding. a (B, T, H, D) (or (T, H, D)), pos I32 (T,),
        rotating the first ``n_dims`` (even, <= D) of each head. ``mode``:
        "normal" (adjacent pairs, llama GGUF layout) or "neox" (halves).
        ``freq_factors`` F32 (>= n_dims/2,) divides the frequencies (llama3);
        ext_factor/attn_factor/beta_* are YaRN's."""
        self._in2(a, pos); _f32(a, "rope")
        cdef int m
        if mode == "normal":
            m = 0
        elif mode == "neox":
            m = GGML_ROPE_TYPE_NEOX
        else:
            raise ValueError(f"rope: mode {mode!r} must be 'normal' or 'neox'")
        if pos.ptr.type != GGML_TYPE_I32 or not ggml_is_vector(pos.ptr):
            raise TypeError(f"rope: pos must be a 1-D I32 tensor, got {pos.dtype.name} {_shp(pos)}")
        if a.ptr.ne[2] != pos.ptr.ne[0]:
            raise ValueError(f"rope: a {_shp(a)} has {a.ptr.ne[2]} positions, pos has {pos.ptr.ne[0]}")
        if n_dims <= 0 or n_dims % 2 != 0 or n_dims > a.ptr.ne[0]:
            raise ValueError(f"rope: n_dims={n_dims} must be even and in 2..{a.ptr.ne[0]}")
        if not freq_base > 0:
            raise ValueError(f"rope: freq_base={freq_base} must be > 0")
        cdef ggml_tensor * c = NULL
        if freq_factors is not None:
            freq_factors._ok(); self._use(freq_factors)
            _f32(freq_factors, "rope", "freq_factors")
            if freq_factors.ptr.ne[0] < n_dims // 2:
                raise ValueError(f"rope: freq_factors needs >= {n_dims // 2} values")
            c = freq_factors.ptr
        return self._r(ggml_rope_ext(self.ptr, a.ptr, pos.ptr, c, n_dims, m, n_ctx_orig, freq_base, freq_scale,
                                     ext_factor, attn_factor, beta_fast, beta_slow), a._ndim)

    def flash_attn_ext(self, Tensor q, Tensor k, Tensor v, Tensor mask=None, float scale=1.0,
                       float max_bias=0.0, float logit_softcap=0.0, bint row_invariant=False):
        """Fused attention. q (B, Hq, Tq, D), k (B, Hkv, Tkv, D),
        v (B, Hkv, Tkv, Dv) (Hq a multiple of Hkv), mask F16 (.., >=Tq, Tkv)
        -> (B, Tq, Hq, Dv) F32 (note: heads and queries swap).
        ``row_invariant`` (CPU): each query row is summed over its keys in
        order, skipping masked ones, whatever the number of rows or keys
        (patch 0020: no tiled or split-key kernel), so a row's result does
        not depend on the rows computed with it or on masked padding."""
        self._room(2)
        q._ok(); k._ok(); v._ok()
        self._use(q); self._use(k); self._use(v)
        _f32(q, "flash_attn_ext", "q")
        if k.ptr.type != GGML_TYPE_F32 and k.ptr.type != GGML_TYPE_F16 and <int>k.ptr.type != 8:
            raise TypeError("flash_attn_ext: k must be F32, F16 or Q8_0")
        if v.ptr.type != k.ptr.type:
            raise TypeError("flash_attn_ext: v must have k's type")
        if k.ptr.ne[0] != q.ptr.ne[0]:
            raise ValueError(f"flash_attn_ext: head sizes differ: q {_shp(q)} k {_shp(k)}")
        if q.ptr.ne[2] % k.ptr.ne[2] != 0 or k.ptr.ne[2] != v.ptr.ne[2]:
            raise ValueError(f"flash_attn_ext: q heads must be a multiple of k/v heads: q {_shp(q)} k {_shp(k)} v {_shp(v)}")
        if k.ptr.ne[1] != v.ptr.ne[1]:
            raise ValueError(f"flash_attn_ext: k {_shp(k)} and v {_shp(v)} differ in length")
        if q.ptr.ne[3] != k.ptr.ne[3] or q.ptr.ne[3] != v.ptr.ne[3]:
            raise ValueError("flash_attn_ext: q, k, v differ in batch")
        if max_bias < 0 or logit_softcap < 0:
            raise ValueError("flash_attn_ext: max_bias and logit_softcap must be >= 0")
        cdef ggml_tensor * mp = NULL
        if mask is not None:
            mask._ok(); self._use(mask)
            if mask.ptr.type != GGML_TYPE_F16:
                raise TypeError("flash_attn_ext: mask must be F16")
            if not ggml_is_contiguous(mask.ptr):
                raise ValueError("flash_attn_ext: mask must be contiguous")
            if (mask.ptr.ne[0] != k.ptr.ne[1] or mask.ptr.ne[1] < q.ptr.ne[1]
                    or q.ptr.ne[2] % mask.ptr.ne[2] != 0 or q.ptr.ne[3] % mask.ptr.ne[3] != 0):
                raise ValueError(f"flash_attn_ext: mask {_shp(mask)} does not fit q {_shp(q)} / k {_shp(k)}")
            mp = mask.ptr
        elif max_bias > 0:
            raise ValueError("flash_attn_ext: ALiBi (max_bias > 0) needs a mask")
        cdef ggml_tensor * r = ggml_flash_attn_ext(self.ptr, q.ptr, k.ptr, v.ptr, mp, scale, max_bias, logit_softcap)
        if row_invariant:
            r.op_params[4] = 1  # toy patch 0020
        return self._r(r, 4)

    # ---------------------------------------------------------------- vision

    def im2col(self, Tensor kernel, Tensor x, int s0=1, int s1=1, int p0=0, int p1=0, int d0=1, int d1=1,
               dtype=None):
        """Unfold x (N, C, H, W) into patches for a 2-D kernel (OC, C, KH, KW):
        -> (N, OH, OW, C*KH*KW), ``dtype`` F32 (default) or F16."""
        self._in2(kernel, x)
        cdef int t = 0 if dtype is None else int(dtype)
        if t != <int>GGML_TYPE_F32 and t != <int>GGML_TYPE_F16:
            raise TypeError("im2col: dtype must be F32 or F16")
        _f32(x, "im2col", "x")
        _check_conv(kernel, x, s0, s1, p0, p1, d0, d1, "im2col")
        return self._r(ggml_im2col(self.ptr, kernel.ptr, x.ptr, s0, s1, p0, p1, d0, d1, True, <ggml_type>t), 4)

    def conv_2d(self, Tensor kernel, Tensor x, int s0=1, int s1=1, int p0=0, int p1=0, int d0=1, int d1=1):
        """2-D convolution (im2col + matmul): kernel (OC, C, KH, KW) F32 or F16,
        x (N, C, H, W) F32 -> (N, OC, OH, OW). s/p/d: stride, padding,
        dilation along W (0) and H (1). ggml builds the patches in F16 (in
        F32 only for a BF16 kernel), so x is rounded to F16; for exact F32
        use im2col(dtype=F32) + mul_mat."""
        self._room(8)
        kernel._ok(); x._ok(); self._use(kernel); self._use(x)
        _f32(x, "conv_2d", "x")
        if kernel.ptr.type != GGML_TYPE_F32 and kernel.ptr.type != GGML_TYPE_F16:
            raise TypeError("conv_2d: kernel must be F32 or F16")
        _check_conv(kernel, x, s0, s1, p0, p1, d0, d1, "conv_2d")
        return self._r(ggml_conv_2d(self.ptr, kernel.ptr, x.ptr, s0, s1, p0, p1, d0, d1), 4)

    def pool_2d(self, Tensor x, op="max", int k0=2, int k1=2, int s0=2, int s1=2, int p0=0, int p1=0):
        """2-D pooling of x (N, C, H, W) F32, ``op`` "max" or "avg", kernel
        (k1, k0), stride (s1, s0), padding (p1, p0)."""
        self._in1(x); _f32(x, "pool_2d")
        cdef ggml_op_pool o
        if op == "max":
            o = GGML_OP_POOL_MAX
        elif op == "avg":
            o = GGML_OP_POOL_AVG
        else:
            raise ValueError(f"pool_2d: op {op!r} must be 'max' or 'avg'")
        if k0 < 1 or k1 < 1 or s0 < 1 or s1 < 1 or p0 < 0 or p1 < 0 or p0 >= k0 or p1 >= k1:
            raise ValueError(f"pool_2d: bad kernel/stride/padding k=({k1},{k0}) s=({s1},{s0}) p=({p1},{p0})")
        ow = (x.ptr.ne[0] + 2 * p0 - k0) // s0 + 1
        oh = (x.ptr.ne[1] + 2 * p1 - k1) // s1 + 1
        if ow <= 0 or oh <= 0:
            raise ValueError(f"pool_2d: input {_shp(x)} is smaller than the kernel")
        return self._r(ggml_pool_2d(self.ptr, x.ptr, o, k0, k1, s0, s1, p0, p1), _max(2, x._ndim))

    # ---------------------------------------------------------------- training

    def cross_entropy_loss(self, Tensor logits, Tensor labels):
        """Mean over rows of -sum(labels * log_softmax(logits)) -> (1,).
        ``logits`` (N, V) F32; ``labels`` (N, V) F32 (probabilities), or (N,)
        I32 target ids (patch 0030): a row's label is then the one-hot row of
        its id, and a negative id a row without a target (adding 0), with the
        same results bit for bit as those one-hot rows (finite logits) and
        without the (N, V) matrix. Ids need toy's CPU ops (``toy_ops``) and
        must be below V: they are data, read only when the graph computes,
        where ggml's kernel aborts on an id >= V (as ``get_rows`` does on an
        index out of range); check them before ``set``."""
        self._in2(logits, labels)
        _f32(logits, "cross_entropy_loss", "logits")
        if labels.ptr.type == GGML_TYPE_I32:
            if not self.toy_ops:
                raise ValueError("cross_entropy_loss: target ids are toy's CPU op (toy_ops is off); "
                                 "give the one-hot rows")
            if logits._ndim != 2 or labels._ndim != 1 or labels.ptr.ne[0] != logits.ptr.ne[1]:
                raise ValueError(f"cross_entropy_loss: target ids {_shp(labels)} for logits {_shp(logits)}: "
                                 "expected logits (N, V) and ids (N,)")
            if not ggml_is_contiguous(logits.ptr) or not ggml_is_contiguous(labels.ptr):
                raise ValueError("cross_entropy_loss: inputs must be contiguous")
            return self._r(ggml_toy_cross_entropy_loss_ids(self.ptr, logits.ptr, labels.ptr), 1)
        _f32(labels, "cross_entropy_loss", "labels")
        if not ggml_are_same_shape(logits.ptr, labels.ptr):
            raise ValueError(f"cross_entropy_loss: logits {_shp(logits)} and labels {_shp(labels)} differ")
        if not ggml_is_contiguous(logits.ptr) or not ggml_is_contiguous(labels.ptr):
            raise ValueError("cross_entropy_loss: inputs must be contiguous")
        return self._r(ggml_cross_entropy_loss(self.ptr, logits.ptr, labels.ptr), 1)

    def opt_step_adamw(self, Tensor param, Tensor grad, Tensor m, Tensor v, Tensor hparams, Tensor scale=None):
        """One AdamW step on ``param`` in place. m, v: moment tensors of
        param's shape; hparams F32 (7,) = [lr, beta1, beta2, eps, weight_decay,
        1/(1-beta1^t), 1/(1-beta2^t)]. ``scale``, an F32 tensor of one element
        (e.g. a clipping factor computed in the graph), multiplies the gradient
        first: the result of ``opt_step_adamw(param, mul(grad, scale), ...)`` bit
        for bit, without the scaled copy (patch 0017); in a context whose
        ``toy_ops`` is False, that ``mul`` and ``opt_step_adamw`` themselves (the
        standard ops, for a device without OPT_STEP_ADAMW_SCALED)."""
        self._room(3)
        for t in (param, grad, m, v, hparams):
            (<Tensor>t)._ok(); self._use(<Tensor>t)
        if scale is not None:
            scale._ok(); self._use(scale); _f32(scale, "opt_step_adamw", "scale")
            if ggml_nelements(scale.ptr) != 1:
                raise ValueError(f"opt_step_adamw: scale must have 1 value, got {ggml_nelements(scale.ptr)}")
        if not (param.ptr.flags & GGML_TENSOR_FLAG_PARAM):
            raise ValueError("opt_step_adamw: param must be marked with set_param()")
        for t, nm in ((param, "param"), (grad, "grad"), (m, "m"), (v, "v"), (hparams, "hparams")):
            _f32(<Tensor>t, "opt_step_adamw", nm)
        if not (ggml_are_same_shape(param.ptr, grad.ptr) and ggml_are_same_shape(param.ptr, m.ptr)
                and ggml_are_same_shape(param.ptr, v.ptr)):
            raise ValueError("opt_step_adamw: param, grad, m, v must have one shape")
        if ggml_nelements(hparams.ptr) != 7:
            raise ValueError(f"opt_step_adamw: hparams must have 7 values, got {ggml_nelements(hparams.ptr)}")
        if scale is not None and not self.toy_ops:
            return self._r(
                ggml_opt_step_adamw(self.ptr, param.ptr, ggml_mul(self.ptr, grad.ptr, scale.ptr), m.ptr, v.ptr, hparams.ptr),
                param._ndim,
            )
        if scale is not None:
            return self._r(
                ggml_opt_step_adamw_scaled(self.ptr, param.ptr, grad.ptr, m.ptr, v.ptr, hparams.ptr, scale.ptr), param._ndim
            )
        return self._r(ggml_opt_step_adamw(self.ptr, param.ptr, grad.ptr, m.ptr, v.ptr, hparams.ptr), param._ndim)


# types ggml's CPU copy (ggml_compute_forward_dup) can quantize into
cdef set _COPY_QUANT_DST = {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20}
cdef set _COPY_FLOAT = {0, 1, 30}   # F32, F16, BF16


cdef int _check_copy(int src, int dst, str name) except -1:
    if src == dst:
        return 0
    if src in _COPY_FLOAT and (dst in _COPY_FLOAT or dst in _COPY_QUANT_DST):
        return 0
    if src == <int>GGML_TYPE_F32 and dst == <int>GGML_TYPE_I32:
        return 0
    if dst == <int>GGML_TYPE_F32 and (src == <int>GGML_TYPE_I32 or ggml_is_quantized(<ggml_type>src)):
        return 0
    raise TypeError(f"{name}: ggml cannot convert {GGMLType(src).name} to {GGMLType(dst).name}")


cdef int _check_conv(Tensor kernel, Tensor x, int s0, int s1, int p0, int p1, int d0, int d1, str name) except -1:
    if s0 < 1 or s1 < 1 or d0 < 1 or d1 < 1 or p0 < 0 or p1 < 0:
        raise ValueError(f"{name}: stride and dilation must be >= 1, padding >= 0")
    if kernel.ptr.ne[2] != x.ptr.ne[2]:
        raise ValueError(f"{name}: kernel {_shp(kernel)} and x {_shp(x)} differ in channels")
    if x.ptr.ne[3] < 1 or kernel.ptr.ne[3] < 1:
        raise ValueError(f"{name}: empty kernel or input")
    ow = (x.ptr.ne[0] + 2 * p0 - d0 * (kernel.ptr.ne[0] - 1) - 1) // s0 + 1
    oh = (x.ptr.ne[1] + 2 * p1 - d1 * (kernel.ptr.ne[1] - 1) - 1) // s1 + 1
    if ow <= 0 or oh <= 0:
        raise ValueError(f"{name}: input {_shp(x)} is smaller than the kernel {_shp(kernel)}")
    return 0
