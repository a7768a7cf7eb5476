"""Decode steps take their sequences longest first: the input builder orders a decode-only
step's rows by context length (``seq_order``) for the Triton decode kernel's grid; the tokens
do not change, and tensor-parallel ranks receive the same order."""

from __future__ import annotations

import torch
from helpers.engines import GREEDY, assert_pool_whole, make_engine

from mini_paged_attn.engine import LLM
from mini_paged_attn.models import attention

PROMPT_LENS = (3, 17, 9, 30, 1)


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_decode_steps_pass_their_rows_longest_first(tiny_model_factory, monkeypatch):
    """Every decode call of the Triton engine (the interpreter on CPU) gets the permutation
    that sorts its context lengths longest first (ties in row order), and the greedy tokens
    equal the torch backend's, which takes no order."""
    model_dir = tiny_model_factory("qwen3")
    options = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_model_len=64)
    reference = make_engine(model_dir, backend="torch", **options)
    assert reference.runner.inputs.order_decode is False
    prompts = _prompts(reference.runner.model_config.vocab_size)
    expected = [o.outputs[0].token_ids
                for o in LLM.from_engine(reference).generate(prompts, GREEDY, use_tqdm=False)]

    seen = []

    def recording(*args, _real=attention.paged_decode, **kwargs):
        order, lens = kwargs.get("seq_order"), args[4]
        seen.append((None if order is None else order.tolist(), lens.tolist()))
        return _real(*args, **kwargs)
    monkeypatch.setattr(attention, "paged_decode", recording)
    engine = make_engine(model_dir, backend="triton", **options)
    outputs = LLM.from_engine(engine).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert seen
    for order, lens in seen:
        assert order == sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    assert any(order != sorted(order) for order, _ in seen)     # some step did reorder
    assert_pool_whole(engine)


def test_the_order_travels_to_other_ranks_and_prefill_steps_have_none(tiny_model_factory):
    """``host_arrays`` / ``load`` (what a tensor-parallel rank rebuilds a step from) carry
    the order of a decode step; a step with prompt tokens has none."""
    engine = make_engine(tiny_model_factory("llama"), backend="triton", block_size=4,
                         num_kv_blocks=64, max_num_seqs=8, max_model_len=64)
    for prompt in _prompts(engine.runner.model_config.vocab_size)[:3]:
        engine.add_request(prompt, GREEDY)
    inputs = engine.runner.inputs
    built = []
    build = inputs.build

    def recording(*args, **kwargs):
        step = build(*args, **kwargs)     # views of staging memory the next step rewrites
        built.append((step, inputs.host_arrays(step)))
        return step
    inputs.build = recording
    while engine.has_unfinished_requests():
        engine.step()
    prefill = [(s, a) for s, a in built if s.max_seqlen_q > 1]
    decode = [(s, a) for s, a in built if s.seq_order is not None]
    assert prefill and decode
    assert all(s.seq_order is None and "seq_order" not in a for s, a in prefill)
    step, arrays = decode[0]
    lens = arrays["context_lens"].tolist()      # the host copy made at build time
    assert arrays["seq_order"].tolist() == sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    loaded = inputs.load(arrays, table_width=step.block_tables.shape[1], max_seqlen_q=1,
                         num_sample_rows=step.num_sample_rows)
    assert loaded.seq_order.tolist() == arrays["seq_order"].tolist()
