"""tools/serve_api_docs.py: the schema rendering on synthetic schemas, and --check on the committed page."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("serve_api_docs", ROOT / "tools/serve_api_docs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


sad = _load()


def test_types_and_constraints():
    prompt = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0.0}, "minItems": 1, "maxItems": 8},
            {"type": "null"},
        ]
    }
    assert sad.type_of(prompt) == "`string` or array of `integer` or `null`"
    assert sad.constraints(prompt) == "`string`: at least 1 character; array of `integer`: 1 to 8 items, each >= 0"
    seed = {"anyOf": [{"type": "integer", "minimum": -1.0, "exclusiveMaximum": 9.223372036854776e18}, {"type": "null"}]}
    assert sad.constraints(seed) == "in [-1, 2^63)"  # a nullable field: the one member's constraints, no prefix
    assert sad.constraints({"type": "number", "exclusiveMinimum": 0.0, "maximum": 10.0}) == "in (0, 10]"
    assert sad.constraints({"type": "array", "items": {"type": "string"}, "maxItems": 16}) == "at most 16 items"
    assert sad.type_of({"$ref": "#/components/schemas/ChatMessage"}) == "[ChatMessage](#chatmessage)"
    assert sad.type_of({"type": "object", "additionalProperties": {"type": "number"}}) == "object of `number`"
    assert sad.type_of({"enum": ["float", "base64"], "type": "string"}) == '`"float"` or `"base64"`'
    assert sad.default_of("x", {"type": "integer"}, set()) == "`null`"  # FastAPI drops null defaults
    assert sad.default_of("x", {"type": "integer", "default": 16}, set()) == "`16`"
    assert sad.default_of("x", {"type": "integer"}, {"x"}) == "*required*"


def test_slug_matches_python_markdown():
    from markdown.extensions.toc import slugify

    for heading in ("POST /v1/chat/completions", "GET /health", "Error codes", "ChatMessage"):
        assert sad.slug(heading) == slugify(heading, "-")


def test_field_notes_must_cover_every_field_and_be_used(monkeypatch):
    notes = sad.Notes()
    assert notes.description("M", "x", {"description": "from the schema"}) == "from the schema"
    with pytest.raises(sad.ApiDocsError, match=r"M\.nope has no description"):
        notes.description("M", "nope", {})
    monkeypatch.setitem(sad.FIELD_NOTES, "Gone.field", "a note for a field that no longer exists")
    schema = sad.load_schema()
    with pytest.raises(sad.ApiDocsError, match="Gone.field"):
        sad.render(
            schema, [], sad.source_error_codes(), {"max_body_bytes": "1", "max_queue": "1", "jobs_per_request": "1"}
        )


def test_routes_and_error_codes_must_match_the_app(monkeypatch):
    schema = sad.load_schema()
    codes = sad.source_error_codes()
    values = {"max_body_bytes": "1", "max_queue": "1", "jobs_per_request": "1"}
    monkeypatch.delitem(sad.ROUTES, ("POST", "/tokenize"))
    with pytest.raises(sad.ApiDocsError, match="routes without an entry"):
        sad.render(schema, [], codes, values)
    monkeypatch.undo()
    with pytest.raises(sad.ApiDocsError, match="ERROR_CODES lacks"):
        sad.render(schema, [], codes | {"brand_new_code"}, values)


def test_page_covers_every_route_and_field():
    schema = sad.load_schema()
    text = (ROOT / sad.PAGE).read_text(encoding="utf-8")
    for path, item in schema["paths"].items():
        for method in item:
            assert f"\n## {method.upper()} {path}\n" in text
    for name, comp in schema["components"]["schemas"].items():
        for field in comp.get("properties", {}):
            assert re.search(rf"^\| `{field}` \|", text, re.M), f"{name}.{field}"


def test_check_passes_on_committed_page(capsys):
    assert sad.main(["--check"]) == 0, capsys.readouterr().err


def test_check_fails_on_stale_page(tmp_path, capsys):
    page = tmp_path / sad.PAGE
    page.parent.mkdir(parents=True)
    committed = (ROOT / sad.PAGE).read_text(encoding="utf-8")
    stale = committed.replace("| `n` | `integer` | `1` | in [1, 8] |", "| `n` | `integer` | `1` | in [1, 16] |")
    assert stale != committed
    page.write_text(stale, encoding="utf-8")
    assert sad.main(["--check"], root=tmp_path) == 1
    err = capsys.readouterr().err
    assert "docs/reference/serve-api.md is stale: run `just api-docs`" in err
    assert "-| `n` | `integer` | `1` | in [1, 16] |" in err  # the diff shows the line
    page.unlink()
    assert sad.main(["--check"], root=tmp_path) == 1


def test_write_then_check(tmp_path):
    assert sad.main([], root=tmp_path) == 0
    assert (tmp_path / sad.PAGE).read_text(encoding="utf-8") == (ROOT / sad.PAGE).read_text(encoding="utf-8")
    assert sad.main(["--check"], root=tmp_path) == 0
