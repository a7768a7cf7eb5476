"""Where the time to first token of one 512-token prompt goes (GPU).

Batch 1, Qwen2.5-0.5B shapes with random bf16 weights (as ``bench_engine`` (b)): TTFT of
several fresh 512-token prompts in a row (no prefix-cache hits), so a first-use cost (lazy
kernel loading, a Triton specialisation) shows as the difference between the first and the
later ones; then a profile of one prefill step (host and GPU time, the top host ops).
``--compare-paths``: the prompts alternate between the engine's attention over the new K/V
(whole prompts) and the block-table path, which a prefix-cache hit takes. ``--prefix-hits N``:
then N prompts of 512 tokens whose first 256 (and N whose first 496) are cached from an
earlier prompt, alternately with the prefill graphs on and off (the paged graphs serve them).
``--toggle-graphs``: the fresh prompts alternate too; ``--kv-cache-dtype fp8``: every prompt
takes the paged graphs.

    python -m benchmarks.experiments.ttft_probe
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import engine_llm, engine_options, random_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="fresh 512-token prompts to time")
    p.add_argument("--compare-paths", action="store_true",
                   help="alternate the prompts between attention over the new K/V and the "
                        "block-table path")
    p.add_argument("--prefix-hits", type=int, default=0,
                   help="prompts with a cached prefix to time, graphs on and off in turn")
    p.add_argument("--toggle-graphs", action="store_true",
                   help="the fresh prompts too alternate between prefill graphs on and off")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="the engine's KV cache (fp8: every prompt takes the paged graphs)")
    args = p.parse_args()
    paged = {"on": False}
    if args.compare_paths:
        import dataclasses

        from mini_paged_attn.engine.worker.input_batch import InputBuilder
        build = InputBuilder.build

        def build_as_told(self, *a, **k):
            step = build(self, *a, **k)
            return dataclasses.replace(step, no_prefix=False) if paged["on"] else step
        InputBuilder.build = build_as_told
    from mini_paged_attn.engine import SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        llm = engine_llm(random_model_dir("qwen2.5-0.5b", Path(tmp)),
                         engine_options(max_num_seqs=8, kv_cache_dtype=args.kv_cache_dtype))
        llm.generate([[5] * 50], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        gen = torch.Generator().manual_seed(1)
        one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
        runner = llm.engine.runner
        graphs = runner.prefill_graphs
        for i in range(args.prompts):
            paged["on"] = args.compare_paths and i % 2 == 1
            prompt = torch.randint(0, 10000, (512,), generator=gen).tolist()
            off = args.toggle_graphs and i % 2 == 1
            runner.prefill_graphs = None if off else graphs
            torch.cuda.synchronize()
            t = time.perf_counter()
            (out,) = llm.generate([prompt], one, use_tqdm=False)
            wall = time.perf_counter() - t
            runner.prefill_graphs = graphs
            path = ("block tables" if paged["on"] else "new K/V") + (", graphs off" if off else "")
            print(f"prompt {i} ({path}): TTFT {1e3 * out.metrics.time_to_first_token:.1f} ms, "
                  f"generate wall {1e3 * wall:.1f} ms", flush=True)
        for cached in (256, 496) if args.prefix_hits else ():
            for i in range(2 * args.prefix_hits):
                base = torch.randint(0, 10000, (512,), generator=gen).tolist()
                llm.generate([base], one, use_tqdm=False)       # caches its blocks
                prompt = base[:cached] + torch.randint(0, 10000, (512 - cached,),
                                                       generator=gen).tolist()
                runner.prefill_graphs = graphs if i % 2 == 0 else None
                torch.cuda.synchronize()
                (out,) = llm.generate([prompt], one, use_tqdm=False)
                runner.prefill_graphs = graphs
                print(f"prefix hit {cached} + {512 - cached} new, graphs "
                      f"{'on ' if i % 2 == 0 else 'off'}: TTFT "
                      f"{1e3 * out.metrics.time_to_first_token:.1f} ms", flush=True)
        from torch.profiler import ProfilerActivity, profile
        prompt = torch.randint(0, 10000, (512,), generator=gen).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], one, use_tqdm=False)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
