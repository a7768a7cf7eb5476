"""Gemma 3 (text): Gemma's layers with (1 + w) q/k norms; five of six layers slide
(``sliding_window_pattern``) and rotate with their own base."""

from ..family import Family
from ..gemma import GemmaForCausalLM

FAMILY = Family(name="gemma3", architecture="Gemma3ForCausalLM", model_type="gemma3_text",
                model_class=GemmaForCausalLM, window="pattern",
                window_pattern_field="sliding_window_pattern",
                sliding_rope_theta_field="rope_local_base_freq",
                activation_field="hidden_activation", gelu_is_tanh=True, qk_norm=True,
                query_pre_attn_scalar=True,
                defaults={"max_position_embeddings": 131072, "num_key_value_heads": 4,
                          "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                          "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                          "sliding_window": 4096, "sliding_window_pattern": 6,
                          "rope_theta": 1e6, "rope_local_base_freq": 1e4})
