"""Loading a GGUF model: the file is read once, the same weights / config / tokenizer come out
as through transformers' GGUF loader, greedy tokens are unchanged, and every phase of the load
is reported and timed.

The tests on the packaged smollm2-135m are skipped (saying why) when the ``real`` extra or the
model is missing; the reader's own test writes a small GGUF file with the gguf package.
"""

import logging

import numpy as np
import pytest
import torch

from mini_paged_attn.errors import ModelLoadError
from mini_paged_attn.models import gguf as gguf_module
from mini_paged_attn.models.load_progress import LoadEvent, LoadTimer

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _small_gguf(path) -> None:
    """A GGUF file with metadata of every kind the reader parses and F32 / F16 / Q8_0 / Q4_1
    tensors."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("general.name", "small ü")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>", "ü"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    writer.add_array("llama.some_floats", [0.5, 1.5])
    writer.add_tensor("a.f32", rng.standard_normal((3, 32)).astype(np.float32))
    writer.add_tensor("b.f16", rng.standard_normal((2, 64)).astype(np.float16))
    for name, qtype in (("c.q8_0", gguf.GGMLQuantizationType.Q8_0),
                        ("d.q4_1", gguf.GGMLQuantizationType.Q4_1)):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        try:
            packed = gguf.quants.quantize(values, qtype)
        except NotImplementedError:
            continue
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_reader_gives_what_gguf_reads(tmp_path):
    pytest.importorskip("gguf")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import read_field

    from mini_paged_attn.models.gguf_file import read_gguf_file

    path = tmp_path / "small.gguf"
    _small_gguf(path)
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    assert ours.tensor_names == tuple(t.name for t in theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.data.dtype, mine.data.shape) == (ref.data.dtype, ref.data.shape), mine.name
        assert np.array_equal(mine.data, ref.data)
        assert np.array_equal(gguf.dequantize(mine.data, mine.ggml_type),
                              gguf.dequantize(ref.data, ref.tensor_type))
    for key in theirs.fields:
        if key.startswith("GGUF."):
            continue
        expected = read_field(theirs, key)
        got = ours.metadata[key]
        assert (got if isinstance(got, list) else [got]) == expected, key


def test_a_truncated_header_is_named(tmp_path):
    pytest.importorskip("gguf")
    from mini_paged_attn.models.gguf_file import read_gguf_file

    path = tmp_path / "small.gguf"
    _small_gguf(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ModelLoadError, match="cut.gguf.*truncated"):
        read_gguf_file(cut)


def _count_reads(monkeypatch) -> dict[str, int]:
    """Calls of this project's GGUF reader, and every numpy memmap of a file (how both gguf's
    reader and transformers' read a GGUF file)."""
    counts = {"ours": 0, "memmap": 0}
    real_read = gguf_module.read_gguf_file

    def read(path):
        counts["ours"] += 1
        return real_read(path)

    real_new = np.memmap.__new__

    def new(cls, *args, **kwargs):
        counts["memmap"] += 1
        return real_new(cls, *args, **kwargs)

    # raising=False: a loader without this reader still has its memmaps counted.
    monkeypatch.setattr(gguf_module, "read_gguf_file", read, raising=False)
    monkeypatch.setattr(np.memmap, "__new__", new)
    return counts


def test_the_gguf_file_is_read_once(smollm2_path, monkeypatch):
    from mini_paged_attn.engine import LLM

    counts = _count_reads(monkeypatch)
    llm = LLM("smollm2-135m", device="cpu", num_kv_blocks=16, max_model_len=64)
    llm.shutdown()
    assert counts == {"ours": 1, "memmap": 0}


