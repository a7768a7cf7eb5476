"""Prefill graphs: a step of one prompt padded to a bucket of tokens, the padding a second
sequence that writes nothing (attending over itself, or, in the paged family, over the
prompt's first tokens). On CPU the padded inputs run eagerly (what a graph replays) and must
give the prompt's rows of the unpadded step; on a GPU the engine replays the graphs and its
greedy tokens equal an eager engine's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.engines import GREEDY, make_engine

from mini_paged_attn.engine import LLM
from mini_paged_attn.engine.worker.prefill_graphs import (MAX_GRAPH_TOKENS, PrefillGraphs,
                                                   PromptGraph, prefill_buckets)
from mini_paged_attn.models.attention import AttentionMetadata


def test_buckets_are_powers_of_two_from_16_cut_to_the_longest_step():
    assert prefill_buckets(8192) == [16, 32, 64, 128, 256, 512] and MAX_GRAPH_TOKENS == 512
    assert prefill_buckets(100) == [16, 32, 64, 100]      # no bucket past the input regions
    assert prefill_buckets(128) == [16, 32, 64, 128]
    assert prefill_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert prefill_buckets(8) == [8]


def _out(num_tokens, *, computed=0, num_seqs=1, decode_only=False):
    seqs = [SimpleNamespace(num_computed_tokens=computed) for _ in range(num_seqs)]
    return SimpleNamespace(decode_only=decode_only, num_seqs=num_seqs, seqs=seqs,
                           num_batched_tokens=num_tokens)


def test_one_prompt_within_the_buckets_takes_a_graph_of_its_family():
    graphs = SimpleNamespace(buckets=prefill_buckets(1024), contiguous=True)
    bucket_for = PrefillGraphs.bucket_for.__get__(graphs)
    assert [bucket_for(_out(n)) for n in (1, 16, 17, 300, 512)] == [
        PromptGraph(b, False) for b in (16, 16, 32, 512, 512)]
    assert bucket_for(_out(513)) is None                     # past the largest bucket
    assert bucket_for(_out(40, computed=16)) == PromptGraph(64, True)   # a cached prefix
    assert bucket_for(_out(40, num_seqs=2)) is None
    assert bucket_for(_out(1, decode_only=True)) is None
    graphs.contiguous = False                                # an fp8 cache: all paged
    assert bucket_for(_out(17)) == PromptGraph(32, True)
    assert [(k.tokens, k.paged) for k in PrefillGraphs.keys(graphs)][:3] == [
        (512, True), (256, True), (128, True)]


def _engine_and_graphs(model_dir, backend, **config):
    config = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=64) | config
    engine = make_engine(model_dir, backend=backend, **config)
    runner = engine.runner
    return engine, PrefillGraphs(runner.model, runner.kv_caches, runner.inputs, max_tokens=64,
                                 backend=runner.backend)


def _check_first_prompt_step(engine, check) -> None:
    """Run the engine to the end; ``check(out, build, expected)`` sees the first prompt
    step, before the engine builds it, with the unbuilt builder and the unpadded step's
    hidden rows."""
    runner = engine.runner
    inputs, build = runner.inputs, runner.inputs.build
    checked = []

    def checking(out, *args, **kwargs):
        if not checked and not out.decode_only:
            step = build(out)
            meta = AttentionMetadata.for_step(step, decode_only=False, backend=runner.backend)
            check(out, build, step, runner.model(step.input_ids, step.positions,
                                                 runner.kv_caches, meta))
            checked.append(out)
        return build(out, *args, **kwargs)
    inputs.build = checking
    while engine.has_unfinished_requests():
        engine.step()
    assert checked


def _padded_hidden(graphs, key):
    """The forward a graph of ``key`` replays, run eagerly on the regions it reads."""
    inputs = graphs.inputs
    return graphs.model(inputs.region("input_ids", key.tokens),
                        inputs.region("positions", key.tokens), graphs.kv_caches,
                        graphs._meta(key))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("prompt_len", [5, 16, 23])
def test_padded_inputs_give_the_prompts_rows(tiny_model_factory, backend, prompt_len):
    """The regions a graph reads (the prompt, then the padding's sequence) run through the
    model give the prompt's hidden rows of the unpadded step; the views the builder returns
    are the step's own."""
    engine, graphs = _engine_and_graphs(tiny_model_factory("qwen2"), backend)
    inputs = graphs.inputs
    gen = torch.Generator().manual_seed(prompt_len)
    engine.add_request(torch.randint(3, 300, (prompt_len,), generator=gen).tolist(), GREEDY)

    def check(out, build, step, expected):
        key = graphs.bucket_for(out)
        bucket = key.tokens
        assert key == PromptGraph(max(16, 1 << (prompt_len - 1).bit_length()), False)
        # The views share the staging memory: keep the unpadded step's values.
        names = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens")
        before = {name: getattr(step, name).clone() for name in names}
        inputs.region("slot_mapping", bucket).fill_(7)      # the padding must overwrite
        padded = build(out, pad_prompt_to=bucket)
        for name in names:
            assert torch.equal(getattr(padded, name), before[name]), name
        assert inputs.region("slot_mapping", bucket)[prompt_len:].eq(-1).all()
        assert inputs.region("cu_seqlens_q", 3).tolist() == [0, prompt_len, bucket]
        hidden = _padded_hidden(graphs, key)
        torch.testing.assert_close(hidden[:prompt_len], expected, atol=1e-5, rtol=1e-5)
        assert hidden[prompt_len:].isfinite().all()
    _check_first_prompt_step(engine, check)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("new_tokens", [5, 16, 23])
def test_padded_paged_inputs_give_the_rows_after_a_prefix_hit(tiny_model_factory, backend,
                                                              new_tokens):
    """A prompt after a prefix-cache hit: the paged family's regions (both table rows the
    prompt's, max_blocks_per_seq wide; the padding attending over the prompt's first tokens)
    give the prompt's hidden rows of the unpadded step."""
    engine, graphs = _engine_and_graphs(tiny_model_factory("qwen2"), backend, max_num_seqs=1,
                                        enable_prefix_caching=True)
    inputs = graphs.inputs
    width = inputs.max_blocks_per_seq
    gen = torch.Generator().manual_seed(new_tokens)
    first = torch.randint(3, 300, (20,), generator=gen).tolist()
    engine.add_request(first, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(first[:12] + torch.randint(3, 300, (new_tokens,), generator=gen).tolist(),
                       GREEDY)

    def check(out, build, step, expected):
        assert out.seqs[0].num_computed_tokens == 12     # three cached blocks
        key = graphs.bucket_for(out)
        assert key == PromptGraph(max(16, 1 << (new_tokens - 1).bit_length()), True)
        own_table = step.block_tables.clone()
        inputs.region("block_tables", 2 * width).fill_(-7)    # the build must overwrite
        padded = build(out, pad_prompt_to=key.tokens, paged_prompt=True)
        tables = inputs.region("block_tables", 2 * width).view(2, width)
        assert torch.equal(tables[0], tables[1])
        assert torch.equal(tables[0, :own_table.shape[1]], own_table[0])
        assert padded.block_tables.shape == (1, width)
        assert inputs.region("context_lens", 2).tolist() == [
            12 + new_tokens, key.tokens - new_tokens]
        hidden = _padded_hidden(graphs, key)
        torch.testing.assert_close(hidden[:new_tokens], expected, atol=1e-5, rtol=1e-5)
        # The pool is NaN wherever nothing was written: the padding read written K/V only.
        assert hidden[new_tokens:].isfinite().all()
    _check_first_prompt_step(engine, check)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_replays_prefill_graphs_with_the_eager_tokens(tiny_model_factory, arch,
                                                             monkeypatch):
    """Prompts of 1..300 tokens and one with a cached prefix give the greedy tokens of an
    eager engine; the prompts of 15..300 tokens replayed a prefill graph, the one after the
    prefix hit a paged one."""
    model_dir = tiny_model_factory(arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 300)]
    prompts.append(prompts[4][:200] + [7] * 20)             # shares 200 tokens: cached prefix
    options = dict(device="cuda", block_size=16, num_kv_blocks=128, max_num_seqs=4,
                   max_model_len=512, enable_prefix_caching=True)
    eager = make_engine(model_dir, enforce_eager=True, **options)
    expected = [[o.outputs[0].token_ids for o in LLM.from_engine(eager).generate(
        [p], GREEDY, use_tqdm=False)][0] for p in prompts]
    replayed = []
    replay = PrefillGraphs.replay

    def counting(self, key, num_tokens):
        replayed.append((key.tokens, key.paged, num_tokens))
        return replay(self, key, num_tokens)
    monkeypatch.setattr(PrefillGraphs, "replay", counting)
    engine = make_engine(model_dir, **options)
    assert engine.runner.prefill_graphs is not None
    llm = LLM.from_engine(engine)
    got = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    # The 1-token prompt's step is a decode step (a decode graph); the last prompt's 28 new
    # tokens after its 192 cached ones (12 blocks) replay a paged graph.
    assert replayed == [(16, False, 15), (16, False, 16), (32, False, 17), (512, False, 300),
                        (32, True, 28)]
