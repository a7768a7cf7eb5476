"""``mini-paged-attn serve``: an OpenAI-compatible HTTP server over one engine.

    mini-paged-attn serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                          [--served-model-name NAME [NAME ...]] [--chat-template T]
                          [--max-queue N] [--max-request-bytes N] [request caps]
                          [--engine-process auto|on|off] [engine options]

The model is the positional argument, as in ``vllm serve MODEL`` (``--model MODEL`` says the
same). With no GPU it runs on the CPU, so ``serve DIR`` alone works on a laptop (``tiny``: the
embedded tiny Llama with RANDOM weights, to try the API). It binds to 127.0.0.1 unless
``--host`` says otherwise. What can be checked without the model (the options, the API key, the
chat template, the port being free) is checked before it loads, and a mistake is one
``error: ...`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from ._args import TRUST_REMOTE_CODE_ERROR, add_engine_arguments, port_number, positive_int
from .progress import LoadProgressBar

if TYPE_CHECKING:
    from mini_paged_attn.server.limits import ServerLimits


# engine/tools/parsers.py's PARSERS, named here so that building the command line imports
# no engine (tests/server/test_tool_calls_parsers.py keeps the two the same).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model_help = ("local Hugging Face model directory (config.json, *.safetensors, tokenizer "
                  "files), a .gguf file, 'smollm2-135m' or 'tiny' (the embedded random tiny "
                  "Llama)")
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help=model_help)
    parser.add_argument("--model", default=None,
                        help="the same as the positional MODEL (give one of them, or both the "
                             "same)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the id(s) clients pass as `model`: a request may name any of "
                             "them, and responses carry the first (default: the model's "
                             "directory or file name)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a local directory whose tokenizer to use instead of the model's "
                             "(its ids must be the model's vocabulary; default: the model's)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the Jinja chat template /v1/chat/completions renders, instead of "
                             "the tokenizer's: a file, or the template itself")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1: this machine only)")
    http.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    http.add_argument("--api-key", default=os.environ.get("MINI_PAGED_ATTN_API_KEY"),
                      help="require `Authorization: Bearer KEY` on /v1/* "
                           "(default: $MINI_PAGED_ATTN_API_KEY, else no key)")
    http.add_argument("--max-queue", type=positive_int, default=None,
                      help="at most N requests may wait for their first token; more get 429 "
                           "(default: no limit)")
    http.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                      help="a host name clients may use in the Host header (repeat it for "
                           "several); bound to a loopback address, localhost, 127.0.0.1 and ::1 "
                           "are allowed and any other name is refused, against DNS rebinding")
    _add_limit_arguments(http)
    http.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                      help="run the engine in a process of its own, so HTTP work does not slow "
                           "its steps (auto, the default: on when it runs on a GPU)")
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                      help="the format of tool calls in the model's output, read when a chat "
                           "request has tools and tool_choice auto (default: the one the chat "
                           "template shows; hermes if it shows none)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM command lines: tool_choice auto is always on "
                           "here (with the parser of --tool-call-parser, else the chat "
                           "template's); unlike vLLM it needs neither flag")
    http.add_argument("--disable-log-requests", action="store_true",
                      help="no log line per request (the access log at INFO)")
    add_engine_arguments(parser, serving=True)
    parser.add_argument("--step-timeout-s", type=_step_timeout, default=60.0, metavar="S",
                        help="with --tensor-parallel-size > 1: a step that takes longer fails "
                             "the engine as a dead rank does (a stopped or hung rank); 0: no "
                             "limit (default 60)")


def _step_timeout(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value or None


def _add_limit_arguments(group: argparse._ArgumentGroup) -> None:
    """One ``--max-...`` option per field of ServerLimits (--max-request-bytes, --max-n, ...)."""
    try:
        from mini_paged_attn.server.limits import ServerLimits
    except ImportError:  # no server extra: every other command must still parse; serve can't run
        return

    for f in dataclasses.fields(ServerLimits):
        group.add_argument(f"--{f.name.replace('_', '-')}", type=positive_int, default=f.default,
                           help=f"{f.metadata['help']} (default {f.default})")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The ServerLimits the ``--max-...`` options ask for."""
    from mini_paged_attn.server.limits import ServerLimits

    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})


def api_key_error(api_key: str | None) -> str | None:
    """Why ``api_key`` cannot be used (None if it can): a blank key, from ``--api-key ""`` or
    an empty ``MINI_PAGED_ATTN_API_KEY=``, would otherwise serve with no key at all, or with one
    no client can send."""
    if api_key is not None and not api_key.strip():
        return (f"--api-key / $MINI_PAGED_ATTN_API_KEY is set but blank ({api_key!r}): give a "
                "key, or unset it to serve without one")
    return None


