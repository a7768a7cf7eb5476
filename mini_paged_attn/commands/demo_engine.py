"""Part 2 of ``mini-paged-attn demo``: the engine on the embedded tiny model, step by step.

The model is a tiny Llama with **random weights** and a byte-level tokenizer (models/tiny.py):
its text is gibberish. What the demo shows is the machinery: continuous batching (prefill
chunks and decodes in one step), prefix caching (the shared system prompt is computed once),
and n=2 sampling whose samples share the prompt's blocks (copy-on-write).
"""

from __future__ import annotations

SYSTEM = "You are a helpful assistant. Answer briefly and kindly.\n"
QUESTIONS = ("What is paged attention?", "Why split the KV cache into blocks?",
             "How does copy-on-write work?")


def _shared_blocks(engine) -> int:
    return sum(1 for b in engine.memory_map().blocks if b.is_shared)


def run_engine_demo(seed: int) -> None:
    import torch

    from mini_paged_attn.engine import LLMEngine, SamplingParams
    from mini_paged_attn.engine.config import EngineConfig

    print("\n=== 6. the engine: a tiny RANDOM-weight Llama (gibberish text, real machinery) ===")
    config = EngineConfig(block_size=8, num_kv_blocks=96, max_num_seqs=8,
                          max_num_batched_tokens=64, seed=seed)
    engine = LLMEngine.from_model("tiny", device="cpu", dtype=torch.float32, config=config)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pair = SamplingParams(temperature=0.8, n=2, seed=seed, max_tokens=12, ignore_eos=True)
    requests = {}
    for i, question in enumerate(QUESTIONS):
        requests[engine.add_request(SYSTEM + question, greedy, request_id=f"q{i}")] = question
    requests[engine.add_request(SYSTEM + "Tell me a story.", pair, request_id="n2")] = \
        "Tell me a story. (n=2)"
    print(f"{len(requests)} requests share a {len(SYSTEM)}-byte system prompt; pool "
          f"{config.num_kv_blocks} blocks x {config.block_size} tokens, token budget "
          f"{config.max_num_batched_tokens} per step")
    print(f"{'step':>4}  {'prefill seqs/tokens':>19}  {'decodes':>7}  {'blocks used':>11}  "
          f"{'shared':>6}  {'prefix hits':>11}")
    final = {}
    step = 0
    live_map = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        sched = engine.last_schedule
        stats = engine.stats()
        if sched is not None:
            decodes = sched.num_seqs - sched.num_prefill_seqs
            print(f"{step:>4}  {sched.num_prefill_seqs:>9}/{sched.num_prefill_tokens:<9}  "
                  f"{decodes:>7}  {stats.kv_blocks_used:>5}/{stats.kv_blocks_total:<5}  "
                  f"{_shared_blocks(engine):>6}  {100 * stats.prefix_cache_hit_rate:>10.0f}%")
        if live_map is None and engine.scheduler.num_running == len(QUESTIONS) + 2:
            live_map = (step, engine.memory_map())   # every request decoding, n=2 forked
        for out in outputs:
            if out.finished:
                final[out.request_id] = out
    if live_map is not None:
        print(f"\nthe engine's live pool after step {live_map[0]} (engine.memory_map(); "
              f"seq ids are the scheduler's, one per sample):")
        print(live_map[1])
    print()
    for request_id, question in requests.items():
        for completion in final[request_id].outputs:
            print(f"{request_id}[{completion.index}] {question!r} -> {completion.text!r}")
    stats = engine.stats()
    print(f"\nafter the run: {stats.kv_blocks_free}/{stats.kv_blocks_total} blocks free "
          f"({stats.kv_blocks_cached} kept in the prefix cache for reuse), "
          f"prefix-cache hit rate {100 * stats.prefix_cache_hit_rate:.0f}%")
