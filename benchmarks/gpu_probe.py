"""First contact of ``batchkit._cuda`` with a GPU: every check a new device needs, one line each.

Run from the repository root (``PYTHONPATH=src``), normally through ``benchmarks/gpu_check.sh``::

    python3 benchmarks/gpu_probe.py [--json results.json] [--budget 200]

Each check runs in its own Python process with its own timeout, so that a kernel fault (which
poisons the CUDA context), a hang or a crash fails that check alone and the next one still runs.
Each prints one line: ``OK``, ``FAIL`` or ``INFO``, the check's name, its seconds and what it
found. The exit status is 0 when no check failed (or when there is no CUDA device to probe).
Nothing is downloaded. ``--json`` writes each check's status, seconds and message as the
harness's figures, with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import _harness as harness

CHECKS: dict[str, tuple[str, float, Callable[[], str]]] = {}


def check(name: str, title: str, timeout: float = 60.0) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register a check: a function that returns a one-line finding or raises."""

    def deco(fn: Callable[[], str]) -> Callable[[], str]:
        CHECKS[name] = (title, timeout, fn)
        return fn

    return deco


# --------------------------------------------------------------------------- helpers (child side)


def _torch() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view(torch.uint8)


def _same(a: Any, b: Any, what: str) -> None:
    import torch

    if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
        raise AssertionError(f"{what}: kernel and torch reference differ")


@contextlib.contextmanager
def _checks_off() -> Iterator[None]:
    """Index checks off, as in a tuned decode loop or a CUDA-graph capture."""
    from batchkit import _cuda

    saved = _cuda.CHECK_INDICES
    _cuda.CHECK_INDICES = False
    try:
        yield
    finally:
        _cuda.CHECK_INDICES = saved


# --------------------------------------------------------------------------- checks


@check("environment", "environment: python, torch, CuPy packages, CUDA versions", 60)
def _environment() -> str:
    import importlib.metadata as md
    import platform

    parts = [f"python {platform.python_version()}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__} (cuda {torch.version.cuda})")
        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}")
        else:
            parts.append("no CUDA device visible to torch")
    except Exception as exc:
        parts.append(f"torch unusable: {exc}")
    dists = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in md.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("cupy", "cuda-", "nvidia-cuda"))
    )
    parts.append(f"packages {dists}")
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc

        rt = cupy.cuda.runtime
        parts.append(f"cupy {cupy.__version__} runtime {rt.runtimeGetVersion()} nvrtc {nvrtc.getVersion()}")
        parts.append(f"driver {rt.driverGetVersion()}")
    except Exception as exc:
        parts.append(f"cupy unusable: {type(exc).__name__}: {exc}")
    if len([d for d in dists if d.lower().startswith("cupy")]) > 1:
        parts.append("WARNING: more than one CuPy package installed")
    return "INFO " + "; ".join(parts)


@check("headers", "CuPy finds the CUDA headers it compiles with (CuPy 14 needs them)", 60)
def _headers() -> str:
    from pathlib import Path

    import cupy._core.core as core

    from batchkit import _cuda

    options = core.assemble_cupy_compiler_options(_cuda.COMPILE_OPTIONS)
    dirs = [o[2:] for o in options if o.startswith("-I")]
    found = [d for d in dirs if (Path(d) / "cuda_runtime.h").is_file()]
    if not found:
        raise RuntimeError(f"no cuda_runtime.h under {dirs}")
    return f"cuda_runtime.h in {found[0]}"


@check("compile", "NVRTC compile + module load of every kernel instantiation on device 0", 120)
def _compile() -> str:
    _torch()
    from batchkit import _cuda

    t0 = time.perf_counter()
    for name in _cuda.kernel_names():
        _cuda._function(0, name)
    took = time.perf_counter() - t0
    ok = _cuda.available(0)
    if not ok:
        raise RuntimeError("available(0) is False although every function loaded")
    return f"{len(_cuda.kernel_names())} kernels loaded in {took:.1f}s; available() True"


def _rand(torch: Any, n: int, dtype: Any) -> Any:
    x = torch.randn(n, device="cuda")
    return (x * 50).to(dtype) if dtype == torch.uint8 else x.to(dtype)


