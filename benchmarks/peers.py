"""batchkit's dynamic batcher against peer batchers: same function, same load, one process each.

Rows (each (row, workload, phase) runs in its own subprocess and sends one JSON line back):
  - batchkit DynamicBatcher (a sync batch function runs in its worker thread);
  - batchkit AsyncBatcher, where this batchkit has it (a sync function on the loop, or
    ``offload=True`` in a worker thread);
  - a bare asyncio batcher written below (~40 lines: a queue and one collector task);
  - Ray Serve ``@serve.batch`` (on a plain async function, no Serve started);
  - BentoML 1.4's adaptive batching dispatcher (``CorkDispatcher``);
  - mixedbread ``batched`` 0.1.5 (``batched.aio.dynamically``).

Workloads: a torch MLP 1024-4096-1024 (float32, inference mode, all the machine's cores), 64
concurrent asyncio callers, max batch 32, max wait 5 ms:
  - ``mlp-loop``: the peers call the model inside their batch function, on the event loop
    (blocking it, as their users do); batchkit's DynamicBatcher runs it in its worker thread,
    AsyncBatcher on the loop;
  - ``mlp-thread``: the peers' batch function awaits ``asyncio.to_thread(model, xs)``;
    DynamicBatcher as above, AsyncBatcher with ``offload=True``;
  - ``noop``: a batch function that returns its inputs (per-request overhead).
Closed loop: requests/s, median of --repeat runs (interleaved over the rows). Open loop
(the two MLP workloads): Poisson arrivals at 70% of the best closed-loop rate of that workload,
the same rate for every row; p50/p99 latency from each request's scheduled arrival, medians.
Every run checks outputs: each caller's first result (the first 64 in open loop) against the
unbatched model output for its input (for ``noop``: the input object itself).

The peers live in their own virtual environment, never in batchkit's dependencies:
  .venv/bin/python benchmarks/peers.py --setup     # creates bench-out/peers-venv (CPU torch,
                                                   # batchkit from this checkout, the peers)
  .venv/bin/python benchmarks/peers.py             # the full comparison, children in that venv
  .venv/bin/python benchmarks/peers.py --quick     # a smoke run (short windows, one repeat)
A row whose peer is missing or fails prints why and the run goes on. ``--json PATH`` writes every
row's closed-loop rates and open-loop latencies with the settings and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

# The harness sits beside this file: on the path when it runs as a script, not when a test loads it by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import _harness as harness

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / "bench-out" / "peers-venv"
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PEER_REQUIREMENTS = ["ray[serve]>=2.60", "bentoml>=1.4,<1.5", "batched==0.1.5"]

MAX_BATCH, MAX_WAIT_MS, CALLERS, DIM, HIDDEN = 32, 5.0, 64, 1024, 4096
OPEN_LOAD = 0.7
UNBOUNDED = 1 << 20  # batchkit's queue bound, as good as none: the peers' queues have none
WORKLOADS = ("mlp-loop", "mlp-thread", "noop")
ROWS = ("batchkit", "batchkit-async", "batchkit-decorator", "bare", "ray", "bentoml", "batched")
LABELS = {
    "batchkit": "batchkit DynamicBatcher",
    "batchkit-async": "batchkit AsyncBatcher",
    "batchkit-decorator": "batchkit @batched async def",
    "bare": "bare asyncio batcher",
    "ray": "Ray Serve serve.batch",
    "bentoml": "BentoML CorkDispatcher",
    "batched": "mixedbread batched",
}
BATCHKIT_ROWS = ("batchkit", "batchkit-async", "batchkit-decorator")

BatchFn = Callable[[list[Any]], Any]  # a list in, a list (or an awaitable of one) out
Submit = Callable[[Any], Awaitable[Any]]


class Unavailable(Exception):
    """This row cannot run here (a peer not installed, a batchkit without AsyncBatcher)."""


# --------------------------------------------------------------------------- the bare batcher


class BareBatcher:
    """The smallest useful asyncio batcher: callers put (item, future) on a queue; one collector
    task takes up to ``max_batch`` items within ``max_wait_s`` of the first, calls ``fn`` and sets
    the futures. No bound, no deadlines, no cancellation handling, one event loop only."""

    def __init__(self, fn: BatchFn, max_batch: int, max_wait_s: float) -> None:
        self.fn, self.max_batch, self.max_wait_s = fn, max_batch, max_wait_s
        self.queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue()
        self.full = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def submit(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.task is None:
            self.task = loop.create_task(self._collect())
        fut: asyncio.Future[Any] = loop.create_future()
        self.queue.put_nowait((x, fut))
        if self.queue.qsize() >= self.max_batch:
            self.full.set()
        return await fut

    async def _collect(self) -> None:
        while True:
            batch = [await self.queue.get()]
            if self.queue.qsize() < self.max_batch - 1:
                self.full.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.full.wait(), self.max_wait_s)
            while len(batch) < self.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                out = self.fn([x for x, _ in batch])
                if inspect.isawaitable(out):
                    out = await out
            except Exception as exc:
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            for (_, fut), y in zip(batch, out, strict=True):
                if not fut.done():
                    fut.set_result(y)

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()


# --------------------------------------------------------------------------- workloads


class Workload:
    """The batch function of one workload, its inputs (one per caller) and the expected outputs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches = 0
        self.items = 0
        self.model_s: list[float] = []  # wall time of each model call, in whichever thread ran it
        if name == "noop":
            self.inputs: list[Any] = [object() for _ in range(CALLERS)]
            self.expected: list[Any] = self.inputs
            self.model: Callable[[list[Any]], list[Any]] = self._noop
            return
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        torch.manual_seed(0)
        self.torch = torch
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM)
        ).eval()
        self.inputs = list(torch.randn(CALLERS, DIM).unbind(0))
        with torch.inference_mode():
            self.expected = [self.net(x.unsqueeze(0))[0] for x in self.inputs]
        self.model = self._mlp

    def _noop(self, xs: list[Any]) -> list[Any]:
        self.batches += 1
        self.items += len(xs)
        return xs

    def _mlp(self, xs: list[Any]) -> list[Any]:
        self.batches += 1
        self.items += len(xs)
        t0 = time.perf_counter()
        with self.torch.inference_mode():  # thread-local: entered in whichever thread runs the model
            out = list(self.net(self.torch.stack(xs)).unbind(0))
        self.model_s.append(time.perf_counter() - t0)
        return out

    def on_loop(self) -> BatchFn:
        """The model called inside the batch function, on the event loop."""
        return self.model

    def in_thread(self) -> Callable[[list[Any]], Awaitable[list[Any]]]:
        """The batch function hands the model to a thread and awaits it."""
        model = self.model

        async def fn(xs: list[Any]) -> list[Any]:
            return await asyncio.to_thread(model, xs)

        return fn

    def peer_fn(self) -> BatchFn:
        return self.in_thread() if self.name == "mlp-thread" else self.on_loop()

    def matches(self, k: int, y: Any) -> bool:
        if self.name == "noop":
            return y is self.expected[k]
        return bool(self.torch.allclose(y, self.expected[k], rtol=1e-4, atol=1e-5))


