"""Type stub of toy._native.gguf_scan (Cython, gguf_scan.pyx), which mypy cannot read.

Keep it in step with the ``def`` signatures there (``just lint`` compares them: mypy's stubtest).
``buf``: a C-contiguous byte buffer (``const unsigned char[::1]``).
"""

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# NumPy arrays are buffers; numpy's stubs say so (__buffer__) only for Python 3.12+
_Bytes = Buffer | npt.NDArray[np.uint8]

class ScanError(ValueError):
    """(index, reason): string ``index`` is truncated or not UTF-8."""

def scan_strings(buf: _Bytes, pos: int, count: int) -> tuple[list[str], int]: ...
def index_strings(buf: _Bytes, pos: int, count: int) -> tuple[npt.NDArray[np.int64], int]: ...
def scan_pairs(buf: _Bytes, pos: int, count: int) -> tuple[list[tuple[str, str]], int]: ...
