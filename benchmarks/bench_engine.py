"""Engine benchmark (GPU), with transformers' ``generate`` as the peer in the same run.

(a) nano-vllm's published workload: 256 requests, prompt and output lengths uniform in
    100..1024 (random.seed(0), prompt ids uniform in 0..10000), temperature 0.6, ignore_eos,
    Qwen3-0.6B shapes with random bf16 weights: output tokens/s and total time.
(b) batch 1: Qwen2.5-0.5B shapes, a 512-token prompt, 256 greedy output tokens: time per
    output token and tokens/s (CUDA graphs; ``--enforce-eager`` to compare).
(c) the same workloads through transformers ``generate`` (sdpa attention, left padding,
    batches of ``--hf-batch``), counting only the tokens each request asked for. For (a) it runs
    the first ``--hf-requests`` requests (batches are independent, so its tokens/s carries over).
(cascade, noshare) cascade attention on and off on requests sharing a 2048-token system
    prompt, and on requests sharing nothing (see ``benchmarks/engine_cascade.py``).
(parity) greedy outputs of the engine vs transformers on Qwen3-0.6B shapes in bf16: the share
    of identical requests, and for the others the top-2 logit gap (transformers' logits) at the
    first differing step, against the spacing of bf16 numbers at that magnitude.

Random weights are drawn by transformers directly on the GPU (its own init, std 0.02) and saved
to a temporary directory that the engine then loads like any checkpoint.

    python -m benchmarks.bench_engine --out /tmp/bench_engine
    python -m benchmarks.bench_engine --workloads a,b --hf-requests 64
    python -m benchmarks.bench_engine --workloads cascade,noshare --no-hf
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": dict(arch="Qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(arch="Qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(arch="Qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="parity,a,b",
                        help="comma-separated subset of parity,a,b,cascade,noshare (default: "
                             "parity,a,b)")
    parser.add_argument("--model", default=None,
                        help="a model directory to use for (a) instead of random Qwen3-0.6B shapes")
    parser.add_argument("--num-requests", type=int, default=256,
                        help="(a), (cascade), (noshare) requests (default 256)")
    parser.add_argument("--hf-requests", type=int, default=64,
                        help="(a) requests run through transformers (default 64; 0 skips it)")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers batch size")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers entirely")
    parser.add_argument("--parity-requests", type=int, default=32,
                        help="requests of the parity workload, checked token by token against "
                             "transformers (default 32)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="engine: most requests in one batch (default 256)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the engine's KV cache: the model dtype (auto) or fp8 (e4m3)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="engine: token budget of one step (default 8192)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="the engine without prefix caching (on by default)")
    add_async_argument(parser)
    parser.add_argument("--profile", action="store_true",
                        help="also profile steady decode steps (kernels per step, GPU busy share)")
    parser.add_argument("--out", default=None,
                        help="directory for results.json (and engine.png with matplotlib)")
    parser.add_argument("--replot", metavar="JSON",
                        help="draw the plot of a results.json (no GPU needed), then exit")
    parser.add_argument("--plot", metavar="PNG",
                        help="where --replot draws (default: beside the JSON, same name)")


ASYNC_CHOICES = {"auto": None, "on": True, "off": False}


def add_async_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--async-scheduling", default="auto", choices=tuple(ASYNC_CHOICES),
                        help="the engine's asynchronous scheduling (auto: on with CUDA)")


def save_random_model(config, path: Path, *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, tokenizer=None) -> Path:
    """Write a Hugging Face directory at ``path``: a model of transformers ``config`` with random
    ``dtype`` weights drawn on the GPU from ``seed`` (+ ``tokenizer``, a Hugging Face tokenizer,
    or by default a byte tokenizer, so the engine loads it; the benchmarks pass token ids)."""
    import transformers
    from mini_paged_attn.models.tiny import byte_level_hf_tokenizer, write_tokenizer_files

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    else:
        write_tokenizer_files(byte_level_hf_tokenizer(), path)
    del model
    torch.cuda.empty_cache()
    return path


def random_model_dir(shape: str, root: Path, seed: int = 0, tokenizer: str | None = None) -> Path:
    """A Hugging Face directory with ``shape``'s config and random bf16 weights (see
    :func:`save_random_model`). ``tokenizer``: a Hugging Face tokenizer directory to ship
    instead of the byte tokenizer (the vocabulary then takes its size)."""
    import transformers

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    ids = dict(bos_token_id=0, eos_token_id=1)
    hf_tokenizer = None
    if tokenizer is not None:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
        spec["vocab_size"] = len(hf_tokenizer)
        ids = dict(bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id)
    config = getattr(transformers, f"{arch}Config")(**spec, **ids)
    return save_random_model(config, root / shape, seed=seed, tokenizer=hf_tokenizer)


def hf_model(path: Path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()


def hf_generate(model, prompts: list[list[int]], max_tokens: list[int], *, batch: int,
                temperature: float, scores: bool = False):
    """Left-padded batches through ``generate``; returns (seconds, outputs[, step logits])."""
    import transformers
    outputs, logits_out = [], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for at in range(0, len(prompts), batch):
        chunk, limits = prompts[at:at + batch], max_tokens[at:at + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen = transformers.GenerationConfig(
            max_new_tokens=max(limits), min_new_tokens=max(limits), do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
            eos_token_id=None, pad_token_id=0, output_logits=scores, return_dict_in_generate=True)
        with torch.no_grad():
            out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=gen)
        for i, n in enumerate(limits):
            outputs.append(out.sequences[i, width:width + n].tolist())
            if scores:
                logits_out.append([step[i].float().cpu() for step in out.logits[:n]])
    torch.cuda.synchronize()
    return time.perf_counter() - start, outputs, logits_out


def engine_options(**overrides) -> argparse.Namespace:
    """This tool's engine options at their defaults, with ``overrides``: the ``args`` of
    :func:`engine_llm` for a tool without this command line."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(overrides)
    return args