def _scatter_case(torch: Any, dtype: Any, heads: int, dim: int, offset: int, slot_dtype: Any) -> bool:
    from batchkit import _cuda
    from batchkit.kv import ops

    n, blocks, bs = 37, 16, 8
    row = heads * dim
    k = _rand(torch, n * row + offset, dtype)[offset:].view(n, heads, dim)
    v = _rand(torch, n * row, dtype).view(n, heads, dim)
    kc = torch.zeros(blocks, bs, heads, dim, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.randperm(blocks * bs, device="cuda")[:n].to(slot_dtype)
    slots[::4] = -1
    vec = bool(_cuda.plan_scatter(kc, vc, k, v, slots).vec)
    if offset and (offset * k.element_size()) % 16 and vec:
        raise AssertionError(f"misaligned base ({offset} elements) was planned on the vector path")
    _cuda.scatter_kv(kc, vc, k, v, slots)
    ops.scatter(rk, rv, k, v, slots)
    torch.cuda.synchronize()
    _same(kc, rk, f"scatter K {dtype} {heads}x{dim} offset {offset}")
    _same(vc, rv, f"scatter V {dtype} {heads}x{dim} offset {offset}")
    return vec


@check("scatter", "scatter_kv bit-exact: 1/2/4/8-byte dtypes, int32/int64 slots, vector and scalar paths", 90)
def _scatter() -> str:
    torch = _torch()
    # One dtype per element width: the kernels are instantiated on the width, not the type.
    dtypes = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64]
    vec = scalar = 0
    for dtype in dtypes:
        for heads, dim in ((8, 128), (1, 3), (2, 80)):
            for offset in (0, 1, 8):  # 1 element: a base pointer off 16 bytes -> scalar path
                for slot_dtype in (torch.int32, torch.int64):
                    used = _scatter_case(torch, dtype, heads, dim, offset, slot_dtype)
                    vec += used
                    scalar += not used
    if not vec or not scalar:
        raise AssertionError(f"expected both paths, got {vec} vector and {scalar} scalar launches")
    return f"{vec} vector + {scalar} scalar launches equal the reference"


@check("gather", "gather_kv bit-exact (incl. zero-length sequences, empty table, wrong total refused)", 90)
def _gather() -> str:
    torch = _torch()
    from batchkit import _cuda
    from batchkit.kv import ops

    n = 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for heads, dim in ((8, 128), (1, 5)):
            cache = torch.randn(64, 16, heads, dim, device="cuda").to(dtype)
            tables = torch.stack([torch.randperm(63, device="cuda")[:8] + 1 for _ in range(5)]).int()
            lens = torch.tensor([1, 16, 0, 128, 77], device="cuda")
            _same(_cuda.gather_kv(cache, tables, lens), ops.gather(cache, tables, lens), f"gather {dtype}")
            got = _cuda.gather_kv(cache, tables, lens, total_tokens=222)
            _same(got, ops.gather(cache, tables, lens), f"gather {dtype} with total_tokens")
            n += 2
    no_blocks = torch.zeros((3, 0), dtype=torch.int32, device="cuda")
    empty = _cuda.gather_kv(cache, no_blocks, torch.zeros(3, dtype=torch.long, device="cuda"))
    if empty.shape[0] != 0:
        raise AssertionError("empty table did not give an empty output")
    try:
        _cuda.gather_kv(cache, tables, lens, total_tokens=1)
    except ValueError:
        pass
    else:
        raise AssertionError("a total_tokens below sum(seq_lens) was not refused with CHECK_INDICES on")
    torch.cuda.synchronize()
    return f"{n} gathers equal the reference; empty table fine; wrong total_tokens refused"


@check("gather_guard", "gather_kv with checks off: bad block ids, negative length, short output stay in bounds", 60)
def _gather_guard() -> str:
    torch = _torch()
    from batchkit import _cuda

    cache = torch.randn(1024, 16, 8, 128, device="cuda").half()
    flat = cache.view(-1, 8, 128)
    with _checks_off():
        tables = torch.tensor([[1, -1], [10**6, 2], [3, 5]], dtype=torch.int32, device="cuda")
        out = _cuda.gather_kv(cache, tables, torch.tensor([32, 32, 20], device="cuda"), total_tokens=84)
        torch.cuda.synchronize()
        if not (torch.equal(out[0:16], flat[16:32]) and not out[16:48].any() and torch.equal(out[48:64], flat[32:48])):
            raise AssertionError("rows with bad block ids are not zero, or good rows are wrong")
        out = _cuda.gather_kv(cache, tables, torch.tensor([-5, 40, 3], device="cuda"), total_tokens=38)
        torch.cuda.synchronize()
        # The defect of issue 9 item 7: 16384 tokens into a one-row output.
        big = torch.arange(1024, dtype=torch.int32, device="cuda").view(1, 1024)
        one = _cuda.gather_kv(cache, big, torch.tensor([16384], device="cuda"), total_tokens=1)
        torch.cuda.synchronize()
        if not torch.equal(one[0], flat[0]):
            raise AssertionError("the one-row output is not token 0")
    return "zero-filled bad rows, no fault, a one-row output of a 16384-token sequence is one row"


