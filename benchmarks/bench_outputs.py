"""CPU micro-benchmark of the engine's per-step output path (no model, no GPU).

R streaming requests each gain one token per step for T steps, as ``LLMEngine.step`` sees them:
the scheduler appends the sampled token, ``OutputProcessor.process`` detokenizes it (and looks
for stop strings), ``OutputProcessor.make_output`` builds the request's ``RequestOutput``, and the
server's stream state turns it into an SSE chunk (on the server that part runs on the asyncio
thread, not the engine thread). Prints milliseconds per step for each part, over the first and
the last 10% of the steps (outputs that copy whole token lists get slower as the requests grow).

    python -m benchmarks.bench_outputs --requests 256 --tokens 1000 [--stop] [--logprobs 2]
"""

from __future__ import annotations

import argparse
import random
import time

from mini_paged_attn.core.request import Request
from mini_paged_attn.core.scheduler import Scheduler, SchedulerConfig
from mini_paged_attn.engine.output_processor import OutputProcessor, RequestState
from mini_paged_attn.engine.sampling_params import SamplingParams
from mini_paged_attn.models.tiny import byte_level_hf_tokenizer
from mini_paged_attn.models.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256,
                        help="requests processed at once (default 256)")
    parser.add_argument("--tokens", type=int, default=1000, help="generated tokens per request")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens per request")
    parser.add_argument("--stop", action="store_true", help="a stop string that never matches")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    args = parser.parse_args()

    from mini_paged_attn.server.formats import ResponseFormat
    from mini_paged_attn.server.openai_api import _StreamState

    tokenizer = Tokenizer(byte_level_hf_tokenizer(), name="bytes")
    processor = OutputProcessor(tokenizer)
    rng = random.Random(0)
    stop = ("\x00never\x00",) if args.stop else ()
    params = SamplingParams(max_tokens=args.tokens, stop=list(stop) or None,
                            logprobs=args.logprobs, ignore_eos=True)
    scheduler = Scheduler(SchedulerConfig(max_model_len=args.prompt + args.tokens + 1), None)
    states, seqs, streams = [], [], []
    fmt = ResponseFormat(request_id="cmpl", model="m", created=0, chat=False)
    for r in range(args.requests):
        request = Request(f"r{r}", [rng.randrange(32, 127) for _ in range(args.prompt)],
                          args.tokens, n=1, params=params)
        seq = scheduler._new_sequence(request, 0, list(request.prompt_token_ids))
        states.append(RequestState(request, None, final_only=False, stop=stop))
        seqs.append(seq)
        streams.append(_StreamState(fmt, 1, False))

    times = {"process": [], "make_output": [], "server chunk": []}
    for _ in range(args.tokens):
        for seq in seqs:                          # what Scheduler.update does per token
            seq.token_ids.append(rng.randrange(32, 127))
            if args.logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append({seq.token_ids[-1]: -0.5})
        t0 = time.perf_counter()
        for state, seq in zip(states, seqs):
            processor.process(state, seq)
        t1 = time.perf_counter()
        outputs = [processor.make_output(state) for state in states]
        t2 = time.perf_counter()
        for stream, out in zip(streams, outputs):
            stream.events(0, out)
        t3 = time.perf_counter()
        times["process"].append(t1 - t0)
        times["make_output"].append(t2 - t1)
        times["server chunk"].append(t3 - t2)

    k = max(1, args.tokens // 10)
    print(f"{args.requests} requests x {args.tokens} tokens (prompt {args.prompt}, "
          f"stop strings {'on' if stop else 'off'}, logprobs {args.logprobs}): ms per step")
    print(f"{'part':<14}{'first 10%':>12}{'last 10%':>12}{'mean':>12}")
    for name, ts in times.items():
        print(f"{name:<14}{1e3 * sum(ts[:k]) / k:>12.3f}{1e3 * sum(ts[-k:]) / k:>12.3f}"
              f"{1e3 * sum(ts) / len(ts):>12.3f}")


if __name__ == "__main__":
    main()
