"""``batchkit`` command line: ``batchkit demo``, ``plan``, ``bench`` and ``run`` (:mod:`batchkit.jobs`).

Every argument is checked before any work starts: ranges, finite numbers, readable input and
writable output paths, importable targets and the optional extras a command needs. A usage error
prints one line on stderr that names the argument and the fix, and exits with status 2. A target
(or model) that fails while running prints its one-line cause and exits with status 1;
``--traceback`` prints the full traceback as well. Every wait has a limit (``bench --timeout``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ._argtypes import (
    MAX_SECONDS,
    MAX_THREADS,
    MAX_WAIT_MS,
    UsageError,
    add_max_wait_ms,
    add_price_per_hour,
    add_progress,
    add_threads,
    import_from_cwd,
    one_line,
    wants_progress,
)
from ._argtypes import float_in as _float_in
from ._argtypes import int_in as _int_in
from ._cpu import allowed_cpus, configure_cpu_threads
from .demo.cli import add_demo_parser, run_demo
from .jobs.cli import add_run_parser, run_cli

__all__ = ["main"]

GIB = 1024**3

# Upper bounds: generous for real use, small enough that a typo cannot hang the machine or
# exhaust its memory. --help states each one (the limits several commands share are in _argtypes).
MAX_GIB = 16384.0  # device, weights and activation memory (16 TiB)
MAX_BLOCK_SIZE = 1024
MAX_SEQ_LEN = 1 << 20
MAX_BENCH_BATCH = 65536
MAX_CONCURRENCY = 10_000  # bench: one task each
MAX_RATE = 100_000.0
MAX_BURSTINESS = 1000.0
MAX_SLO_MS = 1e7
DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."
DEFAULT_MAX_TOKENS = 64


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return f"{text} (default: %(default)s)"


# ---------------------------------------------------------------------- argument types


def _batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: sorted, each size once."""
    one = _int_in(1, MAX_BENCH_BATCH)
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes such as 1,2,4,8, got {text!r}")
    return sorted({one(p) for p in parts})


