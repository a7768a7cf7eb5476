"""Is one source tree's engine faster than another's on workload (a)? (GPU)

Workload (a) of ``bench_engine`` (256 requests, prompts and outputs uniform in 100..1024,
temperature 0.6, Qwen3-0.6B shapes with random bf16 weights, prefix caching off so that every
run prefills its prompts) on the engine of two checkouts, alternated on one machine. Engines
differ by ~5% between machines, more than most single changes, so a change is compared here,
against the tree without it, rather than against a number measured elsewhere.

Each round runs every tree once, in a process of its own (``--worker``) that imports that
tree's ``mini_paged_attn`` and this checkout's benchmark tools: the engine starts, runs the
workload once untimed (an engine's first run pays first-use costs), then once timed. The
order of the trees flips every round (A B, B A, ...), so a drift of the host or the GPU falls
on both. The model checkpoint is written once and shared.

    git worktree add /tmp/base main
    python -m benchmarks.experiments.engine_ab --baseline /tmp/base [--current .]
        [--rounds 3] [--kv-cache-dtype auto|fp8] [--requests 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_engine import (engine_llm, engine_options, random_model_dir, timed_generate,
                                      workload_a_requests)
from benchmarks.experiments import import_tree

ROOT = Path(__file__).resolve().parents[2]


def round_orders(trees: list[str], rounds: int) -> list[list[str]]:
    """The order the trees run in, round by round: as given, then reversed, alternately."""
    return [list(trees) if r % 2 == 0 else list(reversed(trees)) for r in range(rounds)]


def worker(args: argparse.Namespace) -> None:
    # First: every later import of the library (the tools' too) must find this tree's.
    import_tree(args.worker, "mini_paged_attn")
    from mini_paged_attn.engine import SamplingParams
    prompts, limits, params = workload_a_requests(args.requests)
    llm = engine_llm(Path(args.model), engine_options(kv_cache_dtype=args.kv_cache_dtype),
                     enable_prefix_caching=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    first, _ = timed_generate(llm, prompts, params)
    seconds, _ = timed_generate(llm, prompts, params)
    print(json.dumps({"seconds": seconds, "tok_per_s": sum(limits) / seconds,
                      "first_run_tok_per_s": sum(limits) / first}), flush=True)


def run_worker(tree: str, model: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "benchmarks.experiments.engine_ab", "--worker", tree,
               "--model", str(model), "--kv-cache-dtype", args.kv_cache_dtype,
               "--requests", str(args.requests)]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def revision(tree: str) -> str:
    done = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"], check=False,
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="the checkout to compare against (required)")
    parser.add_argument("--current", default=str(ROOT), help="the checkout under test "
                        "(default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--requests", type=int, default=256,
                        help="requests of workload (a) (default 256)")
    parser.add_argument("--out", type=Path, default=None, help="directory for engine_ab.json")
    parser.add_argument("--worker", metavar="TREE", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.requests < 1:
        parser.error(f"--requests: expected at least 1, got {args.requests}")
    if args.worker is not None:
        worker(args)
        return
    if args.baseline is None:
        parser.error("--baseline: expected a checkout to compare against")
    names = {"current": args.current, "baseline": args.baseline}
    for flag, tree in names.items():
        if not (Path(tree) / "mini_paged_attn" / "__init__.py").is_file():
            parser.error(f"--{flag}: expected a checkout holding mini_paged_attn/, got {tree!r}")
    from benchmarks.common import environment
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as root:
        model = random_model_dir("qwen3-0.6b", Path(root))
        for order in round_orders(list(names), args.rounds):
            for name in order:
                row = run_worker(names[name], model, args)
                results[name].append(row)
                print(f"{name:9} {row['tok_per_s']:8.0f} tok/s (its first run "
                      f"{row['first_run_tok_per_s']:.0f})", flush=True)
    medians = {name: statistics.median(r["tok_per_s"] for r in rows)
               for name, rows in results.items()}
    summary = {"env": environment(), "kv_cache_dtype": args.kv_cache_dtype,
               "requests": args.requests,
               "trees": {name: {"path": str(Path(tree).resolve()), "revision": revision(tree)}
                         for name, tree in names.items()},
               "rounds": results, "median_tok_per_s": medians,
               "current_over_baseline": medians["current"] / medians["baseline"]}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_ab.json").write_text(json.dumps(summary, indent=1))
    rates = {name: " / ".join(f"{r['tok_per_s']:.0f}" for r in rows)
             for name, rows in results.items()}
    print(f"kv cache {args.kv_cache_dtype}: " + ", ".join(
        f"{name} ({summary['trees'][name]['revision']}) {rates[name]} tok/s" for name in names)
        + f"; current / baseline {summary['current_over_baseline']:.3f} (medians)")

if __name__ == "__main__":
    main()