def allowed_hosts(host: str, extra: list[str]) -> list[str] | None:
    """The Host header names the server accepts when bound to ``host`` (None: any)."""
    from mini_paged_attn.server.cross_site import LOOPBACK_HOSTS

    if _is_loopback(host):
        return [*LOOPBACK_HOSTS, *extra]
    return extra or None


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def wants_engine_process(choice: str, device: str | None) -> bool:
    """Whether ``--engine-process choice`` puts the engine in its own process.

    ``auto``: on a GPU, yes: there a step is mostly Python between short kernels, and in one
    process the HTTP event loop's per-chunk Python takes the interpreter lock from it, and
    every step grows (docs/performance-notes.md, "Server"). On the CPU, no: the engine's own
    threads use the cores.
    """
    if choice != "auto":
        return choice == "on"
    import torch

    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_available()


def leave_a_core_for_http() -> int:
    """On CPU, cap torch's intra-op threads at one less than the cores; returns the cap.

    The engine thread and the HTTP event loop share the process: torch's worker threads spin
    between ops and, on every core, starve the event loop and the clients (on 2 cores the
    server's throughput halves). Call it when the engine runs on the CPU.
    """
    import torch

    threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))
    torch.set_num_threads(threads)
    return threads


def model_argument(args: argparse.Namespace) -> str:
    """The model of ``serve MODEL`` or ``serve --model MODEL``.

    Raises:
        ValueError: neither is given, or both and they differ.
    """
    positional, option = args.model_arg, args.model
    if positional is None and option is None:
        raise ValueError("MODEL: expected a model directory, .gguf file or packaged name "
                         "(serve MODEL, or --model MODEL), got none")
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"MODEL: expected one model, got {positional!r} and --model "
                         f"{option!r}: give one of them")
    return positional if positional is not None else option


def read_chat_template(text: str) -> str:
    """``--chat-template``: the template in the file ``text`` names, else ``text`` itself if
    it reads as a Jinja template.

    Raises:
        ValueError: neither a file nor a template, or a template that does not parse.
    """
    from pathlib import Path

    path = Path(text)
    try:
        is_file = path.is_file()
    except OSError:   # a template too long to be a path
        is_file = False
    if is_file:
        template, where = path.read_text(), f"the file {text!r}"
    elif "{{" in text or "{%" in text:
        template, where = text, "the template given"
    else:
        raise ValueError(f"--chat-template: expected a file or a Jinja template, got {text!r}, "
                         "which is neither a file nor holds {{ or {%")
    try:
        import jinja2
    except ImportError:   # transformers brings it; without it the template fails at render
        return template
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: {where} is not a valid Jinja template: line "
                         f"{exc.lineno}: {exc.message}") from None
    return template


