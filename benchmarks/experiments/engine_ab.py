"""Workload (a) on one engine in one process, with and without engine changes, alternated
(GPU).

Workload (a) of ``bench_engine`` (256 requests, prompts and outputs uniform in 100..1024,
temperature 0.6, Qwen3-0.6B shapes with random bf16 weights). Each variant undoes one change
by patching the engine for its rounds; "current" patches nothing. Engines differ by ~5%
between machines, more than most single changes, so changes are compared here, on one engine.

    python -m benchmarks.experiments.engine_ab [--variants current eager_sampling ...]
        [--rounds 2] [--kv-cache-dtype auto|fp8]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.bench_engine import (engine_llm, engine_options, random_model_dir, timed_generate,
                                      workload_a_requests)


@contextmanager
def patched(obj, name: str, value):
    # A class's own entry (a staticmethod stays one when it is put back).
    before = vars(obj)[name] if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def eager_sampling(stack: ExitStack, llm) -> None:
    """Temperature rows sampled by the torch reference (seven eager passes over the logits)."""
    import mini_paged_attn.engine.sampler as sampler_module
    from mini_paged_attn.ops.sample import sample_tokens
    stack.enter_context(patched(sampler_module, "sample_tokens",
                                functools.partial(sample_tokens, backend="torch")))


def float32_logits(stack: ExitStack, llm) -> None:
    """The LM head's output widened to float32 before every sampler."""
    from mini_paged_attn.engine.sampler import Sampler
    stack.enter_context(patched(Sampler, "reads_model_dtype",
                                staticmethod(lambda params, seeds: False)))


def store_kv_launch(stack: ExitStack, llm) -> None:
    """The new K/V written by a store_kv launch of their own after the rotary kernel (the
    decode graphs are captured again on entry and on exit)."""
    import mini_paged_attn.models.attention as attention
    from mini_paged_attn.ops.dispatch import store_kv
    rotary = attention.apply_rotary

    def unfused(q, k, positions, table, *, store=None, **kwargs):
        q, k = rotary(q, k, positions, table, **kwargs)
        if store is not None:
            store_kv(k, store.value, store.key_cache, store.value_cache, store.slot_mapping,
                     backend=kwargs.get("backend", "auto"))
        return q, k

    graphs = llm.engine.runner.graphs
    if graphs is not None:
        stack.callback(graphs.capture)
    stack.enter_context(patched(attention, "apply_rotary", unfused))
    if graphs is not None:
        graphs.capture()


def _replan(llm) -> None:
    """Plan the decode launches again: clear the plan and launch caches, then choose the
    decode graphs' table widths and capture them again."""
    from mini_paged_attn.ops import dispatch
    from mini_paged_attn.ops.attention import decode_plan as explain
    plan = explain.plan_decode
    while not hasattr(plan, "cache_clear"):    # patched: the cached function it wraps
        plan = plan.__wrapped__
    plan.cache_clear()
    dispatch._DECODE_RUNS.clear()
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        graphs.widths = {b: graphs._widths(b) for b in graphs.buckets}
        graphs._graphs.clear()
        graphs.capture()


def fp8_short_unsplit(stack: ExitStack, llm) -> None:
    """fp8 launches of short sequences planned as before the "fp8 short" rule (unsplit, or
    split toward 8 programs a SM); the decode graphs are planned and captured again."""
    from mini_paged_attn.ops.attention import decode_plan as explain
    stack.callback(_replan, llm)
    stack.enter_context(patched(explain, "FP8_SHORT_TILES", 0))
    _replan(llm)


def fp8_ordered_unsplit_wide(stack: ExitStack, llm) -> None:
    """fp8 launches of short sequences taken longest first kept unsplit from
    ``FP8_SPLIT_BELOW`` programs a SM instead of from ``FP8_ORDERED_UNSPLIT`` (at (a)'s tail
    lengths, 1000..2000 tokens, 96 sequences read 89.1% of copy bandwidth unsplit against
    83.8% in 2 splits; ``decode_tail``); the decode graphs are planned and captured again."""
    from mini_paged_attn.ops.attention import decode_plan as explain
    stack.callback(_replan, llm)
    stack.enter_context(patched(explain, "FP8_ORDERED_UNSPLIT", explain.FP8_SPLIT_BELOW))
    _replan(llm)


