"""Where does the engine's host time go in steady decode? (GPU)

bench_engine's profile shows more wall time per decode step than GPU kernel time (Qwen3-0.6B
shapes, 256 sequences of ~1k tokens: 16 ms against 12 ms): this runs such steps under cProfile
and prints the functions by own time, so the host's share can be attributed (the wait for the
GPU shows up in the call that synchronizes: ``tolist``). Each case prints the wall time per
step without the profiler and the GPU kernel time per step (torch profiler).

Cases (``--cases``): ``b256`` the batch above; ``b1`` batch 1 (Qwen2.5-0.5B shapes, a
512-token prompt, bench_engine's (b)); ``json64`` / ``plain64`` batch 64 (Qwen2.5-0.5B shapes)
with and without a JSON schema (bench_structured's workload).

    python -m benchmarks.experiments.engine_host_profile --out DIR --cases b256,b1,json64,plain64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
from pathlib import Path

import torch

CASES = {  # shape, batch, prompt length, structured
    "b256": ("qwen3-0.6b", 256, 1000, False),
    "b1": ("qwen2.5-0.5b", 1, 512, False),
    "json64": ("qwen2.5-0.5b", 64, 128, True),
    "plain64": ("qwen2.5-0.5b", 64, 128, False),
}


def gpu_ms_per_step(engine, steps: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total += getattr(e, "self_device_time_total", 0.0)
    return total / steps / 1e3


def profile_case(name: str, root: Path, args) -> str:
    from benchmarks.bench_engine import random_model_dir, step_to_steady_decode, wall_ms_per_step
    from benchmarks.bench_structured import SCHEMA
    from mini_paged_attn.engine import LLM, SamplingParams, StructuredOutputsParams

    shape, batch, prompt_len, structured = CASES[name]
    llm = LLM(str(random_model_dir(shape, root)), dtype="bfloat16", max_model_len=4096,
              max_num_seqs=max(batch, 8), kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    rng = random.Random(0)
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(temperature=0.6, ignore_eos=not structured, max_tokens=400,
                            structured_outputs=so)
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params)
    step_to_steady_decode(engine)
    for _ in range(5):
        engine.step()
    wall = wall_ms_per_step(engine)
    gpu = gpu_ms_per_step(engine)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(25)
    llm.engine.shutdown()
    return (f"== {name}: wall ms/step {wall:.3f}, GPU kernels ms/step {gpu:.3f}, "
            f"running {engine.scheduler.num_running}\n" + buf.getvalue())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--cases", default="b256")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    texts = [profile_case(name, root, args) for name in args.cases.split(",")]
    text = "\n".join(texts)
    print(text)
    print("\n".join(t.splitlines()[0] for t in texts))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_host_profile.txt").write_text(text)


if __name__ == "__main__":
    main()
