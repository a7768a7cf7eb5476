"""The tool-call parsers on strings: what "auto" finds in a model's text, and how much of a
growing text may stream as content before a call might begin."""

from __future__ import annotations

import json

import pytest

from mini_paged_attn.engine.tools.parsers import (PARSERS, ToolCallMode, parser_for_template)

hermes = PARSERS["hermes"]
llama = PARSERS["llama3_json"]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"y": "ü"}}</tool_call>', "Let me look.",
     [("f", {}), ("g", {"y": "ü"})]),
    # Stopped on EOS before the closing tag.
    ('<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    # Arguments given as JSON text.
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", {"x": 2})]),
    ("no call here", "no call here", []),
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', None, []),      # broken JSON
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),                # no name
])
def test_hermes(text, content, calls):
    got_content, got_calls = hermes.extract(text)
    assert _calls(got_calls) == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', [("f", {})]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": 2}}',
     [("f", {"a": 1}), ("g", {"b": 2})]),
    ("Paris is sunny.", []),
    ('{"name": "f", "parameters": {"x": 1}} and some words', []),
    ('{"weather": "sunny"}', []),
])
def test_llama3_json(text, calls):
    content, got = llama.extract(text)
    assert _calls(got) == calls
    assert content == (None if calls else text)


@pytest.mark.parametrize("text, end", [
    ("Hello", 5), ("Hello <tool", 6), ("Hello <tool_call>{", 6), ("<", 0), ("a<b", 3),
])
def test_hermes_streams_content_up_to_a_possible_call(text, end):
    assert hermes.content_end(text) == end


@pytest.mark.parametrize("text, end", [("", 0), ("  ", 0), (' {"na', 0), ("<|py", 0),
                                       ("Sunny", 5)])
def test_llama3_holds_what_may_be_a_call(text, end):
    assert llama.content_end(text) == end


def test_constrained_modes_read_the_grammar_shape():
    required = ToolCallMode("required")
    content, calls = required.extract('[{"name": "f", "arguments": {"x": 1}}, '
                                      '{"name": "g", "arguments": {}}]', "stop")
    assert content is None and _calls(calls) == [("f", {"x": 1}), ("g", {})]
    cut = '[{"name": "f", "argu'
    assert required.extract(cut, "length") == (cut, [])
    named = ToolCallMode("named", function="f")
    _, calls = named.extract('{"x": 1}', "stop")
    assert _calls(calls) == [("f", {"x": 1})]
    assert named.content_end("{") == 0 and required.content_end("[") == 0


def test_call_ids_are_unique_and_openai_shaped():
    _, calls = hermes.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2)
    a, b = (c.to_openai(index=i) for i, c in enumerate(calls))
    assert a["id"] != b["id"] and a["id"].startswith("call_")
    assert a == {"index": 0, "id": a["id"], "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("template, name", [
    ("{% for tool in tools %}<tools>{{ tool | tojson }}</tools>{% endfor %}<tool_call>", "hermes"),
    ('{{- "<|python_tag|>" }}{% if message.role == "ipython" %}', "llama3_json"),
    ('Given the functions, respond with {"name": function name, "parameters": dict}.'
     '{% if message.role == "ipython" %}', "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_parser_for_template(template, name):
    assert parser_for_template(template) == name


def test_serve_flag_and_build_app_check_the_parser_name():
    from mini_paged_attn.cli import build_parser
    from mini_paged_attn.server.app import build_app

    assert build_parser().parse_args(["serve", "--model", "tiny"]).tool_call_parser is None
    args = build_parser().parse_args(["serve", "--model", "tiny", "--tool-call-parser",
                                      "llama3_json"])
    assert args.tool_call_parser == "llama3_json" and args.tool_call_parser in PARSERS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "tiny", "--tool-call-parser", "xml"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(object(), model_name="m", tool_call_parser="xml")


def test_chat_template_receives_the_tools():
    from mini_paged_attn.models.tiny import byte_level_hf_tokenizer
    from mini_paged_attn.models.tokenizer import Tokenizer

    hf = byte_level_hf_tokenizer()
    hf.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = Tokenizer(hf)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   tools=tools) == "[get_time]hi"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


mistral = PARSERS["mistral"]
pythonic = PARSERS["pythonic"]


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', None, [("f", {"x": 1})]),
    ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
     '{"y": "ü"}}]', "Sure.", [("f", {}), ("g", {"y": "ü"})]),
    # Newer tokenizers: one [TOOL_CALLS]name[ARGS]{...} per call, maybe with a call id.
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}',
     None, [("get_weather", {"city": "Paris"}), ("now", {})]),
    # Decoded without special tokens: the marker is gone, the list remains.
    ('[{"name": "f", "arguments": {"x": [1, 2]}}]', None, [("f", {"x": [1, 2]})]),
    ("no call here", "no call here", []),
    ("[1, 2, 3]", None, []),                                        # a list, not of calls
    ('[TOOL_CALLS][{"name": "f", "arguments": {]', None, []),         # broken JSON
    ('[TOOL_CALLS]f[ARGS]{"x": ', None, []),
    ("[TOOL_CALLS]" + "[" * 5000, None, []),                          # deep: not read
])
def test_mistral(text, content, calls):
    got_content, got_calls = mistral.extract(text)
    assert _calls(got_calls) == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="San Francisco", unit="c")]',
     [("get_weather", {"city": "San Francisco", "unit": "c"})]),
    ('<|python_start|>[f(x=1, y=[1, 2.5], z={"a": None, "b": True}), g()]<|python_end|>',
     [("f", {"x": 1, "y": [1, 2.5], "z": {"a": None, "b": True}}), ("g", {})]),
    ("Paris is sunny.", []),
    ("[f(1)]", []),                               # positional arguments: not a call format
    ("[f(x=open('/etc/passwd'))]", []),           # not a literal: never evaluated
    ("[os.system(cmd='ls')]", []),                # attribute, not a function name
    ("[f(x={1, 2})]", []),                        # a set: JSON cannot carry it
    ("[f(x=1)] trailing", []),
    ("[f(x=" + "(" * 3000 + "1" + ")" * 3000 + ")]", []),
    ("[]", []),
])
def test_pythonic(text, calls):
    content, got = pythonic.extract(text)
    assert _calls(got) == calls
    assert content == (None if calls else text)


@pytest.mark.parametrize("parser, text, end", [
    ("mistral", "Hello", 5), ("mistral", "Hello [TOOL", 6), ("mistral", "Hi [TOOL_CALLS][", 3),
    ("mistral", '[{"na', 0), ("pythonic", "Hello", 5), ("pythonic", "[f(", 0),
    ("pythonic", "<|python", 0),
])
def test_the_new_formats_stream_content_up_to_a_possible_call(parser, text, end):
    assert PARSERS[parser].content_end(text) == end


def test_the_template_of_a_mistral_model_picks_its_parser():
    assert parser_for_template("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"


def test_the_command_line_offers_every_parser():
    from mini_paged_attn.commands.serve import TOOL_CALL_PARSERS

    assert sorted(TOOL_CALL_PARSERS) == sorted(PARSERS)
