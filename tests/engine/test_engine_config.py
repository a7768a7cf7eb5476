"""EngineConfig validation: every bad field is a ValueError naming it."""

import pytest

from mini_paged_attn.engine.config import EngineConfig


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("block_size", 16.0), ("block_size", True), ("num_kv_blocks", 0),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", float("nan")), ("cpu_kv_cache_bytes", -1), ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0), ("max_model_len", 0), ("enable_prefix_caching", 1),
    ("enforce_eager", "no"), ("seed", 1.5), ("backend", "cuda"), ("log_stats_interval_s", -1),
    ("log_stats_interval_s", float("nan")), ("max_num_batched_context_tokens", 0),
    ("max_num_batched_context_tokens", 1.5), ("max_num_batched_context_tokens", "none"),
])
def test_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_defaults_and_optional_fields_are_accepted():
    config = EngineConfig(num_kv_blocks=None, max_model_len=None, log_stats_interval_s=0)
    assert config.block_size == 16 and config.backend == "auto"


def test_auto_context_budget_binds_on_the_cpu_only():
    from mini_paged_attn.engine.config import CPU_CONTEXT_BUDGET, resolve_context_budget
    auto = EngineConfig(max_num_batched_context_tokens="auto")
    assert resolve_context_budget(auto, "cpu") == CPU_CONTEXT_BUDGET
    assert resolve_context_budget(auto, "cuda") is None
    assert resolve_context_budget(EngineConfig(), "cpu") is None
    assert resolve_context_budget(EngineConfig(max_num_batched_context_tokens=64), "cuda") == 64
