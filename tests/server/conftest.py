"""Fixtures of the server tests: a tiny random Llama directory and one LLM per test module,
a server on that LLM's engine (with ``API_KEY``) and an official openai client of it.

The LLM runs on the CPU with a small KV pool (64 blocks of 16 tokens), so concurrent requests
share it for real (and get preempted when it runs out). A module that needs another server
(other app settings, or fixtures started first) defines its own ``server``.
"""

from __future__ import annotations

import pytest

from helpers.tiny_models import tiny_model_factory  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):  # noqa: F811
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    from mini_paged_attn.engine import LLM

    # A small pool (64 blocks of 16 tokens) so 40 concurrent requests share it for real.
    return LLM(str(model_dir), device="cpu", block_size=16, num_kv_blocks=64, max_num_seqs=48,
               max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def server(llm):
    from server_harness import API_KEY, served

    with served(llm.engine, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """The openai client of ``server``: no retries, so an error reaches the test as it came."""
    from server_harness import API_KEY, TIMEOUT_S

    openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=TIMEOUT_S)