# Bytes a connection's kernel send queue may hold that were not sent yet (TCP_NOTSENT_LOWAT).
UNSENT_SOCKET_BYTES = 64 * 1024


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, for the server to listen on; bound before the model
    loads, so that a busy port is said at once, and no other program can take it meanwhile.

    Raises:
        ValueError: the port is in use, or the address cannot be bound (names both).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host: expected an address or a host name of this machine, got "
                         f"{host!r} ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # What uvicorn does: a port whose last server just stopped (TIME_WAIT) binds at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "TCP_NOTSENT_LOWAT"):    # Linux, macOS; accepted sockets inherit it
        # The kernel would otherwise queue megabytes a client has not read (the send buffer
        # grows to tcp_wmem's maximum), so a stream whose client stops reading ran to its end
        # unseen by the server's backpressure (--max-unsent-tokens) and send timeout. Bounding
        # the unsent bytes, not the buffer (SO_SNDBUF), keeps a reading client's throughput.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_SOCKET_BYTES)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"--port: {host}:{port}: address already in use (another "
                             "server listens there): stop it, or pick another port with "
                             "--port") from None
        raise ValueError(f"--host/--port: cannot bind {host}:{port}: "
                         f"{exc.strerror or exc}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    if args.trust_remote_code:
        print(f"error: {TRUST_REMOTE_CODE_ERROR}", file=sys.stderr)
        return 2
    problem = api_key_error(args.api_key) or missing_server_extra()
    if problem is not None:  # before the model loads, which can take minutes
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model = model_argument(args)
    chat_template = (None if args.chat_template is None
                     else read_chat_template(args.chat_template))
    sock = bind(args.host, args.port)
    early = start_engine_early(args, model)
    try:
        return _serve(args, model, chat_template, sock, early)
    except BaseException:
        if early is not None:
            early.close()
        raise
    finally:
        sock.close()


def start_engine_early(args: argparse.Namespace, model: str):
    """The engine's process, started before this process imports torch and the server
    (seconds of imports that then run beside the child's load), where it will likely be
    wanted: ``--engine-process on``, or ``auto`` on a host that looks like it has a GPU
    (:func:`~mini_paged_attn.engine.process.spawn.cuda_likely`; torch decides afterwards and
    a child started for nothing is stopped). None: started later, if at all."""
    from mini_paged_attn.engine.process.child import CoreLaunch
    from mini_paged_attn.engine.process.spawn import EngineProcess, cuda_likely

    if args.engine_process == "off" or (args.engine_process == "auto"
                                        and not cuda_likely(args.device)):
        return None
    return EngineProcess.start(CoreLaunch(model, engine_kwargs(args)))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM`` arguments of ``serve``'s engine flags."""
    return dict(dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_batched_context_tokens=args.max_num_batched_context_tokens,
                max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching,
                cascade_attention=args.cascade_attention != "off",
                enforce_eager=args.enforce_eager, seed=args.seed,
                kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=args.tensor_parallel_size,
                step_timeout_s=args.step_timeout_s, tokenizer=args.tokenizer)


def _serve(args: argparse.Namespace, model: str, chat_template: str | None,
           sock: socket.socket, early) -> int:
    import logging
    from pathlib import Path

    from mini_paged_attn.server.app import build_app

    log = logging.getLogger("mini_paged_attn.serve")
    llm_kwargs = engine_kwargs(args)
    use_process = wants_engine_process(args.engine_process, args.device)
    if early is not None and not use_process:   # the hint was wrong: torch sees no CUDA
        early.close()
        early = None
    llm_engine = None
    with LoadProgressBar() as bar:
        if use_process:
            from mini_paged_attn.engine.process.mp_client import MPEngineClient
            engine = MPEngineClient(model, llm_kwargs, load_progress=bar, started=early)
            where = "its own process"
            # LLM logs where its load's time went; the child's log is not configured.
            log.info("%s loaded: %s", model, bar.summary())
        else:
            from mini_paged_attn.engine import LLM
            from mini_paged_attn.engine.process.client import InprocEngineClient
            llm_engine = LLM(model, load_progress=bar, **llm_kwargs).engine
            where = "a thread of the server"
    if llm_engine is not None:
        if llm_engine.runner.device.type == "cpu":
            log.info("torch uses %d CPU threads (one core left for HTTP)",
                     leave_a_core_for_http())
        engine = InprocEngineClient(llm_engine)
    try:
        names = args.served_model_name or [Path(model).resolve().name]
        name = names[0]
        app = build_app(engine, model_name=names, api_key=args.api_key,
                        max_queue=args.max_queue, limits=server_limits(args),
                        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
                        tool_call_parser=args.tool_call_parser, chat_template=chat_template)
        banner = (f"serving {name!r} on http://{args.host}:{args.port}/v1, engine in {where} "
                  f"({engine.stats().summary()})")
        if args.api_key is None and not _is_loopback(args.host):
            log.warning("listening on %s with no API key: anyone who can reach it can use it",
                        args.host)
        if not args.disable_log_requests:
            app = with_access_log(app, _access_logger())
        server = _server(app, args.host, args.port, banner)
        # uvicorn shuts down on SIGTERM, then raises the signal again: make that an ordinary
        # exit, so the engine's process is closed below rather than left to notice it is alone.
        previous = signal.signal(signal.SIGTERM, _exit_quietly)
        try:
            server.run(sockets=[sock])
        except (KeyboardInterrupt, SystemExit):   # Ctrl-C re-raised, SIGTERM, or no bind
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.shutdown()  # the engine's thread or process
        if llm_engine is not None:
            llm_engine.shutdown()   # its tensor-parallel workers, if any
    if not server.started:   # could not listen: uvicorn has logged why
        return 2
    print(f"stopped serving {name!r} on http://{args.host}:{args.port}", flush=True)
    return 0


def missing_server_extra() -> str | None:
    """Why ``serve`` cannot run here (None if it can): a package of the server extra is not
    installed."""
    import importlib.util

    # Found, not imported: the server's imports (torch among them) run once the engine's
    # process is loading.
    for name in SERVER_EXTRA:
        if importlib.util.find_spec(name) is None:
            return (f"serve needs the server extra, and {name!r} is not installed: "
                    'pip install -e ".[server]" (or pip install "mini_paged_attn[server]")')
    return None


# The import names of pyproject.toml's server extra.
SERVER_EXTRA = ("starlette", "pydantic", "uvicorn", "prometheus_client")


def _server(app: object, host: str, port: int, banner: str):
    """A uvicorn server that prints ``banner`` once its socket is bound (not before, so the
    banner means clients can connect)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, flush=True)

    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                 access_log=False))


def _access_logger():
    """The logger of the one line per request: INFO, shown unless --log-level is ERROR or
    higher."""
    import logging

    access = logging.getLogger("mini_paged_attn.serve.access")
    if logging.getLogger().getEffectiveLevel() <= logging.WARNING:
        access.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    return access


def with_access_log(app, log):
    """``app`` (ASGI) logging one line per HTTP request when it ends: client, method, path,
    status and duration (a stream's whole length)."""
    import time

    async def logged(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def send_and_see_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_and_see_status)
        finally:
            client = scope.get("client")
            log.info("%s %s %s %s %.1f ms", f"{client[0]}:{client[1]}" if client else "-",
                     scope["method"], scope["path"], status or "-",
                     1000 * (time.perf_counter() - start))

    return logged


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)
