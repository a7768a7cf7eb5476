"""Gemma 2: Gemma's layers (``models/gemma.py``), sliding and full layers alternating,
attention and final-logit soft-caps."""

from ..family import Family
from ..gemma import GemmaForCausalLM

FAMILY = Family(name="gemma2", architecture="Gemma2ForCausalLM", model_type="gemma2",
                model_class=GemmaForCausalLM, window="pattern",
                activation_field="hidden_activation", gelu_is_tanh=True,
                query_pre_attn_scalar=True,
                defaults={"max_position_embeddings": 8192, "num_key_value_heads": 4,
                          "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                          "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                          "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0})
