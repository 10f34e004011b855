"""Property-based fuzzing of the POST endpoints from the server's own OpenAPI schema (schemathesis).

For each POST operation of /openapi.json, schemathesis generates requests
that fit the schema (positive) and requests that break it (negative), and
sends them to a LIVE server. The properties, from app.py's invariants:

- no response is a 5xx (schemathesis' ``not_a_server_error`` check): the
  schema states the real constraints and anything else is the client's
  error (4xx);
- every error is in OpenAI's shape ``{"error": {"message", "type", "param",
  "code"}}`` and carries ``x-request-id``;
- a positive example is never refused as malformed: its status is 200, or
  400 only for the checks the schema cannot state (the context budget,
  token ids outside the vocabulary, the jobs-per-request bound, the
  unsupported options), each with its documented ``code``/``param``. A
  positive example's ``model`` is set to the served alias (a random name
  would only ever get ``model_not_found``).

Bounded work: the server runs over its own copy of the model with a 64-token
context and 2 slots, and ``max_batch=4``, so a request is at most 4 jobs of
64 tokens (the budget check refuses more before anything runs).
"""

from __future__ import annotations

import json
import os
import re

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
# A longer hunt: TOY_FUZZ_EXAMPLES=300 TOY_FUZZ_RANDOM=1 (new examples each run instead of the fixed ones).
MAX_EXAMPLES = int(os.environ.get("TOY_FUZZ_EXAMPLES", "25"))
# 400s a schema-valid request may still get, each named by its code or param (app.py, schemas.py)
ALLOWED_400 = {
    ("context_length_exceeded", None),
    (None, "n"),
    (None, "prompt"),
    (None, "input"),
    (None, "tokens"),
    (None, "logit_bias"),
    (None, "suffix"),
    (None, "best_of"),
    (None, "tools"),
    (None, "response_format"),
    (None, "top_logprobs"),
    (None, "dimensions"),
    (None, "functions"),
    (None, "function_call"),
    (None, "tool_choice"),
}
# params of a positive example's 400 matched whole (a message's tool call fields: schemas.py refuses them)
ALLOWED_400_PARAMS = re.compile(r"messages\.\d+\.(tool_calls|function_call)")


@pytest.fixture(scope="module")
def fuzz_live(smollm2_path, serve_settings, serving):
    import toy

    m = toy.load(smollm2_path, n_ctx=64, n_slot=2, threads=2, exact_batching=True)
    try:
        with serving(serve_settings(max_batch=4, max_queue=16), m) as live:
            yield live
    finally:
        m.close()


@pytest.fixture(scope="module")
def schema(fuzz_live):
    import schemathesis

    return schemathesis.openapi.from_url(fuzz_live.url + "/openapi.json")


def _error(response) -> dict:
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", POST_PATHS)
def test_fuzz_no_server_errors(fuzz_live, schema, path, mode):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    op = schema[path]["POST"]
    alias = fuzz_live.srv.settings.alias
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("TOY_FUZZ_RANDOM") != "1",  # CI: the same examples every run
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=generation))
    def run(case):
        if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = alias  # a random name is refused first (model_not_found): go further
        response = case.call(base_url=fuzz_live.url, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.headers.get("x-request-id"), response.headers
        if response.status_code >= 400:
            err = _error(response)
            if mode == "positive" and response.status_code == 400:
                param = (err["param"] or "").split(".")[0] or None
                allowed = (err["code"], None) in ALLOWED_400 or (None, param) in ALLOWED_400
                assert allowed or ALLOWED_400_PARAMS.fullmatch(err["param"] or ""), (case.body, err)
            if mode == "positive":
                assert response.status_code in (400, 413), (case.body, err)

    run()
    assert sum(seen.values()) >= 1
    # the server is still up and answering afterwards
    assert fuzz_live.http.get("/health").status_code == 200
    assert fuzz_live.srv.worker.busy() == 0