def _as_async(fn: BatchFn) -> Callable[[list[Any]], Awaitable[list[Any]]]:
    if inspect.iscoroutinefunction(fn):
        return fn

    async def wrapped(xs: list[Any]) -> list[Any]:
        return fn(xs)  # type: ignore[no-any-return]

    return wrapped


# --------------------------------------------------------------------------- one adapter per row


async def make_row(row: str, w: Workload) -> tuple[Submit, Callable[[], Awaitable[None]]]:
    """Build the row's batcher around the workload's function: (submit, aclose)."""
    wait_s = MAX_WAIT_MS / 1000
    if row in BATCHKIT_ROWS:
        import batchkit

        if row == "batchkit":
            b = batchkit.DynamicBatcher(w.model, max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS, max_queue=UNBOUNDED)
            return b.asubmit, b.aclose
        if row == "batchkit-decorator":
            # As users write it: the peers' async batch function under @batched, awaited from tasks.
            fn = _as_async(w.peer_fn())

            @batchkit.batched(max_batch=MAX_BATCH, max_wait_ms=MAX_WAIT_MS, max_queue=UNBOUNDED)
            async def predict(xs: list[Any]) -> list[Any]:
                return await fn(xs)

            return predict, predict.aclose
        if not hasattr(batchkit, "AsyncBatcher"):
            raise Unavailable(f"batchkit {batchkit.__version__} has no AsyncBatcher")
        ab = batchkit.AsyncBatcher(
            w.model,
            max_batch_size=MAX_BATCH,
            max_wait_ms=MAX_WAIT_MS,
            max_queue=UNBOUNDED,
            offload=w.name == "mlp-thread",
        )
        return ab.submit, ab.aclose
    fn = w.peer_fn()
    if row == "bare":
        bare = BareBatcher(fn, MAX_BATCH, wait_s)
        return bare.submit, bare.aclose
    if row == "ray":
        try:
            from ray import serve
        except ImportError as exc:
            raise Unavailable(f"ray[serve] not installed ({exc})") from None
        from ray.serve import batching as ray_batching

        # Outside a Serve replica the batch queue's constructor fails: it reads the replica's
        # max_ongoing_requests only to log a warning. Skip that warning; the batching is unchanged.
        ray_batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = _no_warning  # type: ignore[method-assign]
        afn = _as_async(fn)

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=wait_s)
        async def ray_fn(xs: list[Any]) -> list[Any]:
            return await afn(xs)

        async def ray_close() -> None:
            return None

        return ray_fn, ray_close
    if row == "bentoml":
        try:
            from bentoml._internal.marshal.dispatcher import CorkDispatcher  # type: ignore[import-not-found]
        except ImportError as exc:
            raise Unavailable(f"bentoml not installed ({exc})") from None
        afn = _as_async(fn)
        # BentoML takes a latency budget, not a wait: it learns the batch time from its first
        # batches and waits while that pays; the budget is its default (60 s), so it never sheds.
        dispatcher = CorkDispatcher(
            max_latency_in_ms=60_000, max_batch_size=MAX_BATCH, fallback=_bento_shed, get_batch_size=_one
        )
        bento_fn = dispatcher(afn)

        async def bento_close() -> None:
            dispatcher.shutdown()

        return bento_fn, bento_close
    if row == "batched":
        try:
            import batched  # type: ignore[import-not-found]
        except ImportError as exc:
            raise Unavailable(f"batched not installed ({exc})") from None
        afn = _as_async(fn)
        bfn = batched.aio.dynamically(afn, batch_size=MAX_BATCH, timeout_ms=MAX_WAIT_MS)
        return bfn, _noop_close
    raise ValueError(f"unknown row {row!r}; choose from {', '.join(ROWS)}")


