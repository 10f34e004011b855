"""Hardening of tools and request errors on a live server over SmolLM2 (issue 42, items 11-13).

- 11, role injection through tools: with a chat template that reads ``tools``
  (``toy_testsupport.chat_templates.TOOLS_CHATML``, Qwen2.5-style, swapped in
  for the module), ChatML markup in a tool's description, a property's
  description, an enum value or a property name stays text: the prompt holds
  the template's three ``<|im_start|>`` ids, not seven (the expected ids come
  from ``render_protected`` + ``encode_protected``; the raw rendering is what
  the server used to count).
- 12, pydantic-style tool schemas: parameters with ``$defs`` and
  ``"$ref": "#/$defs/City"`` (``openai.pydantic_function_tool`` of pydantic
  models: a nested ``City``, an enum), and two functions whose ``City`` differ,
  work under a forced, a named and a strict call, and the arguments validate
  against the function's schema (``jsonschema``). Before: 400 "Pointer
  '/$defs/City' does not exist".
- 13, errors: parameters that do not compile under a forced, named or strict
  call answer 400 naming ``tools.N.function.parameters`` and the schema, with
  none of toy's call grammar (before: ``param`` "messages" and the grammar);
  a ``logit_bias`` key of 5,000 digits answers 400 naming ``logit_bias`` (before:
  500, Python's int-string limit); a lone surrogate in an object key answers 400
  with an encodable body naming the key escaped (before: 500, the 400 could not
  be encoded). Raw HTTP for these, as a client may refuse to send them.
"""

from __future__ import annotations

import json
from enum import Enum

import httpx
import pytest
from pydantic import BaseModel, Field

from toy.tokenizer.chat import ChatTemplate
from toy_testsupport.chat_templates import TOOLS_CHATML, injected_tool

pytestmark = pytest.mark.model

ASK = [{"role": "user", "content": "What is the weather in Paris, France, in celsius?"}]


@pytest.fixture(scope="module")
def serve_model(smollm2_path):
    """SmolLM2 with room for pydantic's verbose schemas in the prompt (toy's default tool block lists them
    all), and a chat template this module may swap without touching the session's model."""
    import toy

    m = toy.load(smollm2_path, n_ctx=1024, n_slot=2, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving):
    with serving(serve_settings(), serve_model) as s:
        yield s


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


