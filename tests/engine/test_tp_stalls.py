"""Tensor parallelism on CPU (gloo): a stopped rank fails the step like a dead one, and prompt
logprobs, which the ranks do not compute, are refused as bad input (through the server:
``tests/server/test_server_tensor_parallel.py``).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.admission import Admission
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.worker.tp_watchdog import StepWatchdog, describe_stall
from mini_paged_attn.errors import TensorParallelError


def _worker_pid(llm) -> int:
    (process,) = llm.engine.peers.processes
    return process.pid


def test_a_stopped_rank_fails_the_step_within_the_step_timeout():
    llm = LLM("tiny", device="cpu", num_kv_blocks=1024, tensor_parallel_size=2,
              step_timeout_s=2.0)
    pid = _worker_pid(llm)
    stopper = threading.Timer(0.5, os.kill, (pid, signal.SIGSTOP))
    stopper.start()
    try:
        # Far more steps than 0.5 s holds: the stop lands while steps run back to back. With
        # no step timeout the step would wait out distributed_timeout_s (120 s).
        with pytest.raises(TensorParallelError, match="rank 1 .*is stopped"):
            llm.generate(["x"] * 8, SamplingParams(max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
        with pytest.raises(TensorParallelError, match="step_timeout_s"):   # it stays failed
            llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        stopper.cancel()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_steps_under_the_timeout_are_untouched():
    p = SamplingParams(temperature=0.0, max_tokens=6)
    expected = LLM("tiny", device="cpu", num_kv_blocks=32).generate("hello", p, use_tqdm=False)
    with LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2,
             step_timeout_s=30.0) as llm:
        for _ in range(3):
            out = llm.generate("hello", p, use_tqdm=False)
            assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_the_watchdog_names_no_rank_when_none_is_stopped():
    class _Alive:
        pid = os.getpid()

        def is_alive(self):
            return True

    assert "a worker did not take part" in describe_stall([_Alive()], 1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        StepWatchdog(0, [], lambda text: None)


def test_step_timeout_is_validated():
    for bad in (0, -1.0, float("inf"), "5"):
        with pytest.raises(ValueError, match="step_timeout_s"):
            EngineConfig(step_timeout_s=bad)
    assert EngineConfig().step_timeout_s == 60.0 and EngineConfig(step_timeout_s=None)


def test_admission_refuses_prompt_logprobs_where_they_are_not_computed():
    admission = Admission(100, 64, 16, 16, 4, prompt_logprobs=False)
    with pytest.raises(ValueError, match="^prompt_logprobs: .*tensor_parallel_size"):
        admission.check([1, 2], SamplingParams(prompt_logprobs=1), tokenizer=None)
    admission.check([1, 2], SamplingParams(), tokenizer=None)
