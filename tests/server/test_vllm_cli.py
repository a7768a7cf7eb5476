"""``mini-paged-attn serve`` as a vLLM user types it: the model positional, vLLM's flags, the
refusals that come before the model loads, and help for every option (the bench tools too)."""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys

import httpx
import pytest

from server_harness import free_port, wait_until_serving

from mini_paged_attn.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything starts to load a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model started to load")

    from mini_paged_attn.engine import llm
    from mini_paged_attn.engine.process import mp_client

    monkeypatch.setattr(llm.LLMEngine, "from_model", refuse)
    monkeypatch.setattr(mp_client.MPEngineClient, "__init__", refuse)


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_the_model_is_positional_or_an_option():
    from mini_paged_attn.commands.serve import model_argument

    assert model_argument(_serve_args("DIR")) == "DIR"
    assert model_argument(_serve_args("--model", "DIR")) == "DIR"
    assert model_argument(_serve_args("DIR", "--model", "DIR")) == "DIR"


@pytest.mark.parametrize("argv, says", [
    ([], "MODEL: expected a model"),
    (["one", "--model", "two"], "'one' and --model 'two'"),
])
def test_no_model_or_two_models_is_one_error_line(argv, says, capsys, no_model_loads):
    assert main(["serve", *argv]) == 2
    assert says in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("text, dtype", [("half", "float16"), ("float16", "float16"),
                                         ("bfloat16", "bfloat16"), ("float32", "float32"),
                                         ("float", "float32"), ("auto", "auto"),
                                         ("HALF", "float16")])
def test_vllm_dtype_names(text, dtype):
    assert _serve_args("m", "--dtype", text).dtype == dtype
    assert build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--dtype",
                                      text]).dtype == dtype


@pytest.mark.parametrize("argv, option", [
    (["--dtype", "int8"], "--dtype"), (["--gpu-memory-utilization", "1.5"],
                                       "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--tool-call-parser", "granite"], "--tool-call-parser"),
])
def test_bad_values_are_usage_errors_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "m", *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_vllm_flags_parse_to_what_the_server_uses():
    args = _serve_args("m", "--served-model-name", "a", "org/b", "--max-model-len", "512",
                       "--gpu-memory-utilization", "0.5", "--seed", "7",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--disable-log-requests", "--tokenizer", "TOKDIR")
    assert args.tokenizer == "TOKDIR"
    assert args.served_model_name == ["a", "org/b"]
    assert (args.max_model_len, args.gpu_memory_utilization, args.seed) == (512, 0.5, 7)
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert args.disable_log_requests


@pytest.mark.parametrize("command", [["serve", "tiny"],
                                     ["generate", "--model", "tiny", "--prompt", "x"]])
def test_trust_remote_code_is_refused_in_one_line(command, capsys, no_model_loads):
    assert main([*command, "--trust-remote-code"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--trust-remote-code" in line and "no remote code runs here" in line


def test_a_busy_port_is_one_error_line_before_the_model_loads(capsys, no_model_loads):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "tiny", "--port", str(port), "--device", "cpu"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"127.0.0.1:{port}: address already in use" in line and "--port" in line


def test_a_host_that_cannot_be_bound_is_one_error_line(capsys, no_model_loads):
    assert main(["serve", "tiny", "--host", "no-such-host.invalid", "--port", "8123"]) == 2
    assert "--host" in _one_error_line(capsys.readouterr().err)


def test_chat_template_from_a_file_or_inline(tmp_path):
    from mini_paged_attn.commands.serve import read_chat_template

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert read_chat_template(str(path)) == inline
    assert read_chat_template(inline) == inline


@pytest.mark.parametrize("template, says", [
    ("missing.jinja", "neither a file nor"),
    ("{% for m in messages %}", "not a valid Jinja template"),
])
def test_a_bad_chat_template_is_one_error_line_before_the_model_loads(template, says, capsys,
                                                                      no_model_loads):
    assert main(["serve", "tiny", "--chat-template", template, "--port", "1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--chat-template" in line and says in line


def test_serve_model_positional_with_vllm_flags_end_to_end(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    port = free_port()
    cmd = [sys.executable, "-m", "mini_paged_attn.cli", "--log-level", "INFO", "serve", "tiny",
           "--port", str(port), "--device", "cpu", "--dtype", "float", "--num-kv-blocks", "32",
           "--served-model-name", "first", "second", "--max-model-len", "96",
           "--chat-template", str(template), "--seed", "3", "--enable-auto-tool-choice",
           "--disable-log-requests", "--gpu-memory-utilization", "0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        done = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "second", "prompt": "hi", "max_tokens": 2})
        tokens = httpx.post(f"{url}/tokenize", timeout=10, json={
            "model": "first", "messages": [{"role": "user", "content": "abc"}]}).json()
        version = httpx.get(f"{url}/version", timeout=10).json()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert [m["id"] for m in models] == ["first", "second"]
    assert all(m["max_model_len"] == 96 for m in models)
    assert done.status_code == 200 and done.json()["model"] == "first"
    from mini_paged_attn.engine import LLM

    with LLM("tiny", device="cpu", num_kv_blocks=8) as llm:
        assert tokens["tokens"] == llm.tokenizer.encode("[abc]", add_special_tokens=False)
    assert set(version) == {"version"}
    assert "serving 'first' on" in out
    assert "mini_paged_attn.serve.access" not in out, out   # --disable-log-requests
    assert proc.returncode == 0, out


# Every option of every parser a module builds, when run with --help; prints the ones with no
# help text (argparse's SUPPRESS aside).
_HELP_CHECK = """
import argparse, contextlib, io, runpy, sys
missing, current = [], [None]
real = argparse.ArgumentParser.parse_known_args
def walk(parser, where):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                walk(sub, where + " " + name)
        elif a.dest != "help" and a.help != argparse.SUPPRESS and not (a.help or "").strip():
            missing.append(where + ": " + ("/".join(a.option_strings) or a.dest))
def spy(self, args=None, namespace=None):
    walk(self, current[0])
    return real(self, args, namespace)
argparse.ArgumentParser.parse_known_args = spy
for name in sys.argv[1:]:
    current[0], sys.argv = name, [name, "--help"]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
print("MISSING", *missing, sep="\\n")
"""


def test_help_describes_every_option_of_the_cli_and_the_bench_tools():
    tools = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py")
                   if p.stem.startswith("bench_") or p.stem == "hostile_mix")
    assert "benchmarks.bench_server" in tools
    done = subprocess.run([sys.executable, "-c", _HELP_CHECK, "mini_paged_attn.cli", *tools],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    missing = done.stdout.split("MISSING", 1)[1].split()
    assert missing == [], done.stdout
