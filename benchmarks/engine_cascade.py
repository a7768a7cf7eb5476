"""``bench_engine``'s cascade workloads: the engine with cascade attention on and off, in the
same process, on the same requests.

(cascade) a shared system prompt of 2048 tokens (in the prefix cache before the timed run),
    256 requests each adding 128..512 tokens of its own, 256 output tokens each (temperature
    0.6, ``ignore_eos``), Qwen3-0.6B shapes with random bf16 weights: output tokens/s with
    cascade on and off, their ratio, and the steps that took cascade.
(noshare) the same lengths with a different 2048-token head per request: nothing is shared, so
    the rule must pick plain attention on every step (cascade steps 0, the same speed).

    python -m benchmarks.bench_engine --workloads cascade,noshare --no-hf
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

SYSTEM_TOKENS = 2048
OWN_TOKENS = (128, 512)
OUTPUT_TOKENS = 256


def cascade_requests(n: int, *, shared: bool, seed: int = 0):
    """``(system, prompts, params)``: ``n`` prompts of ``SYSTEM_TOKENS`` head tokens (the
    same ``system`` for all when ``shared``, else one head each) and ``OWN_TOKENS`` of their
    own (uniform), token ids in 0..10000; one ``SamplingParams`` for all."""
    from mini_paged_attn.engine import SamplingParams
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randint(0, 10000) for _ in range(k)]
    system = tokens(SYSTEM_TOKENS)
    prompts = [(system if shared else tokens(SYSTEM_TOKENS)) + tokens(rng.randint(*OWN_TOKENS))
               for _ in range(n)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=OUTPUT_TOKENS)
    return system, prompts, params


def run_cascade_workload(args, root: Path, results: dict, *, shared: bool) -> None:
    """Time the requests with cascade on, then off (a fresh engine each); ``results`` gets
    ``"cascade"`` or ``"noshare"``: per setting the seconds, output tok/s, steps and cascade
    steps of the timed run, and ``ratio`` (on / off tok/s)."""
    from benchmarks.bench_engine import engine_llm, random_model_dir, timed_generate
    from mini_paged_attn.engine import SamplingParams
    n = args.num_requests
    system, prompts, params = cascade_requests(n, shared=shared)
    path = random_model_dir("qwen3-0.6b", root)
    row: dict = {"requests": n, "system_tokens": SYSTEM_TOKENS, "shared": shared,
                 "output_tokens": n * OUTPUT_TOKENS}
    for cascade in (True, False):
        llm = engine_llm(path, args, cascade_attention=cascade)
        warm = SamplingParams(temperature=0.0, max_tokens=4)
        llm.generate([[1, 2, 3]], warm, use_tqdm=False)
        # The system prompt joins the prefix cache: the timed requests hit it, as a server's
        # requests do once the first one ran.
        llm.generate([system + [1]], warm, use_tqdm=False)
        before = llm.stats()
        seconds, _ = timed_generate(llm, prompts, params)
        after = llm.stats()
        row["on" if cascade else "off"] = {
            "seconds": seconds, "tok_per_s": n * OUTPUT_TOKENS / seconds,
            "steps": after.num_steps - before.num_steps,
            "cascade_steps": after.cascade_steps - before.cascade_steps,
            "prefix_hit_rate": after.prefix_cache_hit_rate,
            "preemptions": after.num_preemptions}
        del llm
        torch.cuda.empty_cache()
    row["ratio"] = row["on"]["tok_per_s"] / row["off"]["tok_per_s"]
    results["cascade" if shared else "noshare"] = row


def report_lines(results: dict) -> list[str]:
    """The report's lines of the cascade workloads in ``results``."""
    lines = []
    for key, label in (("cascade", "shared 2k system prompt"), ("noshare", "nothing shared")):
        if key not in results:
            continue
        r = results[key]
        on, off = r["on"], r["off"]
        lines.append(f"({key}) {r['requests']} req, {label}: cascade on {on['tok_per_s']:.0f} "
                     f"tok/s ({on['cascade_steps']}/{on['steps']} cascade steps), off "
                     f"{off['tok_per_s']:.0f} tok/s -> {r['ratio']:.2f}x")
    return lines


def workload_cascade(args, root: Path, results: dict) -> None:
    run_cascade_workload(args, root, results, shared=True)


def workload_noshare(args, root: Path, results: dict) -> None:
    run_cascade_workload(args, root, results, shared=False)


__all__ = ["cascade_requests", "report_lines", "run_cascade_workload", "workload_cascade",
           "workload_noshare"]
