"""``mini-paged-attn serve`` as a user starts it: where the engine runs, and a real process
answering on 127.0.0.1 with its engine in a child process."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import httpx
import pytest

from server_harness import free_port, wait_until_serving

from mini_paged_attn.commands.serve import wants_engine_process
from mini_paged_attn.engine import LLM, SamplingParams


@pytest.mark.parametrize("choice, device, expected", [
    ("on", "cpu", True), ("off", "cuda", False), ("auto", "cpu", False), ("auto", "cuda", True),
    ("auto", "cuda:1", True),
])
def test_engine_process_choice(choice, device, expected):
    assert wants_engine_process(choice, device) is expected


def test_auto_without_device_follows_cuda_availability():
    import torch

    assert wants_engine_process("auto", None) is torch.cuda.is_available()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_serve_with_the_engine_in_its_own_process_answers_like_generate():
    port = free_port()
    cmd = [sys.executable, "-m", "mini_paged_attn.cli", "serve", "--model", "tiny",
           "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--num-kv-blocks", "32", "--engine-process", "on"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, url)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
        expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0]
        assert got["choices"][0]["text"] == expected.text
        assert got["usage"]["completion_tokens"] == len(expected.token_ids)
        engine_pids = _children(proc.pid)
        assert engine_pids, "no engine process under serve"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "engine in its own process" in out
    assert "POST /v1/completions 200" in out   # the access log: one line per request
    assert f"stopped serving 'tiny' on http://127.0.0.1:{port}" in out
    assert proc.returncode == 0, out   # SIGTERM: uvicorn stops, then the engine process
    assert all(_gone(pid, timeout=10) for pid in engine_pids)


def test_serve_prints_its_banner_once_the_port_is_bound_then_logs_and_stops():
    port = free_port()
    cmd = [sys.executable, "-m", "mini_paged_attn.cli", "serve", "--model", "tiny",
           "--port", str(port), "--device", "cpu", "--num-kv-blocks", "32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("serving 'tiny' on"):
                break
        else:
            raise AssertionError(f"serve exited without its banner: {''.join(seen)}")
        # No retry: once the banner is out, the port answers.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        # A second server on the same port: one line from uvicorn, exit 2, no traceback.
        busy = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 2, busy.stderr
        assert "address already in use" in busy.stderr and "Traceback" not in busy.stderr
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    access = [line for line in out.splitlines() if "mini_paged_attn.serve.access" in line]
    assert len(access) == 1 and "GET /v1/models 200" in access[0], out
    assert out.rstrip().endswith(f"stopped serving 'tiny' on http://127.0.0.1:{port}"), out
    assert proc.returncode == 0, out


@pytest.mark.parametrize("argv_key, env_key", [(["--api-key", ""], None),
                                               (["--api-key", "  "], None),
                                               ([], ""), ([], " \t")])
def test_a_blank_api_key_is_a_one_line_error_before_the_model_loads(monkeypatch, capsys,
                                                                    argv_key, env_key):
    from mini_paged_attn.cli import main

    if env_key is None:
        monkeypatch.delenv("MINI_PAGED_ATTN_API_KEY", raising=False)
    else:
        monkeypatch.setenv("MINI_PAGED_ATTN_API_KEY", env_key)
    # A model that does not exist: had serve tried to load it, the error would be another.
    assert main(["serve", "--model", "/nonexistent/model", *argv_key]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "blank" in err, err


def test_build_app_refuses_a_blank_api_key():
    from mini_paged_attn.server.app import build_app

    for key in ("", " ", "\n"):
        with pytest.raises(ValueError, match="api_key"):
            build_app(object(), model_name="tiny", api_key=key)


def test_limit_options_reach_the_server_limits():
    from mini_paged_attn.cli import build_parser
    from mini_paged_attn.commands.serve import server_limits
    from mini_paged_attn.server.limits import ServerLimits

    args = build_parser().parse_args(["serve", "--model", "tiny", "--max-request-bytes", "1000",
                                      "--max-stop-strings", "3", "--max-n", "2"])
    assert server_limits(args) == ServerLimits(max_request_bytes=1000, max_stop_strings=3,
                                               max_n=2)
    defaults = build_parser().parse_args(["serve", "--model", "tiny"])
    assert server_limits(defaults) == ServerLimits()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "tiny", "--max-request-bytes", "0"])
