"""Qwen3: the Llama decoder with per-head q/k RMSNorm; the window as Qwen2's."""

from ..family import Family
from ..llama import CausalLM

FAMILY = Family(name="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3",
                model_class=CausalLM, window="from_layer", window_switch=True, qk_norm=True,
                defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32,
                          "head_dim": 128, "sliding_window": 4096, "use_sliding_window": False,
                          "max_window_layers": 28})
