"""A hostile request mix against the real server, with ordinary clients measured beside it.

Starts ``mini-paged-attn serve --model tiny`` on 127.0.0.1 (a free port, CPU unless told),
measures 8 victim clients alone (their quiet latency), then sends ``--requests`` hostile
requests (``--concurrency`` at a time) while the victims go on, and reports:

- per kind of hostile request: how many got each status, and the 5xx among them that are not
  documented internal errors (a 500 whose grammar could not finish an output is documented:
  the model, not the request, is at fault);
- crashes: the server process gone (it is restarted, so the rest of the mix still runs);
- leaked KV blocks once everything has finished (``/metrics``: free vs total);
- the victims' p50 / max latency during the mix against their quiet p50, and their errors.

Traffic goes to 127.0.0.1 only; every request has a timeout and the mix a deadline, so the
tool stops by itself. ``--requests 100`` is the CI size (``tests/server/test_hostile_mix.py``).
The victims run in a process of their own and each kind's body is encoded once, so the load
generator's own work (it shares the machine) is not counted in the victims' latency.

    python -m benchmarks.hostile_mix                       # 1,000 requests, all kinds
    python -m benchmarks.hostile_mix --requests 100 --kinds amplified_prompt_logprobs,never_reads
    python -m benchmarks.hostile_mix --list-kinds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

MODEL = "tiny"
HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 120.0
START_TIMEOUT_S = 180.0
# The server is started with short I/O budgets, so stalled peers are dropped within the run.
IO_TIMEOUT_S = 3
DOCUMENTED_500 = "could not finish an output of this request within its grammar"


# ---- the hostile requests ------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    status: int | str           # HTTP status, or "dropped" / "error:<what>"
    documented: bool = False    # a 5xx the docs name as the model's fault, not a server bug


def _chat(content: str = "hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _completion(prompt="hello", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, **extra}


def _chained_refs(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


DEEP_TOOL_CALL = "<tool_call>" + "[" * 1100
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]

# kind -> (path, body or None for the raw-socket kinds); one family each.
BODIES: dict[str, tuple[str, Callable[[random.Random], dict]]] = {
    "amplified_prompt_logprobs": ("/v1/completions", lambda r: _completion(
        [[r.randrange(256) for _ in range(2000)] for _ in range(2)], n=128, prompt_logprobs=20,
        max_tokens=1)),
    "amplified_chat_top_logprobs": ("/v1/chat/completions", lambda r: _chat(
        n=128, logprobs=True, top_logprobs=20)),
    "amplified_echo": ("/v1/completions", lambda r: _completion(
        [r.randrange(256) for _ in range(1500)], n=64, echo=True, logprobs=5, max_tokens=4)),
    "deep_tool_call": ("/v1/chat/completions", lambda r: _chat(
        tools=TOOLS, tool_choice="auto", max_tokens=1200,
        structured_outputs={"choice": [DEEP_TOOL_CALL]}, stream=r.random() < 0.5)),
    "oversized_prompt": ("/v1/completions", lambda r: _completion("word " * 800_000,
                                                                 max_tokens=2)),
    "huge_model_name": ("/v1/completions", lambda r: {**_completion(max_tokens=2),
                                                      "model": "m" * 1_000_000}),
    "sampler_top_p_tiny": ("/v1/completions", lambda r: _completion(max_tokens=8,
                                                                    top_p=1e-46)),
    "sampler_repetition_tiny": ("/v1/completions", lambda r: _completion(
        max_tokens=8, repetition_penalty=1e-40, top_p=0.9)),
    "grammar_chained_refs": ("/v1/chat/completions", lambda r: _chat(
        max_tokens=4, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": _chained_refs(1000)}})),
    "grammar_big_choice": ("/v1/completions", lambda r: _completion(
        max_tokens=4, structured_outputs={"choice": [f"c{i}" for i in range(60_000)]})),
    "grammar_huge_repeat": ("/v1/completions", lambda r: _completion(
        max_tokens=4, structured_outputs={"regex": "a{1000000}"})),
    "grammar_21_digit_int": ("/v1/chat/completions", lambda r: _chat(
        max_tokens=4, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "maximum": 10 ** 21}}})),
    "grammar_min_tokens": ("/v1/completions", lambda r: _completion(
        max_tokens=8, min_tokens=6, top_p=0.5, structured_outputs={"choice": ["a", "b"]})),
}
RAW_KINDS = ("never_reads", "stalled_upload")
KINDS = (*BODIES, *RAW_KINDS)
# The kinds whose defences live in the HTTP server (``--kinds server``).
SERVER_KINDS = ("amplified_prompt_logprobs", "amplified_chat_top_logprobs", "amplified_echo",
                "deep_tool_call", "oversized_prompt", "huge_model_name", *RAW_KINDS)


async def _post(client: httpx.AsyncClient, path: str, body: dict, raw: bytes) -> Outcome:
    """Send one request (``raw``: ``body`` encoded); read the whole response (streamed or not)."""
    headers = {"content-type": "application/json"}
    if body.get("stream"):
        async with client.stream("POST", path, content=raw, headers=headers) as r:
            text = (await r.aread()).decode(errors="replace")
            if r.status_code == 200 and not text.rstrip().endswith("data: [DONE]"):
                return Outcome("error:stream_without_done")
            errors = [line for line in text.splitlines()
                      if line.startswith("data: {\"error\"")]
            if errors:   # an error event in a 200 stream: judge it as its status would be
                documented = all(DOCUMENTED_500 in line for line in errors)
                return Outcome(500, documented)
            return Outcome(r.status_code)
    r = await client.post(path, content=raw, headers=headers)
    documented = r.status_code == 500 and DOCUMENTED_500 in r.text
    return Outcome(r.status_code, documented)


async def _raw(port: int, data: bytes, hold_s: float) -> Outcome:
    """Write ``data`` and read nothing for ``hold_s``; then read what the server said."""
    reader, writer = await asyncio.open_connection(HOST, port)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(hold_s)
        head = await asyncio.wait_for(reader.read(256), REQUEST_TIMEOUT_S)
        status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "dropped"
        return Outcome(int(status) if status.isdigit() else status)
    finally:
        writer.close()


def _raw_request(path: str, body: bytes, declared: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode() + body


async def hostile(kind: str, rng: random.Random, client: httpx.AsyncClient, port: int,
                  encoded: dict[str, tuple[dict, bytes]] | None = None) -> Outcome:
    """Send one request of ``kind``. ``encoded`` keeps each kind's body once encoded, so the
    load generator's own CPU time (it shares the machine) stays small beside the server's."""
    if kind == "never_reads":
        body = json.dumps(_completion(max_tokens=1500, ignore_eos=True, stream=True, n=4,
                                      logprobs=5)).encode()
        return await _raw(port, _raw_request("/v1/completions", body, len(body)),
                          IO_TIMEOUT_S + 2)
    if kind == "stalled_upload":
        body = json.dumps(_completion(max_tokens=2)).encode()
        return await _raw(port, _raw_request("/v1/completions", body[:10], len(body)),
                          IO_TIMEOUT_S + 1)
    path, make = BODIES[kind]
    if encoded is None or kind not in encoded:
        body = make(rng)
        entry = (body, json.dumps(body).encode())
        if encoded is not None:
            encoded[kind] = entry
    return await _post(client, path, *(entry if encoded is None else encoded[kind]))


# ---- the server ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on HOST that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``mini-paged-attn serve --model tiny`` in a child process on a free port."""

    def __init__(self, extra_args: list[str]) -> None:
        self.extra_args = extra_args
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mini_paged_attn.cli", "serve", "--model", MODEL,
               "--host", HOST, "--port", str(self.port),
               "--body-timeout-s", str(IO_TIMEOUT_S), "--send-timeout-s", str(IO_TIMEOUT_S),
               *self.extra_args]
        # A file, not a pipe: a pipe nobody reads fills up and blocks the server's logging.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None and self.alive:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def kv_blocks(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("mini_paged_attn_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout_s: float) -> dict[str, float]:
    """/metrics once nothing runs or waits (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = kv_blocks(url)
        idle = (m.get("mini_paged_attn_requests_running") == 0
                and m.get("mini_paged_attn_requests_waiting") == 0
                and m.get("mini_paged_attn_kv_blocks_free")
                == m.get("mini_paged_attn_kv_blocks_total"))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# ---- the run -------------------------------------------------------------------------------------
VICTIM_BODY = _completion("The quick brown fox", max_tokens=8, temperature=0)
QUIET_ROUNDS = 10       # requests per victim for the quiet latency


@dataclass
class Report:
    requests: int
    seconds: float
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    undocumented_5xx: dict[str, int] = field(default_factory=dict)
    crashes: int = 0
    crash_kinds: list[str] = field(default_factory=list)
    leaked_blocks: int = 0
    victim_quiet_p50_s: float = 0.0
    victim_p50_s: float = 0.0
    victim_max_s: float = 0.0
    victim_worst_p50_s: float = 0.0      # the slowest victim's own median
    victim_requests: int = 0
    victim_errors: int = 0

    @property
    def undocumented_5xx_total(self) -> int:
        return sum(self.undocumented_5xx.values())


async def _victim(url: str, stop: asyncio.Event, latencies: list[float], errors: list[str],
                  rounds: int | None = None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        done = 0
        while not stop.is_set() and (rounds is None or done < rounds):
            start = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json=VICTIM_BODY)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors.append(str(r.status_code))
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                await asyncio.sleep(0.2)
            done += 1


def _victims_main(url: str, victims: int, rounds: int | None, stop, results) -> None:
    """The victims, in a process of their own: the attackers' work of building and sending
    megabyte bodies must not be counted in the victims' latency. Puts ``(latencies per
    victim, errors)`` on ``results``."""
    async def main() -> tuple[list[list[float]], list[str]]:
        done = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()

        watcher = asyncio.create_task(watch())
        lat: list[list[float]] = [[] for _ in range(victims)]
        errs: list[str] = []
        await asyncio.gather(*(_victim(url, done, lat[i], errs, rounds)
                               for i in range(victims)))
        watcher.cancel()
        return lat, errs

    results.put(asyncio.run(main()))


class _Victims:
    """``victims`` ordinary clients in a child process, from :meth:`start` to :meth:`stop`
    (or for ``rounds`` requests each)."""

    def __init__(self, url: str, victims: int, rounds: int | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._results = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_victims_main, daemon=True,
                                    args=(url, victims, rounds, self._stop, self._results))

    def start(self) -> _Victims:
        self._process.start()
        return self

    def stop(self) -> tuple[list[list[float]], list[str]]:
        """Stop them; their ``(latencies per victim, errors)``."""
        self._stop.set()
        return self.result()

    def result(self) -> tuple[list[list[float]], list[str]]:
        """Their ``(latencies per victim, errors)``, once they are done."""
        result = self._results.get(timeout=REQUEST_TIMEOUT_S + 30)
        self._process.join(30)
        return result


async def run_mix(server: ServerProcess, kinds: list[str], requests: int, concurrency: int,
                  victims: int, seed: int, deadline_s: float) -> Report:
    rng = random.Random(seed)
    plan = [kinds[i % len(kinds)] for i in range(requests)]
    rng.shuffle(plan)
    quiet, _ = await asyncio.to_thread(
        lambda: _Victims(server.url, victims, rounds=QUIET_ROUNDS).start().result())
    report = Report(requests, 0.0, victim_quiet_p50_s=statistics.median(sum(quiet, [])))
    outcomes: dict[str, Counter] = defaultdict(Counter)
    in_flight: Counter = Counter()
    victims_under_mix = _Victims(server.url, victims).start()
    queue: asyncio.Queue = asyncio.Queue()
    for kind in plan:
        queue.put_nowait(kind)
    end = time.monotonic() + deadline_s
    restart_lock = asyncio.Lock()
    encoded: dict[str, tuple[dict, bytes]] = {}

    async def check_crash() -> None:
        async with restart_lock:
            if not server.alive:
                report.crashes += 1
                report.crash_kinds.append(",".join(sorted(k for k, v in in_flight.items() if v)))
                await asyncio.to_thread(server.start)

    async def attacker(worker: int) -> None:
        wrng = random.Random(seed * 1000 + worker)
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
            while not queue.empty() and time.monotonic() < end:
                kind = queue.get_nowait()
                in_flight[kind] += 1
                try:
                    outcome = await asyncio.wait_for(hostile(kind, wrng, client, server.port, encoded),
                                                     REQUEST_TIMEOUT_S + 10)
                except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
                    outcome = Outcome(f"error:{type(exc).__name__}")
                finally:
                    in_flight[kind] -= 1
                outcomes[kind][str(outcome.status)] += 1
                if isinstance(outcome.status, int) and outcome.status >= 500 \
                        and not outcome.documented:
                    report.undocumented_5xx[kind] = report.undocumented_5xx.get(kind, 0) + 1
                if not server.alive:
                    await check_crash()

    start = time.monotonic()
    await asyncio.gather(*(attacker(w) for w in range(concurrency)))
    report.seconds = time.monotonic() - start
    per_victim, errs = await asyncio.to_thread(victims_under_mix.stop)
    await check_crash()
    m = await asyncio.to_thread(wait_idle, server.url, 60.0)
    report.leaked_blocks = int(m.get("mini_paged_attn_kv_blocks_total", 0)
                               - m.get("mini_paged_attn_kv_blocks_free", 0))
    report.by_kind = {k: dict(v) for k, v in sorted(outcomes.items())}
    lat = sum(per_victim, [])
    report.victim_requests, report.victim_errors = len(lat), len(errs)
    if lat:
        report.victim_p50_s, report.victim_max_s = statistics.median(lat), max(lat)
        report.victim_worst_p50_s = max(statistics.median(v) for v in per_victim if v)
    return report


def run(kinds: list[str], requests: int, concurrency: int = 8, victims: int = 8, seed: int = 0,
        deadline_s: float = 900.0, server_args: list[str] | None = None) -> Report:
    """Start the server, run the mix, stop the server; the report."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds: expected some of {', '.join(KINDS)}, got {unknown}")
    server = ServerProcess(server_args or [])
    server.start()
    try:
        return asyncio.run(run_mix(server, kinds, requests, concurrency, victims, seed,
                                   deadline_s))
    finally:
        server.stop()


