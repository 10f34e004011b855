"""Tool calls in /v1/chat/completions (toy_serve.tools), through the official openai client.

With the real SmolLM2-135M-Instruct: forced calls (``required``, a named
function) carry arguments valid for the function's schema (checked with
``jsonschema``), greedy and sampled, streamed deltas reassemble to the plain
message, a conversation continues after a ``tool`` result, and
``tool_choice: "none"`` never yields a call even when the text holds one, and
a ``strict`` function constrains the calls the model writes under ``"auto"``
(the same request without ``strict`` gives broken blocks, with it valid calls).
The parser and the default rendering are checked on their own, and a template
that knows tools gets them (and the history's calls) as variables.
"""

from __future__ import annotations

import json

import pytest

from toy_serve.tools import ToolParser, render_messages, strict_auto, template_knows_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


# ------------------------------------------------------------------ the parser and the rendering (no model)


def test_parser_splits_content_and_calls_whatever_the_chunking():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "add", "parameters": {"a": 3, "b": 4}}\n</tool_call>\n'
    whole = ToolParser({"add"})
    deltas = whole.feed(text) + whole.finish()
    calls = [v for k, v in deltas if k == "call"]
    assert calls == [{"name": "add", "arguments": '{"a":1,"b":2}'}, {"name": "add", "arguments": '{"a":3,"b":4}'}]
    # an unknown function stays text, whitespace around calls is not content
    assert whole.message_content() == 'Let me check.\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    for size in (1, 2, 3, 5, 7, 11):
        p = ToolParser({"add"})
        got = [d for i in range(0, len(text), size) for d in p.feed(text[i : i + size])] + p.finish()
        assert [v for k, v in got if k == "call"] == calls
        assert "".join(v for k, v in got if k == "content") == whole.message_content()


def test_parser_plain_text_and_broken_blocks_stay_content():
    for text in [
        "Hello <tool and </tool_call> x  ",
        "a <tool_call>{not json}</tool_call> b",
        'ends <tool_call>{"name"',
    ]:
        p = ToolParser({"add"})
        out = p.feed(text) + p.finish()
        assert "".join(v for k, v in out if k == "content") == text and not p.calls
    p = ToolParser({"add"})
    assert p.feed("  \n ") + p.finish() == [] and p.message_content() is None


def test_default_rendering_and_a_template_that_knows_tools():
    from toy.tokenizer.chat import ChatTemplate

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    out = render_messages(history, [ADD], native=False)
    assert out[0]["role"] == "system" and out[0]["content"].endswith("\n\nBe brief.")
    assert json.dumps(ADD) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    # a template with its own tool syntax gets the tools and the calls (arguments as objects)
    src = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.a }}){% endif %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    tpl = ChatTemplate(src)
    assert template_knows_tools(tpl) and not template_knows_tools(ChatTemplate.default())
    native = render_messages(history, [ADD], native=True)
    text = tpl.render(native, add_generation_prompt=False, tools=[ADD])
    assert text == "[add]system:Be brief.;user:1+2?;assistant:add(1);tool:3#c1;"


# ------------------------------------------------------------------ the live server


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving):
    with serving(serve_settings(), serve_model) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


def check_calls(message, names=None):
    import jsonschema

    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.model
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", ["required", "add", "get_weather"])
def test_forced_call_has_valid_arguments(client, live, choice, sampling):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = {"model": live.srv.settings.alias, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    r = client.chat.completions.create(**kw, max_tokens=200, **sampling)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    check_calls(c.message, None if choice == "required" else {choice})
    one = client.chat.completions.create(**kw, max_tokens=200, parallel_tool_calls=False, **sampling)
    assert len(one.choices[0].message.tool_calls) == 1
    check_calls(one.choices[0].message)


@pytest.mark.model
def test_streamed_tool_calls_reassemble_to_the_message(client, live):
    kw = {"model": live.srv.settings.alias, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
          "temperature": 0, "max_tokens": 200}  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                e = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                e["id"] = t.id or e["id"]
                e["name"] += (t.function.name or "") if t.function else ""
                e["arguments"] += (t.function.arguments or "") if t.function else ""
    assert finish == full.finish_reason == "tool_calls" and content == ""
    want = [(t.function.name, t.function.arguments) for t in full.message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
    assert all(e["id"].startswith("call_") for e in calls.values())


@pytest.mark.model
def test_conversation_continues_after_a_tool_result(client, live, serve_model):
    first = client.chat.completions.create(
        model=live.srv.settings.alias, messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=200,
    ).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]  # fmt: skip
    r = client.chat.completions.create(model=live.srv.settings.alias, messages=history, tools=TOOLS, temperature=0,
                                       max_tokens=40)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content
    # the prompt held the call and the result, rendered as toy's default (SmolLM2's template has no tools)
    rendered = serve_model.render_chat(render_messages(history_plain(history), TOOLS, False))
    assert r.usage.prompt_tokens == len(serve_model.tokenize(rendered))
    assert "<tool_response>" in rendered and '"sky": "sunny"' in rendered and '"name": "get_weather"' in rendered


def history_plain(history):
    from toy_serve.schemas import ChatMessage

    return [ChatMessage.model_validate(m).plain() for m in history]


@pytest.mark.model
def test_tool_choice_none_never_calls(client, live):
    """The same text, a well-formed call of a given function (forced by a regex), is a call under "auto"
    and plain content under "none"."""
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    kw = {"model": live.srv.settings.alias, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
          "extra_body": {"regex": block.replace("{", "\\{").replace("}", "\\}")}}  # fmt: skip
    auto = client.chat.completions.create(**kw, tool_choice="auto").choices[0]
    assert auto.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in auto.message.tool_calls] == [("add", '{"a":2,"b":3}')]
    none = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content == block and none.finish_reason == "stop"
    for sampled in range(3):  # and nothing the model writes freely becomes a call
        free = client.chat.completions.create(model=live.srv.settings.alias, messages=ASK, tools=TOOLS,
                                              tool_choice="none", temperature=1.0, seed=sampled, max_tokens=30)  # fmt: skip
        assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason != "tool_calls"


