"""Llama 2 / 3.x: the shared decoder as it is (rope scaling, biases and head_dim from the config)."""

from ..family import Family
from ..llama import CausalLM

FAMILY = Family(name="llama", architecture="LlamaForCausalLM", model_type="llama",
                model_class=CausalLM, defaults={"max_position_embeddings": 2048})
