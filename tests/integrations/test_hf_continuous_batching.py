"""transformers' continuous batching (generate_batch) with our implementation, per version.

Up to 5.22 it switches the model to "paged|mini_paged_attn" (our paged kernel over its cache);
from 5.23 on it refuses implementations other than its own, which the README documents.
"""

import pytest
import torch

from mini_paged_attn.integrations.transformers import register

NAME = register()
# Long enough for a chunked prefill at max_batch_tokens=16, so cached blocks are read.
PROMPTS = [list(range(5, 24)), [8, 9], [30, 31, 32, 33, 34]]


def _takes_paged_functions() -> bool:
    from transformers import AttentionInterface

    return "paged|sdpa" in AttentionInterface._global_mapping


def _generate_batch(model, monkeypatch):
    import transformers.generation.continuous_batching.cache as cb_cache
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Without psutil transformers sizes a CPU cache from 0 bytes; give it a fixed budget.
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown",
                        lambda: (torch.device("cpu"), 1 << 30, 0, 0))
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16,
                                  max_memory_percent=0.5)
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb)
    return [out[key].generated_tokens for key in sorted(out)]


def _model(model_dir, implementation):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation,
                                                dtype=torch.float32).eval()


# mistral: every layer windowed (W = 6, shorter than the prompts, so the cache's ring wraps
# within a chunk); gemma2: sliding and full layers alternate, with soft-capping, which only
# transformers' eager attention computes (its own paged path, 5.17, disagrees with its eager
# generate there, so only the latter is the reference).
@pytest.mark.parametrize("arch, paged_reference, reference", [
    ("llama", "paged|sdpa", "sdpa"), ("mistral", "paged|sdpa", "sdpa"), ("gemma2", None, "eager")])
def test_generate_batch_equals_the_reference(tiny_model_factory, monkeypatch, arch,
                                             paged_reference, reference):
    if not _takes_paged_functions():
        pytest.skip("this transformers' continuous batching takes no custom implementation")
    model_dir = tiny_model_factory(arch)
    ours = _generate_batch(_model(model_dir, NAME), monkeypatch)
    if paged_reference is not None:
        assert ours == _generate_batch(_model(model_dir, paged_reference), monkeypatch)
    plain = _model(model_dir, reference)
    for prompt, tokens in zip(PROMPTS, ours):
        ref = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=-1, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


def test_generate_batch_refused_from_5_23(tiny_model_factory, monkeypatch):
    if _takes_paged_functions():
        pytest.skip("this transformers' continuous batching runs paged|mini_paged_attn")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        _generate_batch(_model(tiny_model_factory("llama"), NAME), monkeypatch)


def test_block_tables_from_read_indices():
    from mini_paged_attn.integrations.hf_paged import _block_tables

    # Sequence 0: 6 tokens in blocks 7, 2 (block_size 4); sequence 1: 3 tokens in block 5.
    read_index = torch.tensor([28, 29, 30, 31, 8, 9, 20, 21, 22])
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    tables = _block_tables(read_index, cu_k, 6, 4)
    assert tables.dtype == torch.int32 and tables.tolist() == [[7, 2], [5, 0]]