def _config_file(text: str) -> tuple[str, dict[str, Any]]:
    from .kv.planner import read_hf_config

    try:
        return text, read_hf_config(text)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"no such file {text!r}: pass the path of a config.json") from None
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_writable(path: str, option: str) -> None:
    """Prove ``path`` can be written now, before a long run: open it (creating, then removing it
    if it did not exist), so that the run does not fail at its end."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"argument {option}: {path!r} is a folder: pass a file name")
    existed = p.exists()
    try:
        with p.open("ab"):
            pass
    except OSError as exc:
        raise UsageError(
            f"argument {option}: cannot write {path!r} ({exc.strerror or exc}): pick another path"
        ) from None
    if not existed:
        p.unlink()


def _require(module: str, what: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise UsageError(f"{what} needs {module}: pip install 'batchkit[{extra}]'") from None


def _load(spec: str, option: str) -> Callable[..., Any]:
    from .bench import load_callable

    import_from_cwd()
    try:
        return load_callable(spec)
    except ValueError as exc:
        raise UsageError(f"argument {option}: {exc}") from None


# ---------------------------------------------------------------------- demo


def _prepare_demo(args: argparse.Namespace) -> Callable[[], int]:
    _require("torch", "the demo", "torch")
    return lambda: run_demo(args)


# ---------------------------------------------------------------------- plan


def _prepare_plan(args: argparse.Namespace) -> Callable[[], int]:
    from .kv.planner import PRESETS, ModelShape, dtype_bytes_of, plan

    if args.config is not None:
        name, config = args.config
        option = "--config"
    else:
        name, config = args.preset, PRESETS[args.preset]
        option = "--preset"
    dtype_bytes = args.dtype_bytes
    if dtype_bytes is None:
        try:
            dtype_bytes = dtype_bytes_of(config.get("torch_dtype") or config.get("dtype") or "float16")
        except ValueError as exc:
            raise UsageError(f"argument {option}: {exc}".replace("pass dtype_bytes", "pass --dtype-bytes")) from None
    try:
        shape = ModelShape.from_hf_config(config, dtype_bytes=dtype_bytes)
    except ValueError as exc:
        raise UsageError(f"argument {option}: {exc}") from None
    if args.weights_gib is None and shape.num_params is None:
        raise UsageError(
            f"argument --weights-gib: {name} has no hidden_size to estimate the weights from: pass --weights-gib"
        )
    try:
        p = plan(
            shape,
            device_bytes=max(1, int(args.device_gib * GIB)),
            gpu_memory_utilization=args.gpu_memory_utilization,
            weight_bytes=None if args.weights_gib is None else int(args.weights_gib * GIB),
            activation_bytes=int(args.activation_gib * GIB),
            block_size=args.block_size,
            mean_seq_len=args.mean_len,
        )
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("no memory left"):
            msg += ": lower --weights-gib or --activation-gib, or raise --device-gib or --gpu-memory-utilization"
        elif "block_size" in msg:
            msg = msg.replace("use a smaller block_size", "lower --block-size")
        raise UsageError(msg) from None

    def run() -> int:
        print(
            f"{name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads x {shape.head_dim}, "
            f"{shape.dtype_bytes} bytes per value"
        )
        print(p.table())
        return 0

    return run


# ---------------------------------------------------------------------- bench


_URL_ONLY = ("model", "endpoint", "prompt", "max_tokens", "slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms")
_TARGET_ONLY = {"make_item": "", "plot": "", "sla_ms": ": use --slo-e2e-ms", "price_per_hour": "", "threads": ""}


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _prepare_bench(args: argparse.Namespace) -> Callable[[], int]:
    if args.burstiness is not None and args.rate is None:
        raise UsageError("argument --burstiness: shapes open-loop arrivals: pass --rate too")
    if args.url is not None:
        return _prepare_bench_url(args)
    given = [dest for dest in _URL_ONLY if getattr(args, dest) is not None]
    if given:
        raise UsageError(f"argument {_option(given[0])}: applies to --url only: pass --url, or drop it")
    if args.target is None:
        args.target = "demo"
    return _prepare_bench_target(args)


def _prepare_bench_url(args: argparse.Namespace) -> Callable[[], int]:
    from urllib.parse import urlsplit

    if args.target is not None:
        raise UsageError(
            f"argument --url: not allowed with the target {args.target!r}: load-test a server or a function, not both"
        )
    for dest, hint in _TARGET_ONLY.items():
        if getattr(args, dest) is not None:
            raise UsageError(f"argument {_option(dest)}: applies to a target, not to --url{hint}")
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise UsageError(f"argument --url: expected http://HOST:PORT (the server's base URL), got {args.url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise UsageError(f"argument --url: the port of {args.url!r} is not in 0..65535") from None
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("argument --prompt: is empty: pass some text")
    try:
        __import__("httpx")
    except ImportError:
        raise UsageError("argument --url needs httpx: pip install httpx") from None
    if args.json is not None:
        _check_writable(args.json, "--json")
    from .serve.loadtest import run_load_test

    args.target = args.url  # a failure reads "batchkit bench: <url> failed: ..."
    concurrency = None if args.rate is not None else (args.concurrency or 64)

    def run() -> int:
        report = run_load_test(
            args.url,
            model=args.model,
            endpoint=args.endpoint or "chat",
            prompt=args.prompt or DEFAULT_PROMPT,
            max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS,
            concurrency=concurrency,
            rate=args.rate,
            burstiness=args.burstiness or 1.0,
            duration_s=args.duration,
            timeout_s=args.timeout,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            slo_e2e_ms=args.slo_e2e_ms,
        )
        print(report.table())
        if args.json is not None:
            report.to_json(args.json)
            print(f"wrote {args.json}")
        return 0

    return run


def _default_threads() -> int:
    """One less than the CPUs this process may use (at least 1): the callers' event loop keeps
    a core, so that the target's threads do not fight it for one."""
    return max(1, allowed_cpus() - 1)


