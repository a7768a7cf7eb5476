"""num_splits_heuristic returns what FlashAttention's C++ returns, float rounding included.

Two independent transcriptions of the C++ arithmetic check it: one in Python, rounding every
float operation to float32 through ``struct`` (a float op computed in double and rounded once to
float is the correctly rounded float op: double has more than 2 * 24 + 2 bits); one compiled with
the system C++ compiler, where the types themselves give float and double arithmetic.
"""

from __future__ import annotations

import math
import random
import shutil
import struct
import subprocess
from fractions import Fraction

import pytest

from mini_paged_attn.ops import num_splits_heuristic


def f32(x: float) -> float:
    """Round a Python float (double) to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def transcription(units: int, sms: int, n_blocks: int, max_splits: int) -> int:
    """The C++ loop, line by line, with float32 rounding where the C++ has float."""
    if units >= f32(f32(0.8) * f32(sms)):  # `units >= 0.8f * num_SMs`, in float
        return 1
    limit = min(max_splits, sms, n_blocks)
    efficiencies = []
    for s in range(1, limit + 1):
        per_split, per_split_before = -(-n_blocks // s), -(-n_blocks // max(s - 1, 1))
        if s > 1 and per_split == per_split_before:
            efficiencies.append(0.0)  # as many tiles per split as with s - 1: not eligible
            continue
        waves = f32(f32(units * s) / f32(sms))  # `float n_waves = float(units * s) / num_SMs`
        efficiencies.append(f32(waves / math.ceil(waves)))
    best = max(efficiencies, default=0.0)
    for s in range(1, limit + 1):
        per_split, per_split_before = -(-n_blocks // s), -(-n_blocks // max(s - 1, 1))
        if s > 1 and per_split == per_split_before:
            continue
        if efficiencies[s - 1] >= 0.85 * best:  # the literal 0.85 is a double
            return s
    return 1


def exact(units: int, sms: int, n_blocks: int, max_splits: int) -> int:
    """The same rule in exact rational arithmetic (what the C++ *means*, not what it returns)."""
    if units >= Fraction(4, 5) * sms:
        return 1
    limit = min(max_splits, sms, n_blocks)
    eff = {}
    for s in range(1, limit + 1):
        if s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1)):
            waves = Fraction(units * s, sms)
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= Fraction(85, 100) * best)


def grid():
    """Launch shapes around the interesting regions: SM counts of real GPUs (x2, as FlashAttention
    passes 2 * multiProcessorCount) and small ones, every unit count below the 80% cut-off and a
    few above, KV tile counts from 1 to many, max_splits 1, a few, and FlashAttention's 128."""
    cases = []
    for sms in (1, 2, 7, 10, 100, 108, 216, 264):
        units = sorted(set(range(1, int(0.8 * sms) + 3)) if sms <= 108
                       else set(range(1, 12)) | set(range(12, int(0.8 * sms) + 3, 7)))
        for u in units:
            for n_blocks in (1, 2, 3, 7, 64, 1000):
                for max_splits in (1, 4, 128):
                    cases.append((u, sms, n_blocks, max_splits))
    return cases


# Inputs where a careless transcription goes wrong (found by search): computing in double
# throughout changes all five answers; comparing against 0.85f in float changes the last three.
EDGE_CASES = [(51, 100, 1000, 128), (13, 264, 1000, 128), (65, 153, 100000, 128),
              (87, 256, 100000, 128), (13, 262, 100000, 128)]


def test_documented_example():
    # FlashAttention's comment: batch * n_heads = 48 on 108 SMs. By hand:
    #   1 split: 48/108 = 0.44 waves, efficiency 0.44 / 1 = 0.44
    #   2 splits: 0.89 waves -> 0.89;  3 splits: 1.33 waves -> 1.33 / 2 = 0.67
    #   9 splits: 432/108 = 4 waves exactly -> 1.0, the best
    # 0.85 * 1.0 = 0.85; the first split count reaching it is 2 (0.89).
    assert num_splits_heuristic(48, 108, 64, 128) == 2


def test_hand_checked_cases():
    # 87 units >= 0.8 * 108 = 86.4: the SMs are nearly full, no split.
    assert num_splits_heuristic(87, 108, 64, 128) == 1
    # 86 < 86.4. Efficiencies: 1: 0.80, 2: 1.59/2 = 0.80, 3: 2.39/3 = 0.80, 4: 3.19/4 = 0.80,
    # 5: 3.98/4 = 0.995; 54 splits give 43 waves exactly (1.0). First >= 0.85: 5.
    assert num_splits_heuristic(86, 108, 64, 128) == 5
    # One KV tile cannot be split.
    assert num_splits_heuristic(1, 108, 1, 128) == 1
    # max_splits caps the answer: with 2 tiles, 48 units: 1 split 0.44, 2 splits 0.89 -> 2.
    assert num_splits_heuristic(48, 108, 2, 128) == 2
    # 64 tiles: 11 splits are 6 tiles each (the last 4); 12 splits would also be 6 tiles each
    # (ceil(64/12) = 6 = ceil(64/11)), so 12 is not eligible; nor is 9 (ceil(64/9) = 8 =
    # ceil(64/8)). 1 unit on 12 SMs: efficiency s/12 (less than one wave); best 11/12 = 0.917,
    # threshold 0.779: the first eligible s with s/12 >= 0.779 is 10.
    assert num_splits_heuristic(1, 12, 64, 128) == 10


