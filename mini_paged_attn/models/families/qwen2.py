"""Qwen2 / 2.5: the Llama decoder with biases on q/k/v (never on o_proj); the window only with
``use_sliding_window``, on the layers from ``max_window_layers`` on."""

from ..family import Family
from ..llama import CausalLM

FAMILY = Family(name="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2",
                model_class=CausalLM, window="from_layer", window_switch=True,
                qkv_bias="always", own_tokenizer_class="Qwen2Tokenizer",
                defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32,
                          "sliding_window": 4096, "use_sliding_window": False,
                          "max_window_layers": 28})
