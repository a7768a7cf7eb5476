"""Phi-3 / Phi-4-mini: the Llama decoder with fused qkv_proj / gate_up_proj checkpoint tensors,
partial rotary, longrope against ``original_max_position_embeddings``, the window on every layer."""

from ..family import Family
from ..llama import CausalLM

FAMILY = Family(name="phi3", architecture="Phi3ForCausalLM", model_type="phi3",
                model_class=CausalLM, window="every", partial_rotary=True,
                reads_original_max_positions=True, fused_checkpoint=True,
                rope_types=("default", "longrope"),
                defaults={"max_position_embeddings": 4096,
                          "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5})
