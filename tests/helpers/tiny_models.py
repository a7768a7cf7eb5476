"""Tiny random Hugging Face model directories for tests (Llama, Qwen2, Qwen3, Mistral, Phi-3,
Gemma 2, Gemma 3, and the mixture-of-experts Qwen3-MoE, Mixtral and gpt-oss).

``make_tiny_model_dir(path, arch)`` writes what a real checkpoint directory holds, through
``transformers`` itself: config.json, model.safetensors (or shards + index),
generation_config.json, tokenizer.json + tokenizer_config.json with a ChatML chat template.
The tokenizer is a byte-level BPE trained on a few sentences (English, Chinese, emoji), so tokens
span several bytes and multi-byte characters split across tokens.

Weights are seeded random, larger than transformers' init (std 0.1 instead of 0.02) so the logits
have clear top-1 gaps and greedy parity does not hinge on float rounding; biases and norm weights
are random too, so a loader that forgot one would fail the parity tests.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.tiny_models import make_tiny_model_dir, hf_reference_model
    from helpers.tiny_models import tiny_model_factory  # noqa: F401  (the fixture)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mini_paged_attn.models.tiny import CHAT_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS, write_tokenizer_files

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe",
         "mixtral", "gpt_oss")
# Windows shorter than the test prompts, not a multiple of the test block sizes.
TINY_WINDOW = 6

TOKENIZER_VOCAB_SIZE = 300

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello paged attention!",
    "Blocks of sixteen tokens live in a pool; a block table maps each sequence to its blocks.",
    "你好，世界。分页注意力把键值缓存切成固定大小的块。",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and emoji 🙂🚀✨ end here.",
    "def forward(self, x):\n    return self.norm(x) + x\n",
]

LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    # transformers 5 (and late 4.x) take `dtype`; older 4.x only `torch_dtype`.
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


def tiny_tokenizer():
    """The test tokenizer: byte-level BPE, 300 tokens, ids 0..2 are the special tokens.

    ``<|endoftext|>`` (id 0) is bos and eos, ``<|im_start|>`` 1, ``<|im_end|>`` 2; ChatML template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=ENDOFTEXT, eos_token=ENDOFTEXT,
                                   chat_template=CHAT_TEMPLATE)


def _hf_config(arch: str, vocab_size: int, special_ids: dict[str, int], **overrides):
    import transformers as tf
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=special_ids[ENDOFTEXT],
                  eos_token_id=[special_ids[ENDOFTEXT], special_ids[IM_END]], tie_word_embeddings=False)
    if arch == "llama":
        common.update(rope_theta=10000.0)
        common.update(overrides)
        return LlamaConfig(**common)
    if arch == "qwen2":
        common.update(rope_theta=1000000.0)
        common.update(overrides)
        return Qwen2Config(**common)
    if arch == "qwen3":
        common.update(rope_theta=1000000.0, head_dim=32)   # head_dim != hidden / heads, as in Qwen3
        common.update(overrides)
        return Qwen3Config(**common)
    if arch in _NEW_FAMILIES:
        cls, defaults = _NEW_FAMILIES[arch]
        return getattr(tf, cls)(**{**common, **defaults, **overrides})
    if arch in MOE_ARCHS:
        return _hf_moe_config(arch, common, overrides)
    raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")


# arch -> (transformers config class, its tiny fields): windows shorter than the test prompts,
# soft-caps small enough that tanh bends the scores / logits, Gemma 3 mixing sliding and full
# layers with different rope bases.
_NEW_FAMILIES = {
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=TINY_WINDOW)),
    "phi3": ("Phi3Config", dict(rope_theta=10000.0, pad_token_id=None,
                                original_max_position_embeddings=512)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    pad_token_id=None)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24,
                                        sliding_window=TINY_WINDOW, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention",
                                                     "sliding_attention"],
                                        rope_theta=10000.0, rope_local_base_freq=100.0,
                                        pad_token_id=None)),
}
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)]}


MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")


