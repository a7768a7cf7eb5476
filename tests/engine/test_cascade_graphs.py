"""Cascade attention in decode graphs: a bucket's cascade graphs read arrays of fixed shapes
(``cascade_inputs.CascadePad``: group slots, every row in one, padding rows included), built by
the input builder for the graph a step replays.

CUDA graphs need a GPU; here a stand-in replays each "graph" by running the model eagerly on
exactly the fixed-address inputs its capture would read, so the padded arrays, the key a step
picks and the model's result over them are checked on the CPU, against plain attention."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engines import assert_pool_whole, make_engine, step_to_finish
from helpers.tiny_models import random_prompts

from mini_paged_attn.core.cascade import CascadeRule, plan_cascade
from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.worker.cascade_inputs import GRAPH_GROUPS
from mini_paged_attn.engine.worker.cuda_graphs import DecodeGraphs
from mini_paged_attn.models.attention import AttentionMetadata

RULE = CascadeRule(min_group_size=2, min_prefix_tokens=4, min_saved_tokens=4)
BASE = dict(block_size=4, num_kv_blocks=240, max_num_seqs=12, max_model_len=96,
            backend="torch")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs are the steps their capture would read, run eagerly."""

    def capture(self) -> None:
        for b in self.buckets:
            for width in self.widths[b]:
                for cascade in (False, True) if b in self.cascade_pads else (False,):
                    self._graphs[b, width, cascade] = self._step(b, width, cascade)
        self.replayed = []

    def replay(self, n, block_tables, cascade=None):
        key = self.key_for(n, block_tables.shape[1], cascade)
        step = self._graphs[key]
        if cascade is not None:     # the builder wrote the arrays the graph reads
            for name, tensor in vars(cascade).items():
                assert getattr(step.cascade, name).data_ptr() == tensor.data_ptr(), name
                assert getattr(step.cascade, name).shape == tensor.shape, name
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        self.replayed.append(key)
        meta = AttentionMetadata.for_step(step, decode_only=True, backend=self.backend,
                                          decode_workspace=self.workspace)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta)

    def release(self) -> None:
        self._graphs.clear()


def _engine(model_dir, cascade: bool, **options):
    engine = make_engine(model_dir, cascade_attention=cascade, cascade_rule=RULE,
                         **{**BASE, **options})
    runner = engine.runner
    runner.graphs = EagerGraphs(runner.model, runner.kv_caches, runner.inputs,
                                max_batch=engine.config.max_num_seqs, backend=runner.backend,
                                decode_workspace=runner.workspace)
    runner.graphs.capture()
    return engine


def _requests(vocab: int, groups: int, per_group: int, strangers: int):
    """``groups`` system prompts, each followed by ``per_group`` requests' own tokens, and
    ``strangers`` requests sharing nothing; the first request of each group goes first (its
    prompt joins the prefix cache)."""
    firsts, rest = [], []
    for g in range(groups):
        system = random_prompts(vocab, [13 + 4 * g], seed=10 + g)[0]
        own = random_prompts(vocab, [1 + (5 * i + g) % 9 for i in range(per_group)],
                             seed=20 + g)
        firsts.append((system + own[0], GREEDY))
        rest += [(system + o, GREEDY) for o in own[1:]]
    rest += [(p, GREEDY) for p in random_prompts(vocab, [6 + 5 * i for i in range(strangers)],
                                                   seed=3)]
    return firsts, rest


def _run(engine, firsts, rest):
    ids = [engine.add_request(*r) for r in firsts]
    final = step_to_finish(engine)
    ids += [engine.add_request(*r) for r in rest]
    final.update(step_to_finish(engine))
    return [(final[i].outputs[0].token_ids, final[i].outputs[0].logprobs) for i in ids]


@pytest.mark.parametrize("backend, groups, strangers", [
    ("torch", 1, 3), ("torch", GRAPH_GROUPS + 1, 1), ("triton", 1, 3)])
