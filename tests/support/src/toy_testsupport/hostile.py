"""Hostile constraints shared by the library and server hardening tests
(``from toy_testsupport.hostile import ...``): chains that made llguidance's
compiler recurse once per link until the stack overflowed (issue 42, item 8)."""

from __future__ import annotations


def lark_chain(n: int) -> str:
    """A Lark grammar of ``n + 1`` rules, each naming the next."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    """The same chain in llama.cpp's GBNF."""
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int, wrap: str | None = None) -> dict:
    """A JSON schema whose ``$defs`` form an ``n``-link ``$ref`` chain; ``wrap`` ("items" or "anyOf") puts each
    ``$ref`` inside that keyword."""
    defs: dict = {}
    for i in range(n):
        ref: dict = {"$ref": f"#/$defs/d{i + 1}"}
        if wrap == "items":
            ref = {"type": "array", "items": ref}
        elif wrap == "anyOf":
            ref = {"anyOf": [ref, {"type": "null"}]}
        defs[f"d{i}"] = ref
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


__all__ = ["gbnf_chain", "lark_chain", "ref_chain"]
