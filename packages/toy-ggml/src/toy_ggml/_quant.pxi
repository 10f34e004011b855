# Quantization and dequantization of host arrays through ggml's own kernels.

_QUANTIZABLE = frozenset({1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 30, 34, 35, 39, 40, 41, 42})


def quantizable_types():
    """ggml type ids that quantize() accepts (no importance matrix needed)."""
    return sorted(t for t in _QUANTIZABLE if not ggml_quantize_requires_imatrix(<ggml_type>t))


def quantize(array, dtype):
    """Quantize a float32 array (..., K) row by row to ggml type ``dtype``;
    K must be a multiple of the type's block size. Returns the bytes as a
    uint8 array of ggml_row_size(dtype, K) * rows."""
    cdef int t = int(dtype)
    if t not in _QUANTIZABLE or ggml_quantize_requires_imatrix(<ggml_type>t):
        raise ValueError(f"cannot quantize to ggml type {t} "
                         f"({ggml_type_name(<ggml_type>t).decode() if _type_valid(t) else 'unknown'})")
    cdef cnp.ndarray a = np.ascontiguousarray(array, dtype=np.float32)
    if a.ndim < 1 or a.size == 0:
        raise ValueError("quantize: need a non-empty array")
    cdef int64_t k = a.shape[a.ndim - 1]
    cdef int64_t rows = a.size // k
    cdef int64_t blck = ggml_blck_size(<ggml_type>t)
    if k % blck != 0:
        raise ValueError(f"quantize: row length {k} is not a multiple of the block size {blck}")
    if not np.isfinite(a).all():
        raise ValueError("quantize: array has NaN or inf")
    cdef size_t row_size = ggml_row_size(<ggml_type>t, k)
    out = np.empty(rows * row_size, dtype=np.uint8)
    cdef cnp.ndarray o = out
    cdef size_t written
    cdef const float * src = <const float *>cnp.PyArray_DATA(a)
    cdef void * dst = cnp.PyArray_DATA(o)
    with nogil:
        written = ggml_quantize_chunk(<ggml_type>t, src, dst, 0, rows, k, NULL)
    if written != rows * row_size:
        raise GGMLError(f"quantize wrote {written} bytes, expected {rows * row_size}")
    return out


def dequantize(data, dtype, shape):
    """float32 array of NumPy ``shape`` from ggml type ``dtype`` bytes."""
    cdef int t = int(dtype)
    if not _type_valid(t):
        raise ValueError(f"unknown ggml type {dtype!r}")
    cdef const ggml_type_traits * tr = ggml_get_type_traits(<ggml_type>t)
    cdef int64_t ne[4]
    _shape_to_ne(shape, ne)
    cdef int64_t n = ne[0] * ne[1] * ne[2] * ne[3]
    if ne[0] % tr.blck_size != 0:
        raise ValueError(f"dequantize: row length {ne[0]} is not a multiple of the block size {tr.blck_size}")
    cdef size_t need = ggml_row_size(<ggml_type>t, ne[0]) * (n // ne[0] if ne[0] else 0)
    cdef cnp.ndarray raw = np.ascontiguousarray(np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8))
    if <size_t>raw.shape[0] != need:
        raise ValueError(f"dequantize: {raw.shape[0]} bytes given, {tr.type_name.decode()} {tuple(shape)} needs {need}")
    out = np.empty(tuple(shape), dtype=np.float32)
    if n == 0:
        return out
    cdef cnp.ndarray o = out
    if t == <int>GGML_TYPE_F32:
        memcpy(cnp.PyArray_DATA(o), cnp.PyArray_DATA(raw), need)
        return out
    if tr.to_float == NULL:
        raise ValueError(f"ggml cannot dequantize {tr.type_name.decode()}")
    cdef ggml_to_float_t fn = tr.to_float
    cdef const void * src = cnp.PyArray_DATA(raw)
    cdef float * dst = <float *>cnp.PyArray_DATA(o)
    with nogil:
        fn(src, dst, n)
    return out
