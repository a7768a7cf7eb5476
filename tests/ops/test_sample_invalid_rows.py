"""sample_tokens on rows with nothing to sample: every id stays in the vocabulary and
``return_invalid`` flags exactly the rows that are all -inf or hold a NaN, on both backends (the
Triton kernel through the interpreter on CPU, natively in the ``gpu`` test of
tests/engine/test_sampler_isolation_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops.sample import sample_tokens

NEG_INF = float("-inf")


def _hostile_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Logits of eight rows and their temperatures (greedy and sampled), with the flags
    expected: all -inf, a NaN in the last slice, all NaN, +inf, one finite token, normal."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocab, generator=gen)
    logits[0] = NEG_INF
    logits[1] = NEG_INF
    logits[2, vocab - 1] = float("nan")
    logits[3] = float("nan")
    logits[4, 11] = logits[4, vocab - 2] = float("inf")
    logits[5] = NEG_INF
    logits[5, 1234 % vocab] = -3.0
    logits[7] = NEG_INF
    logits[7, vocab - 1] = 80.0
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.0, 1.3, 0.0, 0.9])
    return logits, temps, [True, True, True, True, False, False, False, False]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ids_stay_in_range_and_empty_rows_are_flagged(backend, dtype):
    vocab = 5000                     # several kernel slices per row
    logits, temps, expected = _hostile_rows(vocab)
    logits = logits.to(dtype)
    ids, invalid = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(1),
                                 backend=backend, return_invalid=True)
    assert ids.dtype == torch.int64 and invalid.dtype == torch.bool
    assert bool(((ids >= 0) & (ids < vocab)).all()), ids
    assert invalid.tolist() == expected
    assert ids[4].item() in (11, vocab - 2)
    assert ids[5].item() == 1234 % vocab and ids[7].item() == vocab - 1
    assert ids[6].item() == logits[6].float().argmax().item()
    plain = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(1),
                          backend=backend)
    assert torch.equal(plain, ids)


def test_return_invalid_is_checked():
    with pytest.raises(ValueError, match="return_invalid: expected a bool"):
        sample_tokens(torch.zeros(2, 4), torch.ones(2), return_invalid=1)
