"""Gemma 2: Gemma's layers (``models/gemma.py``), sliding and full layers alternating,
attention and final-logit soft-caps."""

from ..family import Family
from ..gemma import GemmaForCausalLM

FAMILY = Family(name="gemma2", architecture="Gemma2ForCausalLM", model_type="gemma2",
                model_class=GemmaForCausalLM, window="pattern",
                activation_field="hidden_activation", gelu_is_tanh=True,
                query_pre_attn_scalar=True)
