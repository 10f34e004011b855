# cython: language_level=3, boundscheck=False, wraparound=False
"""The byte pieces of a vocabulary in one native pass (``toy.tokenizer.build``
decides what each token renders as; a Python loop over ~50k tokens costs
~30 ms, most of a tokenizer's build)."""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdlib cimport free, malloc


def build_pieces(list tokens, list attrs, bint byte_level, const short[::1] alphabet, int hidden, int user,
                 int normal, int byte, spm_piece, byte_piece, byte_level_piece):
    """(rendered, plain) lists of bytes, one per token. ``hidden``: the
    attribute bits of tokens rendered as their text and empty in ``plain``;
    ``user``: rendered as their text; ``normal``: through the model's
    alphabet: ``byte_level`` tokens map each character through
    ``alphabet`` (code point -> byte, -1 for none; a token with a character
    outside it goes to ``byte_level_piece(text)``), other models' through
    ``spm_piece(text)``; ``byte``: ``byte_piece(text)``; anything else
    renders nothing."""
    cdef Py_ssize_t n = len(tokens), i, j, ln, top = alphabet.shape[0]
    cdef list rendered = [None] * n
    cdef list plain = [None] * n
    cdef int a
    cdef Py_UCS4 c
    cdef short b
    cdef char * buf = NULL
    cdef Py_ssize_t cap = 0
    cdef str text
    cdef bint ok
    empty = b""
    try:
        for i in range(n):
            text = tokens[i]
            a = attrs[i]
            if a & hidden:
                rendered[i] = text.encode("utf-8")
                plain[i] = empty
                continue
            if a & user:
                piece = text.encode("utf-8")
            elif a & normal:
                if byte_level:
                    ln = len(text)
                    if ln > cap:
                        free(buf)
                        cap = max(ln, 256)
                        buf = <char *>malloc(cap)
                        if buf == NULL:
                            raise MemoryError()
                    ok = True
                    j = 0
                    for c in text:
                        b = alphabet[c] if <Py_ssize_t>c < top else -1
                        if b < 0:
                            ok = False
                            break
                        buf[j] = <char>b
                        j += 1
                    piece = PyBytes_FromStringAndSize(buf, ln) if ok else byte_level_piece(text)
                else:
                    piece = spm_piece(text)
            elif a & byte:
                piece = byte_piece(text)
            else:
                piece = empty
            rendered[i] = piece
            plain[i] = piece
    finally:
        free(buf)
    return rendered, plain