def _hf_moe_config(arch: str, common: dict, overrides: dict):
    """8 experts of intermediate 32, 2 per token. Qwen3-MoE: 3 layers, layer 0 dense
    (``mlp_only_layers``), top-k weights not renormalised; Mixtral renormalises. gpt-oss:
    sliding (``TINY_WINDOW``) and full layers alternating, attention
    sinks and biases, yarn rope, expert biases, the clamped SwiGLU."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common.update(num_experts_per_tok=2)
    if arch == "qwen3_moe":
        common.update(rope_theta=1000000.0, head_dim=32, num_experts=8, moe_intermediate_size=32,
                      num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=False)
        common.update(overrides)
        return Qwen3MoeConfig(**common)
    common.update(num_local_experts=8, intermediate_size=32)
    if arch == "gpt_oss":
        common.update(head_dim=16, sliding_window=TINY_WINDOW, layer_types=["sliding_attention",
                                                                  "full_attention"])
        common.update(overrides)
        return GptOssConfig(**common)
    common.update(rope_theta=1000000.0)
    common.update(overrides)
    return MixtralConfig(**common)


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)     # RMSNorm gains near 1, but not all equal
            else:
                p.copy_(std * noise)           # weights and biases (Qwen2's qkv bias included)


def tiny_config_json(arch: str = "llama", **config_overrides) -> dict:
    """The config.json :func:`make_tiny_model_dir` writes for ``arch`` (and the same
    ``config_overrides``), without building the model."""
    from mini_paged_attn.models.registry import REGISTRY

    tokenizer = tiny_tokenizer()
    special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _hf_config(arch, len(tokenizer), special_ids, tie_word_embeddings=False,
                        **config_overrides)
    raw = json.loads(config.to_json_string(use_diff=True))
    dtype_key = next(iter(_dtype_kwarg(torch.float32)))
    return {**raw, "architectures": [REGISTRY.by_name(arch).architecture], dtype_key: "float32"}


def make_tiny_model_dir(path: str | Path, arch: str = "llama", *, seed: int = 0,
                        tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                        max_shard_size: str | int | None = None, dtype: torch.dtype = torch.float32,
                        std: float = 0.1, **config_overrides) -> Path:
    """Write a tiny random ``arch`` model directory at ``path`` (created) and return ``path``.

    Args:
        arch: one of :data:`ARCHS` (2 layers, hidden 64, 4 q heads, 2 kv heads; head_dim
            16, Qwen3 32; vocab 300 = the tokenizer's). Mistral and the Gemmas slide over
            :data:`TINY_WINDOW` keys (Gemma 2 every other layer, Gemma 3 in 3 layers the first
            and last, with its own rope base); Phi-3 saves fused projections. The MoE families
            ("qwen3_moe", "mixtral", "gpt_oss"): see :func:`_hf_moe_config`.
        tie_word_embeddings: share lm_head with the embedding (Qwen2.5-0.5B does).
        rope_scaling: e.g. :data:`LLAMA3_ROPE_SCALING`, :data:`PHI3_LONGROPE` (Phi-3).
        max_shard_size: e.g. "20KB" to get several shards and model.safetensors.index.json.
        dtype: dtype the weights are saved in (config.json's torch_dtype / dtype).
        config_overrides: any other config field (num_hidden_layers=3, ...).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if rope_scaling is not None:
        config_overrides["rope_scaling"] = rope_scaling
    config = _hf_config(arch, len(tokenizer), special_ids, tie_word_embeddings=tie_word_embeddings,
                        **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(torch.float32))
    _randomize(model, seed, std)
    if tie_word_embeddings:
        model.tie_weights()
    model.to(dtype)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    write_tokenizer_files(tokenizer, path)
    return path


def hf_reference_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu"):
    """The transformers model of ``model_dir`` (eager attention, eval mode) to compare against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                 **_dtype_kwarg(dtype))
    return model.to(device).eval()


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (``max_tokens`` ids) of each prompt, one at a time."""
    hf = hf_reference_model(model_dir)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """float32 ``[len(token_ids), vocab_size]``: the logits of transformers' full forward."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def random_prompts(vocab_size: int, lens, seed: int = 0) -> list[list[int]]:
    """One prompt of each length in ``lens``, ids in ``[3, vocab_size)`` (no special token)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch="llama", **kwargs) -> Path``: tiny model dirs, written once per session.

    The directories are shared between tests: do not modify them.
    """
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, json.dumps(kwargs, sort_keys=True, default=str))
        if key not in made:
            made[key] = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return made[key]

    return make
