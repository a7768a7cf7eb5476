"""Register :func:`~.hf_attention.mini_paged_attention_forward` with transformers.

After :func:`register`, ``AutoModelForCausalLM.from_pretrained(path,
attn_implementation="mini_paged_attn")`` (or ``model.set_attn_implementation("mini_paged_attn")``)
runs every attention layer on our varlen kernel: Triton on CUDA, the torch reference on CPU.

Two registrations, both in transformers' own registries (the only global state):

- ``AttentionInterface``: the attention function;
- ``AttentionMaskInterface``: transformers' flash mask function, which hands the attention
  function ``None`` when no row is padded (the causal fast path) and otherwise the 2D padding
  mask, from which we pack the real tokens. Without a mask function of our name transformers'
  mask builders fail with a KeyError.

When it runs: importing this module registers. ``import mini_paged_attn`` imports it only when
``transformers`` is already imported, because registering imports ``transformers.modeling_utils``
(about 3 s on a CPU machine, several times ``import mini_paged_attn``); otherwise call
:func:`register` (idempotent, cheap once transformers is loaded).

Continuous batching (``generate_batch``): transformers 5.17 switches the model to
``"paged|mini_paged_attn"``, registered here when the installed transformers still has its
``paged|`` implementations (:mod:`.hf_paged`: our paged kernel over its cache's pages). From 5.22
on (checked on its wheel) it accepts only ``"sdpa"``, ``"paged|eager"`` and names containing ``"flash"`` (and a
``"flash"`` name makes transformers load a FlashAttention package or Hub kernel of that name),
so ``generate_batch`` on a ``"mini_paged_attn"`` model raises its ValueError.
"""

from __future__ import annotations

from .hf_attention import IMPLEMENTATION_NAME, mini_paged_attention_forward
from .hf_paged import PAGED_IMPLEMENTATION_NAME, mini_paged_attention_paged_forward


def register() -> str:
    """Register ``"mini_paged_attn"`` with transformers' attention and mask interfaces.

    Returns:
        the implementation name, for ``attn_implementation=``.

    Raises:
        ImportError: a transformers without these interfaces.
    """
    import transformers

    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError(f"{IMPLEMENTATION_NAME} needs transformers' AttentionInterface and "
                          "AttentionMaskInterface (transformers 5.x; tested 5.17 and 5.24), "
                          f"found transformers {transformers.__version__}") from exc

    AttentionInterface.register(IMPLEMENTATION_NAME, mini_paged_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION_NAME, flash_attention_mask)
    # Only transformers versions whose continuous batching calls "paged|<name>" functions ship
    # "paged|sdpa"; later ones would never call ours.
    if "paged|sdpa" in AttentionInterface._global_mapping:
        AttentionInterface.register(PAGED_IMPLEMENTATION_NAME, mini_paged_attention_paged_forward)
        AttentionMaskInterface.register(PAGED_IMPLEMENTATION_NAME, flash_attention_mask)
    return IMPLEMENTATION_NAME


register()
