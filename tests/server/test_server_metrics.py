"""/metrics through prometheus_client: today's gauges and counters, the latency histograms
observed as requests finish, and one registry per app (two apps in one process keep apart)."""

from __future__ import annotations

import httpx

from server_harness import GOOD, TIMEOUT_S

HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds")
GAUGES_AND_COUNTERS = ("requests_running", "requests_waiting", "kv_blocks_total",
                       "kv_blocks_free", "prefix_cache_hit_rate", "preemptions_total",
                       "generation_tokens_total", "generation_tokens_per_second", "engine_up")


def test_histograms_count_finished_requests(server):
    before = server.metrics()
    for name in GAUGES_AND_COUNTERS:
        assert f"mini_paged_attn_{name}" in before, name
    for name in HISTOGRAMS:
        assert before[f"mini_paged_attn_{name}_count"] == 0, name
    with server.client() as c:
        for _ in range(3):
            assert c.post("/v1/completions", json={**GOOD, "max_tokens": 4,
                                                   "ignore_eos": True}).status_code == 200
        stream = c.post("/v1/completions", json={**GOOD, "stream": True, "n": 2})
        assert stream.status_code == 200
    m = server.wait_all_free()
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"mini_paged_attn_{name}_count"] == 4, name
        assert m[f'mini_paged_attn_{name}_bucket{{le="+Inf"}}'] == 4
        assert m[f"mini_paged_attn_{name}_sum"] >= 0
    # Requests of 4 tokens have per-token times; GOOD's 2-token stream one more.
    assert m["mini_paged_attn_time_per_output_token_seconds_count"] == 4
    e2e, ttft = (m[f"mini_paged_attn_{n}_sum"] for n in ("e2e_request_latency_seconds",
                                                        "time_to_first_token_seconds"))
    assert e2e >= ttft > 0
    assert m['mini_paged_attn_server_requests_total{outcome="finished"}'] >= 4
    assert m["mini_paged_attn_generation_tokens_total"] >= 3 * 4 + 2 * 2


def test_openmetrics_on_request(server):
    r = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S,
                  headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
    plain = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S)
    assert plain.headers["content-type"].startswith("text/plain")
    assert "# TYPE mini_paged_attn_e2e_request_latency_seconds histogram" in plain.text


def test_two_registries_in_one_process_keep_apart(server):
    """A second ServerMetrics next to the running app's: same names, no collision (no global
    registry), its own counts."""
    from types import SimpleNamespace

    from mini_paged_attn.engine.outputs import EngineStats, RequestMetrics, RequestOutput
    from mini_paged_attn.server.async_client import ServerCounters
    from mini_paged_attn.server.metrics import ServerMetrics

    engine = SimpleNamespace(stats=lambda: EngineStats(kv_blocks_total=8, kv_blocks_free=8),
                             alive=True, counters=ServerCounters())
    first, second = ServerMetrics(engine), ServerMetrics(engine)
    out = RequestOutput("r", None, [1], [SimpleNamespace(token_ids=[5, 6, 7])], True,
                        RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                                       first_token_time=11.0, last_token_time=12.0,
                                       finished_time=12.0))
    first.observe(out)
    text = first.render(None)[0].decode()
    assert "mini_paged_attn_request_queue_time_seconds_sum 0.5" in text
    assert "mini_paged_attn_time_to_first_token_seconds_sum 1.0" in text
    assert "mini_paged_attn_time_per_output_token_seconds_sum 0.5" in text   # 1 s, 2 tokens
    assert "mini_paged_attn_e2e_request_latency_seconds_sum 2.0" in text
    assert "mini_paged_attn_kv_blocks_total 8.0" in text
    assert "mini_paged_attn_e2e_request_latency_seconds_count 0.0" in second.render(None)[0].decode()
    assert server.app.state.metrics.registry is not first.registry
