"""What a web page could send to a key-less server on this machine: POST bodies that are not
declared JSON (415), and, when the server is bound to loopback, Host headers naming another host
(400, DNS rebinding). The official client and the README's curl command still work."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from mini_paged_attn.commands.serve import allowed_hosts
from mini_paged_attn.server.cross_site import LOOPBACK_HOSTS
from server_harness import CHAT_GOOD, GOOD, MODEL_NAME, TIMEOUT_S, assert_error, served


@pytest.fixture(scope="module")
def server(llm):
    with served(llm.engine, allowed_hosts=LOOPBACK_HOSTS) as s:
        yield s


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_post_not_declared_json_is_415(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(GOOD), headers=headers,
                   timeout=TIMEOUT_S)
    assert assert_error(r, 415)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON",
                                          "application/json; charset=utf-8"])
def test_json_content_types_are_served(server, content_type):
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(GOOD),
                   headers={"Content-Type": content_type}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example:80", "[::2]:8000", "0.0.0.0"])
def test_a_foreign_host_header_is_400(server, host):
    for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", GOOD)):
        r = httpx.request(method, f"{server.url}{path}", json=body, headers={"Host": host},
                          timeout=TIMEOUT_S)
        assert assert_error(r, 400)["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1:1234", "[::1]:8000",
                                  "::1"])
def test_loopback_host_headers_are_served(server, host):
    r = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers={"Host": host},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text


def test_the_openai_client_passes(server):
    openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
    assert client.chat.completions.create(**{**CHAT_GOOD, "stream": False}).choices


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_the_readme_curl_command_passes(server):
    body = json.dumps({**CHAT_GOOD, "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", f"{server.url}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout
    assert out.rstrip().endswith("data: [DONE]"), out


@pytest.mark.parametrize("host, extra, expected", [
    ("127.0.0.1", [], list(LOOPBACK_HOSTS)),
    ("127.0.0.2", [], list(LOOPBACK_HOSTS)),
    ("::1", ["box.lan"], [*LOOPBACK_HOSTS, "box.lan"]),
    ("localhost", [], list(LOOPBACK_HOSTS)),
    ("0.0.0.0", [], None),
    ("0.0.0.0", ["box.lan"], ["box.lan"]),
    ("my.host.name", [], None),
])
def test_serve_allows_loopback_names_when_bound_to_loopback(host, extra, expected):
    assert allowed_hosts(host, extra) == expected
