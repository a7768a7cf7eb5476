"""Where a constrained step's time goes under asynchronous scheduling (GPU experiment).

bench_structured's workload (64 requests, Qwen2.5-0.5B shapes, JSON schema, final outputs
only) with timestamps on the phases of each engine step: the wait for the previous tokens,
the grammar fill on the worker (its start and end), the stepping thread's wait for it, the
held sampling and the next forward's enqueueing. Repeated for several llguidance thread
pool sizes (``--threads``; 0 = llguidance's default), once with the constrained steps run
synchronously (as before held sampling), and once unconstrained.

    python -m benchmarks.experiments.structured_timeline --threads 0,1,4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _timed(record: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.setdefault(key, []).append(time.perf_counter() - start)
    return wrapper


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_case(llm, prompts, params, threads: int | None, held: bool = True) -> dict:
    import llguidance

    from mini_paged_attn.engine import sampler as sampler_module
    engine = llm.engine
    structured = engine.structured
    if threads is not None:
        structured._executor = llguidance.LLExecutor(threads) if threads else None
    record: dict[str, list[float]] = {}
    patched = {
        (structured, "_fill"): "fill (worker)",
        (engine, "_open_held"): "read prev + start fill",
        (engine, "_sample_held"): "held sampling (waits fill)",
        (engine.scheduler, "schedule"): "schedule",
        (engine.runner.inputs, "build"): "build inputs",
        (engine.runner, "_forward"): "enqueue forward",
        (engine, "_advance_grammars"): "grammar advance",
        (engine, "_process_outputs"): "process outputs",
    }
    for (obj, name), key in patched.items():
        setattr(obj, name, _timed(record, key, getattr(obj, name)))
    start_fill = structured.start

    def start(out):
        return _timed(record, "wait for the fill", start_fill(out))
    structured.start = start
    patched[(structured, "start")] = ""
    if not held:
        # The engine before held sampling: steps with grammars ran synchronously.
        mode = engine._mode
        engine._mode = lambda out: "sync" if engine._num_structured else mode(out)
        patched[(engine, "_mode")] = ""
    read = sampler_module.PendingSample.read
    sampler_module.PendingSample.read = _timed(record, "read tokens", read)
    try:
        _sync()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        seconds = time.perf_counter() - start
    finally:
        sampler_module.PendingSample.read = read
        if threads is not None:
            structured._executor = None     # the engine's own pool again
        for obj, name in patched:
            delattr(obj, name)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    steps = len(record.get("schedule", [])) or 1
    row = {"tok/s": tokens / seconds, "ms/step": 1e3 * seconds / steps}
    for key, values in record.items():
        row[key] = 1e3 * sum(values) / steps
        row[key + " (median ms)"] = 1e3 * statistics.median(values)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="0,1,4")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--model", default=None, help="default: random Qwen2.5-0.5B shapes")
    p.add_argument("--tokenizer", default=None,
                   help="random weights with this tokenizer (default: a byte tokenizer)")
    args = p.parse_args(argv)
    from benchmarks.bench_engine import random_model_dir
    from benchmarks.bench_structured import SCHEMA
    from mini_paged_attn.engine import LLM, SamplingParams
    from mini_paged_attn.engine.structured import StructuredOutputsParams

    root = Path(tempfile.mkdtemp())
    model = args.model or str(random_model_dir("qwen2.5-0.5b", root, tokenizer=args.tokenizer))
    llm = LLM(model, dtype="bfloat16" if torch.cuda.is_available() else "float32",
              max_model_len=128 + 256, max_num_seqs=args.batch, async_scheduling=True)
    rng = random.Random(0)
    vocab = min(llm.engine.tokenizer.vocab_size, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(args.batch)]
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0.6, max_tokens=256, structured_outputs=so)
    plain = SamplingParams(temperature=0.6, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=so),
                 use_tqdm=False)
    rows = {"plain": run_case(llm, prompts, plain, None)}
    for t in args.threads.split(","):
        rows[f"json, {t or 'default'} threads"] = run_case(llm, prompts, constrained, int(t))
    rows["json, synchronous steps"] = run_case(llm, prompts, constrained, None, held=False)
    # The worker needs the GIL back to return from the fill: how long the stepping thread
    # keeps it matters.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    rows["json, switch 0.1 ms"] = run_case(llm, prompts, constrained, None)
    rows["plain, switch 0.1 ms"] = run_case(llm, prompts, plain, None)
    sys.setswitchinterval(interval)
    keys = sorted({k for r in rows.values() for k in r}, key=lambda k: (k.endswith(")"), k))
    print(f"{'ms per step':34}" + "".join(f"{n[:20]:>21}" for n in rows))
    for k in keys:
        print(f"{k[:34]:34}" + "".join(f"{r.get(k, float('nan')):21.3f}" for r in rows.values()))


if __name__ == "__main__":
    main()
