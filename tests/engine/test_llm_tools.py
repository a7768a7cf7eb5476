"""``LLM.chat(tools=..., tool_choice=...)`` on the tiny random Llama: its output is noise, so a
valid call under "required" or a named function shows the grammar did the work; "auto" reads
a Hermes call that a one-string choice forces (noise never writes one)."""

from __future__ import annotations

import json

import pytest
from helpers.engines import assert_pool_whole
from helpers.json_checks import assert_valid
from helpers.tool_specs import CLOCK, HERMES_CALL, MESSAGES, SCHEMAS, TOOLS, WEATHER

from mini_paged_attn.engine import LLM, SamplingParams, StructuredOutputsParams
from mini_paged_attn.engine.tools.parsers import ToolCall

pytest.importorskip("llguidance", reason='tool calls need pip install -e ".[structured]"')

# Renders the tools' names, so a test can see that they reached the template.
TOOLS_TEMPLATE = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
               max_model_len=256, max_num_seqs=8)


def _sampled(seed: int = 0, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=160, **kwargs)


def test_tools_reach_the_chat_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", TOOLS_TEMPLATE)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), tools=TOOLS, tool_choice="none",
                   use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert prompt.startswith("[get_weather][get_time]user:"), prompt
    assert out.outputs[0].tool_calls is None     # "none": nothing is read back


def test_required_gives_valid_calls(llm):
    outs = llm.chat([MESSAGES, MESSAGES], [_sampled(1), _sampled(2)], tools=TOOLS,
                    tool_choice="required", use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert completion.tool_calls
        for call in completion.tool_calls:
            assert isinstance(call, ToolCall) and call.name in SCHEMAS
            assert_valid(call.arguments, SCHEMAS[call.name])
    assert_pool_whole(llm.engine)


def test_one_call_only_without_parallel_tool_calls(llm):
    out = llm.chat(MESSAGES, _sampled(3), tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.tool_calls) == 1
    assert len(json.loads(out.text)) == 1


def test_a_named_function_gives_its_arguments(llm):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = llm.chat(MESSAGES, _sampled(4), tools=TOOLS, tool_choice=choice,
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    [call] = out.tool_calls
    assert call.name == "get_weather" and call.arguments == out.text
    assert_valid(call.arguments, WEATHER)


def test_auto_reads_calls_from_the_text(llm):
    forced = _sampled(structured_outputs=StructuredOutputsParams(choice=[HERMES_CALL]))
    calls = llm.chat(MESSAGES, forced, tools=TOOLS, use_tqdm=False)[0].outputs[0].tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    plain = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), tools=TOOLS,
                     tool_choice="auto", use_tqdm=False)[0].outputs[0]
    assert plain.tool_calls == []       # noise is no call: all content


def test_without_tools_nothing_is_read_back(llm):
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.tool_calls is None


BAD = [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"function": "get_time"}), "tool_choice"),
    (dict(tools={"get_time": CLOCK}), "tools"),
    (dict(tools=[CLOCK]), r"tools\[0\]"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
     r"tools\[0\]\.function\.name"),
    (dict(tools=[TOOLS[1], TOOLS[1]]), r"tools\[1\]\.function\.name"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {
        "name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
          tool_choice="required"), r"tools\[1\]\.function\.parameters"),
    (dict(tools=TOOLS, tool_call_parser="xml"), "tool_call_parser"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_arguments_name_the_argument_and_queue_nothing(llm, kwargs, param):
    with pytest.raises(ValueError, match=f"^{param}: "):
        llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_a_forced_call_cannot_be_combined_with_structured_outputs(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="^tool_choice: .*sampling_params.structured_outputs"):
        llm.chat(MESSAGES, params, tools=TOOLS, tool_choice="required", use_tqdm=False)