def _print(report: Report) -> None:
    print(f"{report.requests} hostile requests in {report.seconds:.1f} s")
    for kind, statuses in report.by_kind.items():
        cells = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
        flag = f"  <- {report.undocumented_5xx[kind]} undocumented 5xx" \
            if report.undocumented_5xx.get(kind) else ""
        print(f"  {kind:30s} {cells}{flag}")
    print(f"undocumented 5xx: {report.undocumented_5xx_total}; crashes: {report.crashes}"
          + (f" (in flight: {'; '.join(report.crash_kinds)})" if report.crashes else ""))
    print(f"leaked KV blocks: {report.leaked_blocks}")
    quiet = report.victim_quiet_p50_s or float("nan")
    print(f"victims: quiet p50 {report.victim_quiet_p50_s * 1000:.0f} ms; under the mix p50 "
          f"{report.victim_p50_s * 1000:.0f} ms, slowest victim's p50 "
          f"{report.victim_worst_p50_s * 1000:.0f} ms ({report.victim_worst_p50_s / quiet:.2f}x "
          f"quiet), max {report.victim_max_s * 1000:.0f} ms ({report.victim_max_s / quiet:.1f}x)"
          f"; {report.victim_requests} ok, {report.victim_errors} errors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="hostile requests (1000)")
    parser.add_argument("--concurrency", type=int, default=8, help="hostile requests at once")
    parser.add_argument("--victims", type=int, default=8, help="ordinary clients (8)")
    parser.add_argument("--kinds", default="all",
                        help="comma-separated kinds, 'all' or 'server' (see --list-kinds)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the mix: which hostile requests, in which order (default 0)")
    parser.add_argument("--deadline-s", type=float, default=900.0,
                        help="no hostile request starts after this many seconds")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--list-kinds", action="store_true",
                        help="print the kinds of hostile request, then exit")
    parser.add_argument("server_args", nargs="*",
                        help="more `serve` options, after --, e.g. -- --max-num-seqs 64")
    args = parser.parse_args(argv)
    if args.list_kinds:
        print("\n".join(KINDS))
        return 0
    kinds = (list(KINDS) if args.kinds == "all" else list(SERVER_KINDS) if args.kinds == "server"
             else args.kinds.split(","))
    report = run(kinds, args.requests, args.concurrency, args.victims, args.seed,
                 args.deadline_s, args.server_args)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