async def _noop_close() -> None:
    return None


def _bento_shed() -> Any:
    raise RuntimeError("BentoML shed the request (its latency budget ran out)")


def _no_warning(self: Any) -> None:
    return None


def _one(x: Any) -> int:
    return 1


# --------------------------------------------------------------------------- load generators


async def closed_loop(submit: Submit, w: Workload, duration_s: float | None, requests: int | None) -> dict[str, Any]:
    """CALLERS tasks, each with one request in flight. Counts completions in the measured window
    (after a warm-up of a fifth of it), or runs ``requests`` requests in all and times them."""
    loop = asyncio.get_running_loop()
    mismatches = checked = 0
    done = 0
    warm = 0.0 if duration_s is None else min(1.0, duration_s / 5)
    t0 = loop.time()
    start, stop = t0 + warm, t0 + warm + (duration_s or 0.0)
    per = None if requests is None else max(1, requests // CALLERS)

    async def caller(k: int) -> None:
        nonlocal mismatches, checked, done
        first = True
        n = 0
        x = w.inputs[k]
        while (per is None and loop.time() < stop) or (per is not None and n < per):
            y = await submit(x)
            n += 1
            if first:
                first = False
                checked += 1
                mismatches += not w.matches(k, y)
            now = loop.time()
            if per is not None or start <= now <= stop:
                done += 1

    await asyncio.gather(*(caller(k) for k in range(CALLERS)))
    elapsed = (loop.time() - t0) if per is not None else (duration_s or 1.0)
    return {"rate": done / elapsed, "requests": done, "checked": checked, "mismatches": mismatches}


async def open_loop(submit: Submit, w: Workload, rate: float, duration_s: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate``: one task per request, started on schedule; latency counts from
    the scheduled arrival, so a loop that falls behind shows it."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    mismatches = checked = 0
    last = 0.0

    async def one(i: int, sched: float) -> None:
        nonlocal mismatches, checked
        k = i % CALLERS
        nonlocal last
        y = await submit(w.inputs[k])
        last = loop.time()
        lat.append(last - sched)
        if i < CALLERS:
            checked += 1
            mismatches += not w.matches(k, y)

    tasks = []
    last = t0 = loop.time()
    for i, at in enumerate(harness.poisson_arrivals(rate, duration_s, seed=7)):
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(i, t0 + at)))
    await asyncio.gather(*tasks)
    return {
        "rate": rate,
        "served": len(lat) / (last - t0),  # below the offered rate: the row could not keep up
        "requests": len(lat),
        "p50_ms": 1000 * harness.percentile(lat, 0.5),
        "p99_ms": 1000 * harness.percentile(lat, 0.99),
        "checked": checked,
        "mismatches": mismatches,
    }


