# Shared pieces: cimports, the error bridge, ggml's log -> Python logging,
# type tables, and _Handle, the base of every owner of a C handle.
#
# Ownership model: a _Handle may depend on other handles (a compute context
# on the context holding its weights, a context on the buffers and runtime
# its tensors were allocated in). A dependency is a strong reference plus a
# counter on the target. close() marks a handle closed at once (new use
# raises) but frees the C resource only when no live handle depends on it, so
# a graph that still points into it can never dangle.

cimport cython
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.string cimport memcpy, strcmp, strlen
from libc.stdlib cimport malloc, free
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

from toy_ggml._c.ggml cimport *
from toy_ggml._c.ggml_backend cimport *
from toy_ggml._c.ggml_alloc cimport *
from toy_ggml._c.ggml_cpu cimport *
from toy_ggml._c.ggml_rpc cimport *

import atexit
import logging

import numpy as np
cimport numpy as cnp

from toy_ggml.errors import GGMLError, ClosedError, RPCError

cnp.import_array()

# ggml's RPC backend (toy patch 0023): its registry and entry points, set when
# _dispatch.pxi's load_backend loads libggml-rpc.so; NULL without it.
cdef ggml_backend_reg_t _rpc_reg = NULL
cdef toy_rpc_connect_t _rpc_connect = NULL
cdef toy_rpc_backend_error_t _rpc_backend_error = NULL
cdef toy_rpc_buffer_error_t _rpc_buffer_error = NULL
cdef toy_rpc_serve_t _rpc_serve = NULL

_log = logging.getLogger("toy_ggml")

# --------------------------------------------------------------------------
# ggml log -> logging. ggml may log from its worker threads; `with gil`
# takes the GIL there. Partial lines (GGML_LOG_LEVEL_CONT) are joined.

cdef list _log_pending = []
cdef int _log_level_pending = 0
cdef bint _log_installed = False

cdef void _log_callback(ggml_log_level level, const char * text, void * user_data) noexcept with gil:
    global _log_level_pending
    try:
        s = text.decode("utf-8", "replace")
        if level != GGML_LOG_LEVEL_CONT:
            _log_level_pending = level
        _log_pending.append(s)
        if s.endswith("\n"):
            msg = "".join(_log_pending).rstrip("\n")
            _log_pending.clear()
            py_level = {GGML_LOG_LEVEL_DEBUG: logging.DEBUG, GGML_LOG_LEVEL_INFO: logging.INFO,
                        GGML_LOG_LEVEL_WARN: logging.WARNING, GGML_LOG_LEVEL_ERROR: logging.ERROR
                        }.get(_log_level_pending, logging.INFO)
            _log.log(py_level, "%s", msg)
    except BaseException:
        pass


def _install_log_bridge():
    global _log_installed
    if not _log_installed:
        ggml_log_set(_log_callback, NULL)
        _log_installed = True


def _remove_log_bridge():
    # At interpreter shutdown logging may be gone; give ggml back its default.
    global _log_installed
    if _log_installed:
        ggml_log_set(NULL, NULL)
        _log_installed = False


_install_log_bridge()
atexit.register(_remove_log_bridge)

# --------------------------------------------------------------------------
# types

DEF _N_TYPES = 43  # GGML_TYPE_COUNT in ggml 0.25.3 (checked at import below)

if <int>GGML_TYPE_COUNT != _N_TYPES:
    raise ImportError(f"toy_ggml was written for GGML_TYPE_COUNT={_N_TYPES}, ggml has {<int>GGML_TYPE_COUNT}")

cdef inline bint _type_valid(int t) noexcept:
    if t < 0 or t >= _N_TYPES:
        return False
    return ggml_get_type_traits(<ggml_type>t).blck_size > 0 and ggml_get_type_traits(<ggml_type>t).type_size > 0


def type_info(int t):
    """(name, block_size, type_size, is_quantized, can_dequantize) of ggml type ``t``."""
    if not _type_valid(t):
        raise ValueError(f"unknown ggml type {t}")
    cdef const ggml_type_traits * tr = ggml_get_type_traits(<ggml_type>t)
    return (tr.type_name.decode(), tr.blck_size, tr.type_size, bool(tr.is_quantized), tr.to_float != NULL)


def type_count():
    return _N_TYPES


def op_name(int op):
    if op < 0 or op >= <int>GGML_OP_COUNT:
        raise ValueError(f"unknown ggml op {op}")
    return ggml_op_name(<ggml_op>op).decode()


def op_count():
    return <int>GGML_OP_COUNT


def unary_op_name(int op):
    if op < 0 or op >= <int>GGML_UNARY_OP_COUNT:
        raise ValueError(f"unknown ggml unary op {op}")
    return ggml_unary_op_name(<ggml_unary_op>op).decode()


def unary_op_count():
    return <int>GGML_UNARY_OP_COUNT


def glu_op_name(int op):
    if op < 0 or op >= <int>GGML_GLU_OP_COUNT:
        raise ValueError(f"unknown ggml glu op {op}")
    return ggml_glu_op_name(<ggml_glu_op>op).decode()


def glu_op_count():
    return <int>GGML_GLU_OP_COUNT


def ggml_version_string():
    return ggml_version().decode()


def status_name(int status):
    return ggml_status_to_string(<ggml_status>status).decode()


cdef inline int _check_status(ggml_status st, str what) except -1:
    if st != GGML_STATUS_SUCCESS:
        raise GGMLError(f"{what} failed: {ggml_status_to_string(st).decode()} (status {<int>st})")
    return 0


# --------------------------------------------------------------------------
# handles

cdef class _Handle:
    """Base of every owner of a C handle (see the module notes on ownership)."""
    cdef bint _closed
    cdef bint _freed
    cdef int _n_dependents
    cdef list _deps

    def __cinit__(self):
        self._closed = False
        self._freed = False
        self._n_dependents = 0
        self._deps = []

    cdef void _free_resources(self) noexcept:
        pass

    cdef int _add_dep(self, _Handle other) except -1:
        cdef _Handle d
        for d in self._deps:
            if d is other:
                return 0
        self._deps.append(other)
        other._n_dependents += 1
        return 0

    cdef void _maybe_free(self) noexcept:
        cdef _Handle d
        if self._closed and self._n_dependents == 0 and not self._freed:
            self._freed = True
            self._free_resources()
            deps = self._deps or ()  # None after the garbage collector cleared a cycle's attributes
            self._deps = []
            for d in deps:
                d._n_dependents -= 1
                d._maybe_free()

    def close(self):
        """Release the handle. Idempotent. Memory that other live objects
        still point into is kept until they are gone."""
        if not self._closed:
            self._closed = True
            self._maybe_free()

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    cdef inline int _check_open(self) except -1:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        return 0
