"""Temperature sampling (ops/sample.py): the Triton kernel and the torch reference.

The two draw different noise, so they are checked against the distribution they must sample
(``softmax(logits / T)``) and against argmax for greedy rows, not against each other's ids. On
CPU the kernel runs through the Triton interpreter (fp32 / fp16 logits); the ``gpu`` tests
repeat it natively on a real vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops.sample import sample_tokens

BACKENDS = ("torch", "triton")


def _frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.cpu(), minlength=vocab).double() / ids.numel()


def _expected(logits_row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits_row.double() / temperature, dim=-1).cpu()


def _tv_bound(p: torch.Tensor, n: int) -> float:
    """Three standard deviations of each frequency of ``n`` draws, halved as total variation
    halves the summed deviations."""
    return 1.5 * (p * (1 - p) / n).sqrt().sum().item()


# The interpreter runs each row's program in numpy (~10 ms): fewer draws there.
@pytest.mark.parametrize("backend, rows", [("torch", 4000), ("triton", 800)])
def test_rows_sample_softmax_of_logits_over_temperature(backend, rows):
    vocab, temperature = 6, 0.5
    row = torch.tensor([1.0, -0.5, 0.3, 0.9, -1.2, 0.0])
    logits = row.expand(rows, vocab).contiguous()
    temps = torch.full((rows,), temperature)
    ids = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(1),
                        backend=backend)
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    expected = _expected(row, temperature)
    tv = 0.5 * (_frequencies(ids, vocab) - expected).abs().sum().item()
    assert tv < _tv_bound(expected, rows), tv
    # The bound is tight enough to see a wrong temperature (T = 1 instead of 0.5).
    assert 0.5 * (expected - _expected(row, 1.0)).abs().sum().item() > 2 * _tv_bound(
        expected, rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_take_the_first_argmax_and_sampled_rows_mix(backend):
    vocab = 5000  # several kernel slices per row on the CPU's assumed GPU size
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float32)
    logits[0, vocab - 1] = 50.0          # the winner in the last slice
    logits[1, 7] = logits[1, 4000] = 50.0  # a tie: the first id wins
    temps = torch.tensor([0.0, 0.0, 1.0, 0.0])
    before = logits.clone()
    ids = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(3),
                        backend=backend)
    assert ids[0] == vocab - 1 and ids[1] == 7 and ids[3] == logits[3].argmax()
    assert torch.equal(logits, before), "logits must not be modified"


def test_kernel_reads_half_precision_and_strided_rows():
    vocab = 300
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 2 * vocab, generator=gen).to(torch.float16)
    wide[:, vocab:] = float("nan")        # past each row's vocabulary: never read
    logits = wide[:, :vocab]
    ids = sample_tokens(logits, torch.zeros(3), backend="triton")
    assert torch.equal(ids, logits.float().argmax(dim=-1))


def test_same_generator_state_same_tokens_and_rows_draw_apart():
    vocab, rows = 64, 120
    logits = torch.zeros(rows, vocab)  # uniform: every id equally likely
    temps = torch.ones(rows)
    a = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(5), backend="triton")
    b = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(5), backend="triton")
    c = sample_tokens(logits, temps, generator=torch.Generator().manual_seed(6), backend="triton")
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.8
    # Each row has its own key: identical rows do not draw the same token.
    assert a.unique().numel() > 40  # of 64; ~56 expected from 120 independent draws


@pytest.mark.parametrize("bad, match", [
    (dict(temperatures=torch.ones(3, dtype=torch.float64)), "temperatures"),
    (dict(temperatures=torch.ones(2)), r"temperatures: expected shape \(3,\)"),
    (dict(logits=torch.zeros(3, 4, dtype=torch.int64)), "logits"),
])
def test_bad_arguments_raise_value_errors(bad, match):
    args = dict(logits=torch.zeros(3, 4), temperatures=torch.ones(3)) | bad
    with pytest.raises(ValueError, match=match):
        sample_tokens(args["logits"], args["temperatures"])


@pytest.mark.gpu
def test_gpu_real_vocabulary_distribution_and_greedy():
    vocab, rows, temperature = 151_936, 256, 0.6
    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    temps = torch.full((rows,), temperature, device="cuda")
    temps[::4] = 0.0
    ids = sample_tokens(logits, temps, generator=gen)
    greedy = ids[::4]
    assert torch.equal(greedy, logits[::4].float().argmax(dim=-1))
    # A peaked row of 16 live tokens (the rest at -inf), drawn 4096 times.
    peaked = torch.full((4096, vocab), float("-inf"), device="cuda")
    live = torch.randn(16, device="cuda", generator=gen)
    cols = torch.arange(16, device="cuda") * 9001
    peaked[:, cols] = live
    drawn = sample_tokens(peaked, torch.full((4096,), temperature, device="cuda"),
                          generator=gen)
    assert bool(torch.isin(drawn, cols).all())
    freq = torch.bincount(drawn // 9001, minlength=16).double().cpu() / 4096
    expected = _expected(live, temperature)
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < _tv_bound(expected, 4096), tv
