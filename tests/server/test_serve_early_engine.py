"""``serve`` starts its engine's process before it imports torch and the server, so the two
processes' imports and the engine's load overlap; the process boundary itself imports no
torch, and the child's load progress stays a few messages however many units it counts."""

import json
import subprocess
import sys
import textwrap

import pytest

from server_harness import free_port

from mini_paged_attn.engine.process.child import PROGRESS_INTERVAL_S, _LoadingSender
from mini_paged_attn.engine.process.spawn import cuda_likely
from mini_paged_attn.models.load_progress import LoadEvent, LoadTimer

LIGHT_MODULES = ["mini_paged_attn", "mini_paged_attn.cli", "mini_paged_attn.commands.serve",
                 "mini_paged_attn.engine.process.spawn", "mini_paged_attn.engine.process.child",
                 "mini_paged_attn.engine.process.mp_client", "mini_paged_attn.engine",
                 "mini_paged_attn.models"]


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_process_boundary_imports_no_torch():
    got = _run(f"""
        import importlib, json, sys
        for name in {LIGHT_MODULES!r}:
            importlib.import_module(name)
        print(json.dumps({{"torch": "torch" in sys.modules,
                          "transformers": "transformers" in sys.modules}}))
    """)
    assert got == {"torch": False, "transformers": False}


def test_the_engine_process_starts_before_serve_imports_torch():
    """``serve --engine-process on``: what ``EngineProcess.start`` sees of this process's
    imports when it is called (the start is replaced by a stop, so nothing loads). No
    ``--device``: checking one asks torch whether it can use it."""
    got = _run(f"""
        import json, sys
        from mini_paged_attn import cli
        from mini_paged_attn.engine.process import spawn

        seen = {{}}
        def start(launch):
            seen.update(torch="torch" in sys.modules, model=launch.model,
                        kwargs=sorted(launch.llm_kwargs))
            raise SystemExit(0)
        spawn.EngineProcess.start = start
        try:
            cli.main(["serve", "tiny", "--port", "{free_port()}", "--engine-process", "on"])
        except SystemExit:
            pass
        print(json.dumps(seen))
    """)
    assert got["torch"] is False and got["model"] == "tiny"
    assert {"device", "dtype", "block_size", "tokenizer"} <= set(got["kwargs"])


@pytest.mark.parametrize("device, env, expected", [
    ("cuda", None, True), ("cuda:1", None, True), ("cpu", None, False),
    (None, "", False), (None, "-1", False),
])
def test_cuda_likely(monkeypatch, device, env, expected):
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert cuda_likely(device) is expected


class _Outbox:
    def __init__(self) -> None:
        self.sent = []

    def send(self, message) -> None:
        self.sent.append(message.event)


def test_load_progress_is_a_few_messages_with_every_phase_s_ends():
    outbox = _Outbox()
    timer = LoadTimer(_LoadingSender(outbox))
    with timer.phase("config"):
        pass
    with timer.phase("weights", 5000) as phase:
        for _ in range(5000):
            phase.advance()
    events = outbox.sent
    assert len(events) < 2 + 2 + 50, len(events)     # 5000 units in well under a second
    for name in ("config", "weights"):
        mine = [e for e in events if e.phase == name]
        assert (mine[0].done, mine[0].finished) == (0, False)
        assert mine[-1].finished and mine[-1].done == mine[-1].total


def test_progress_between_a_phase_s_ends_is_sent_once_an_interval():
    outbox = _Outbox()
    sender = _LoadingSender(outbox)
    sender(LoadEvent("weights", 0, 3, False, 0.0))
    sender(LoadEvent("weights", 1, 3, False, 0.0))     # too soon after the first
    assert [e.done for e in outbox.sent] == [0]
    sender._last["weights"] -= PROGRESS_INTERVAL_S
    sender(LoadEvent("weights", 2, 3, False, 0.0))
    sender(LoadEvent("weights", 3, 3, True, 0.1))
    assert [e.done for e in outbox.sent] == [0, 2, 3]
