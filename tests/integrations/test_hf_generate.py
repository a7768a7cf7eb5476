"""generate() with attn_implementation="mini_paged_attn" equals sdpa's, fp32 on CPU.

Tiny random models of several families: Llama, Qwen2, Qwen3 from checkpoint directories
(``from_pretrained``), Mistral, Gemma and Phi-3 built from configs. Batches are left padded,
so prefill packs out padding and every decode step (q_len 1) reads the padded cache.
"""

import pytest
import torch

from mini_paged_attn.integrations.transformers import register

NAME = register()
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
GEN_KWARGS = dict(max_new_tokens=10, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _randomized(model, seed=0, std=0.1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            # Norm gains near 1; larger-than-init weights give clear top-1 gaps for greedy parity.
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    return model.eval()


def _config_model(family, implementation="sdpa", **overrides):
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, f"{family}Config")(**{**common, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                          dtype=torch.float32)
    return _randomized(model)


def _generate_both(model, ids, mask):
    """(ours, sdpa's) generate outputs of the same weights."""
    model.set_attn_implementation(NAME)
    ours = model.generate(input_ids=ids, attention_mask=mask, **GEN_KWARGS)
    model.set_attn_implementation("sdpa")
    ref = model.generate(input_ids=ids, attention_mask=mask, **GEN_KWARGS)
    return ours, ref


def _assert_same(ours, ref):
    assert torch.equal(ours.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_from_pretrained_generate_equals_sdpa(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), attn_implementation=NAME,
                                                 dtype=torch.float32).eval()
    assert model.config._attn_implementation == NAME
    for prompts in (PROMPTS, [PROMPTS[0], PROMPTS[0][::-1]]):      # padded, then unpadded
        _assert_same(*_generate_both(model, *_left_padded(prompts)))


@pytest.mark.parametrize("family,overrides", [
    ("Mistral", {"sliding_window": None}),
    ("Mistral", {"sliding_window": 64}),         # a window longer than every sequence here
    ("Gemma", {}),
    ("Phi3", {"num_key_value_heads": 4}),
])
def test_other_families_generate_equals_sdpa(family, overrides):
    model = _config_model(family, **overrides)
    _assert_same(*_generate_both(model, *_left_padded(PROMPTS)))


def test_prefill_logits_equal_sdpa_at_real_positions(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen3"), dtype=torch.float32)
    ids, mask = _left_padded(PROMPTS)
    with torch.no_grad():
        model.set_attn_implementation(NAME)
        ours = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


def test_sliding_window_shorter_than_the_keys_equals_sdpa():
    model = _config_model("Mistral", sliding_window=4)
    _assert_same(*_generate_both(model, *_left_padded(PROMPTS)))


def test_softcapping_sliding_model_equals_eager():
    # Gemma 2 has no sdpa path (sdpa cannot softcap): compared with eager. Small logit cap and
    # window so both change the result; large weights so the cap binds.
    model = _config_model("Gemma2", "eager", attn_logit_softcapping=0.5, sliding_window=3)
    ids, mask = _left_padded(PROMPTS)
    model.set_attn_implementation(NAME)
    ours = model.generate(input_ids=ids, attention_mask=mask, **GEN_KWARGS)
    model.set_attn_implementation("eager")
    ref = model.generate(input_ids=ids, attention_mask=mask, **GEN_KWARGS)
    _assert_same(ours, ref)
