"""ggml tensor types as a Python enum, and each type's traits.

Values are ggml's (and GGUF's) type ids in ggml 0.25.3; names are ggml's own
type names upper-cased. Ids 4, 5 and 31-33, 36-38 were removed from ggml and
are absent here. A test checks every member against ``ggml_type_name``.

``type_info(t)`` is the public face of ggml's type traits (block size, bytes
per block): what a GGUF reader or writer needs to size tensor data. It asks
the extension module, which ``import toy_ggml`` has loaded already.
"""

from enum import IntEnum
from typing import NamedTuple


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42

    @classmethod
    def parse(cls, value: "str | int | GGMLType") -> "GGMLType":
        """Accept an enum member, an id, or a name in any case ("q8_0")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"unknown ggml type id {value}") from None
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                names = ", ".join(m.name for m in cls)
                raise ValueError(f"unknown ggml type {value!r}; known: {names}") from None
        raise TypeError(f"expected a ggml type name or id, got {type(value).__name__}")


F32, F16, BF16, Q8_0, Q4_0, Q4_1, I32, I64 = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.I32,
    GGMLType.I64,
)


class TypeTraits(NamedTuple):
    """ggml's traits of one tensor type."""

    name: str  # ggml's type name ("q8_0", "q4_K")
    block_size: int  # elements per block (1 for unquantized types)
    type_size: int  # bytes per block
    is_quantized: bool
    can_dequantize: bool  # ggml has a to-float conversion for it


def type_info(t: "GGMLType | int | str") -> TypeTraits:
    """The traits of ggml type ``t`` (a member, an id or a name);
    ``ValueError`` for a type ggml does not know."""
    # at call time: _core imports this module (GGMLType), so this module cannot import _core at its top
    from toy_ggml import _core

    return TypeTraits(*_core.type_info(int(GGMLType.parse(t))))
