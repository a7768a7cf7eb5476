"""The command line's load progress bar and its ``--threads`` choice."""

import io

import pytest
import torch

from mini_paged_attn.cli import main
from mini_paged_attn.commands.progress import (LoadProgressBar, apply_cpu_threads, auto_threads,
                                               cpu_threads)
from mini_paged_attn.models.load_progress import LoadTimer


@pytest.fixture
def torch_threads():
    """Puts torch's thread count back after a test that sets it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_one_bar_over_every_phase():
    out = io.StringIO()
    bar = LoadProgressBar(file=out, disable=False)
    timer = LoadTimer(bar)
    with timer.phase("config"):
        pass
    with timer.phase("weights", total=3) as phase:
        for _ in range(3):
            phase.advance()
    with timer.phase("kv pool"):
        pass
    assert (bar.bar.total, bar.bar.n) == (5, 5)
    bar.close()
    text = out.getvalue()
    assert "loading: weights" in text
    assert list(bar.seconds) == ["config", "weights", "kv pool"]
    assert "loaded (config " in text and "kv pool " in text


@pytest.mark.parametrize("cpus, load, default, expected", [
    (2, 0.3, 2, 2),      # an idle machine: torch's one thread a core
    (2, 1.4, 2, 2),      # one core of two busy: two threads still won
    (2, 2.6, 2, 1),      # every core busy: threads waiting on each other
    (16, 15.6, 16, 8),
    (1, 4.0, 1, 1),
    (8, 0.0, 4, 4),      # never more than torch would start
])
def test_auto_threads(cpus, load, default, expected):
    assert auto_threads(cpus, load, default) == expected


@pytest.mark.parametrize("bad", ["0", "-2", "two", ""])
def test_a_bad_thread_count_is_named(bad):
    with pytest.raises(ValueError, match="--threads: expected 'auto' or an int >= 1"):
        cpu_threads(bad, "cpu")


def test_threads_are_set_on_cpu_only(torch_threads):
    assert cpu_threads("3", "cpu") == 3
    assert cpu_threads("auto", "cuda") is None
    assert apply_cpu_threads("1", "cpu") == 1 == torch.get_num_threads()


def test_generate_takes_threads(torch_threads, capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2",
                 "--device", "cpu", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--threads", "none"]) == 2
    assert "--threads: expected 'auto' or an int >= 1, got 'none'" in capsys.readouterr().err


def test_a_failed_load_does_not_say_loaded():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with LoadProgressBar(file=out, disable=False) as bar:
            with LoadTimer(bar).phase("weights", total=2):
                raise RuntimeError("truncated")
    assert "loading: weights" in out.getvalue() and "loaded (" not in out.getvalue()
