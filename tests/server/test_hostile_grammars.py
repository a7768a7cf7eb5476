"""Hostile constraints through the real server: each is a 400 naming its field, nothing reaches
the engine, and the server keeps serving. The ones that used to kill the process (SIGSEGV in
llguidance's compiler) are sent to a server in a child process, which must survive them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server_harness import CHAT_GOOD, GOOD, assert_error

pytest.importorskip("llguidance", reason='structured outputs need pip install -e ".[structured]"')

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "engine"))
from test_grammar_limits import chained_refs, chained_rules  # noqa: E402

REFS = chained_refs(1000)
TOOL = [{"type": "function", "function": {"name": "f", "parameters": REFS}}]
HUGE_INT = '{"type": "integer", "maximum": 1' + "0" * 25 + "}"

# (endpoint, extra body fields, the param the 400 must name)
CRASHERS = [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": REFS}}},
     "response_format.json_schema.schema"),
    ("completions", {"structured_outputs": {"json": REFS}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"grammar": chained_rules(3000)}},
     "structured_outputs.grammar"),
    ("chat", {"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ("chat", {"tools": TOOL, "tool_choice": "required"}, "tools[0].function.parameters"),
]


def _post(c, endpoint: str, extra: dict):
    base = CHAT_GOOD if endpoint == "chat" else GOOD
    return c.post(f"/v1/{endpoint}" if endpoint == "completions" else "/v1/chat/completions",
                  json={**base, **extra})


def _adds(server) -> int:
    return server.async_client.client._core.adds_seen


CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = {paths!r}
    from server_harness import API_KEY, served
    from test_hostile_grammars import CRASHERS, _post
    from mini_paged_attn.engine import LLMEngine
    from mini_paged_attn.engine.config import EngineConfig
    engine = LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
        block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=128))
    with served(engine, api_key=API_KEY) as server, server.client() as c:
        for endpoint, extra, param in CRASHERS:
            r = _post(c, endpoint, extra)
            print(json.dumps([r.status_code, r.json()["error"]["param"]]))
""")


def test_stack_overflowing_constraints_are_400s_in_a_child_server():
    code = CHILD.format(paths=[str(HERE), str(HERE.parent), str(HERE.parent / "engine")])
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    got = [json.loads(line) for line in child.stdout.strip().splitlines()[-len(CRASHERS):]]
    assert got == [[400, param] for _, _, param in CRASHERS], child.stderr[-3000:]


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"structured_outputs": {"choice": [f"c{i}" for i in range(3000)]}},
     "structured_outputs.choice"),
    ("chat", {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
     "structured_outputs.choice"),
    ("chat", {"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"json": {"anyOf": [{"const": i}
                                                              for i in range(5000)]}}},
     "structured_outputs.json"),
    ("chat", {"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"$ref": "#"}}, "required": ["a"]}}}, "structured_outputs.json"),
    ("chat", {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 10},
     "min_tokens"),
])
def test_hostile_constraints_are_400s_naming_the_field(server, endpoint, extra, param):
    before = _adds(server)
    with server.client() as c:
        assert_error(_post(c, endpoint, extra), 400, param)
        assert _adds(server) == before
        assert c.post("/v1/chat/completions", json=CHAT_GOOD).status_code == 200


@pytest.mark.parametrize("where, param", [
    ("response_format", "response_format.json_schema.schema"),
    ("tool", "tools[0].function.parameters"),
])
def test_huge_integers_in_a_schema_are_400s(server, where, param):
    schema = '{"type": "object", "properties": {"a": ' + HUGE_INT + "}}"
    if where == "tool":
        extra = ('"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                 + schema + '}}], "tool_choice": "required"')
    else:
        extra = ('"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                 '"schema": ' + schema + "}}")
    body = json.dumps(CHAT_GOOD)[:-1] + ", " + extra + "}"
    with server.client() as c:
        err = assert_error(c.post("/v1/chat/completions", content=body,
                                  headers={"Content-Type": "application/json"}), 400, param)
    assert "26 digits" in err["message"]


def test_required_tool_with_pydantic_defs_is_accepted(server):
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        city: str
        zip: int

    class Person(pydantic.BaseModel):
        name: str
        home: Address
        work: Address | None = None

    schema = Person.model_json_schema()
    assert "$defs" in schema
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": schema}},
             {"type": "function", "function": {"name": "noop"}}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT_GOOD, "max_tokens": 40, "tools": tools,
                                                 "tool_choice": "required"})
    assert r.status_code == 200, r.text


def test_the_compile_happens_on_the_request_worker(server, llm, monkeypatch):
    """The request worker compiles the constraint into the engine's cache; the engine core's
    thread finds it there and only copies it."""
    import threading

    from mini_paged_attn.engine.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"worker": {"enum": ["yes"]}},
              "required": ["worker"]}
    key = StructuredOutputsParams(json=schema).key
    compiler = llm.engine.structured.compiler
    calls = []
    real = compiler.compile

    def recording(params):
        calls.append((threading.current_thread().name, params.key in compiler.cache))
        return real(params)

    monkeypatch.setattr(compiler, "compile", recording)
    assert key not in compiler.cache
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT_GOOD, "max_tokens": 20,
                                                 "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    misses = [name for name, hit in calls if not hit]
    assert len(misses) == 1 and misses[0] != "engine-core", calls
    assert any(name == "engine-core" and hit for name, hit in calls), calls
