"""Chat templates: SmolLM2's template rendered like llama-cpp-python's Jinja2
formatter (recorded in ``fixtures/smollm2_tokenizer_llamacpp.json``), the ChatML
default like llama.cpp's built-in "chatml" formatter (recorded in the same file),
and the sandbox's limits: no dunder access, no file access, a wall-clock
deadline and an output cap, every failure a ``ChatTemplateError``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from toy.errors import ToyError
from toy.gguf import GGUFFile
from toy.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError

REF = json.loads((Path(__file__).parent / "fixtures" / "smollm2_tokenizer_llamacpp.json").read_text("utf-8"))
CT = REF["chat_template"]
RENDERINGS = CT["renderings"]
HELLO = [{"role": "user", "content": "Hello!"}]


def rid(r: dict) -> str:
    return f"{r['messages']}-gen{int(r['add_generation_prompt'])}"


@pytest.fixture(scope="module")
def smol_metadata(smollm2_path) -> dict:
    with GGUFFile(smollm2_path) as f:
        return dict(f.metadata)


@pytest.fixture(scope="module")
def smol_chat(smol_metadata) -> ChatTemplate:
    return ChatTemplate.from_gguf(smol_metadata)


# --------------------------------------------------------------- parity


@pytest.mark.model
def test_template_and_tokens_from_the_file(smol_metadata, smol_chat):
    assert smol_metadata["tokenizer.chat_template"] == CT["template_from_metadata"]
    assert not smol_chat.is_default
    assert smol_chat.bos_token == CT["jinja_bos_token"]
    assert smol_chat.eos_token == CT["jinja_eos_token"]


@pytest.mark.model
@pytest.mark.parametrize("r", RENDERINGS, ids=rid)
def test_renders_like_llamacpp_jinja_formatter(smol_chat, r):
    messages = CT["message_sets"][r["messages"]]
    assert smol_chat.render(messages, add_generation_prompt=r["add_generation_prompt"]) == r["jinja2_chat_formatter"]


def test_all_ten_renderings_are_covered():
    assert len(RENDERINGS) == 10
    assert {r["add_generation_prompt"] for r in RENDERINGS} == {False, True}


@pytest.mark.parametrize("r", RENDERINGS, ids=rid)
def test_default_template_is_llamacpp_chatml(r):
    # llama.cpp with no template (tmpl=NULL) falls back to its built-in "chatml" formatter
    messages = CT["message_sets"][r["messages"]]
    out = ChatTemplate.default().render(messages, add_generation_prompt=r["add_generation_prompt"])
    assert out == r["llama_chat_apply_template_null"]


def test_model_without_template_gets_chatml():
    md = {"tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    t = ChatTemplate.from_gguf(md)
    assert t.is_default and t.source == DEFAULT_CHAT_TEMPLATE
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    assert t.render(HELLO, add_generation_prompt=False) == "<|im_start|>user\nHello!<|im_end|>\n"
    assert t.render(HELLO) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate.from_gguf({"tokenizer.chat_template": ""}).is_default


def test_named_templates():
    md = {"tokenizer.chat_template.tool_use": "{{ messages[0].content }}!"}
    assert ChatTemplate.from_gguf(md, name="tool_use").render(HELLO) == "Hello!!"
    with pytest.raises(ChatTemplateError, match="'rag'") as e:
        ChatTemplate.from_gguf(md, name="rag")
    assert "tool_use" in e.value.hint


def test_helpers_and_variables():
    t = ChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') }}|{{ tools|tojson }}|{{ messages|length }}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    out = t.render(HELLO, tools=[{"name": "f", "note": "é<>"}])
    year = time.strftime("%Y")
    # HF's tojson: no HTML escaping, no ASCII escaping
    assert out == f'<s>{year}|[{{"name": "f", "note": "é<>"}}]|1</s>'
    with pytest.raises(ChatTemplateError, match="rejected the messages: no tools"):
        ChatTemplate("{{ raise_exception('no tools') }}").render(HELLO)
    with pytest.raises(ChatTemplateError, match="set by render"):
        t.render(HELLO, bos_token="x")


def test_trim_blocks_and_loop_controls():
    src = "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n{{ m.content }}\n{% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    # trim_blocks eats the newline after a block tag, lstrip_blocks the spaces before one
    assert ChatTemplate(src).render(msgs) == "a\n"
    assert ChatTemplate("{% generation %}x{% endgeneration %}").render(HELLO) == "x"


# --------------------------------------------------------------- sandbox


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ ''['__class__'] }}",
        "{% if ''.__class__ %}x{% endif %}",
        "{{ messages.append(1) }}",
        "{{ (lipsum | attr('__globals__')) }}",
    ],
)
def test_sandbox_blocks_attribute_escapes(src):
    with pytest.raises(ChatTemplateError, match="unsafe operation|not allowed"):
        ChatTemplate(src).render(HELLO)


@pytest.mark.parametrize(
    "src",
    ["{% import 'os' as os %}", "{% from 'x' import y %}", "{% include '/etc/passwd' %}", "{% extends 'base' %}"],
)
def test_no_file_access(src):
    with pytest.raises(ChatTemplateError, match="cannot .* other templates"):
        ChatTemplate(src)


def test_range_too_big_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for i in range(10**9) %}x{% endfor %}").render(HELLO)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    "src",
    [
        # 10^10 iterations that print nothing: only the per-iteration deadline check stops them
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
        # exponential recursion
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    ],
)
def test_endless_templates_hit_the_deadline(src):
    t = ChatTemplate(src, time_limit=0.5)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="0.5 s limit"):
        t.render(HELLO)
    assert time.monotonic() - t0 < 2.0


def test_default_deadline_is_about_a_second():
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="limit"):
        ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").render(HELLO)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    "src",
    [
        "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",  # 10 MB of output
        "{{ 'x' * 10**8 }}",
        "{{ 'x' | center(1000000000) }}",
        "{{ 'x'.ljust(999999999) }}",
        "{{ '%999999999s' % 'x' }}",
        "{{ '{:>999999999}'.format('x') }}",
        "{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | join }}",
        "{% set s = 'x' * 1000000 %}{% set y %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}",
        "{% set s = 'x' * 1000000 %}{{ s ~ s }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ [1] | batch(1000000000, 'x') | list }}",
        "{{ ('x' * 1000).replace('x', 'y' * 100000) }}",
        "{{ 10 ** 1000000 }}",
    ],
)
def test_huge_output_fails(src):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="over the|bits"):
        ChatTemplate(src).render(HELLO)
    assert time.monotonic() - t0 < 2.0


def test_output_cap_is_configurable():
    src = "{{ 'x' * 2000 }}"
    assert len(ChatTemplate(src).render(HELLO)) == 2000
    with pytest.raises(ChatTemplateError, match="over the 1000 limit"):
        ChatTemplate(src, max_output=1000).render(HELLO)


@pytest.mark.parametrize(
    "src, match",
    [
        ("{% for %}", "syntax error on line 1"),
        ("{{ foo.bar }}", "UndefinedError"),
        ("{{ 'a' + 1 }}", "TypeError"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply|limit"),
    ],
)
def test_template_errors_become_chat_template_errors(src, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        ChatTemplate(src).render(HELLO)
    assert isinstance(e.value, ToyError)


def test_undefined_message_fields_render_empty():
    # HF semantics: a missing key of a message is undefined and prints as nothing
    assert ChatTemplate("[{{ messages[0].name }}]").render(HELLO) == "[]"


# --------------------------------------------------------------- messages


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "x"}, "must be a list"),
        ([["user", "x"]], r"messages\[0\] is a list"),
        ([{"content": "x"}], r"messages\[0\] has no 'role'"),
        ([{"role": "", "content": "x"}], "non-empty str"),
        ([{"role": 3, "content": "x"}], "non-empty str"),
        ([{"role": "user"}], "has no 'content'"),
        ([HELLO[0], {"role": "user", "content": None}], r"messages\[1\]\['content'\] must be a str, got NoneType"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "must be a str, got list"),
        ([{"role": "user", "content": "x", "when": object()}], "only JSON-like"),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate.default().render(messages)


def test_messages_are_copied_and_extra_keys_pass_through():
    msgs = [{"role": "user", "content": "x", "name": "ann"}]
    assert ChatTemplate("{{ messages[0].name }}").render(msgs) == "ann"
    assert ChatTemplate.default().render([], add_generation_prompt=True) == "<|im_start|>assistant\n"


def test_bad_construction():
    with pytest.raises(ChatTemplateError):
        ChatTemplate(None)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("x", time_limit=0)