def model_times(batches: int = 15) -> dict[str, Any]:
    """t_batch(MAX_BATCH) of the MLP, called in this process's main thread and in a second
    thread, interleaved: the ceiling of every row, and what the thread that runs it costs. A
    third series calls it in the main thread after 0.2 ms of Python work (about what a batcher
    does between two batches of 32): whether idle time between calls slows the next one."""
    from concurrent.futures import ThreadPoolExecutor

    w = Workload("mlp-loop")
    xs = [w.inputs[k % CALLERS] for k in range(MAX_BATCH)]
    main_s: list[float] = []
    thread_s: list[float] = []
    gap_s: list[float] = []

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def timed(out: list[float]) -> None:
        out.append(harness.timed(lambda: w.model(xs))[0])

    with ThreadPoolExecutor(1) as second:
        for _ in range(3):  # warm-up, in both threads
            w.model(xs)
            second.submit(w.model, xs).result()
        for _ in range(batches):
            w.model(xs)  # so that the next call follows one at once
            timed(main_s)
            busy(0.0002)
            timed(gap_s)
            second.submit(timed, thread_s).result()
    return {
        "main_ms": 1000 * harness.median(main_s),
        "thread_ms": 1000 * harness.median(thread_s),
        "gap_ms": 1000 * harness.median(gap_s),
    }


def measure(
    row: str,
    workload: str,
    phase: str = "closed",
    *,
    duration_s: float | None = 3.0,
    requests: int | None = None,
    rate: float | None = None,
) -> dict[str, Any]:
    """One measurement, in this process: build the row's batcher, drive it, close it.
    Returns a JSON-able dict; ``error`` says why a row could not run."""
    result: dict[str, Any] = {"row": row, "workload": workload, "phase": phase}
    try:
        w = Workload(workload)

        async def main() -> dict[str, Any]:
            submit, aclose = await make_row(row, w)
            try:
                if phase == "closed":
                    return await closed_loop(submit, w, None if requests else duration_s, requests)
                if rate is None or duration_s is None:
                    raise ValueError("open loop needs a rate and a duration")
                return await open_loop(submit, w, rate, duration_s)
            finally:
                await aclose()

        result.update(asyncio.run(main()))
        result["mean_batch"] = w.items / w.batches if w.batches else 0.0
        if w.model_s:
            result["model_ms"] = 1000 * harness.median(w.model_s)
    except Unavailable as exc:
        result["error"] = str(exc)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


