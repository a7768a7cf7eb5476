"""On a GPU: rows with nothing to sample and the tightest filters never index out of range (an
out-of-range gather or embedding lookup would be a device-side assert that poisons the CUDA
context for every later request), the Triton sampling kernel flags the empty rows at a real
vocabulary, and an engine with hostile requests in its batch keeps serving its neighbours and
the requests after them."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.sample.sampler import Sampler
from mini_paged_attn.ops.sample import sample_tokens

pytestmark = pytest.mark.gpu

NEG_INF = float("-inf")
VOCAB = 151_936


def _hostile_logits(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Random logits on the GPU with rows all -inf, NaN in the last slice, all NaN and +inf;
    returns them and the rows that have nothing to sample."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen)
    logits[0] = NEG_INF
    logits[5, VOCAB - 1] = float("nan")
    logits[9] = float("nan")
    logits[12, [3, VOCAB - 3]] = float("inf")
    logits[13] = NEG_INF
    logits[13, 100_000] = -4.0           # one allowed token
    return logits.to(dtype), [0, 5, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_race_flags_empty_rows_at_a_real_vocabulary(dtype):
    logits, empty = _hostile_logits(64, dtype)
    temps = torch.full((64,), 0.8, device="cuda")
    temps[::3] = 0.0
    gen = torch.Generator(device="cuda").manual_seed(1)
    for backend in ("triton", "torch"):
        ids, invalid = sample_tokens(logits, temps, generator=gen, backend=backend,
                                     return_invalid=True)
        torch.cuda.synchronize()
        assert bool(((ids >= 0) & (ids < VOCAB)).all())
        assert invalid.nonzero().flatten().tolist() == empty, backend
        assert ids[12].item() in (3, VOCAB - 3) and ids[13].item() == 100_000


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=1e-46),
    SamplingParams(temperature=1.0, seed=3, top_p=0.9, top_k=50),
    SamplingParams(temperature=0.7, min_p=0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0)], ids=["top_p 1e-46", "seeded top_p top_k", "min_p",
                                           "one pass", "greedy"])
def test_the_sampler_on_the_gpu_flags_empty_rows_and_stays_in_range(params):
    logits, empty = _hostile_logits(16, torch.float32)
    seeds = [("r", i) if params.seed is not None else None for i in range(16)]
    out = Sampler(torch.device("cuda"))(logits, [params] * 16, seeds)
    torch.cuda.synchronize()
    assert out.invalid_rows == empty
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert out.token_ids[12] in (3, VOCAB - 3) and out.token_ids[13] == 100_000


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_an_engine_on_the_gpu_survives_hostile_requests(async_scheduling, monkeypatch):
    pytest.importorskip("llguidance")
    from helpers.hostile_requests import (MAX_TOKENS, NEIGHBOURS, WORDS, failing_grammar,
                                          neighbours_alone, with_hostile)

    from mini_paged_attn.engine.structured import StructuredOutputsParams

    llm = LLM("tiny", dtype="float32", device="cuda", block_size=16, num_kv_blocks=128,
              max_num_seqs=16, max_model_len=128, async_scheduling=async_scheduling)
    alone = neighbours_alone(llm)
    greedy = [i for i, (_, p) in enumerate(NEIGHBOURS) if p.greedy]
    hostile = {
        "top_p 1e-46": SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=MAX_TOKENS,
                                      ignore_eos=True),
        "repetition 1e-40": SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1e-40,
                                           max_tokens=MAX_TOKENS, ignore_eos=True),
        "nothing to sample": SamplingParams(temperature=1.0, max_tokens=8, min_tokens=3,
                                            stop_token_ids=[97], structured_outputs=(
                                                StructuredOutputsParams(regex="a"))),
    }
    reasons = {}
    for name, params in hostile.items():
        neighbours, out = with_hostile(llm, "x y", params)
        reasons[name] = out.outputs[0].finish_reason
        # Greedy rows match exactly; the others may see other float rounding at another
        # batch size on the GPU, so they are held to finishing as they did alone.
        assert [neighbours[i] for i in greedy] == [alone[i] for i in greedy], name
        assert [s[0][1] for s in neighbours] == [s[0][1] for s in alone], name
    failing_grammar(monkeypatch, llm, "unsafe_compute_mask_ptr", at=3)
    neighbours, out = with_hostile(llm, "w", SamplingParams(temperature=1.0, seed=5,
                                                           max_tokens=12,
                                                           structured_outputs=WORDS))
    reasons["mask fails"] = out.outputs[0].finish_reason
    assert len(out.outputs[0].token_ids) == 2
    assert reasons == {"top_p 1e-46": "length", "repetition 1e-40": "length",
                       "nothing to sample": "error", "mask fails": "error"}
    torch.cuda.synchronize()
    # The context is healthy: a later batch runs as the first one did.
    assert [neighbours_alone(llm)[i] for i in greedy] == [alone[i] for i in greedy]