def post(http, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return http.post(path, content=body, headers={"content-type": "application/json"})


def error_of(r: httpx.Response) -> dict:
    return json.loads(r.content.decode("utf-8"))["error"]  # strict UTF-8: the body must be encodable


# -- 11: tool strings reach a template that reads tools, as text


@pytest.fixture
def tools_template(serve_model):
    before = serve_model.chat_template
    serve_model.chat_template = ChatTemplate(TOOLS_CHATML)
    try:
        yield serve_model.chat_template
    finally:
        serve_model.chat_template = before


def test_markup_in_tools_is_text_in_the_prompt(http, serve_model, tools_template):
    tok, tools = serve_model.tokenizer, [injected_tool()]
    start = tok.token_to_id("<|im_start|>")
    text, spans = tools_template.render_protected(ASK, tok.special_spans, tools=tools)
    want = tok.encode_protected(text, spans)
    raw = tok.encode(tools_template.render(ASK, tools=tools))
    assert want.count(start) == 3 and raw.count(start) == 7
    r = post(http, {"messages": ASK, "tools": tools, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want) != len(raw)
    # named and forced calls render the same prompt
    r = post(http, {"messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text


# -- 12: pydantic-style schemas ($defs, $ref) under forced, named and strict calls


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


class GetWeather(BaseModel):
    city: City
    unit: Unit


def population_tool():
    class City(BaseModel):  # the same name as the other tool's City, another shape
        name: str = Field(max_length=12)
        year: int = Field(ge=1900, le=2100)

    class GetPopulation(BaseModel):
        city: City

    return GetPopulation


def pydantic_tools() -> list[dict]:
    import openai

    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(population_tool())]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    assert '"$ref": "#/$defs/City"' in json.dumps(tools[0])
    return tools


def check_arguments(message, tools: list[dict], names: set[str]) -> None:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice", ["required", "GetWeather", "GetPopulation"])
def test_pydantic_schemas_under_forced_and_named_calls(client, live, choice):
    tools = pydantic_tools()
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    r = client.chat.completions.create(
        model=live.srv.settings.alias, messages=ASK, tools=tools, tool_choice=tool_choice, temperature=0,
        max_tokens=60, parallel_tool_calls=False,
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    check_arguments(c.message, tools, {"GetWeather", "GetPopulation"} if choice == "required" else {choice})


def test_pydantic_schemas_under_strict_auto(client, live, serve_model):
    from toy.engine.constrain import Matcher, prepare
    from toy_serve.tools import strict_auto

    tools = pydantic_tools()
    assert all(t["function"]["strict"] for t in tools)
    r = client.chat.completions.create(
        model=live.srv.settings.alias, messages=ASK, tools=tools, temperature=0, max_tokens=60
    )  # before: 400, Pointer '/$defs/City' does not exist
    if r.choices[0].message.tool_calls:
        check_arguments(r.choices[0].message, tools, {"GetWeather", "GetPopulation"})
    # the constraint itself holds calls to each function's own City
    tok = serve_model.tokenizer
    cons = prepare(strict_auto(tools, parallel=True), tok)

    def allowed(text: str) -> bool:
        m = Matcher(cons, tok, tok.vocab_size)
        for t in tok.encode(text, add_special=False):
            if not m.allowed()[t]:
                return False
            m.advance(t)
        return True

    call = '<tool_call>\n{"name":"%s","arguments":{"city":%s%s}}\n</tool_call>'
    paris = '{"name":"Paris","country":"France"}'
    assert allowed("Sure. " + call % ("GetWeather", paris, ',"unit":"celsius"'))
    assert allowed(call % ("GetPopulation", '{"name":"Paris","year":2020}', ""))
    assert not allowed(call % ("GetPopulation", paris, ""))  # the other tool's City
    assert not allowed(call % ("GetWeather", paris, ',"unit":"kelvin"'))


def test_relocated_references_compile_recursive_and_clashing_schemas(serve_model):
    from toy.engine.constrain import prepare
    from toy_serve.tools import call_schema, forced_call, relocate

    class Node(BaseModel):
        value: int
        children: list[Node] = []

    node = {"type": "function", "function": {"name": "tree", "parameters": Node.model_json_schema()}}
    tools = [*pydantic_tools(), node]
    for parallel in (False, True):
        prepare(forced_call(tools, parallel), serve_model.tokenizer)  # before: Pointer '/$defs/...' does not exist
    schema = call_schema(tools)
    assert set(schema["$defs"]) == {"tool0", "tool1", "tool2"}
    assert schema["$defs"]["tool2"]["$ref"] == "#/$defs/tool2/$defs/Node"
    # data and anchors are not references; property names may be any keyword
    s = {"properties": {"enum": {"$ref": "#/$defs/A"}, "$ref": {"type": "string"}}, "default": {"$ref": "#/x"},
         "items": {"$ref": "#a"}, "anyOf": [{"$ref": "#"}]}  # fmt: skip
    assert relocate(s, "#/$defs/t") == {
        "properties": {"enum": {"$ref": "#/$defs/t/$defs/A"}, "$ref": {"type": "string"}},
        "default": {"$ref": "#/x"}, "items": {"$ref": "#a"}, "anyOf": [{"$ref": "#/$defs/t"}],
    }  # fmt: skip


# -- 13: the field and the words of errors


BAD_PARAMS = {"type": "object", "properties": {"q": {"type": "string", "pattern": "(("}}}  # an unclosed group


def bad_tools() -> list[dict]:
    ok = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": BAD_PARAMS}}
    return [ok, bad]


@pytest.mark.parametrize("how", ["required", "named", "strict"])
def test_parameters_that_do_not_compile_name_the_function(http, how):
    tools = bad_tools()
    body = {"messages": ASK, "tools": tools, "max_tokens": 1}
    if how == "required":
        body["tool_choice"] = "required"
    elif how == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "bad"}}
    else:
        tools[1]["function"]["strict"] = True
    r = post(http, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "tools.1.function.parameters", err
    assert err["message"].startswith("tools.1.function.parameters (function 'bad'): the JSON schema "), err
    assert "unclosed group" in err["message"]
    for internal in ("%json", "tool_call", "grammar", "start:", "tool0"):
        assert internal not in err["message"], err


@pytest.mark.parametrize("key", ["1" * 5000, "0" * 5000 + "7"], ids=["5000-digits", "leading-zeros"])
def test_huge_logit_bias_key_is_a_400(http, key):
    for path, body in [
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "logit_bias": {key: 1}}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {key: 1}}),
    ]:
        r = post(http, body, path)
        if key.lstrip("0") == "7":  # many digits, but token 7: fine
            assert r.status_code == 200, r.text
            continue
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "logit_bias", r.text
        assert "not a token id" in err["message"] and len(err["message"]) < 200, err


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"\\ud800": 1}}',
         "logit_bias.\\ud800"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "\\udfffx": 1}', "\\udfffx"),
        (b'{"messages": [{"role": "user", "content": "hi", "\\ud83d": "x"}], "max_tokens": 1}',
         "messages.0.\\ud83d"),
    ],
)  # fmt: skip
def test_lone_surrogate_in_a_key_is_a_400_that_can_be_encoded(http, body, param):
    r = post(http, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["code"] == "invalid_value" and "surrogate" in err["message"], err
    assert http.get("/health").status_code == 200
