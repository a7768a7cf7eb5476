"""parse_json's lone-surrogate check in every form a body can take it: the walk over the parsed
body is skipped for UTF-8 bodies without a surrogate escape, and must never miss one."""

from __future__ import annotations

import json

import pytest

from mini_paged_attn.server.errors import APIError
from mini_paged_attn.server.json_body import parse_json

LONE = "\ud800"


@pytest.mark.parametrize("raw, param", [
    (json.dumps({"a": LONE}).encode(), "a"),                              # \ud800
    (json.dumps({"a": ["x", "\udfff"]}).encode().replace(b"dfff", b"DFFF"), "a[1]"),
    (json.dumps({"b": {"c": "\udbff"}}).encode().replace(b"\\udbff", b"\\uDbfF"), "b.c"),
    (json.dumps({"a": LONE}).encode("utf-16"), "a"),                      # no ASCII escape
    (json.dumps({"a": LONE}).encode("utf-32-le"), "a"),
])
def test_a_lone_surrogate_is_refused_whatever_the_encoding(raw, param):
    with pytest.raises(APIError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("data", [
    {"a": "x\U0001F600"},                  # a pair, written as two escapes
    {"a": "\\ud800"},                      # an escaped backslash, then plain letters
    {"a": ["é", "\u00e9" * 1000]},
])
def test_paired_surrogates_and_look_alikes_pass(data):
    assert parse_json(json.dumps(data).encode()) == data
    assert parse_json(json.dumps(data, ensure_ascii=False).encode()) == data