def test_cascade_graph_steps_match_plain_graphs(tiny_model_factory, backend, groups, strangers):
    """Decode steps replay the bucket's cascade graph (padding rows, rows in no group, and
    with more groups than the graph holds, the groups left out attending plainly), and the
    outputs equal plain graphs' (the torch backend also checks every padded array's values)."""
    model_dir = tiny_model_factory("llama", num_attention_heads=4, num_key_value_heads=2)
    per_group = 3 if groups > GRAPH_GROUPS else 4     # the first of each runs alone
    firsts, rest = _requests(256, groups, per_group, strangers)
    results, replayed = {}, {}
    for cascade in (True, False):
        engine = _engine(model_dir, cascade, backend=backend)
        inputs, planned = engine.runner.inputs, []

        def recording(*args, _plan=inputs.plan_cascade, planned=planned, **kwargs):
            plan = _plan(*args, **kwargs)
            if kwargs.get("max_groups") is not None:      # a decode step's, for a graph
                planned.append(0 if plan is None else plan.groups.num_groups)
            return plan
        inputs.plan_cascade = recording
        results[cascade] = _run(engine, firsts, rest)
        if cascade:     # decode steps: the groups a graph holds at most, all when they fit
            assert max(planned) == min(groups, GRAPH_GROUPS)
        replayed[cascade] = engine.runner.graphs.replayed
        assert_pool_whole(engine)
    assert any(key[2] for key in replayed[True]), replayed[True]
    assert not any(key[2] for key in replayed[False])
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(results[True], results[False]):
        assert tokens_on == tokens_off
        for a, b in zip(lp_on, lp_off):
            np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], atol=1e-4)


def test_a_bucket_below_the_group_size_has_no_cascade_graphs(tiny_model_factory):
    engine = _engine(tiny_model_factory("llama"), True)
    graphs = engine.runner.graphs
    small = [b for b in graphs.buckets if b < RULE.min_group_size]
    assert all(graphs.cascade_pad(b) is None for b in small)
    for b in graphs.buckets:
        if b >= RULE.min_group_size:
            pad = graphs.cascade_pad(b)
            assert (pad.num_rows, pad.num_groups) == (b, GRAPH_GROUPS + 1)
            assert pad.suffix_widths == tuple(graphs.widths[b])
    assert not _engine(tiny_model_factory("llama"), False).runner.graphs.cascade_pads


def test_plan_keeps_the_groups_that_save_most():
    """``max_groups`` keeps the qualifying groups saving the most KV reads."""
    # Rows 0-2 share block 1 (2 blocks each), rows 3-4 share block 2 (3 blocks), rows 5-8
    # share block 3 (1 block): saved blocks (size - 1) * prefix = 4, 3, 3.
    tables = np.array([[1, 10, 0], [1, 11, 0], [1, 12, 0], [2, 4, 5], [2, 4, 5],
                       [3, 20, 0], [3, 21, 0], [3, 22, 0], [3, 23, 0]])
    tables[:3, 1] = 7
    computed = np.array([8, 8, 8, 12, 12, 4, 4, 4, 4])
    context = computed + 1
    rule = CascadeRule(min_group_size=2, min_prefix_tokens=4, min_saved_tokens=4)
    full = plan_cascade(tables, computed, context, 4, rule)
    assert full.groups.num_groups == 3
    kept = plan_cascade(tables, computed, context, 4, rule, max_groups=1)
    assert kept.groups.num_groups == 1 and kept.groups.group(0).tolist() == [0, 1, 2]
    two = plan_cascade(tables, computed, context, 4, rule, max_groups=2)
    assert sorted(two.groups.prefix_blocks.tolist()) == [2, 3]
    assert two.saved_tokens < full.saved_tokens
    more = plan_cascade(tables, computed, context, 4, rule, max_groups=5)
    assert (more.groups.num_groups, more.saved_tokens) == (3, full.saved_tokens)
