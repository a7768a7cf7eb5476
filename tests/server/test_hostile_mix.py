"""The hostile mix of ``benchmarks/hostile_mix.py`` at CI size, against a real ``serve`` process.

100 requests of every kind (amplified logprobs, a deep tool call, an oversized prompt, a huge
model name, a client that never reads, a stalled upload, hostile grammars and sampling
parameters), with 8 ordinary clients beside them: no 5xx, no crash, no leaked KV block, and every ordinary
request served. (Latency is reported by the tool, never asserted here.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("llguidance", reason="the deep tool call is forced by a grammar")

from benchmarks import hostile_mix  # noqa: E402


def test_a_hostile_mix_leaves_the_server_and_its_neighbours_whole():
    report = hostile_mix.run(list(hostile_mix.KINDS), requests=100, concurrency=8,
                             victims=8, seed=0, deadline_s=120.0)
    assert sum(sum(v.values()) for v in report.by_kind.values()) == 100, report
    assert report.crashes == 0, report
    assert report.undocumented_5xx_total == 0, report
    assert report.leaked_blocks == 0, report
    assert report.victim_errors == 0 and report.victim_requests > 0, report
    expected = {"amplified_prompt_logprobs": "400", "amplified_chat_top_logprobs": "400",
                "amplified_echo": "400", "oversized_prompt": "400", "huge_model_name": "404",
                "stalled_upload": "408", "deep_tool_call": "200",
                "grammar_21_digit_int": "400", "grammar_big_choice": "400",
                "grammar_huge_repeat": "400", "grammar_min_tokens": "400",
                "grammar_chained_refs": "200", "sampler_top_p_tiny": "200",
                "sampler_repetition_tiny": "200"}
    for kind, status in expected.items():
        assert set(report.by_kind[kind]) == {status}, (kind, report.by_kind[kind])