def _prepare_bench_target(args: argparse.Namespace) -> Callable[[], int]:
    from . import bench

    # Cheap checks first: a bad output path must not wait for a model to load.
    if args.plot is not None:
        _require("matplotlib", "argument --plot", "plot")
        _check_writable(args.plot, "--plot")
    if args.json is not None:
        _check_writable(args.json, "--json")
    make_item: Callable[[int], Any] | None = None
    if args.make_item is not None:
        make_item = _load(args.make_item, "--make-item")
    threads = args.threads if args.threads is not None else _default_threads()
    if args.target == "demo":
        torch = _require("torch", "argument target: 'demo' (the built-in MLP)", "torch")
        from .demo import mlp as mlp_demo

        model = mlp_demo.make_mlp(threads=threads)
        fn: Callable[..., Any] = mlp_demo.batch_fn_for(model)
        if make_item is None:
            gen = torch.Generator().manual_seed(0)

            def make_item(i: int) -> object:
                return torch.randn(1024, generator=gen)

    else:
        fn = _load(args.target, "target")
    if make_item is None:

        def make_item(i: int) -> object:
            return i

    concurrency = None if args.rate is not None else (args.concurrency or 64)
    item_fn = make_item

    progress = wants_progress(args.progress)

    def run() -> int:
        load = f"open loop, Poisson {args.rate:g}/s" if args.rate is not None else f"closed loop, {concurrency} callers"
        print(
            f"{args.target}: {load}, max_wait_ms={args.max_wait_ms:g}, {args.duration:g} s per point, "
            f"--threads {threads}",
            flush=True,
        )
        report = bench.sweep(
            fn,
            item_fn,
            args.batch_sizes,
            max_wait_ms=args.max_wait_ms,
            concurrency=concurrency,
            rate=args.rate,
            duration_s=args.duration,
            timeout_s=args.timeout,
            sla_ms=args.sla_ms,
            price_per_hour=args.price_per_hour,
            tokens_per_item=args.tokens_per_item,
            progress=progress,
            threads=threads,
        )
        print(report.table())
        if args.json is not None:
            report.to_json(args.json)
            print(f"wrote {args.json}")
        if args.plot is not None:
            report.plot(args.plot)
            print(f"wrote {args.plot}")
        return 0

    return run


# ---------------------------------------------------------------------- the parser