def test_float32_rounding_matters_and_is_replicated():
    # 51 units on 100 SMs, 1000 tiles: 100 splits give 51 waves exactly (best 1.0, threshold
    # 0.85). 5 splits give 2.55 waves in 3, exactly 0.85 in rational arithmetic, but in float
    # 2.55f / 3 = 0.84999996 < 0.85, so FlashAttention skips 5 (and 6: 0.765) and returns 7
    # (3.57 / 4 = 0.8925).
    assert exact(51, 100, 1000, 128) == 5
    assert transcription(51, 100, 1000, 128) == 7
    assert num_splits_heuristic(51, 100, 1000, 128) == 7


def test_matches_the_python_transcription_on_a_grid():
    cases = grid() + EDGE_CASES
    mismatches = [(c, num_splits_heuristic(*c), transcription(*c)) for c in cases
                  if num_splits_heuristic(*c) != transcription(*c)]
    assert not mismatches, mismatches[:10]
    # The grid is not trivial: it holds answers well above 1 and cases where float arithmetic
    # departs from the exact rule.
    assert max(transcription(*c) for c in cases) >= 50
    assert any(transcription(*c) != exact(*c) for c in cases)


CPP_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

// The split-KV rule with the C++ types of FlashAttention's heuristic: float efficiencies,
// `units >= 0.8f * sms` in float, the final comparison against a double literal.
static int splits_for(int units, int sms, int n_blocks, int max_splits) {
    if (units >= 0.8f * sms) return 1;
    int limit = std::min({max_splits, sms, n_blocks});
    std::vector<float> eff(limit + 1, 0.f);
    std::vector<bool> ok(limit + 1, false);
    float best = 0.f;
    for (int s = 1; s <= limit; ++s) {
        ok[s] = s == 1 || (n_blocks + s - 1) / s != (n_blocks + s - 2) / (s - 1);
        if (!ok[s]) continue;
        float waves = float(units * s) / sms;
        eff[s] = waves / std::ceil(waves);
        if (eff[s] > best) best = eff[s];
    }
    for (int s = 1; s <= limit; ++s)
        if (ok[s] && eff[s] >= 0.85 * best) return s;
    return 1;
}

int main() {
    int u, sms, nb, ms;
    while (std::scanf("%d %d %d %d", &u, &sms, &nb, &ms) == 4)
        std::printf("%d\n", splits_for(u, sms, nb, ms));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")
def test_matches_compiled_cpp_on_a_grid(tmp_path):
    src, exe = tmp_path / "splits.cpp", tmp_path / "splits"
    src.write_text(CPP_SOURCE)
    # -ffp-contract=off: no fused multiply-add, as in FlashAttention's host build on x86-64.
    subprocess.run(["g++", "-O1", "-std=c++17", "-ffp-contract=off", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    cases = grid() + EDGE_CASES
    stdin = "\n".join(" ".join(map(str, c)) for c in cases)
    answers = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True,
                             check=True).stdout.split()
    got = [num_splits_heuristic(*c) for c in cases]
    mismatches = [(c, g, int(a)) for c, g, a in zip(cases, got, answers) if g != int(a)]
    assert len(answers) == len(cases) and not mismatches, mismatches[:10]


@pytest.mark.parametrize("name, args", [
    ("batch_nheads_mblocks", (0, 108, 8, 128)),
    ("num_sms", (4, -1, 8, 128)),
    ("num_n_blocks", (4, 108, 0, 128)),
    ("max_splits", (4, 108, 8, 0)),
    ("batch_nheads_mblocks", (2.5, 108, 8, 128)),
    ("num_sms", (4, True, 8, 128)),
    ("max_splits", (4, 108, 8, 2 ** 31)),
])
def test_bad_arguments_raise_value_error_naming_them(name, args):
    with pytest.raises(ValueError, match=f"^{name}:"):
        num_splits_heuristic(*args)


def test_balance_splits_evens_out_the_splits_within_the_same_waves():
    from mini_paged_attn.ops.attention.decode_plan import balance_splits

    # Batch 1, 8 KV heads, 2048 tiles (64k tokens in 32-token tiles) on 132 SMs x 2 slots:
    # FlashAttention's 29 splits run 71 tiles each; 32 run 64 and still fit one wave.
    assert balance_splits(29, 8, 264, 2048, 128) == 32
    # A workspace with room for 30 splits caps it.
    assert balance_splits(29, 8, 264, 2048, 30) == 30
    # Already even, or no room in the wave: unchanged.
    assert balance_splits(32, 8, 264, 128, 128) == 32
    assert balance_splits(4, 64, 264, 512, 128) == 4


def test_balance_splits_never_adds_waves_or_lengthens_a_split():
    from mini_paged_attn.ops.attention.decode_plan import balance_splits

    rng = random.Random(3)
    for _ in range(2000):
        slots = rng.choice([16, 108 * 2, 132 * 2])
        units = rng.randint(1, slots)
        tiles = rng.randint(2, 5000)
        cap = rng.randint(2, 128)
        fa = num_splits_heuristic(units, slots, tiles, cap)
        got = balance_splits(fa, units, slots, tiles, cap)
        assert fa <= got <= max(fa, min(cap, 128))
        assert -(-units * got // slots) == -(-units * fa // slots)
        assert -(-tiles // got) <= -(-tiles // fa)
