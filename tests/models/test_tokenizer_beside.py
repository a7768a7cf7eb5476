"""The tokenizer of a Hugging Face directory loads on a thread of its own, beside the weights
and the runner's build (``models.loader.start_loading``), and the load's timer takes events
from both threads one at a time."""

import shutil
import threading

import pytest

from mini_paged_attn.engine import LLM
from mini_paged_attn.models import loader, tokenizer as tokenizer_module
from mini_paged_attn.models.load_progress import LoadTimer

WAIT_S = 30


def test_the_tokenizer_loads_while_the_weights_do(tiny_model_factory, monkeypatch):
    """The tokenizer's load waits for the weights to finish: run one after the other, it
    would time out; run beside them, it returns and is used. The config (which imports
    transformers) is read before the tokenizer's thread starts."""
    model_dir = tiny_model_factory("llama")
    config_read, weights_done = threading.Event(), threading.Event()
    threads = []
    real_tokenizer = tokenizer_module.load_tokenizer
    real_config, real_weights = loader.read_checkpoint, loader.load_checkpoint

    def tokenizer_after_the_weights(path):
        threads.append((threading.current_thread().name, config_read.is_set()))
        assert weights_done.wait(WAIT_S), "the weights waited for the tokenizer"
        return real_tokenizer(path)

    def config(*args, **kwargs):
        out = real_config(*args, **kwargs)
        config_read.set()
        return out

    def weights(*args, **kwargs):
        out = real_weights(*args, **kwargs)
        weights_done.set()
        return out

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", tokenizer_after_the_weights)
    monkeypatch.setattr(loader, "read_checkpoint", config)
    monkeypatch.setattr(loader, "load_checkpoint", weights)
    events = []
    with LLM(str(model_dir), device="cpu", num_kv_blocks=16, max_model_len=64,
             load_progress=events.append) as llm:
        assert llm.tokenizer.encode("hello") == real_tokenizer(model_dir).encode("hello")
    [(thread, after_the_config)] = threads
    assert thread.startswith("tokenizer-load") and after_the_config
    tokenizer_events = [e for e in events if e.phase == "tokenizer"]
    assert tokenizer_events[0].done == 0 and tokenizer_events[-1].finished


def test_another_tokenizer_is_the_only_one_loaded(tiny_model_factory, tmp_path, monkeypatch):
    model_dir = tiny_model_factory("llama")
    other = tmp_path / "tok"
    real = tokenizer_module.load_tokenizer
    real(model_dir).hf.save_pretrained(str(other))
    loaded = []

    def recorded(path):
        loaded.append(str(path))
        return real(path)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", recorded)
    with LLM(str(model_dir), device="cpu", num_kv_blocks=16, max_model_len=64,
             tokenizer=str(other)):
        pass
    assert loaded == [str(other)]


@pytest.mark.parametrize("which", ["model", "other"])
def test_a_missing_tokenizer_fails_before_the_weights_load(tiny_model_factory, tmp_path,
                                                           monkeypatch, which):
    model_dir = tmp_path / "model"      # a copy: the factory's directories are shared
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    if which == "model":
        for name in tokenizer_module.TOKENIZER_FILES:
            (model_dir / name).unlink(missing_ok=True)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the tokenizer's path was checked")

    monkeypatch.setattr(loader, "read_checkpoint", no_weights)
    monkeypatch.setattr(loader, "load_checkpoint", no_weights)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        LLM(str(model_dir), device="cpu",
            tokenizer=str(empty) if which == "other" else None)


def test_the_timer_serialises_events_of_two_threads():
    inside = threading.Lock()
    seen = []

    def callback(event):
        assert inside.acquire(blocking=False), "two events reached the callback at once"
        try:
            seen.append(event.phase)
        finally:
            inside.release()

    timer = LoadTimer(callback)

    def tokenizer_phase():
        with timer.phase("tokenizer", 200, concurrent=True) as phase:
            for _ in range(200):
                phase.advance()

    thread = threading.Thread(target=tokenizer_phase)
    thread.start()
    with timer.phase("weights", 200) as phase:
        for _ in range(200):
            phase.advance()
    thread.join()
    assert seen.count("tokenizer") == seen.count("weights") == 202
    summary = timer.summary()
    assert "tokenizer " in summary and "(in parallel)" in summary.split("tokenizer ", 1)[1]
    assert "(in parallel)" not in summary.split("weights ", 1)[1].split(",")[0]
