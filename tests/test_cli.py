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


# ---- user mistakes: one `error:` line on stderr, exit 2, no traceback ----------------------

def _model_dir(tmp_path, case: str) -> str:
    """A model path with one thing wrong with it (``case``)."""
    import shutil

    from mini_paged_attn.models.tiny import write_tiny_llama

    path = tmp_path / case
    if case == "missing":
        return str(path)
    if case == "hub-id":
        return "Qwen/Qwen2.5-0.5B-Instruct"
    path.mkdir()
    if case == "empty":
        return str(path)
    good = write_tiny_llama(tmp_path / "good")
    if case == "config-only":
        shutil.copy(good / "config.json", path)
        return str(path)
    for f in good.iterdir():
        shutil.copy(f, path)
    weights = path / "model.safetensors"
    if case == "no-weights":
        weights.unlink()
    elif case == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:200])
    return str(path)


MODEL_CASES = {
    "missing": "is not a directory",
    "hub-id": "`hf download Qwen/Qwen2.5-0.5B-Instruct",
    "empty": "is empty",
    "config-only": "no tokenizer",
    "no-weights": r"no *.safetensors",
    "truncated-weights": "truncated",
}


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_model_directory_that_cannot_load_is_one_error_line(tmp_path, capsys, case):
    model = _model_dir(tmp_path, case)
    assert main(["generate", "--model", model, "--prompt", "x", "--device", "cpu"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert MODEL_CASES[case] in line
    if case not in ("hub-id",):
        assert case in line   # names the path


@pytest.mark.parametrize("case", ["missing", "truncated-weights"])
@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_serve_reports_the_same_model_error_as_generate(tmp_path, capsys, case, engine_process):
    model = _model_dir(tmp_path, case)
    assert main(["generate", "--model", model, "--prompt", "x", "--device", "cpu"]) == 2
    from_generate = _one_error_line(capsys.readouterr().err)
    assert main(["serve", "--model", model, "--device", "cpu",
                 "--engine-process", engine_process]) == 2
    assert _one_error_line(capsys.readouterr().err) == from_generate


def test_debug_shows_the_traceback_instead(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        main(["--debug", "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])


@pytest.mark.parametrize("argv, names", [
    (["--log-level", "LOUD", "demo"], "--log-level"),
    (["generate", "--model", "tiny", "--prompt", "x", "--dtype", "nonsense"], "--dtype"),
    (["demo", "--block-size", "0"], "--block-size"),
    (["serve", "--model", "tiny", "--port", "99999"], "--port"),
    (["serve", "--model", "tiny", "--port", "0"], "--port"),
])
def test_bad_option_values_are_usage_errors_naming_the_option(capsys, argv, names):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: argument {names}" in err.splitlines()[-1]


def test_a_cuda_device_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny", "--prompt", "x", "--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_log_level_is_case_insensitive(capsys):
    assert main(["--log-level", "error", "demo", "--skip-engine"]) == 0


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"mini-paged-attn {version('mini_paged_attn')}"


def test_system_without_chat_is_an_error(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--system", "be brief"]) == 2
    assert "--chat" in _one_error_line(capsys.readouterr().err)


def test_serve_without_the_server_extra_says_how_to_install_it(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)   # import uvicorn -> ImportError
    assert main(["serve", "--model", "tiny"]) == 2
    assert 'pip install -e ".[server]"' in _one_error_line(capsys.readouterr().err)


def test_an_unloadable_model_is_one_line_end_to_end(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mini_paged_attn.cli", "generate", "--model",
                           str(tmp_path / "missing"), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "is not a directory" in _one_error_line(proc.stderr)


def test_demo_runs_where_triton_is_not_installed():
    """The README's quick start installs a CPU torch, which brings no Triton: the package and
    its demo must not need it (a subprocess where ``import triton`` fails)."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "from mini_paged_attn.cli import main\n"
            "main(['demo'])\n"
            "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules\n"
            "               if sys.modules[m] is not None)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "blocks free" in done.stdout


@pytest.mark.parametrize("flags, expected", [([], True), (["--no-cascade-attention"], False),
                                             (["--cascade-attention", "on"], True),
                                             (["--cascade-attention", "off"], False)])
def test_serve_maps_the_cascade_flag_to_the_engine_config(flags, expected):
    from mini_paged_attn.cli import build_parser
    from mini_paged_attn.commands.serve import engine_kwargs
    from mini_paged_attn.engine.config import EngineConfig

    args = build_parser().parse_args(["serve", "--model", "tiny", *flags])
    kwargs = engine_kwargs(args)
    assert kwargs["cascade_attention"] is expected
    assert EngineConfig(cascade_attention=kwargs["cascade_attention"]).cascade_attention is expected