def fp8_unordered_plan(stack: ExitStack, llm) -> None:
    """Decode launches planned as if their sequences came in batch order (over an fp8 cache:
    short sequences split in two at any count of programs); the decode graphs are planned
    and captured again."""
    from mini_paged_attn.ops import decode
    from mini_paged_attn.ops.attention import decode_plan as explain
    plan = explain.plan_decode

    @functools.wraps(plan)
    def unordered(*args, ordered=False, **kwargs):
        return plan(*args, **kwargs)
    stack.callback(_replan, llm)
    stack.enter_context(patched(explain, "plan_decode", unordered))
    stack.enter_context(patched(decode, "plan_decode", unordered))
    _replan(llm)


def unordered_decode(stack: ExitStack, llm) -> None:
    """Decode programs take the sequences in batch order instead of longest first (the decode
    graphs are captured again on entry and on exit)."""
    runner = llm.engine.runner
    graphs = runner.graphs
    if graphs is not None:
        stack.callback(graphs.capture)
    stack.enter_context(patched(runner.inputs, "order_decode", False))
    if graphs is not None:
        graphs.capture()


def plain_launches(stack: ExitStack, llm) -> None:
    """The library's kernels launched plainly instead of as programmatic dependent launches
    (the launch caches emptied, the decode graphs planned and captured again)."""
    from mini_paged_attn.ops import launch, pdl

    def relaunch():
        launch._LAUNCHES.clear()
        _replan(llm)
    stack.callback(relaunch)
    stack.enter_context(patched(pdl, "pdl_supported", lambda device_index: False))
    relaunch()


def cublas_projections(stack: ExitStack, llm) -> None:
    """Every projection by cuBLAS and SwiGLU's product by a kernel of its own, as before
    ``ops.linear`` took decode-sized inputs (the decode and prompt graphs are captured again
    on entry and on exit)."""
    from mini_paged_attn.ops import projection
    runner = llm.engine.runner

    def recapture():
        runner.graphs.capture()
        if runner.prefill_graphs is not None:
            runner.prefill_graphs.capture(runner.graphs.pool)
    stack.callback(recapture)
    stack.enter_context(patched(projection, "MAX_TRITON_ROWS", 0))
    recapture()


VARIANTS = {"current": lambda stack, llm: None, "eager_sampling": eager_sampling,
            "float32_logits": float32_logits, "store_kv_launch": store_kv_launch,
            "fp8_short_unsplit": fp8_short_unsplit, "fp8_unordered_plan": fp8_unordered_plan,
            "fp8_ordered_unsplit_wide": fp8_ordered_unsplit_wide,
            "unordered_decode": unordered_decode, "plain_launches": plain_launches,
            "cublas_projections": cublas_projections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    from mini_paged_attn.engine import SamplingParams
    prompts, limits, params = workload_a_requests()
    results = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as root:
        path = random_model_dir("qwen3-0.6b", Path(root))
        # No prefix caching: every round prefills its prompts as the first did.
        llm = engine_llm(path, engine_options(kv_cache_dtype=args.kv_cache_dtype),
                         enable_prefix_caching=False)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        timed_generate(llm, prompts, params)                                     # warm-up
        for name in args.variants:    # each variant's own kernels compiled before timing
            with ExitStack() as stack:
                VARIANTS[name](stack, llm)
                timed_generate(llm, prompts[:32], params[:32])
        for _ in range(args.rounds):
            for name in args.variants:
                with ExitStack() as stack:
                    VARIANTS[name](stack, llm)
                    seconds, _ = timed_generate(llm, prompts, params)
                results[name].append(sum(limits) / seconds)
                print(f"{name:16} {sum(limits) / seconds:8.0f} tok/s", flush=True)
    print(f"kv cache {args.kv_cache_dtype}: " + ", ".join(
        f"{name} {' / '.join(f'{v:.0f}' for v in vals)} tok/s" for name, vals in results.items()))


if __name__ == "__main__":
    main()
