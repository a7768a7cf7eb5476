"""Hostile request bodies: every one is a 4xx with OpenAI's error body, never a 5xx, and the
same keep-alive connection then serves a valid request.

Hand-written bodies (deep nesting, huge numbers, NaN / Infinity, lone surrogates in every string
field, invalid UTF-8, truncated JSON, wrong types, non-object top levels) and a seeded mutation
fuzz of valid bodies, both sent over one ``http.client`` connection whose socket must survive.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from server_harness import API_KEY, CHAT_GOOD, GOOD, TIMEOUT_S

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD_BODY = {COMPLETIONS: GOOD, CHAT: CHAT_GOOD}
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
LONE = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\ud800"
VALID_TOO = "*"  # a case that may also be a valid request (200)


@pytest.fixture
def conn(server) -> Iterator[http.client.HTTPConnection]:
    host, port = server.url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    c.connect()
    yield c
    c.close()


def _post(conn: http.client.HTTPConnection, path: str, body: bytes
          ) -> tuple[int, dict[str, Any] | None, bytes]:
    """POST on ``conn``'s socket; fails if the server closes it (http.client would reconnect
    silently for the next request)."""
    sock = conn.sock
    conn.request("POST", path, body=body, headers=HEADERS)
    r = conn.getresponse()
    data = r.read()
    assert conn.sock is sock, f"the server closed the connection after {body[:200]!r}"
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    return r.status, parsed, data


def _assert_error_body(status: int, parsed: Any, data: bytes, what: str) -> dict[str, Any]:
    assert 400 <= status < 500, f"{what}: {status} {data[:300]!r}"
    assert isinstance(parsed, dict) and set(parsed) == {"error"}, f"{what}: {data[:300]!r}"
    err = parsed["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"{what}: {err}"
    assert isinstance(err["message"], str) and err["message"], what
    assert err["type"] == "invalid_request_error", f"{what}: {err}"
    return err


def _assert_still_serves(conn: http.client.HTTPConnection, path: str) -> None:
    status, parsed, data = _post(conn, path, json.dumps(GOOD_BODY[path]).encode())
    assert status == 200 and parsed["choices"], data[:300]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate becomes "\ud800"


def _nested(depth: int, leaf: str = "1", obj: bool = False) -> str:
    if obj:
        return '{"a": ' * depth + leaf + "}" * depth
    return "[" * depth + leaf + "]" * depth


def _hostile_bodies() -> list[tuple[str, bytes, str | None]]:
    """(path, body, expected): expected is the param the error must name, None for any 4xx,
    or VALID_TOO where 200 is fine as well."""
    cases: list[tuple[str, bytes, str | None]] = []
    good = json.dumps(GOOD)
    chat_good = json.dumps(CHAT_GOOD)
    for path, base in ((COMPLETIONS, good), (CHAT, chat_good)):
        # Not a JSON object at all.
        for raw in ("", " ", "null", "true", "1", '"text"', "[]", "[1, 2]", "{", "}", "{]",
                    "{'model': 'tiny'}", "\x00", "NaN", "Infinity", "-Infinity", "1e999",
                    _nested(100_000), _nested(100_000, obj=True), _nested(3000),
                    "1" * 5000, "-" + "9" * 10_000, base + base, base + "x"):
            cases.append((path, raw.encode(), None))
        # Truncated at every few bytes, and invalid UTF-8 inside a string.
        cases += [(path, base.encode()[:i], None) for i in range(1, len(base), 7)]
        for bad in (b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                    b"\xe2\x82"):
            cases.append((path, base.encode().replace(b'"tiny"', b'"ti' + bad + b'ny"'), None))
        # Deep nesting, huge numbers and non-JSON numbers inside a field of a valid body.
        for field in ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                      "top_k", "prompt" if path == COMPLETIONS else "messages"):
            template = json.dumps({**GOOD_BODY[path], field: "@@"})
            for value in (_nested(100_000), _nested(100_000, obj=True), "1" * 4301, "NaN",
                          "Infinity", "-Infinity"):  # never valid
                cases.append((path, template.replace('"@@"', value).encode(), None))
            for value in (_nested(900), "9" * 4300, "-" + "9" * 4300, "1e999", "-1e999",
                          "1e308", "-0", "0.5e-400"):  # valid JSON, maybe a valid request
                cases.append((path, template.replace('"@@"', value).encode(), VALID_TOO))
    # Lone surrogates in every string field, and in keys (the error names the field).
    surrogate_cases = [
        (COMPLETIONS, {**GOOD, "model": LONE}, "model"),
        (COMPLETIONS, {**GOOD, "model": "tiny" + LONE}, "model"),
        (COMPLETIONS, {**GOOD, "prompt": LONE}, "prompt"),
        (COMPLETIONS, {**GOOD, "prompt": "hello " + LONE + " world"}, "prompt"),
        (COMPLETIONS, {**GOOD, "prompt": ["ok", "\udfff"]}, "prompt[1]"),
        (COMPLETIONS, {**GOOD, "stop": LONE}, "stop"),
        (COMPLETIONS, {**GOOD, "stop": ["a", LONE]}, "stop[1]"),
        (COMPLETIONS, {**GOOD, "user": LONE}, "user"),
        (COMPLETIONS, {**GOOD, "logit_bias": {LONE: 1}}, "logit_bias." + LONE),
        (COMPLETIONS, {**GOOD, LONE: 1}, LONE),
        (COMPLETIONS, {**GOOD, "stream_options": {LONE: True}}, "stream_options." + LONE),
        (CHAT, {**CHAT_GOOD, "model": LONE}, "model"),
        (CHAT, {**CHAT_GOOD, "messages": [{"role": "user", "content": LONE}]},
         "messages[0].content"),
        (CHAT, {**CHAT_GOOD, "messages": [{"role": LONE, "content": "hi"}]}, "messages[0].role"),
        (CHAT, {**CHAT_GOOD, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
         "messages[0].name"),
        (CHAT, {**CHAT_GOOD, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": LONE}]}]},
         "messages[0].content[1].text"),
        (CHAT, {**CHAT_GOOD, "stop": [LONE]}, "stop[0]"),
    ]
    cases += [(path, _dumps(body), param) for path, body, param in surrogate_cases]
    # Wrong types and values, field by field.
    for path, base_obj in GOOD_BODY.items():
        for field in ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                      "stream", "stream_options", "user", "logit_bias", "top_k", "min_p",
                      "ignore_eos", "logprobs", "presence_penalty",
                      "prompt" if path == COMPLETIONS else "messages"):
            for value in ([], {}, [[]], [None], {"a": {"b": []}}, "x", -1, 2 ** 70, 1.5, True,
                          None if field in ("model", "prompt", "messages") else [1, "a"]):
                cases.append((path, _dumps({**base_obj, field: value}), VALID_TOO))
    for messages in ([{}], [None], ["hi"], [{"role": "user"}, 5], [{"role": "user",
                     "content": [{"type": "image_url", "image_url": "x"}]}],
                     [{"role": "user", "content": [{"text": "no type"}]}], "hi", {"0": "hi"}):
        cases.append((CHAT, _dumps({**CHAT_GOOD, "messages": messages}), None))
    for prompt in ([], [[]], [["a"]], ["a", 1], [1, "a"], [[1], "a"], [-1], [2 ** 64],
                   [[0] * 300], [1.0], [True], [[True]], {"text": "x"}):
        cases.append((COMPLETIONS, _dumps({**GOOD, "prompt": prompt}), None))
    return cases


HOSTILE = _hostile_bodies()


def test_there_are_many_hostile_bodies():
    assert len(HOSTILE) > 500


@pytest.mark.parametrize("chunk", range(8))
def test_hostile_bodies_get_4xx_and_the_connection_serves_on(server, conn, chunk):
    cases = HOSTILE[chunk::8]
    for i, (path, body, param) in enumerate(cases):
        status, parsed, data = _post(conn, path, body)
        if param == VALID_TOO and status == 200:
            assert parsed is None or parsed["choices"], data[:300]  # (a stream is not JSON)
            continue
        err = _assert_error_body(status, parsed, data, f"{path} {body[:120]!r}")
        if param not in (None, VALID_TOO):
            assert err["param"] == param.replace(LONE, "\ufffd"), (body[:120], err)
        if i % 10 == 0 or param == "model":
            _assert_still_serves(conn, path)
    _assert_still_serves(conn, COMPLETIONS)


def test_hostile_paths_and_methods_get_4xx(conn):
    for method, path in (("GET", "/v1/%ED%A0%80"), ("GET", "/%ff%fe"), ("PUT", COMPLETIONS),
                         ("DELETE", "/v1/models"), ("GET", "/v1/" + "a" * 5000)):
        sock = conn.sock
        conn.request(method, path, headers=HEADERS)
        r = conn.getresponse()
        data = r.read()
        err = json.loads(data)["error"]
        assert r.status in (404, 405) and set(err) == {"message", "type", "param", "code"}
        assert conn.sock is sock
    _assert_still_serves(conn, CHAT)


# ---- seeded mutation fuzz of valid bodies --------------------------------------------------
_HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, -1, 2 ** 31, 2 ** 64, -(2 ** 63), 10 ** 300, 1e308, -1e308, 1e-320,
    "", LONE, "x" * 1000, "\x00", "\ufffd", [], {}, [[]], [None], [LONE], {LONE: LONE},
    [1, 2, 3], [[1], [2]], ["a", "b"], {"type": "text", "text": LONE}, [{}],
]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _mutate_structure(rng: random.Random, obj: Any) -> Any:
    obj = json.loads(json.dumps(obj))
    path = rng.choice(_paths(obj)[1:])
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    action = rng.randrange(4)
    if action == 0:
        parent[last] = rng.choice(_HOSTILE_VALUES)
    elif action == 1 and isinstance(parent, dict):
        del parent[last]
    elif action == 2:
        parent[last] = [parent[last]]
    else:
        target = parent if isinstance(parent, dict) else obj
        target[rng.choice(["extra", LONE, "n", "stop", "stream", "best_of"])] = \
            rng.choice(_HOSTILE_VALUES)
    return obj


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        i = rng.randrange(len(data))
        op = rng.randrange(5)
        if op == 0:
            data[i] = rng.randrange(256)
        elif op == 1:
            data.insert(i, rng.choice(b'{}[]",:0123456789-+.eE\\ nultrfa\xff\xc3\x00'))
        elif op == 2:
            del data[i]
        elif op == 3:
            j = rng.randrange(i, len(data))
            data[i:i] = data[i:j + 1]
        else:
            del data[i:]
    return bytes(data)


FUZZ_SEED, FUZZ_COUNT = 20240611, 1000


def test_fuzzed_valid_bodies_never_get_5xx(conn):
    rng = random.Random(FUZZ_SEED)
    statuses: dict[int, int] = {}
    for i in range(FUZZ_COUNT):
        path = rng.choice([COMPLETIONS, CHAT])
        body_obj = GOOD_BODY[path]
        for _ in range(rng.randint(1, 3)):
            body_obj = _mutate_structure(rng, body_obj)
        raw = _dumps(body_obj)
        if rng.random() < 0.5:
            raw = _mutate_bytes(rng, raw)
        status, parsed, data = _post(conn, path, raw)
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:  # a mutation can leave the body valid (a stream is text, not JSON)
            assert parsed is None or "choices" in parsed, data[:300]
        else:
            _assert_error_body(status, parsed, data, f"#{i} {path} {raw[:200]!r}")
        if i % 25 == 0:
            _assert_still_serves(conn, path)
    assert statuses.get(400, 0) > FUZZ_COUNT // 2, statuses  # the fuzz does reach the checks
    _assert_still_serves(conn, CHAT)