def _installed_version() -> str:
    """The installed distribution's version (``unknown`` for a source tree on ``sys.path`` that
    was never installed)."""
    try:
        return importlib.metadata.version("batchkit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--traceback", action="store_true", help="on a failure (exit status 1), print the full traceback too"
    )
    parser = _Parser(
        prog="batchkit",
        description="Batching for any model callable.",
        epilog="exit status: 0 done, 1 the target or model failed (one-line cause; --traceback for more), "
        "2 a usage error (one line naming the argument and the fix), 130 interrupted (Ctrl-C), "
        "143 terminated by SIGTERM (batchkit run; rerun it to resume)",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"batchkit {_installed_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,plan,bench,run,serve}")

    demo = add_demo_parser(sub, parents=[common], formatter_class=_HelpFormatter)
    demo.set_defaults(prepare=_prepare_demo)

    from .kv.planner import PRESETS

    pl = sub.add_parser(
        "plan",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="print the KV-cache memory budget for a model on a device",
        description="How many KV-cache blocks fit on a device after the weights and the activation "
        "peak, and how many sequences of a mean length they hold.",
    )
    src = pl.add_mutually_exclusive_group()
    src.add_argument(
        "--config",
        type=_config_file,
        metavar="PATH",
        help="a Hugging Face config.json (needs num_hidden_layers, num_attention_heads and hidden_size "
        "or head_dim); default: --preset",
    )
    src.add_argument("--preset", choices=list(PRESETS), default="llama-2-7b", help="a built-in model config")
    pl.add_argument(
        "--dtype-bytes",
        type=int,
        choices=[1, 2, 4, 8],
        default=None,
        help="bytes per weight and KV value (1 fp8/int8, 2 fp16/bf16, 4 fp32); default: from the config's torch_dtype",
    )
    pl.add_argument(
        "--device-gib",
        metavar="GIB",
        type=_float_in(0, MAX_GIB, lo_open=True),
        default=80.0,
        help=f"device memory in GiB, in (0, {MAX_GIB:g}]",
    )
    pl.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        type=_float_in(0, 1, lo_open=True),
        default=0.9,
        help="share of device memory batchkit may plan with, in (0, 1]",
    )
    pl.add_argument(
        "--weights-gib",
        metavar="GIB",
        type=_float_in(0, MAX_GIB),
        default=None,
        help=f"weights in GiB, in [0, {MAX_GIB:g}]; default: estimated from the config's parameter count",
    )
    pl.add_argument(
        "--activation-gib",
        metavar="GIB",
        type=_float_in(0, MAX_GIB),
        default=2.0,
        help=f"activation peak in GiB, in [0, {MAX_GIB:g}]",
    )
    pl.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=_int_in(1, MAX_BLOCK_SIZE),
        default=16,
        help=f"tokens per KV block, 1..{MAX_BLOCK_SIZE}",
    )
    pl.add_argument(
        "--mean-len",
        metavar="TOKENS",
        type=_int_in(1, MAX_SEQ_LEN),
        default=1024,
        help=f"mean sequence length in tokens (prompt + output), 1..{MAX_SEQ_LEN:,}",
    )
    pl.set_defaults(prepare=_prepare_plan)

    be = sub.add_parser(
        "bench",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="load-test a batch function and find B_opt under a P99 SLA, or load-test a server (--url)",
        description="Serve a batch function through a DynamicBatcher at each batch size, measure throughput "
        "and latency, and recommend B_opt = min(B_knee, B_SLA) and QPS_max = mean batch at B_opt / "
        "t_batch(B_opt). A module:function target is imported from the current folder first. "
        "With --url instead, load-test a running OpenAI-compatible server (streamed chat or text "
        "completions) closed-loop (--concurrency) or open-loop (--rate, --burstiness).",
    )
    be.add_argument(
        "target",
        nargs="?",
        default=None,
        help="module:function, a batch function fn(list) -> list; 'demo' is the built-in CPU MLP (needs torch); "
        "default: demo, or none with --url",
    )
    be.add_argument(
        "--url",
        metavar="URL",
        default=None,
        help="load-test a running OpenAI-compatible server instead of a target: its base URL, "
        "http://HOST:PORT (needs httpx); streams --endpoint and reports throughput, TTFT / TPOT / "
        "end-to-end p50/p99 and goodput; default: bench the target",
    )
    be.add_argument(
        "--model",
        metavar="NAME",
        default=None,
        help="with --url: the model to request; default: the first one GET /v1/models names",
    )
    be.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default=None,
        help="with --url: stream /v1/chat/completions or /v1/completions; default: chat",
    )
    be.add_argument(
        "--prompt",
        metavar="TEXT",
        default=None,
        help=f"with --url: the prompt (the user message for chat) of every request; default: {DEFAULT_PROMPT!r}",
    )
    be.add_argument(
        "--max-tokens",
        metavar="N",
        type=_int_in(1, MAX_SEQ_LEN),
        default=None,
        help=f"with --url: max_tokens of every request, 1..{MAX_SEQ_LEN:,}; default: {DEFAULT_MAX_TOKENS}",
    )
    be.add_argument(
        "--burstiness",
        metavar="K",
        type=_float_in(0, MAX_BURSTINESS, lo_open=True),
        default=None,
        help=f"with --rate: the shape of gamma-distributed gaps between arrivals, in (0, {MAX_BURSTINESS:g}]: "
        "1 is Poisson, below 1 burstier, above 1 more regular; default: 1",
    )
    for name, what in (("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "end-to-end")):
        be.add_argument(
            f"--slo-{name}-ms",
            metavar="MS",
            type=_float_in(0, MAX_SLO_MS, lo_open=True),
            default=None,
            help=f"with --url: an SLO on {what} in ms, in (0, {MAX_SLO_MS:g}]; goodput is the share of "
            "requests within every SLO given; default: none",
        )
    be.add_argument(
        "--make-item",
        metavar="MODULE:FUNCTION",
        help="fn(i) -> the input of request i; default: i for a module:function target, a random "
        "1024-float tensor for demo",
    )
    be.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default="1,2,4,8,16,32,64",
        metavar="B1,B2,...",
        help=f"max batch sizes to measure, each 1..{MAX_BENCH_BATCH:,} (duplicates are measured once)",
    )
    add_max_wait_ms(be, default=5.0, help=f"the batcher's max_wait_ms, in [0, {MAX_WAIT_MS:g}]")
    load = be.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        metavar="N",
        type=_int_in(1, MAX_CONCURRENCY),
        default=None,
        help=f"closed loop: callers each sending their next request when the last returns, "
        f"1..{MAX_CONCURRENCY:,}; default: 64 unless --rate is given",
    )
    load.add_argument(
        "--rate",
        metavar="PER_S",
        type=_float_in(0, MAX_RATE, lo_open=True),
        default=None,
        help=f"open loop instead: Poisson arrivals per second, in (0, {MAX_RATE:g}]; arrivals finding "
        f"100,000 requests waiting are refused and counted; default: closed loop",
    )
    be.add_argument(
        "--duration",
        metavar="S",
        type=_float_in(0, MAX_SECONDS, lo_open=True),
        default=2.0,
        help=f"seconds per batch size (with --url: seconds of sending requests; those running then finish), "
        f"in (0, {MAX_SECONDS:g}]",
    )
    be.add_argument(
        "--timeout",
        metavar="S",
        type=_float_in(0, MAX_SECONDS, lo_open=True),
        default=60.0,
        help=f"seconds one call of the target may run before the bench stops with an error (with --url: "
        f"one request may take before it counts as failed), in (0, {MAX_SECONDS:g}]",
    )
    be.add_argument(
        "--sla-ms",
        metavar="MS",
        type=_float_in(0, 1e7, lo_open=True),
        default=None,
        help="P99 latency SLA in ms, in (0, 1e7]; default: none (every size qualifies)",
    )
    add_price_per_hour(
        be,
        metavar="PRICE",
        help="accelerator price per hour, in [0, 1e6], for the cost per token; default: no cost line",
    )
    be.add_argument(
        "--tokens-per-item",
        metavar="N",
        type=_float_in(0, 1e9, lo_open=True),
        default=1.0,
        help="tokens each request stands for, in the cost per token, in (0, 1e9]",
    )
    add_threads(
        be,
        help=f"threads of the target's BLAS and OpenMP pools and torch's intra-op threads, 1..{MAX_THREADS}; the "
        "report names the pools it ran with; default: one less than the CPUs this process may use, at least 1 "
        "(the callers keep a core)",
    )
    be.add_argument(
        "--json",
        metavar="PATH",
        help="write the report as JSON (checked writable before the run); default: not written",
    )
    be.add_argument(
        "--plot",
        metavar="PATH",
        help="write throughput and P99 against batch size as a PNG (needs matplotlib: "
        "pip install 'batchkit[plot]'; checked before the run); default: not drawn",
    )
    add_progress(be, help="a progress bar on stderr; default: when stderr is a terminal")
    be.set_defaults(prepare=_prepare_bench)

    # batchkit.jobs validates and reports for itself (the same exit statuses and one-line errors).
    add_run_parser(sub, parents=[common], formatter_class=_HelpFormatter).set_defaults(prepare=_prepare_run)

    from .serve.cli import add_serve_parser

    # batchkit.serve imports its web framework only when the command runs.
    add_serve_parser(sub, parents=[common], formatter_class=_HelpFormatter).set_defaults(prepare=_prepare_serve)
    return parser


