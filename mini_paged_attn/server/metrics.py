"""GET /metrics: the engine's statistics and the server's counters in Prometheus text format.

Written by hand (the exposition format is a few lines of text) rather than through
prometheus_client, whose registry is process-global state.
"""

from __future__ import annotations

from typing import Any

from .async_engine import AsyncEngine

PREFIX = "mini_paged_attn_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name without prefix, type, help, how to read it from the engine's EngineStats)
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_running", "gauge", "Requests in the engine's running batch.", "num_running"),
    ("requests_waiting", "gauge",
     "Requests waiting to be scheduled (what --max-queue limits).", "num_waiting"),
    ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("kv_blocks_free", "gauge",
     "KV cache blocks no live request holds (evictable prefix-cache blocks count as free).",
     "kv_blocks_free"),
    ("prefix_cache_hit_rate", "gauge", "Share of prompt blocks found in the prefix cache.",
     "prefix_cache_hit_rate"),
    ("preemptions_total", "counter", "Requests preempted (recomputed) for lack of blocks.",
     "num_preemptions"),
    ("generation_tokens_total", "counter", "Tokens generated since the engine started.",
     "generation_tokens_total"),
    ("generation_tokens_per_second", "gauge", "Recent generation throughput.",
     "generation_tokens_per_s"),
)


def _line(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    lines.append(f"# HELP {PREFIX}{name} {help_text}")
    lines.append(f"# TYPE {PREFIX}{name} {kind}")
    lines.append(f"{PREFIX}{name} {_number(value)}")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_metrics(engine: AsyncEngine) -> str:
    """The exposition text: the engine's stats now, then the server's counters."""
    stats: Any = engine.stats()
    lines: list[str] = []
    for name, kind, help_text, attr in _ENGINE_METRICS:
        value = getattr(stats, attr, None)
        if value is not None:
            _line(lines, name, kind, help_text, value)
    _line(lines, "engine_up", "gauge", "1 while the engine runs, 0 once it has died.",
          int(engine.alive))
    c = engine.counters
    name = "server_requests_total"
    lines.append(f"# HELP {PREFIX}{name} Engine requests by how they ended.")
    lines.append(f"# TYPE {PREFIX}{name} counter")
    for outcome, value in (("finished", c.requests_finished), ("aborted", c.requests_aborted),
                           ("failed", c.requests_failed), ("rejected", c.requests_rejected)):
        lines.append(f'{PREFIX}{name}{{outcome="{outcome}"}} {value}')
    return "\n".join(lines) + "\n"
