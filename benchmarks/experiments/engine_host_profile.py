"""Where the engine's host time goes in steady decode at batch 256 (GPU experiment).

bench_engine's profile shows 16 ms of wall time per decode step against 12 ms of GPU kernels
(Qwen3-0.6B shapes, 256 sequences of ~1k tokens): this runs the same steps under cProfile and
prints the functions by own time, so the host's share can be attributed (the wait for the GPU
shows up in the call that synchronizes: ``tolist``).

    python -m benchmarks.experiments.engine_host_profile --out DIR
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


def main(argv=None) -> None:
    from benchmarks.bench_engine import random_model_dir, step_to_steady_decode, wall_ms_per_step
    from mini_paged_attn.engine import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    llm = LLM(str(random_model_dir("qwen3-0.6b", root)), dtype="bfloat16", max_model_len=4096,
              max_num_seqs=args.batch, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=400)
    for _ in range(args.batch):
        engine.add_request([rng.randint(0, 10000) for _ in range(1000)], params)
    step_to_steady_decode(engine)
    for _ in range(5):
        engine.step()
    plain_ms = wall_ms_per_step(engine)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumtime").print_stats(40)
    text = f"wall ms/step without the profiler: {plain_ms:.2f}\n" + buf.getvalue()
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_host_profile.txt").write_text(text)


if __name__ == "__main__":
    main()
