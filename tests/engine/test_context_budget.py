"""The per-step context budget (``max_num_batched_context_tokens``) through the engine: steps
that leave long sequences out in turn give the same greedy tokens as unbounded steps, every step
keeps within the budget but for the one sequence whose turn it is, and the short requests run
in every step they are live."""

from __future__ import annotations

import torch
from helpers.engines import GREEDY, assert_pool_whole, make_engine

from mini_paged_attn.engine import LLM

PROMPT_LENS = (40, 3, 35, 5, 30)
OPTIONS = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=64)
BUDGET = 48


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_budgeted_steps_give_the_same_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    reference = make_engine(model_dir, **OPTIONS)
    prompts = _prompts(reference.runner.model_config.vocab_size)
    expected = [o.outputs[0].token_ids
                for o in LLM.from_engine(reference).generate(prompts, GREEDY, use_tqdm=False)]

    engine = make_engine(model_dir, max_num_batched_context_tokens=BUDGET, **OPTIONS)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    left_out = 0
    while engine.has_unfinished_requests():
        running = [s for s in engine.scheduler.running]
        outputs = engine.step()
        out = engine.last_schedule
        took = [s for s in out.seqs if s in running]
        costs = sorted(s.num_computed_tokens for s in took)       # context after the step
        assert len(costs) <= 2 or sum(costs[:-1]) <= BUDGET, costs
        left_out += len(running) - len(took)
        for s in running:   # the short ones are never left out
            if s.request.num_prompt_tokens < 10:
                assert s in took
        for o in outputs:
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert left_out > 0                     # the budget did bind
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected
    assert_pool_whole(engine)


def test_serve_defaults_to_the_auto_budget(tiny_model_factory):
    """``serve`` bounds a CPU engine's steps unless told otherwise; ``none`` lifts the bound."""
    import argparse

    from mini_paged_attn.commands.serve import add_arguments, engine_kwargs
    from mini_paged_attn.engine.config import CPU_CONTEXT_BUDGET

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny"])
    assert engine_kwargs(args)["max_num_batched_context_tokens"] == "auto"
    assert parser.parse_args(["--model", "tiny", "--max-num-batched-context-tokens", "none"]) \
        .max_num_batched_context_tokens is None
    model_dir = tiny_model_factory("llama")
    engine = make_engine(model_dir, max_num_batched_context_tokens="auto", **OPTIONS)
    assert engine.scheduler.config.max_num_batched_context_tokens == CPU_CONTEXT_BUDGET