# ------------------------------------------------------------------ strict functions under tool_choice "auto"


def strict_tools(strict: bool = True) -> list[dict]:
    return [{**t, "function": {**t["function"], "strict": strict}} for t in TOOLS]


def walk(cons, tokenizer, text: str) -> tuple[bool, bool]:
    """(whether every token of ``text`` was allowed, whether the constraint may end there)."""
    from toy.engine.constrain import ConstraintError, Matcher

    m = Matcher(cons, tokenizer, tokenizer.vocab_size)
    eog = sorted(tokenizer.eog_ids)[0]
    for t in tokenizer.encode(text, add_special=False):
        if not m.allowed()[t]:
            return False, False
        try:
            m.advance(t)
        except ConstraintError:
            return False, False
    return True, bool(m.allowed()[eog])


@pytest.mark.model
def test_strict_auto_constraint_lets_text_through_and_holds_calls_to_the_schema(serve_model):
    tok = serve_model.tokenizer
    assert strict_auto(TOOLS, parallel=True) is None  # no strict function: "auto" stays free
    one, many = strict_auto(strict_tools(), parallel=False), strict_auto(strict_tools(), parallel=True)
    # the calls' JSON is compact (the constraint's whitespace is fixed, as for forced calls)
    good = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'
    bad = '<tool_call>\n{"name":"add","arguments":{"a":2}}\n</tool_call>'  # "b" is required
    loose = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","unit":"kelvin"}}\n</tool_call>'
    for cons in (one, many):
        assert walk(cons, tok, "Any text, even <tool and tool_call> alone.") == (True, True)
        assert walk(cons, tok, "Let me add.\n" + good) == (True, True)
        assert walk(cons, tok, good) == (True, True)
        assert walk(cons, tok, "Let me add.\n" + bad)[0] is False
        assert walk(cons, tok, loose)[0] is False  # not one of the enum's units
        assert walk(cons, tok, good + "\nand more text")[0] is False  # only calls follow a call
    assert walk(many, tok, good + "\n" + good) == (True, True)
    assert walk(one, tok, good + "\n" + good)[0] is False
    # a function without strict: its calls must still name it, its arguments may be any object
    mixed = [strict_tools()[0], ADD]
    free_args = '<tool_call>\n{"name":"add","arguments":{"anything":[1]}}\n</tool_call>'
    assert walk(strict_auto(mixed, parallel=True), tok, free_args) == (True, True)
    assert walk(strict_auto(mixed, parallel=True), tok, loose)[0] is False


# SmolLM2 answers a follow-up by echoing a <tool_response> block; with "response" banned and "call" favoured
# (logit_bias) it opens a <tool_call> block, whose contents are garbage unless the function is strict
FOLLOW_UP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18})},
    {"role": "assistant", "content": "It is 18 degrees in Paris."},
    {"role": "user", "content": "And what is the weather in Rome?"},
]  # fmt: skip


@pytest.mark.model
def test_strict_function_constrains_calls_under_auto(client, live, serve_model):
    tok = serve_model.tokenizer
    (response,) = tok.encode("response", add_special=False)
    (call,) = tok.encode("call", add_special=False)
    kw = {"model": live.srv.settings.alias, "messages": FOLLOW_UP, "tool_choice": "auto", "max_tokens": 80,
          "logit_bias": {str(response): -100, str(call): 10}}  # fmt: skip
    loose = client.chat.completions.create(**kw, tools=strict_tools(False), temperature=0).choices[0]
    assert loose.message.tool_calls is None and "<tool_call>" in loose.message.content  # the unconstrained block
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 3}):
        r = client.chat.completions.create(**kw, tools=strict_tools(), **sampling).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.content is None
        check_calls(r.message)
        one = client.chat.completions.create(**kw, tools=strict_tools(), parallel_tool_calls=False, **sampling)
        assert len(one.choices[0].message.tool_calls) == 1
        check_calls(one.choices[0].message)


@pytest.mark.model
def test_strict_function_and_another_constraint_is_a_400(client, live):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.srv.settings.alias, messages=ASK, tools=strict_tools(),
                                       response_format={"type": "json_object"}, max_tokens=5)  # fmt: skip
    assert "strict" in str(e.value) and e.value.body["param"] == "tools"
