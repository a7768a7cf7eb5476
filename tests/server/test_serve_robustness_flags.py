"""The ``serve`` options of the response caps, the I/O budgets and the tensor-parallel step
timeout reach the server and the engine."""

from __future__ import annotations

import pytest

from mini_paged_attn.cli import build_parser
from mini_paged_attn.commands.serve import server_limits
from mini_paged_attn.server.limits import ServerLimits


def _parse(*extra: str):
    return build_parser().parse_args(["serve", "--model", "tiny", *extra])


def test_response_and_timeout_options_reach_the_limits():
    args = _parse("--max-logprobs", "5", "--max-response-logprob-entries", "1000",
                  "--body-timeout-s", "7", "--send-timeout-s", "9")
    assert server_limits(args) == ServerLimits(max_logprobs=5, max_response_logprob_entries=1000,
                                               body_timeout_s=7, send_timeout_s=9)


def test_step_timeout_option():
    assert _parse().step_timeout_s == 60.0
    assert _parse("--step-timeout-s", "2.5").step_timeout_s == 2.5
    assert _parse("--step-timeout-s", "0").step_timeout_s is None     # no limit
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            _parse("--step-timeout-s", bad)
