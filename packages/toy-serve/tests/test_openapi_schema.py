"""The published OpenAPI document (no model needed: ``create_app`` loads nothing until startup).

References: app.py's docstring (validation errors answer 400, not FastAPI's
422, and every error status is documented in OpenAI's error shape) and
schemas.py's ("/openapi.json states the real constraints"). The request
models' own JSON schema (pydantic, ``model_json_schema()``) is the reference
for every numeric bound: a JSON number means the decimal it spells (JSON
Schema validators such as jsonschema-rs, and schemathesis' generator, read it
so), hence the bounds are compared as exact decimals (``Fraction(str(v))``).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from toy_serve import Settings, create_app
from toy_serve import schemas as S

POST_ROUTES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
MODELS = {
    "CompletionRequest": S.CompletionRequest,
    "ChatCompletionRequest": S.ChatCompletionRequest,
    "EmbeddingRequest": S.EmbeddingRequest,
    "TokenizeRequest": S.TokenizeRequest,
    "DetokenizeRequest": S.DetokenizeRequest,
}
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@pytest.fixture(scope="module")
def openapi():
    return create_app(Settings(model="not-loaded.gguf")).openapi()


def test_routes_and_error_responses(openapi):
    paths = openapi["paths"]
    assert set(POST_ROUTES) <= set(paths)
    assert {"/health", "/v1/models", "/metrics"} <= set(paths)
    for path, model in POST_ROUTES.items():
        op = paths[path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        responses = op["responses"]
        assert "422" not in responses, path
        for code in ("400", "401", "413", "429", "500", "503"):
            schema = responses[code]["content"]["application/json"]["schema"]
            assert schema["$ref"] == "#/components/schemas/ErrorResponse", (path, code)
    for item in paths.values():
        for op in item.values():
            assert "422" not in op.get("responses", {})
    components = openapi["components"]["schemas"]
    assert "HTTPValidationError" not in components and "ValidationError" not in components
    assert set(components["ErrorResponse"]["properties"]) == {"error"}


def _numeric_bounds(node, path=()):
    """(json path, keyword, value) of every numeric bound in a schema tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield path, k, v
            else:
                yield from _numeric_bounds(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numeric_bounds(v, (*path, str(i)))


def _bound_cases():
    cases = []
    for name, model in MODELS.items():
        for field, prop in model.model_json_schema()["properties"].items():
            if not any(_numeric_bounds(prop)):
                continue
            cases.append(pytest.param(name, field, id=f"{name}.{field}"))
    return cases


@pytest.mark.parametrize(("name", "field"), _bound_cases())
def test_published_bounds_are_the_real_ones(openapi, name, field):
    published = openapi["components"]["schemas"][name]["properties"][field]
    real = MODELS[name].model_json_schema()["properties"][field]
    got = sorted((p, k, Fraction(str(v))) for p, k, v in _numeric_bounds(published))
    want = sorted((p, k, Fraction(str(v))) for p, k, v in _numeric_bounds(real))
    assert got == want


def test_cli_defaults_equal_settings_defaults():
    """cli.py repeats the host/port defaults so `toy --help` needn't import toy."""
    from toy_serve import cli
    from toy_serve.settings import DEFAULT_HOST, DEFAULT_PORT

    assert (cli.DEFAULT_HOST, cli.DEFAULT_PORT) == (DEFAULT_HOST, DEFAULT_PORT)
