"""Tools with a chat template that drops them: the model never sees the functions and
``tool_choice="auto"`` silently never calls, so the first such request logs a warning (once
per template); templates that render tools pass quietly."""

from __future__ import annotations

import logging

import pytest
from helpers.tool_specs import MESSAGES, TOOLS

from mini_paged_attn.engine import LLM, SamplingParams

LOGGER = "mini_paged_attn.models.tokenizer"
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
# Renders the tools' names before the conversation.
TOOLS_TEMPLATE = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
# Drops the tools (as the tiny model's ChatML template and SmolLM2's do).
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def llm():
    """A fresh LLM each test: the warning is once per tokenizer and template."""
    return LLM("tiny", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=256,
               max_num_seqs=4)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_template_that_drops_tools_is_warned_about_once(llm, caplog):
    assert llm.tokenizer.renders_tools() is False
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False)               # no tools: no warning
        assert _warnings(caplog) == []
        for _ in range(2):
            llm.chat(MESSAGES, ONE_TOKEN, tools=TOOLS, tool_choice="auto", use_tqdm=False)
        llm.chat([MESSAGES, MESSAGES], ONE_TOKEN, tools=TOOLS[:1], use_tqdm=False)
    (warning,) = _warnings(caplog)
    assert "ignores tools" in warning and "tool_choice='auto'" in warning


def test_a_template_that_renders_tools_is_not_warned_about(llm, caplog, monkeypatch):
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", TOOLS_TEMPLATE)
    assert llm.tokenizer.renders_tools() is True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = llm.chat(MESSAGES, ONE_TOKEN, tools=TOOLS, tool_choice="auto", use_tqdm=False)
    assert llm.tokenizer.decode(out[0].prompt_token_ids).startswith("[get_weather][get_time]")
    assert _warnings(caplog) == []


def test_each_template_is_probed_and_warned_about_on_its_own(llm, caplog, monkeypatch):
    tokenizer = llm.tokenizer
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # A per-call template override is the template that counts.
        llm.chat(MESSAGES, ONE_TOKEN, tools=TOOLS, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
        assert _warnings(caplog) == []
        tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=PLAIN_TEMPLATE)
        tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=PLAIN_TEMPLATE)
        assert len(_warnings(caplog)) == 1
        tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)       # the tokenizer's own
        assert len(_warnings(caplog)) == 2
    assert tokenizer.renders_tools(TOOLS_TEMPLATE) is True
    assert tokenizer.renders_tools(PLAIN_TEMPLATE) is False


def test_a_template_the_probe_cannot_render_is_left_alone(llm, caplog, monkeypatch):
    strict = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
              "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", strict)
    assert llm.tokenizer.renders_tools() is None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llm.tokenizer.apply_chat_template([{"role": "system", "content": "s"}, *MESSAGES],
                                          tools=TOOLS)
    assert _warnings(caplog) == []


def test_no_chat_template_is_none(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", None)
    assert llm.tokenizer.renders_tools() is None


def test_the_tokenizer_still_pickles(llm, caplog):
    """The engine process sends its tokenizer to the client; the copy probes and warns anew."""
    import pickle
    assert llm.tokenizer.renders_tools() is False
    copy = pickle.loads(pickle.dumps(llm.tokenizer))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        copy.apply_chat_template(MESSAGES, tools=TOOLS)
    assert len(_warnings(caplog)) == 1 and copy.renders_tools() is False
