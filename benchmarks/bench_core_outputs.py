"""CPU micro-benchmark of the engine process's per-step output work (tiny model, no GPU).

R streaming requests run in an ``EngineCore`` as the server's engine process runs them (the
requests the HTTP process's ``MPEngineClient`` sends: text made by the client unless stop
strings need it in the core). For every decode step in which all R requests got a token it
times, in microseconds:

- ``outputs``: the engine making the step's outputs (``EngineStep._report``: text where the
  core makes it, then one output per request);
- ``send``: the outbox taking the step's outputs (and the engine's stats) and, in the next
  step, flushing them (what is left to turn them into a message, and encoding it; the pipe
  write is left out: a stand-in keeps the bytes);
- ``core``: the two together, the host work per step the engine's process adds to a streaming
  step (what an offline ``final_only`` run does not do);
- ``client``: decoding the message and rebuilding the outputs in the client
  (``MPEngineClient._on_outputs``, the HTTP process's output thread), measured apart.

Medians over the steps, each configuration repeated and the best median kept (the host is
shared). Torch runs on one thread (``--threads``): its idle OpenMP workers would spin on the
cores the timed host work needs, which a GPU host's step does not see. Run from the
repository root:

    python -m benchmarks.bench_core_outputs [--requests 1 8 64] [--tokens 64] [--stop]
        [--logprobs K] [--n N] [--repeats 3] [--threads 1] [--codecs]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import marshal
import random
import statistics
import time
import timeit
from typing import Any

import torch

from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.engine_step import EngineStep
from mini_paged_attn.engine.process.child import PipeOutbox
from mini_paged_attn.engine.process.client import ClientBookkeeping
from mini_paged_attn.engine.process.core import EngineCore
from mini_paged_attn.engine.process.messages import AddRequest, Outputs, decode, encode
from mini_paged_attn.engine.process.mp_client import MPEngineClient, _engine_text

# As run_core_process makes its core (from the commit where the engine makes the deltas on).
CORE_OPTIONS = ({"deltas": True} if "deltas" in inspect.signature(EngineCore).parameters
                else {})
LLM_KWARGS = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=256,
                  max_model_len=512, enable_prefix_caching=False, seed=0)


class _Pipe:
    """The result pipe's stand-in: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class _TimedOutbox(PipeOutbox):
    def __init__(self, conn: _Pipe) -> None:
        super().__init__(conn)
        self.flush_us: list[tuple[float, int]] = []   # (us, requests in the message)
        self.outputs_us: list[float] = []             # taking the step's outputs and stats

    def outputs(self, outputs: list, stats: Any, adds_seen: int) -> None:
        self.flush()            # already done in the step's overlap, but at the core's end
        t0 = time.perf_counter()
        super().outputs(outputs, stats, adds_seen)
        self.outputs_us.append(1e6 * (time.perf_counter() - t0))

    def flush(self) -> None:
        if self._pending is None:
            return
        count = len(self._pending[0])
        t0 = time.perf_counter()
        super().flush()
        # With what outputs() took for this message (the engine's stats, mostly).
        taken = self.outputs_us[len(self.flush_us)] if len(self.outputs_us) > len(
            self.flush_us) else 0.0
        self.flush_us.append((taken + 1e6 * (time.perf_counter() - t0), count))


class _Inbox:
    """The adds first; between steps, the client's side of what the core sent (timed apart);
    EOF once the engine is idle."""

    def __init__(self, adds: list[AddRequest], engine: Any, pipe: _Pipe, client: Any) -> None:
        self.adds, self.engine, self.pipe, self.client = list(adds), engine, pipe, client
        self.client_us: list[tuple[float, int]] = []
        self.messages: list[Any] = []               # every Outputs message, decoded

    def get(self, timeout: float | None) -> Any:
        for data in self.pipe.sent:
            t0 = time.perf_counter()
            message = decode(data)
            self.client._on_outputs(message)
            us = 1e6 * (time.perf_counter() - t0)
            self.messages.append(message)
            self.client_us.append((us, len(getattr(message, "deltas", ()))))
        self.pipe.sent.clear()
        if self.adds:
            return self.adds.pop(0)
        if timeout is None and not self.engine.has_unfinished_requests():
            raise EOFError
        return None


def _client(engine: Any, params: SamplingParams, adds: list[AddRequest]) -> Any:
    """An MPEngineClient's output side without a child process: its live requests, a
    tokenizer, no handler."""
    client = MPEngineClient.__new__(MPEngineClient)
    ClientBookkeeping.__init__(client, engine.tokenizer, engine.admission)
    client._stats, client._seen_adds = engine.stats(), 0
    for add in adds:
        client._live[add.request_id] = client._new_state(params, None, add.prompt_token_ids)
    return client