# --------------------------------------------------------------------------- the parent


def venv_python(venv: Path = PEERS_VENV) -> Path:
    return venv / "bin" / "python"


def setup(venv: Path = PEERS_VENV) -> None:
    """Create the peers' venv: CPU torch first, batchkit from this checkout, then the peers."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install"]
    # A CPU wheel already known to pip (a local wheelhouse) is taken first; else the CPU index.
    local = subprocess.run([*pip, "--no-deps", "--no-index", f"torch=={TORCH_VERSION}"], check=False)
    if local.returncode == 0:
        subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    else:
        subprocess.run([*pip, f"torch=={TORCH_VERSION}", "--index-url", TORCH_CPU_INDEX], check=True)
    subprocess.run([*pip, "-e", str(ROOT)], check=True)
    if subprocess.run([*pip, *PEER_REQUIREMENTS], check=False).returncode == 0:  # resolved together
        return
    for req in PEER_REQUIREMENTS:  # one at a time: a peer that fails to install leaves the others
        if subprocess.run([*pip, req], check=False).returncode != 0:
            print(f"could not install {req}; its rows will say so", file=sys.stderr)


def run_child(python: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--child", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {out.returncode}: {tail[:160]}"}


def _median(vals: Sequence[float]) -> float:
    return harness.median(vals) if vals else float("nan")


def _fmt_rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _fmt_ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _ratio_line(what: str, mine: float | None, theirs: float | None, target: float, higher: bool) -> str:
    if mine is None or theirs is None or theirs == 0 or mine == 0:
        return f"- {what}: n/a"
    r = mine / theirs
    met = r >= target if higher else r <= target
    verdict = "met" if met else f"NOT met, by {abs(r - target) / target:.0%}"
    return f"- {what}: {r:.2f}x (target {'>=' if higher else '<='} {target:g}x): {verdict}"


def report(
    workload: str, rows: list[str], closed: dict[str, list[dict[str, Any]]], opened: dict[str, list[dict[str, Any]]]
) -> str:
    """One markdown table for a workload, then batchkit against the best peer."""
    has_open = workload != "noop"
    has_model = any("model_ms" in r for rs in closed.values() for r in rs)
    head = (
        "| row | closed req/s | mean batch |"
        + (" model ms/batch |" if has_model else "")
        + (" open p50 ms | open p99 ms |" if has_open else "")
        + " outputs |"
    )
    offered = [r["rate"] for rs in opened.values() for r in rs if "error" not in r]
    title = f"### {workload}" + (f" (open loop offered {offered[0]:,.0f} req/s)" if offered else "")
    lines = [title, "", head, "|" + " --- |" * (head.count("|") - 1)]
    rate: dict[str, float | None] = {}
    p99: dict[str, float | None] = {}
    for row in rows:
        ok = [r for r in closed[row] if "error" not in r]
        errs = [r["error"] for r in closed[row] + opened.get(row, []) if "error" in r]
        oks = [r for r in opened.get(row, []) if "error" not in r]
        rate[row] = _median([r["rate"] for r in ok]) if ok else None
        p50 = _median([r["p50_ms"] for r in oks]) if oks else None
        p99[row] = _median([r["p99_ms"] for r in oks]) if oks else None
        behind = [r for r in oks if r["served"] < 0.95 * r["rate"]]
        checked = sum(r["checked"] for r in ok + oks)
        bad = sum(r["mismatches"] for r in ok + oks)
        outputs = "—" if not checked else (f"{checked} checked, equal" if not bad else f"{bad}/{checked} WRONG")
        if errs and not ok:
            outputs = f"not run: {errs[0]}"
        elif errs:
            outputs += f"; {len(errs)} run(s) failed: {errs[0]}"
        mb = _median([r["mean_batch"] for r in ok]) if ok else None
        cells = [LABELS[row], _fmt_rate(rate[row]), "—" if mb is None else f"{mb:.1f}"]
        if has_model:
            cells.append(_fmt_ms(_median([r["model_ms"] for r in ok if "model_ms" in r]) if ok else None))
        if has_open:
            cells += [_fmt_ms(p50), _fmt_ms(p99[row])]
            if behind:
                served = _median([r["served"] for r in behind])
                cells[-1] += f" (fell behind in {len(behind)}/{len(oks)} runs: served {served:,.0f} req/s)"
        lines.append("| " + " | ".join([*cells, outputs]) + " |")
    peers = [r for r in rows if r not in BATCHKIT_ROWS and rate[r] is not None]
    best = max(peers, key=lambda r: rate[r] or 0.0, default=None)
    best_p99 = min((r for r in peers if p99.get(r) is not None), key=lambda r: p99[r] or 0.0, default=None)
    lines.append("")
    for mine in (r for r in rows if r in BATCHKIT_ROWS and rate[r] is not None):
        if workload == "noop":
            lines.append(
                _ratio_line(
                    f"{LABELS[mine]} / bare asyncio batcher, req/s",
                    rate[mine],
                    rate.get("bare"),
                    0.6 if mine == "batchkit-decorator" else 0.5,
                    True,
                )
            )
            continue
        if best is not None:
            lines.append(
                _ratio_line(f"{LABELS[mine]} / best peer ({LABELS[best]}), req/s", rate[mine], rate[best], 1.0, True)
            )
        if has_open and best_p99 is not None:
            lines.append(
                _ratio_line(
                    f"{LABELS[mine]} p99 / best peer's p99 ({LABELS[best_p99]})", p99[mine], p99[best_p99], 1.0, False
                )
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--setup", action="store_true", help="create bench-out/peers-venv and exit")
    ap.add_argument("--venv", default=str(PEERS_VENV), help="the peers' virtual environment (bench-out/peers-venv)")
    ap.add_argument("--repeat", "--repeats", type=int, default=3, help="interleaved runs of every row (default 3)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per closed-loop window")
    ap.add_argument("--open-duration", type=float, default=5.0, help="seconds of Poisson arrivals")
    ap.add_argument("--requests", type=int, default=None, help="closed loop: this many requests, not a window")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, short windows")
    ap.add_argument("--only", default=None, help=f"comma-separated rows, from {', '.join(ROWS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--python", default=None, help="interpreter for the children (default: the peers venv)")
    ap.add_argument("--child", nargs=3, metavar=("ROW", "WORKLOAD", "PHASE"), help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.setup:
        setup(Path(args.venv))
        return
    if args.quick:
        args.repeat, args.duration, args.open_duration = 1, 1.0, 1.5
    if args.child:
        row, workload, phase = args.child
        duration = args.open_duration if phase == "open" else args.duration
        if phase == "times":
            res = model_times()
        else:
            res = measure(row, workload, phase, duration_s=duration, requests=args.requests, rate=args.rate)
        print(json.dumps(res), flush=True)
        return

    if args.warmup:
        ap.error("peers.py warms up inside each child (its first batches); it takes no --warmup runs")
    record = harness.start(args)
    rows = list(ROWS) if not args.only else [r.strip() for r in args.only.split(",")]
    for r in rows:
        if r not in ROWS:
            ap.error(f"--only: unknown row {r!r}; choose from {', '.join(ROWS)}")
    workloads = [w.strip() for w in args.workloads.split(",")]
    venv = Path(args.venv)
    python = args.python or (str(venv_python(venv)) if venv_python(venv).exists() else sys.executable)
    if not venv_python(venv).exists() and args.python is None:
        print("note: no bench-out/peers-venv (run with --setup); peers will show as not installed")
    common = ["--duration", str(args.duration), "--open-duration", str(args.open_duration)]
    if args.requests:
        common += ["--requests", str(args.requests)]
    timeout = 120 + 4 * max(args.duration, args.open_duration)
    t_start = time.time()
    print(f"# batchkit vs peer batchers ({os.cpu_count()} cores; children: {python})")
    print(
        f"MLP {DIM}-{HIDDEN}-{DIM} float32, {CALLERS} asyncio callers, max batch {MAX_BATCH}, "
        f"max wait {MAX_WAIT_MS:g} ms; closed loop {args.duration:g} s windows, median of {args.repeat}; "
        f"open loop {args.open_duration:g} s at {OPEN_LOAD:.0%} of the workload's best closed-loop rate",
        flush=True,
    )
    if any(w.startswith("mlp") for w in workloads):
        tb = run_child(python, ["model", "mlp-loop", "times"], timeout)
        if "error" in tb:
            print(f"t_batch({MAX_BATCH}): not measured: {tb['error']}")
        else:
            for name in ("main_ms", "thread_ms", "gap_ms"):
                record.add(f"t_batch({MAX_BATCH}) {name}", tb[name], "ms")
            print(
                f"t_batch({MAX_BATCH}) of the MLP, median of 15 interleaved: {tb['main_ms']:.2f} ms in the main thread "
                f"(ceiling {MAX_BATCH / tb['main_ms'] * 1000:,.0f} req/s), {tb['thread_ms']:.2f} ms in a second "
                f"thread ({MAX_BATCH / tb['thread_ms'] * 1000:,.0f} req/s); {tb['gap_ms']:.2f} ms in the main thread "
                "after 0.2 ms of Python work",
                flush=True,
            )
    closed: dict[str, dict[str, list[dict[str, Any]]]] = {w: {r: [] for r in rows} for w in workloads}
    opened: dict[str, dict[str, list[dict[str, Any]]]] = {w: {r: [] for r in rows} for w in workloads}
    unavailable: set[tuple[str, str]] = set()
    for rep in range(args.repeat):  # interleaved: each repeat visits every row once
        for w in workloads:
            for r in rows:
                if (r, w) in unavailable:
                    continue
                res = run_child(python, [r, w, "closed", *common], timeout)
                closed[w][r].append(res)
                if (
                    "error" in res
                    and rep == 0
                    and ("not installed" in res["error"] or "no AsyncBatcher" in res["error"])
                ):
                    unavailable.add((r, w))
                print(
                    f"  closed {w:10s} {r:14s} {_fmt_rate(res.get('rate')):>9s} req/s {res.get('error', '')}",
                    flush=True,
                )
    for w in workloads:
        if w == "noop":
            continue
        rates = [res["rate"] for r in rows for res in closed[w][r] if "error" not in res]
        best = max(
            (
                _median([x["rate"] for x in closed[w][r] if "error" not in x])
                for r in rows
                if any("error" not in x for x in closed[w][r])
            ),
            default=None,
        )
        if not rates or best is None:
            continue
        rate = OPEN_LOAD * best
        for _ in range(args.repeat):
            for r in rows:
                if (r, w) in unavailable:
                    continue
                res = run_child(python, [r, w, "open", *common, "--rate", f"{rate:.3f}"], timeout)
                opened[w][r].append(res)
                p99 = _fmt_ms(res.get("p99_ms"))
                print(
                    f"  open   {w:10s} {r:14s} {rate:,.0f} req/s offered: p99 {p99} ms {res.get('error', '')}",
                    flush=True,
                )
    print()
    for w in workloads:
        print(report(w, rows, closed[w], opened[w]))
        print()
        for r in rows:
            ok = [x for x in closed[w][r] if "error" not in x]
            if ok:
                record.add("closed loop", [x["rate"] for x in ok], "req/s", workload=w, row=r)
            for key in ("p50_ms", "p99_ms"):
                values = [x[key] for x in opened[w][r] if key in x]
                if values:
                    record.add(f"open loop {key.removesuffix('_ms')}", values, "ms", workload=w, row=r)
    record.write()
    load1 = os.getloadavg()
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; {time.time() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
