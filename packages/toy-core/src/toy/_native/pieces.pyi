"""Type stub of toy._native.pieces (Cython, pieces.pyx), which mypy cannot read.

Keep it in step with the ``def`` signature there (``just lint`` compares them: mypy's stubtest).
``alphabet``: a C-contiguous int16 buffer (``const short[::1]``).
"""

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

def build_pieces(
    tokens: list[str],
    attrs: list[int],
    byte_level: bool,
    alphabet: npt.NDArray[np.int16] | Buffer,
    hidden: int,
    user: int,
    normal: int,
    byte: int,
    spm_piece: Callable[[str], bytes],
    byte_piece: Callable[[str], bytes],
    byte_level_piece: Callable[[str], bytes],
) -> tuple[list[bytes], list[bytes]]: ...