def engine_llm(path: Path, args, **overrides):
    from mini_paged_attn.engine import LLM
    options = dict(dtype="bfloat16", max_model_len=4096, enforce_eager=args.enforce_eager,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   kv_cache_dtype=args.kv_cache_dtype,
                   enable_prefix_caching=not args.no_prefix_caching,
                   async_scheduling=ASYNC_CHOICES[args.async_scheduling])
    options.update(overrides)
    return LLM(str(path), **options)


def timed_generate(llm, prompts, params):
    """(seconds, outputs) of one ``generate`` call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def step_to_steady_decode(engine) -> None:
    """Step ``engine`` until a step is decode-only with no request waiting."""
    engine.step()
    while not (engine.last_schedule.decode_only and engine.scheduler.num_waiting == 0):
        engine.step()


def wall_ms_per_step(engine, steps: int = 20) -> float:
    """Mean wall milliseconds of ``steps`` engine steps, the GPU drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def profile_decode(llm, prompts: list[list[int]], max_tokens: int, steps: int = 5) -> dict:
    """Steady decode steps of ``prompts``: wall time per step, GPU kernel time per step (so the
    share the GPU is busy), kernels per step, the kernels that take the most time, and the KV
    blocks the requests hold then."""
    from torch.profiler import ProfilerActivity, profile

    from mini_paged_attn.engine import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    step_to_steady_decode(engine)
    wall_ms = wall_ms_per_step(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    total_us = sum(device_us(e) for e in kernels)
    top = sorted(kernels, key=device_us, reverse=True)[:12]
    stats = llm.stats()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": len(prompts), "wall_ms_per_step": wall_ms,
            "gpu_ms_per_step": total_us / steps / 1e3,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "kv_blocks_free": stats.kv_blocks_free, "kv_blocks_cached": stats.kv_blocks_cached,
            "top_kernels": [{"name": e.key[:80], "count_per_step": e.count / steps,
                             "ms_per_step": device_us(e) / steps / 1e3} for e in top]}


def workload_a_requests(n: int = 256, rng: random.Random | None = None):
    """Workload (a)'s requests: ``(prompts, limits, params)``, ``n`` prompts of token ids
    uniform in 0..10000 with lengths uniform in 100..1024, then their output lengths (same
    range), sampled at temperature 0.6 with ``ignore_eos``. ``rng`` (default
    ``random.Random(0)``, the sequence of ``random.seed(0)``) is left after the draws, for a
    caller that draws more from it."""
    from mini_paged_attn.engine import SamplingParams
    rng = random.Random(0) if rng is None else rng
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    limits = [rng.randint(100, 1024) for _ in range(n)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in limits]
    return prompts, limits, params


