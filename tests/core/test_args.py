"""The shared argument checks and integer helpers of core/args.py."""

import numpy as np
import pytest
import torch

from mini_paged_attn.core.args import (cdiv, check_bool, is_int, is_number, next_pow2,
                                       non_negative_int, positive_int)


def test_cdiv_is_exact_and_elementwise():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert cdiv(2 ** 70 + 1, 2 ** 35) == 2 ** 35 + 1        # no float rounding
    assert cdiv(torch.tensor([0, 3, 4, 5]), 4).tolist() == [0, 1, 1, 2]
    assert cdiv(np.array([7, 8]), 8).tolist() == [1, 1]


def test_next_pow2():
    assert [next_pow2(x) for x in (0, 1, 2, 3, 16, 17, 80)] == [1, 1, 2, 4, 16, 32, 128]


@pytest.mark.parametrize("value", [1, 7, np.int64(3), torch.tensor(2)])
def test_positive_int_accepts_integers_and_returns_a_python_int(value):
    got = positive_int("n", value)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", True, None, np.bool_(True)])
def test_positive_int_refuses_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"^n: expected a positive int, got "):
        positive_int("n", value)


def test_non_negative_int():
    assert non_negative_int("n", 0) == 0
    with pytest.raises(ValueError, match=r"^n: expected a non-negative int, got -1"):
        non_negative_int("n", -1)


def test_check_bool_and_type_tests():
    assert check_bool("flag", False) is False
    for value in (1, "yes", None):
        with pytest.raises(ValueError, match=r"^flag: expected a bool"):
            check_bool("flag", value)
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3) and is_number(2.5) and not is_number(False) and not is_number("1")
