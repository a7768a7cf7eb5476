"""Mistral: the Llama decoder, its window (when set) on every layer."""

from ..family import Family
from ..llama import CausalLM

FAMILY = Family(name="mistral", architecture="MistralForCausalLM", model_type="mistral",
                model_class=CausalLM, window="every",
                defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8,
                          "sliding_window": 4096})