def workload_a(args, root: Path, results: dict) -> None:
    from mini_paged_attn.engine import SamplingParams
    n = args.num_requests
    prompts, limits, params = workload_a_requests(n)
    path = Path(args.model) if args.model else random_model_dir("qwen3-0.6b", root)
    llm = engine_llm(path, args)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)      # warm-up
    seconds, _ = timed_generate(llm, prompts, params)
    stats = llm.stats()
    row = {"requests": n, "output_tokens": sum(limits), "seconds": seconds,
           "tok_per_s": sum(limits) / seconds, "preemptions": stats.num_preemptions,
           "kv_blocks": stats.kv_blocks_total}
    if args.profile:
        rng = random.Random(5)
        row["profile_256"] = profile_decode(
            llm, [[rng.randint(0, 10000) for _ in range(1000)] for _ in range(256)], 200)
    del llm
    torch.cuda.empty_cache()
    if args.hf_requests and not args.no_hf:
        k = min(args.hf_requests, n)
        hf = hf_model(path)
        hf_generate(hf, [[1, 2, 3]], [4], batch=1, temperature=0.6)               # warm-up
        hf_s, _, _ = hf_generate(hf, prompts[:k], limits[:k], batch=args.hf_batch, temperature=0.6)
        row.update(hf_requests=k, hf_seconds=hf_s, hf_tok_per_s=sum(limits[:k]) / hf_s)
        row["speedup"] = row["tok_per_s"] / row["hf_tok_per_s"]
        del hf
        torch.cuda.empty_cache()
    results["a"] = row


