"""The command line: ``demo`` (the README's main job), ``generate``, and argument errors."""

import pytest

from mini_paged_attn.cli import main
from mini_paged_attn.engine import LLM, SamplingParams


def test_demo_runs_and_paged_attention_matches_dense(capsys):
    assert main(["demo", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "(OK)" in text
    assert "copy-on-write" in text
    # Both parts end with the whole pool free again.
    assert "0 used (0 shared), 16 free" in text
    assert "after the run: 96/96 blocks free" in text
    # The n=2 request produced two samples.
    assert "n2[0]" in text and "n2[1]" in text


@pytest.mark.parametrize("tp", ["1", "2"])
def test_generate_streams_the_same_text_as_llm_generate(capsys, tp):
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6",
                 "--temperature", "0", "--device", "cpu", "--dtype", "float32",
                 "--tensor-parallel-size", tp]) == 0
    streamed = capsys.readouterr().out
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=16)
    expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0].text
    assert streamed == expected + "\n"


def test_generate_with_an_fp8_kv_cache(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "4",
                 "--temperature", "0", "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 0
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "0"],
    ["serve", "--model", "tiny", "--max-queue", "-1"],
    ["serve", "--model", "tiny", "--device", "bogus"],
    ["generate", "--model", "tiny", "--prompt", "x", "--device", "gpu0"],
    ["demo", "--block-size", "many"],
    ["generate", "--model", "tiny", "--prompt", "x", "--kv-cache-dtype", "int8"],
    ["serve", "--model", "tiny", "--kv-cache-dtype", "fp4"],
    ["generate", "--model", "tiny", "--prompt", "x", "--tensor-parallel-size", "0"],
])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_generate_rejects_bad_sampling_values(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--top-p", "1.5",
                 "--device", "cpu"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--presence-penalty", "3",
                 "--device", "cpu"]) == 2
    assert "presence_penalty" in capsys.readouterr().err


def test_generate_applies_the_penalties(capsys):
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2)
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "6",
                 "--temperature", "0", "--device", "cpu", "--dtype", "float32",
                 "--presence-penalty", "0.5", "--frequency-penalty", "1",
                 "--repetition-penalty", "1.2"]) == 0
    streamed = capsys.readouterr().out
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=16)
    expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6, **penalties),
                            use_tqdm=False)[0].outputs[0]
    assert streamed == expected.text + "\n"
    # The tiny model repeats one token greedily; the penalties break that.
    assert len(set(expected.token_ids)) > 1
