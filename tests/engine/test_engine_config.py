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
    ("max_num_batched_context_tokens", 1.5),
])
def test_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_defaults_and_optional_fields_are_accepted():
    config = EngineConfig(num_kv_blocks=None, max_model_len=None, log_stats_interval_s=0)
    assert config.block_size == 16 and config.backend == "auto"