@check("copy_blocks", "copy_blocks bit-exact (independent pairs, all dtypes)", 60)
def _copy() -> str:
    torch = _torch()
    from batchkit import _cuda
    from batchkit.kv import ops

    for dtype in (torch.float16, torch.float32, torch.float64):
        caches = torch.randn(6, 64, 16 * 8 * 128, device="cuda").to(dtype)
        ref = caches.clone()
        pairs = [(1, 2), (3, 40), (63, 0)]
        _cuda.copy_blocks(caches, pairs)
        ops.copy_blocks([ref[i] for i in range(6)], pairs)
        torch.cuda.synchronize()
        _same(caches, ref, f"copy_blocks {dtype}")
    odd = torch.randn(2, 16, 3 * 5, device="cuda").half()  # 30-byte blocks: scalar path
    ref = odd.clone()
    _cuda.copy_blocks(odd, [(1, 2), (5, 9)])
    ops.copy_blocks([ref[0], ref[1]], [(1, 2), (5, 9)])
    torch.cuda.synchronize()
    _same(odd, ref, "copy_blocks scalar path")
    return "vector and scalar copies equal the reference"


@check("copy_race", "copy_blocks chained / cyclic pairs vs the reference's snapshot semantics (50 runs each)", 90)
def _copy_race() -> str:
    torch = _torch()
    from batchkit import _cuda
    from batchkit.kv import ops

    cases = {
        "chain": [(i, i + 1) for i in range(255)],
        "reverse chain": [(i, i + 1) for i in reversed(range(255))],
        "cycle": [(i, (i + 1) % 64) for i in range(64)],
        "fan out": [(2, 3), (2, 4), (3, 5), (4, 6), (6, 7)],
    }
    bad = {}
    for name, pairs in cases.items():
        wrong = 0
        for _ in range(50):
            caches = torch.randn(4, 256, 16 * 8 * 128, device="cuda").half()
            ref = caches.clone()
            _cuda.copy_blocks(caches, pairs)
            ops.copy_blocks([ref[i] for i in range(4)], pairs)
            torch.cuda.synchronize()
            wrong += not torch.equal(caches, ref)
        if wrong:
            bad[name] = wrong
    if bad:
        raise AssertionError(f"runs differing from the reference out of 50: {bad}")
    return f"{len(cases)} cases x 50 runs equal the reference"


@check("side_stream", "ordering on a non-default stream (kernel on torch's current stream, no sync)", 60)
def _side_stream() -> str:
    torch = _torch()
    from batchkit import _cuda

    s = torch.cuda.Stream()
    n = 4096
    with torch.cuda.stream(s):
        kc = torch.zeros(n, 16, 8, 128, device="cuda", dtype=torch.float16)
        k = torch.zeros(n, 8, 128, device="cuda", dtype=torch.float16)
        slots = torch.arange(n, device="cuda") * 16
        for i in range(10):
            torch.cuda._sleep(20_000_000)  # delay the stream: a kernel on another stream would run early
            k.fill_(float(i + 1))
            with _checks_off():
                _cuda.scatter_kv(kc, kc, k, k, slots)
            got = kc.view(-1, 8, 128)[slots].float().mean()
            gk = _cuda.gather_kv(
                kc,
                torch.arange(n, dtype=torch.int32, device="cuda").view(n, 1),
                torch.ones(n, dtype=torch.long, device="cuda"),
                total_tokens=n,
            )
            if float(got) != float(i + 1) or float(gk.float().mean()) != float(i + 1):
                raise AssertionError(f"iteration {i}: read {float(got)} / {float(gk.float().mean())}, wrote {i + 1}")
    torch.cuda.synchronize()
    return "10 delayed producer -> scatter -> gather -> consumer rounds ordered on the side stream"


