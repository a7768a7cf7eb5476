"""A paged model against transformers' own forward, token for token.

    from helpers.model_parity import assert_prefill_then_decode_match, load_with_reference
    from helpers.model_parity import assert_triton_backend_matches_torch
"""

from __future__ import annotations

import torch

from helpers.paged_batch import PagedBatchBuilder
from helpers.tiny_models import hf_logits, hf_reference_model, random_prompts
from mini_paged_attn.models.loader import load_model


def load_with_reference(model_dir):
    """Our model and config in fp32 next to transformers' fp32 model, from one checkpoint."""
    model, config = load_model(model_dir, dtype=torch.float32)
    return model, config, hf_reference_model(model_dir)


@torch.inference_mode()
def assert_prefill_then_decode_match(model, config, hf, prompt_lens: tuple[int, ...], *,
                                     block_size: int, atol: float,
                                     decode_steps: int = 3) -> None:
    """Prefill random prompts of ``prompt_lens`` tokens in one varlen step, then decode
    ``decode_steps`` greedy tokens per sequence; every row of our fp32 logits
    ``[num_tokens, vocab_size]`` must match ``hf``'s full forward of the same tokens within
    ``atol``."""
    prompts = random_prompts(config.vocab_size, prompt_lens)
    batch = PagedBatchBuilder(config, block_size=block_size)
    ids, pos, meta = batch.step(dict(enumerate(prompts)))
    assert not meta.decode_only
    logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
    assert logits.dtype == torch.float32 and logits.shape == (sum(prompt_lens), config.vocab_size)
    cu = meta.cu_seqlens_q.tolist()
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[cu[i]:cu[i + 1]], hf_logits(hf, prompt), atol=atol, rtol=0)

    # Decode: one greedy token per sequence per step, compared with a full forward of the sequence.
    seqs = [list(p) for p in prompts]
    next_tokens = logits[[c - 1 for c in cu[1:]]].argmax(-1).tolist()
    for _ in range(decode_steps):
        for seq, tok in zip(seqs, next_tokens):
            seq.append(tok)
        ids, pos, meta = batch.step({i: [tok] for i, tok in enumerate(next_tokens)})
        assert meta.decode_only
        logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(logits[i], hf_logits(hf, seq)[-1], atol=atol, rtol=0)
        next_tokens = logits.argmax(-1).tolist()


@torch.inference_mode()
def assert_triton_backend_matches_torch(model_dir, prompt: list[int], *, block_size: int) -> None:
    """The model through the Triton kernels (the interpreter on CPU; the GPU when there is one)
    against its torch path, over strided pool views: a mixed prefill step (``prompt`` and a
    2-token prompt) and a decode step padded to 3 rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, config = load_model(model_dir, device=device)
    outs = {}
    for backend in ("torch", "triton"):
        batch = PagedBatchBuilder(config, block_size=block_size, seed=1, interleaved=True,
                                  device=device)
        ids, pos, meta = batch.step({0: prompt, 1: [5, 6]}, backend=backend)
        prefill = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
        ids, pos, meta = batch.step({0: [7], 1: [9]}, pad_to=3, backend=backend)
        decode = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
        outs[backend] = (prefill, decode[:2])
    atol = 1e-4 if device == "cpu" else 1e-2    # tf32 dots on the GPU
    for got, want in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
