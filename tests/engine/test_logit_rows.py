"""The LM head runs on a fixed set of row counts (``InputBuilder.logit_buckets``, the batch
buckets on CUDA): the sample rows are padded up to the next bucket, the padding's logits are
dropped, and the tokens do not change. On CPU the engine runs unpadded; these tests give a
CPU engine buckets by hand."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import assert_pool_whole, make_engine, run_to_finish

from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.worker.input_batch import batch_buckets

BUCKETS = [1, 4, 8]
OPTIONS = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=24,
               max_model_len=64)


@pytest.mark.parametrize("max_batch", [1, 3, 16, 17, 130, 256, 300])
def test_batch_buckets_cover_every_batch_up_to_the_largest(max_batch):
    buckets = batch_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_batch
    gaps = [b - a for a, b in zip(buckets, buckets[1:])]
    assert all(gap <= max(16, a // 4) for a, gap in zip(buckets, gaps))


def _requests(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist()
               for n in (5, 11, 2, 17, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=6)] * 4 + [
        SamplingParams(temperature=0.9, seed=11, n=3, max_tokens=5)]     # forks into 3 rows
    return list(zip(prompts, params))


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_lm_head_rows_give_the_same_tokens(tiny_model_factory, backend):
    model_dir = tiny_model_factory("qwen3")
    reference = make_engine(model_dir, backend=backend, **OPTIONS)
    assert reference.runner.inputs.logit_buckets is None      # CPU: no padding
    requests = _requests(reference.runner.model_config.vocab_size)
    expected = _tokens(run_to_finish(reference, requests))

    engine = make_engine(model_dir, backend=backend, **OPTIONS)
    engine.runner.inputs.logit_buckets = BUCKETS
    model, seen = engine.runner.model, []
    compute_logits = model.compute_logits

    def recording(hidden, **kwargs):
        seen.append(hidden.shape[0])
        return compute_logits(hidden, **kwargs)
    model.compute_logits = recording
    sampled = []
    sample = engine.runner.sample

    def recording_sample(prepared, logits, *args, **kwargs):
        sampled.append((sum(prepared.out.num_samples), logits.shape[0]))
        return sample(prepared, logits, *args, **kwargs)
    engine.runner.sample = recording_sample

    assert _tokens(run_to_finish(engine, requests)) == expected
    assert seen and set(seen) <= set(BUCKETS)
    # The sampler sees the sample rows only, and some step was padded.
    assert all(rows == n for rows, n in sampled)
    assert any(n not in BUCKETS for _, n in sampled)
    assert_pool_whole(engine)


def test_padded_sample_rows_travel_to_other_ranks(tiny_model_factory):
    """``host_arrays`` / ``load`` (a tensor-parallel rank's copy of a step) give the same
    LM-head rows, padding included."""
    engine = make_engine(tiny_model_factory("llama"), backend="torch", **OPTIONS)
    inputs = engine.runner.inputs
    inputs.logit_buckets = BUCKETS
    for prompt, params in _requests(engine.runner.model_config.vocab_size)[:3]:
        engine.add_request(prompt, params)
    built = []
    build = inputs.build

    def recording(*args, **kwargs):
        step = build(*args, **kwargs)
        built.append((step, inputs.host_arrays(step)))
        return step
    inputs.build = recording
    for _ in range(4):
        engine.step()
    padded = [(s, a) for s, a in built if s.logit_rows > s.num_sample_rows]
    assert padded
    for step, arrays in padded:
        assert step.logit_rows == min(b for b in BUCKETS if b >= step.num_sample_rows)
        rows = arrays["sample_rows"].tolist()
        assert len(rows) == step.logit_rows and rows[step.num_sample_rows:] == [0] * (
            step.logit_rows - step.num_sample_rows)
        loaded = inputs.load(arrays, table_width=step.block_tables.shape[1],
                             max_seqlen_q=step.max_seqlen_q,
                             num_sample_rows=step.num_sample_rows)
        assert loaded.logit_rows == step.logit_rows
        assert loaded.sample_rows.tolist() == rows


@pytest.mark.gpu
def test_pool_sizing_profiles_the_lm_head_on_padded_rows(tiny_model_factory, monkeypatch):
    """With fewer batched tokens than sequences, a step's sample rows may pad past its
    tokens; the profiled step that sizes the pool runs the LM head on that padded count."""
    from mini_paged_attn.models.llama import CausalLM

    seen = []
    compute_logits = CausalLM.compute_logits

    def recording(self, hidden, **kwargs):
        seen.append(hidden.shape[0])
        return compute_logits(self, hidden, **kwargs)
    monkeypatch.setattr(CausalLM, "compute_logits", recording)
    # The pool is sized from the device's free memory: count only this process's, so that
    # engines of tests running beside it on the same GPU do not leave it no room.
    total = torch.cuda.mem_get_info()[1]
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (total - torch.cuda.memory_reserved(device), total))
    # 20 tokens a step, 30 sequences: 20 sample rows at most, padded to a bucket above 20.
    bucket = min(b for b in batch_buckets(30) if b >= 20)
    assert bucket > 20
    engine = make_engine(tiny_model_factory("qwen3"), backend="triton", device="cuda",
                         enforce_eager=True, max_num_seqs=30, max_num_batched_tokens=20,
                         max_model_len=20, block_size=4, gpu_memory_utilization=0.05)
    assert seen[0] == bucket, seen
    seen.clear()
    requests = [([5 + i], SamplingParams(temperature=0.0, max_tokens=3)) for i in range(25)]
    outputs = run_to_finish(engine, requests)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert bucket in seen and max(seen) == bucket
    assert_pool_whole(engine)