@check("graph", "CUDA-graph capture + replay of scatter, gather and PagedKVCache ops (checks off)", 90)
def _graph() -> str:
    torch = _torch()
    from batchkit import PagedKVCache, _cuda
    from batchkit.kv import ops

    with _checks_off():
        kc = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.float16)
        vc = torch.zeros_like(kc)
        k = torch.randn(32, 8, 128, device="cuda").half()
        v = torch.randn(32, 8, 128, device="cuda").half()
        slots = torch.randperm(1024, device="cuda")[:32]
        tables = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
        lens = torch.tensor([5, 16, 100, 1], device="cuda")
        cache = PagedKVCache(2, 64, 16, 8, 128, dtype=torch.float16, device="cuda", backend="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up outside capture
                _cuda.scatter_kv(kc, vc, k, v, slots)
                _cuda.gather_kv(kc, tables, lens, total_tokens=122)
                cache.scatter(1, k, v, slots)
                cache.gather(1, tables, lens, total_tokens=122)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _cuda.scatter_kv(kc, vc, k, v, slots)
            out = _cuda.gather_kv(kc, tables, lens, total_tokens=122)
            cache.scatter(1, k, v, slots)
            ck, cv = cache.gather(1, tables, lens, total_tokens=122)
        for _ in range(3):
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
            kc.zero_()
            vc.zero_()
            cache.kv.zero_()
            g.replay()
            torch.cuda.synchronize()
            rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
            ops.scatter(rk, rv, k, v, slots)
            _same(kc, rk, "replayed scatter")
            _same(out, ops.gather(rk, tables, lens), "replayed gather")
            _same(cache.key(1), rk, "replayed PagedKVCache.scatter")
            _same(ck, ops.gather(rk, tables, lens), "replayed PagedKVCache.gather (K)")
            _same(cv, ops.gather(rv, tables, lens), "replayed PagedKVCache.gather")
    return "captured once, replayed 3x with new inputs, equal the reference"


@check("graph_ptds", "graph capture with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 (raised BufferError before)", 90)
def _graph_ptds() -> str:
    if os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM") != "1":
        raise RuntimeError("run by the parent with the variable set")
    return _graph()


@check("host_overhead", "host time per launch (checks off; INFO)", 60)
def _overhead() -> str:
    torch = _torch()
    from batchkit import _cuda

    kc = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 8, 128, device="cuda").half()
    slots = torch.tensor([5], device="cuda")
    tables = torch.tensor([[1]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([1], device="cuda")
    caches = kc.view(1, 64, -1)
    kflat = kc.view(-1, 8, 128)

    def per_call(fn: Callable[[], object], n: int = 500) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    with _checks_off():
        scatter = per_call(lambda: _cuda.scatter_kv(kc, kc, k, k, slots))
        gather = per_call(lambda: _cuda.gather_kv(kc, tables, lens, total_tokens=1))
        copy = per_call(lambda: _cuda.copy_blocks(caches, [(1, 2)]))
    checked = per_call(lambda: _cuda.scatter_kv(kc, kc, k, k, slots))
    ref = per_call(lambda: kflat.index_copy_(0, slots, k))
    return (
        f"INFO scatter {scatter:.1f} us, gather {gather:.1f} us, copy_blocks {copy:.1f} us per call; "
        f"scatter with CHECK_INDICES {checked:.1f} us; torch index_copy_ {ref:.1f} us"
    )


# --------------------------------------------------------------------------- driver


def _child(name: str) -> int:
    _, _, fn = CHECKS[name]
    try:
        msg = fn() or ""
        status = "INFO" if msg.startswith("INFO ") else "OK"
        msg = msg.removeprefix("INFO ")
    except Exception as exc:
        status = "FAIL"
        tb = traceback.format_exc(limit=4).strip().splitlines()
        where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File ")), "")
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} [{where}]"
    print("@@RESULT " + json.dumps({"status": status, "message": msg}), flush=True)
    return 0


def main() -> int:
    ap = harness.parser(__doc__, once=True)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for all checks together")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child)
    record = harness.start(args)
    deadline = time.monotonic() + args.budget
    results = []
    no_device = False
    names = [n for n in CHECKS if not args.only or n in args.only]
    for name in names:
        title, timeout, _ = CHECKS[name]
        env = dict(os.environ)
        if name == "graph_ptds":
            env["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        if no_device and name != "headers":
            status, msg = "FAIL", "not run: torch sees no CUDA device"
        elif left < 5:
            status, msg = "FAIL", "not run: the probe's time budget is spent"
        else:
            try:
                r = subprocess.run(
                    [sys.executable, __file__, "--child", name],
                    capture_output=True,
                    text=True,
                    timeout=min(timeout, left),
                    env=env,
                )
                line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("@@RESULT ")), None)
                if line is None:
                    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
                    status, msg = "FAIL", f"process ended with rc {r.returncode} and no result: {' | '.join(tail)}"
                else:
                    res = json.loads(line.removeprefix("@@RESULT "))
                    status, msg = res["status"], res["message"]
            except subprocess.TimeoutExpired:
                status, msg = "FAIL", f"timed out after {min(timeout, left):.0f}s"
        if name == "environment" and ("no CUDA device visible to torch" in msg or "torch unusable" in msg):
            no_device = True
        took = time.monotonic() - t0
        print(f"{status:4} {name:14} ({took:5.1f}s) {title}: {msg}", flush=True)
        results.append({"check": name, "status": status})
        record.add(name, status, title=title, seconds=round(took, 2), message=msg)
    failed = [r["check"] for r in results if r["status"] == "FAIL"]
    print(
        f"probe: {len(results) - len(failed)}/{len(results)} checks passed" + (f"; failed: {failed}" if failed else "")
    )
    record.add("failed", ", ".join(failed))
    record.write()
    if no_device:
        # Like kv_kernels.py, not an error where there is nothing to probe (scripts/dev bench runs
        # every benchmark); gpu_check.sh reports the missing device itself.
        print("probe: no CUDA device here; run it on a GPU machine (bash benchmarks/gpu_check.sh)")
        return 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