def test_every_phase_is_reported_and_logged(smollm2_path, caplog):
    from mini_paged_attn.engine import LLM

    events: list[LoadEvent] = []
    with caplog.at_level(logging.INFO, logger="mini_paged_attn.engine.llm"):
        llm = LLM("smollm2-135m", device="cpu", num_kv_blocks=16, max_model_len=64,
                  load_progress=events.append)
    llm.shutdown()
    phases = list(dict.fromkeys(e.phase for e in events))
    assert phases == ["config", "tokenizer", "weights", "kv pool"]
    for phase in phases:
        mine = [e for e in events if e.phase == phase]
        assert (mine[0].done, mine[0].finished) == (0, False)
        assert mine[-1].finished and mine[-1].done == mine[-1].total
        assert [e.done for e in mine] == sorted(e.done for e in mine)
    weights = [e for e in events if e.phase == "weights"]
    assert weights[0].total == 272 and len(weights) == 272 + 2    # start, each tensor, end
    [line] = [r.getMessage() for r in caplog.records if "loaded in" in r.getMessage()]
    for phase in phases:
        assert f"{phase} " in line.split(":", 1)[1]


@pytest.mark.gpu
def test_cuda_phases_are_reported(smollm2_path):
    from mini_paged_attn.engine import LLM

    events: list[LoadEvent] = []
    llm = LLM("smollm2-135m", device="cuda", max_model_len=1024, max_num_seqs=8,
              load_progress=events.append)
    llm.shutdown()
    phases = set(e.phase for e in events)
    assert {"config", "tokenizer", "weights", "kv pool", "graphs", "warm-up"} <= phases


def _through_transformers(monkeypatch) -> None:
    """Read GGUF files of every architecture through transformers' loader, as before."""
    monkeypatch.setattr(gguf_module, "_OWN_READER_TYPES", ())


def test_same_config_tokenizer_and_weights_as_transformers(smollm2_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    ours = gguf_module.read_gguf(smollm2_path)
    reference = AutoConfig.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    # Only where it was read from may differ (transformers records the directory).
    mine, theirs = ours.hf_config.to_dict(), reference.to_dict()
    mine.pop("_name_or_path"), theirs.pop("_name_or_path")
    assert mine == theirs

    tokenizer = gguf_module.load_gguf_tokenizer(ours).hf
    ref_tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    assert type(tokenizer) is type(ref_tok)
    for text in PROMPTS + ["ü 🙂 <|im_start|>user\nhi<|im_end|>", "  two  spaces\n\ttab"]:
        assert tokenizer(text)["input_ids"] == ref_tok(text)["input_ids"], text
    messages = [{"role": "user", "content": "hi"}]
    assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            == ref_tok.apply_chat_template(messages, add_generation_prompt=True))
    assert (tokenizer.all_special_tokens, tokenizer.eos_token_id, tokenizer.bos_token_id) == (
        ref_tok.all_special_tokens, ref_tok.eos_token_id, ref_tok.bos_token_id)

    model, _ = gguf_module.load_gguf_model(ours)
    _through_transformers(monkeypatch)
    ref_model, _ = gguf_module.load_gguf_model(smollm2_path)
    ref_state = ref_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name


def test_greedy_tokens_unchanged(smollm2_path, monkeypatch):
    from mini_paged_attn.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = LLM("smollm2-135m", device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
        try:
            return [list(o.outputs[0].token_ids)
                    for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    ours = greedy()
    _through_transformers(monkeypatch)
    assert ours == greedy()


def test_timer_adds_up_a_phase_run_twice():
    events: list[LoadEvent] = []
    timer = LoadTimer(events.append)
    for _ in range(2):
        with timer.phase("weights", total=2) as phase:
            phase.advance()
            phase.advance()
    with timer.phase("kv pool"):
        pass
    assert list(timer.durations) == ["weights", "kv pool"]
    assert [(e.phase, e.done, e.finished) for e in events][:4] == [
        ("weights", 0, False), ("weights", 1, False), ("weights", 2, False),
        ("weights", 2, True)]
    assert timer.summary().startswith("loaded in ")
    assert ", kv pool " in timer.summary()


def test_a_callback_that_is_not_callable_is_refused():
    with pytest.raises(ValueError, match="load_progress: expected a callable"):
        LoadTimer("not a function")


def test_the_real_extra_brings_what_transformers_needs_for_gguf():
    """transformers' from_pretrained(..., gguf_file=...) raises without accelerate."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    real = pyproject["project"]["optional-dependencies"]["real"]
    assert any(req.split(">")[0].split("=")[0].strip() == "accelerate" for req in real)
    assert any(req.startswith("gguf") for req in real)
