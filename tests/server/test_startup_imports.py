"""What ``serve``'s two processes import of transformers when they start on a safetensors
directory: not its auto-model stack (``transformers.models.auto``: the auto factories, which
bring generation, masking, accelerate and ``torch.distributed``; seconds of a start, 8.8 s on a
GPU host), neither in the engine's process, which reads the config and loads the tokenizer,
nor in the HTTP process, which unpickles the tokenizer and renders and decodes with it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

from mini_paged_attn.models.tokenizer import load_tokenizer

# The modules the auto stack brings on every transformers the project supports.
SLOW = ("transformers.models.auto", "transformers.generation")


def _run(code: str) -> list[str]:
    """The slow modules a fresh interpreter running ``code`` has imported."""
    tail = f"""
        import json, sys
        print(json.dumps(sorted(m for m in sys.modules if m.startswith({SLOW!r}))))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + textwrap.dedent(tail)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_process_imports_no_auto_stack(tiny_model_factory, tmp_path):
    """The child as ``run_core_process`` builds its engine and says Ready."""
    model_dir = tiny_model_factory("qwen3")
    assert _run(f"""
        from mini_paged_attn.engine.process.child import CoreLaunch
        from mini_paged_attn.engine.process.messages import Ready, encode

        engine = CoreLaunch({str(model_dir)!r}, {{"device": "cpu", "num_kv_blocks": 16,
                                                "max_model_len": 64}}).build_engine()
        encode(Ready(engine.tokenizer, engine.model_config, engine.max_model_len,
                     engine.admission, engine.stats()))
        assert type(engine.tokenizer.hf).__name__ in ("TokenizersBackend",
                                                      "PreTrainedTokenizerFast")
    """) == []


def test_the_http_process_imports_no_auto_stack(tiny_model_factory, tmp_path):
    """The client's imports ahead of Ready, the tokenizer unpickled, then at work."""
    model_dir = tiny_model_factory("qwen3")
    pickled = tmp_path / "tokenizer.pickle"
    pickled.write_bytes(pickle.dumps(load_tokenizer(model_dir)))
    assert _run(f"""
        import pickle
        from mini_paged_attn.engine.process import mp_client
        from mini_paged_attn.server.app import build_app  # noqa: F401

        mp_client._import_tokenizer_modules()
        with open({str(pickled)!r}, "rb") as f:
            tokenizer = pickle.load(f)
        ids = tokenizer.apply_chat_template([{{"role": "user", "content": "hi 🙂"}}])
        assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")
        tokenizer.detokenizer(ids[:2]).add(ids[2:])
        tokenizer.renders_tools()
    """) == []