def run_once(engine: Any, requests: int, params: SamplingParams, prompt_len: int,
             seed: int) -> dict[str, float]:
    """One run of ``requests`` streaming requests to the end; median us per full step."""
    rng = random.Random(seed)
    adds = [AddRequest(f"req-{seed}-{r}", None,
                       [rng.randrange(3, 250) for _ in range(prompt_len)], params,
                       _engine_text(params), False) for r in range(requests)]
    pipe = _Pipe()
    outbox = _TimedOutbox(pipe)
    inbox = _Inbox(adds, engine, pipe, _client(engine, params, adds))
    report_us: list[tuple[float, int]] = []
    original = EngineStep._report

    def timed_report(self: EngineStep) -> list:
        t0 = time.perf_counter()
        outputs = original(self)
        report_us.append((1e6 * (time.perf_counter() - t0), len(outputs)))
        return outputs

    EngineStep._report = timed_report
    try:
        EngineCore(engine, inbox, outbox, **CORE_OPTIONS).run()
    finally:
        EngineStep._report = original
    inbox.get(0.0)       # the client's side of the last message

    def full(samples: list[tuple[float, int]]) -> list[float]:
        # Steps in which every request got a token, the finishing one excluded.
        kept = [us for us, count in samples if count == requests]
        return kept[:-1] or kept

    outputs, send, client = full(report_us), full(outbox.flush_us), full(inbox.client_us)
    middle = [m for m in inbox.messages if isinstance(m, Outputs) and len(m.deltas) == requests]
    return {"outputs": statistics.median(outputs), "send": statistics.median(send),
            "core": statistics.median([a + b for a, b in zip(outputs, send)]),
            "client": statistics.median(client), "steps": len(outputs),
            "message": middle[len(middle) // 2]}


def codec_us(message: Outputs, repeats: int = 2000) -> dict[str, float]:
    """us to encode / decode one step's message: the pipe's pickle, and marshal (stdlib, plain
    values only: the metrics and stats as tuples of their fields)."""
    stats = dataclasses.astuple(message.stats)
    plain = ("outputs", ([(d[0], d[1], d[2], d[3] and dataclasses.astuple(d[3]), d[4])
                          for d in message.deltas], stats, message.adds_seen))
    pickled, marshalled = encode(message), marshal.dumps(plain)

    def us(fn: Any) -> float:
        return 1e6 * min(timeit.repeat(fn, number=repeats, repeat=3)) / repeats
    return {"pickle dumps": us(lambda: encode(message)), "pickle loads": us(lambda: decode(pickled)),
            "marshal dumps": us(lambda: marshal.dumps(plain)),
            "marshal loads": us(lambda: marshal.loads(marshalled)),
            "pickle bytes": len(pickled), "marshal bytes": len(marshalled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64],
                        help="live streaming requests (default 1 8 64)")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--stop", action="store_true",
                        help="a stop string that never matches (the core makes the text)")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    parser.add_argument("--n", type=int, default=1, help="samples per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--codecs", action="store_true",
                        help="also time pickle against marshal on a full step's message")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine = LLM("tiny", **LLM_KWARGS).engine
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, n=args.n, seed=0,
                            temperature=1.0, stop=["\x00never\x00"] if args.stop else None,
                            logprobs=args.logprobs)
    run_once(engine, 2, params, args.prompt, seed=99)     # warm-up
    print(f"us per step (median over full steps, best of {args.repeats}); tokens "
          f"{args.tokens}, prompt {args.prompt}, stop {'on' if args.stop else 'off'}, "
          f"logprobs {args.logprobs}, n {args.n}")
    print(f"{'requests':>9}{'outputs':>10}{'send':>10}{'core':>10}{'client':>10}{'steps':>7}")
    for requests in args.requests:
        runs = [run_once(engine, requests, params, args.prompt, seed=k)
                for k in range(args.repeats)]
        best = {key: min(r[key] for r in runs) for key in ("outputs", "send", "core", "client")}
        print(f"{requests:>9}{best['outputs']:>10.1f}{best['send']:>10.1f}{best['core']:>10.1f}"
              f"{best['client']:>10.1f}{runs[0]['steps']:>7}")
        if args.codecs:
            print("          " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in codec_us(runs[0]["message"]).items()))


if __name__ == "__main__":
    main()