def workload_b(args, root: Path, results: dict) -> None:
    from mini_paged_attn.engine import SamplingParams
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 10000, (512,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
    path = random_model_dir("qwen2.5-0.5b", root)
    llm = engine_llm(path, args, max_num_seqs=8)
    # A warm-up prompt of its own: one sharing the timed prompt's first blocks would make the
    # timed one a prefix-cache hit, which runs eagerly (see docs/performance-notes.md).
    warm_up = torch.randint(0, 10000, (50,), generator=gen).tolist()
    llm.generate([warm_up], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    seconds, (out,) = timed_generate(llm, [prompt], params)
    ttft = out.metrics.time_to_first_token
    row = {"seconds": seconds, "tok_per_s": 256 / seconds, "ttft_ms": 1e3 * ttft,
           "tpot_ms": 1e3 * (out.metrics.last_token_time - out.metrics.first_token_time) / 255}
    if args.profile:
        row["profile_1"] = profile_decode(llm, [prompt], 200)
    del llm
    torch.cuda.empty_cache()
    results["b"] = row
    if args.no_hf:
        return
    hf = hf_model(path)
    hf_generate(hf, [warm_up], [8], batch=1, temperature=0.0)
    hf_s, _, _ = hf_generate(hf, [prompt], [256], batch=1, temperature=0.0)
    row.update(hf_seconds=hf_s, hf_tok_per_s=256 / hf_s, speedup=hf_s / seconds)
    del hf
    torch.cuda.empty_cache()


def greedy_parity(ours: list[list[int]], theirs: list[list[int]],
                  logits: list[list[torch.Tensor]]) -> dict:
    """Compare greedy token lists with transformers' (``logits``: its per-step logits of each
    request): identical requests, the mean share of tokens before the first difference, and at
    each first difference transformers' logit gap between its token and ours, also in units of
    bf16's spacing at the top logit."""
    identical, gaps, prefix = 0, [], []
    for mine, ref, steps_logits in zip(ours, theirs, logits):
        if mine == ref:
            identical += 1
            prefix.append(1.0)
            continue
        t = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        prefix.append(t / len(ref))
        row = steps_logits[t]
        top = row.topk(2).values
        gap = float(row[ref[t]] - row[mine[t]])
        # bf16 keeps 8 significant bits: the spacing of representable logits near the top one.
        spacing = 2.0 ** (math.floor(math.log2(abs(float(top[0])) or 1.0)) - 7)
        gaps.append({"step": t, "gap": gap, "top2_gap": float(top[0] - top[1]),
                     "bf16_spacing": spacing, "gap_in_bf16_steps": gap / spacing})
    return {"requests": len(ours), "identical": identical,
            "identical_share": identical / max(len(ours), 1),
            "agreeing_prefix_share": sum(prefix) / max(len(prefix), 1), "differing": gaps}


def workload_parity(args, root: Path, results: dict) -> None:
    from mini_paged_attn.engine import SamplingParams
    path = random_model_dir("qwen3-0.6b", root, seed=1)
    rng = random.Random(2)
    prompts = [[rng.randint(0, 100000) for _ in range(rng.randint(16, 400))]
               for _ in range(args.parity_requests)]
    steps = 32
    llm = engine_llm(path, args)
    ours = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    hf = hf_model(path)
    _, theirs, logits = hf_generate(hf, prompts, [steps] * len(prompts), batch=len(prompts),
                                    temperature=0.0, scores=True)
    results["parity"] = greedy_parity(ours, theirs, logits)
    del hf
    torch.cuda.empty_cache()


def report(results: dict, env: dict) -> str:
    lines = [f"device: {env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
             f"date {env['date']}", ""]
    if "a" in results:
        a = results["a"]
        lines.append(f"(a) {a['requests']} req, {a['output_tokens']} output tokens: "
                     f"{a['seconds']:.2f} s, {a['tok_per_s']:.0f} tok/s "
                     f"(preemptions {a['preemptions']}, {a['kv_blocks']} KV blocks)")
        if "hf_tok_per_s" in a:
            lines.append(f"    transformers ({a['hf_requests']} req): {a['hf_seconds']:.2f} s, "
                         f"{a['hf_tok_per_s']:.0f} tok/s -> engine {a['speedup']:.1f}x")
    if "b" in results:
        b = results["b"]
        lines.append(f"(b) batch 1, 512 + 256: {b['seconds']:.3f} s, {b['tok_per_s']:.0f} tok/s, "
                     f"TPOT {b['tpot_ms']:.2f} ms, TTFT {b['ttft_ms']:.1f} ms")
        if "hf_tok_per_s" in b:
            lines.append(f"    transformers {b['hf_tok_per_s']:.0f} tok/s -> engine {b['speedup']:.1f}x")
    for key in ("a", "b"):
        for name, prof in results.get(key, {}).items():
            if not name.startswith("profile"):
                continue
            lines.append(f"  profile ({key}) batch {prof['batch']}: {prof['wall_ms_per_step']:.2f} ms/step "
                         f"wall, GPU kernels {prof['gpu_ms_per_step']:.2f} ms/step "
                         f"({prof['kernels_per_step']:.0f} kernels)")
            for k in prof["top_kernels"][:8]:
                lines.append(f"    {k['ms_per_step']:7.3f} ms  x{k['count_per_step']:5.0f}  {k['name']}")
    if "parity" in results:
        p = results["parity"]
        worst = max((abs(g["gap_in_bf16_steps"]) for g in p["differing"]), default=0.0)
        lines.append(f"(parity) bf16 greedy identical: {p['identical']}/{p['requests']} "
                     f"({100 * p['identical_share']:.0f}%); differing: first-diff logit gap "
                     f"<= {worst:.1f} bf16 steps")
    from benchmarks.engine_cascade import report_lines
    lines += report_lines(results)
    return "\n".join(lines)


def plot_results(path: Path, results: dict) -> None:
    """Output tokens/s of the engine and of transformers, per workload (log scale)."""
    from benchmarks.plots import plot_bars
    labels = {"a": "(a) 256 requests, Qwen3-0.6B shapes", "b": "(b) batch 1, Qwen2.5-0.5B shapes"}
    keys = [k for k in labels if k in results]
    env = results["env"]
    series = {"engine": [results[k]["tok_per_s"] for k in keys],
              "transformers generate": [results[k].get("hf_tok_per_s") for k in keys]}
    # A run without transformers (--no-hf) plots the engine alone, with no empty legend entry.
    series = {name: values for name, values in series.items() if any(v for v in values)}
    plot_bars(path, [labels[k] for k in keys], series,
              title=f"engine output tokens/s - {env['device']}, {env['date']}",
              ylabel="output tokens/s (log)", log=True, annotate=True)


def run(args: argparse.Namespace) -> int:
    if args.replot:
        source = Path(args.replot)
        plot_results(Path(args.plot) if args.plot else source.with_suffix(".png"),
                     json.loads(source.read_text()))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.bench_engine needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
           "async_scheduling": args.async_scheduling, "kv_cache_dtype": args.kv_cache_dtype,
           "prefix_caching": not args.no_prefix_caching}
    results: dict = {"env": env}
    from benchmarks.engine_cascade import workload_cascade, workload_noshare
    workloads = {"parity": workload_parity, "a": workload_a, "b": workload_b,
                 "cascade": workload_cascade, "noshare": workload_noshare}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            start = time.perf_counter()
            workloads[name](args, Path(tmp), results)
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    print(report(results, env))
    if args.out and ("a" in results or "b" in results):
        try:
            plot_results(Path(args.out) / "engine.png", results)
        except ImportError:
            print("no plot: matplotlib is not installed (pip install -e .[bench])")
    return 0


def engine_tool_main(doc: str, add: Callable[[argparse.ArgumentParser], None],
                     run_tool: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """Parse ``argv`` with the tool's arguments and ``--log-level``, set up logging, run it
    (shared by the engine-level tools: this one and ``bench_tp``)."""
    from benchmarks.cli import add_log_level, parse_and_log
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add(parser)
    add_log_level(parser)
    return run_tool(parse_and_log(parser, argv))


def main(argv: list[str] | None = None) -> int:
    return engine_tool_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