def _prepare_serve(args: argparse.Namespace) -> Callable[[], int]:
    from .serve.cli import run_serve

    return lambda: run_serve(args)


def _prepare_run(args: argparse.Namespace) -> Callable[[], int]:
    return lambda: run_cli(args)


# The commands that run torch models in this process: their CPU threads are sized to the CPUs the
# process may use and sleep when idle (batchkit._cpu says why), unless the environment chose.
_RUNS_TORCH = frozenset({"demo", "run", "serve"})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 done, 1 the target failed, 2 usage error)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else 2
    prog = f"batchkit {args.command}"
    if args.command in _RUNS_TORCH:
        # Before anything imports torch: its OpenMP runtime reads the wait policy once, at load.
        args.cpu_threads = configure_cpu_threads(getattr(args, "threads", None))
        if args.command == "demo":
            args.threads = args.cpu_threads.threads
    try:
        try:
            run = args.prepare(args)
        except UsageError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        return int(run())
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the target failed: one line, the traceback on request
        from ._errors import BatchTimeout

        if args.traceback:
            traceback.print_exc()
        if isinstance(exc, BatchTimeout):
            cause = (
                f"the target ran longer than --timeout {args.timeout:g} s in one call: "
                "raise --timeout if it is only slow"
            )
        elif args.command == "bench":
            cause = f"{args.target} failed: {one_line(exc)}"
        else:
            cause = f"failed: {one_line(exc)}"
        hint = "" if args.traceback else " (--traceback shows where)"
        print(f"{prog}: {cause}{hint}", file=sys.stderr)
        return 1
