"""A tensor-parallel engine behind the server (two ranks on CPU, gloo): what the ranks cannot
compute is a 400 naming the field, not a 500 with nothing logged."""

from __future__ import annotations

import httpx
import pytest

from mini_paged_attn.engine import LLM
from mini_paged_attn.engine.process.client import InprocEngineClient
from server_harness import GOOD, TIMEOUT_S, assert_error, served


@pytest.fixture(scope="module")
def server():
    with LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2) as llm:
        client = InprocEngineClient(llm.engine)
        try:
            with served(client) as s:
                yield s
        finally:
            client.shutdown()


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 2}, {"echo": True, "logprobs": 2}])
def test_prompt_logprobs_are_a_400(server, extra):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        r = c.post("/v1/completions", json={**GOOD, **extra})
        assert "tensor_parallel_size" in assert_error(r, 400, "prompt_logprobs")["message"]
        assert c.post("/v1/completions", json=GOOD).status_code == 200
        assert c.get("/health").status_code == 200
