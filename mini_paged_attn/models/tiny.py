"""The embedded default model: a tiny Llama with RANDOM weights and a byte-level tokenizer.

Nothing is downloaded and no file is needed: the weights come from a seeded generator and the
tokenizer maps every byte to the token id of the same value (0..255) plus three special tokens.
The model has learnt nothing; its output is noise. It exists so that ``mini-paged-attn demo`` and
the tests can run the whole engine end to end in seconds on a CPU.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .config import ModelConfig
from .llama import CausalLM
from .registry import init_empty_model
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Special tokens after the 256 byte tokens (ChatML markers, as Qwen uses them).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": [256, 258],
    "torch_dtype": "float32",
}


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte maps to one printable character.

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls, space,
    a few Latin-1 gaps) are shifted to code points 256, 257, ... in byte order, so that every
    token of the vocabulary is a visible, whitespace-free string (the convention of byte-level BPE
    tokenizers, which the `tokenizers` ByteLevel decoder undoes).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def byte_level_hf_tokenizer():
    """A ``transformers`` fast tokenizer over bytes: token id ``b`` is byte ``b`` (0..255).

    Ids 256, 257, 258 are ``<|endoftext|>`` (bos and eos), ``<|im_start|>``, ``<|im_end|>``;
    the chat template is ChatML. Built in memory; ``save_pretrained(dir)`` writes it out.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _byte_to_char().items()}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=ENDOFTEXT, eos_token=ENDOFTEXT,
                                   chat_template=CHAT_TEMPLATE)


def write_tokenizer_files(hf_tokenizer, model_dir: str | Path) -> None:
    """Save ``hf_tokenizer`` into ``model_dir`` so that any transformers 4.4x..5.x loads it.

    transformers 5 records ``tokenizer_class: TokenizersBackend``, a name 4.x does not know;
    ``PreTrainedTokenizerFast`` loads on both.
    """
    model_dir = Path(model_dir)
    hf_tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(hf_tokenizer, "chat_template", None):
        config["chat_template"] = hf_tokenizer.chat_template   # 4.x reads it from here
    config_path.write_text(json.dumps(config, indent=2))


def tiny_llama_config() -> ModelConfig:
    """The :class:`ModelConfig` of the embedded tiny Llama."""
    return ModelConfig.from_dict(TINY_LLAMA_CONFIG, source="the embedded tiny Llama config")


def randomize_weights(model: CausalLM, seed: int = 0, std: float = 0.1) -> None:
    """Fill ``model`` with seeded random weights, identical on every device.

    Weights ~ N(0, std) (larger than a trained model's init so the logits are not flat); RMSNorm
    gains ~ 1 + N(0, 0.1). Drawn on the CPU in checkpoint-name order, then copied.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, target in sorted(model.checkpoint_targets().items()):
            noise = torch.randn(tuple(target.shape), generator=gen, dtype=torch.float32)
            value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise
            target.copy_(value)


def tiny_llama(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """The embedded default, in memory: a tiny Llama with RANDOM weights and the byte tokenizer.

    Returns ``(model, config, tokenizer)``. The model knows nothing: it produces noise.
    """
    config = tiny_llama_config()
    model = init_empty_model(config, dtype=dtype, device=device)
    randomize_weights(model, seed)
    tokenizer = Tokenizer(byte_level_hf_tokenizer(), extra_eos_token_ids=config.eos_token_ids,
                          name="the embedded byte-level tokenizer")
    logger.info("tiny Llama with RANDOM weights (seed %d): its output is noise", seed)
    return model, config, tokenizer


def write_tiny_llama(model_dir: str | Path, seed: int = 0) -> Path:
    """Write the embedded tiny Llama (RANDOM weights) as a Hugging Face model directory.

    The directory (config.json, model.safetensors, tokenizer files) loads with
    :func:`~mini_paged_attn.models.loader.load_model`, ``load_tokenizer`` and ``transformers``
    alike. Returns ``model_dir``.
    """
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    model, _, _ = tiny_llama(seed=seed)
    tensors = {name: t.detach().contiguous().clone()
               for name, t in model.checkpoint_targets().items()}
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {**TINY_LLAMA_CONFIG,
              "_mini_paged_attn_note": f"RANDOM weights (seed {seed}): this model knows nothing"}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(byte_level_hf_tokenizer(), model_dir)
    return model_dir
