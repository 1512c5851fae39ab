"""CUDA kernels for the paged-KV hot path, compiled with NVRTC and launched through CuPy.

The kernel source is ``paged_kv.cu`` beside this file. This module:

- checks every argument (dtype, device, shape, strides, index ranges) *before* any launch and
  turns the call into a :class:`Launch` (kernel name, grid, block, arguments): the planning is
  pure and runs on any machine, which is how the CPU test suite checks it;
- compiles the module lazily, once per device, and caches it and each kernel function;
- launches on torch's current CUDA stream, passing tensors as raw device pointers
  (``data_ptr()``): no DLPack exchange, no CuPy array, so nothing synchronises a stream and a
  launch can be captured in a CUDA graph.

``CHECK_INDICES`` (default True) also checks slot and block indices and sequence lengths on the
host, which costs a device-to-host synchronisation per call; turn it off in a tuned decode loop
or for CUDA-graph capture. The kernels never touch memory outside their tensors either way:
an out-of-range slot is skipped, and a gathered row whose block id or length is out of range is
zero-filled (see ``paged_kv.cu`` and docs/kernels.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "CHECK_INDICES",
    "CopyPlan",
    "Launch",
    "available",
    "compile_ptx",
    "copy_blocks",
    "copy_waves",
    "gather_kv",
    "kernel_args",
    "kernel_names",
    "plan_copy_blocks",
    "plan_gather",
    "plan_scatter",
    "scatter_kv",
    "source",
]

logger = logging.getLogger(__name__)

CHECK_INDICES = True
THREADS = 128
MAX_GRID = 1 << 20  # kernels grid-stride beyond this

_WIDTHS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_SLOT_TYPES = {"torch.int32": "int", "torch.int64": "long long"}

Tensor = Any


@cache
def source() -> str:
    """The CUDA C++ source of the kernels."""
    return Path(__file__).with_name("paged_kv.cu").read_text()


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def kernel_names() -> list[str]:
    """Every template instantiation the launcher may use (NVRTC name expressions)."""
    names = []
    for w in _WIDTHS.values():
        for vec in (True, False):
            for i in _SLOT_TYPES.values():
                names.append(f"scatter_kv<{w}, {i}, {_b(vec)}>")
            names.append(f"gather_kv<{w}, {_b(vec)}>")
            names.append(f"copy_blocks<{w}, {_b(vec)}>")
    return names


COMPILE_OPTIONS = ("--std=c++17",)


def compile_ptx(arch: str = "compute_90") -> dict[str, str]:
    """Compile every instantiation with NVRTC for ``arch`` (no GPU needed); return the lowered
    (mangled) name of each. Raises RuntimeError with NVRTC's log if compilation fails."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(), "paged_kv.cu", [], [])
    try:
        names = kernel_names()
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*COMPILE_OPTIONS, f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        ptx = nvrtc.getPTX(prog)
        if not ptx:
            raise RuntimeError(f"NVRTC produced no PTX for {arch}")
        return {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)


# --------------------------------------------------------------------------- availability

_available: dict[int, bool] = {}
_warned = False
_available_lock = threading.Lock()


def available(device_index: int | None = None) -> bool:
    """Whether the kernels really run on CUDA device ``device_index`` (default: the current one).

    True only when CuPy imports, sees the device, and the kernel module compiles and loads on it
    (the first call per device compiles, which takes seconds; the answer is cached). When CuPy is
    installed but any of this fails, one warning is logged (once per process) with the reason
    and False is returned, so that ``backend="auto"`` serves through the torch reference. Without
    CuPy it returns False silently.
    """
    try:
        import cupy
    except ImportError:
        return False
    with _available_lock:
        index = -1 if device_index is None else device_index
        try:
            if device_index is None:
                index = int(cupy.cuda.runtime.getDevice())
            if index in _available:
                return _available[index]
            count = int(cupy.cuda.runtime.getDeviceCount())
            if index >= count:
                raise RuntimeError(f"CuPy sees {count} CUDA device(s), not device {index}")
            for name in kernel_names():  # compiles and loads the module, caches every function
                _function(index, name)
        except Exception as exc:  # noqa: BLE001 - any failure means: serve through torch
            _available[index] = False
            _warn_once(exc)
            return False
        _available[index] = True
        return True


def _warn_once(exc: BaseException) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    first = (str(exc).strip().splitlines() or [""])[0]
    logger.warning(
        "batchkit CUDA kernels unavailable (%s: %s); using the torch reference path. Install the CuPy "
        "matching your CUDA (pip install 'batchkit[cuda12]' or 'batchkit[cuda13]'), or pass "
        "backend='torch' to silence this.",
        type(exc).__name__,
        first,
    )


# --------------------------------------------------------------------------- planning (pure)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, fully decided: which instantiation, grid, block and arguments.

    ``args`` holds tensors (passed to the kernel as their ``data_ptr()``) and ints (passed as
    64-bit integers), in the kernel's parameter order."""

    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    device: Any
    width: int
    vec: bool


@dataclass(frozen=True)
class CopyPlan:
    """A block copy, ordered so that the GPU gives the reference's snapshot semantics.

    ``waves`` run one after another on one stream; the pairs of one wave are independent (no
    block is both read and written in it). ``cut`` holds one pair of each copy cycle (such as
    ``(1, 2), (2, 1)``): its source is saved before the waves and written to its destination
    after them."""

    waves: tuple[Launch, ...]
    cut: tuple[tuple[int, int], ...]


def _require_cuda(*tensors: Tensor) -> Any:
    dev = tensors[0].device
    for t in tensors:
        if t.device.type != "cuda":
            raise ValueError(f"the CUDA kernels need CUDA tensors, got one on {t.device}")
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    return dev


def _width(t: Tensor) -> int:
    size = int(t.element_size())
    if size not in _WIDTHS:
        raise ValueError(f"unsupported dtype {t.dtype} ({size}-byte elements)")
    return size


def _aligned(*xs: int) -> bool:
    return all(x % 16 == 0 for x in xs)


def plan_scatter(key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> Launch:
    """Check a scatter's arguments and decide its launch (see :func:`scatter_kv`)."""
    device = _require_cuda(key_cache, value_cache, key, value, slot_mapping)
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    heads, dim = int(key_cache.shape[2]), int(key_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (heads, dim):
            raise ValueError(f"{name} must be [num_tokens, {heads}, {dim}], got {tuple(t.shape)}")
        if t.dtype != key_cache.dtype:
            raise ValueError(f"{name} is {t.dtype} but the cache is {key_cache.dtype}; convert it first")
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError(f"{name} must be contiguous within each token (strides [*, {dim}, 1])")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must share a dtype")
    n = int(key.shape[0])
    if value.shape[0] != n or slot_mapping.dim() != 1 or slot_mapping.shape[0] != n:
        raise ValueError(f"key, value and slot_mapping must agree on num_tokens ({n})")
    slot_type = _SLOT_TYPES.get(str(slot_mapping.dtype))
    if slot_type is None:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    num_slots = int(key_cache.shape[0]) * int(key_cache.shape[1])
    if CHECK_INDICES and n and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot {int(slot_mapping.max())} is outside the cache ({num_slots} slots)")
    w = _width(key_cache)
    row = heads * dim
    vec = _aligned(
        row * w,
        key.stride(0) * w,
        value.stride(0) * w,
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
    )
    name = f"scatter_kv<{_WIDTHS[w]}, {slot_type}, {_b(vec)}>"
    args = (key, value, key_cache, value_cache, slot_mapping, n, key.stride(0), value.stride(0), row, num_slots)
    return Launch(name, (max(1, min(n, MAX_GRID)),), (THREADS,), args, device, w, vec)


def plan_gather(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, total_tokens: int | None = None) -> Launch:
    """Check a gather's arguments and decide its launch; allocates the output tensor.

    The output has ``total_tokens`` rows (default: ``sum(seq_lens)``, read back from the device).
    With ``CHECK_INDICES`` a ``total_tokens`` that differs from ``sum(seq_lens)``, a negative
    length, a sequence longer than its block-table row, or a block id outside the cache is a
    ValueError; without, the kernel zero-fills the rows those would address (see
    :func:`gather_kv`).
    """
    import torch

    device = _require_cuda(cache, block_tables, seq_lens)
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous [num_blocks, block_size, heads, head_dim], got {tuple(cache.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError("seq_lens must be 1-D with one length per block-table row")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
    if total_tokens is not None and (isinstance(total_tokens, bool) or int(total_tokens) < 0):
        raise ValueError(f"total_tokens must be an int >= 0 (= sum(seq_lens)), got {total_tokens!r}")
    block_tables = block_tables.contiguous()
    num_blocks, block_size = int(cache.shape[0]), int(cache.shape[1])
    num_seqs, max_blocks = int(block_tables.shape[0]), int(block_tables.shape[1])
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(seq_lens.to(torch.int64), 0, out=cu[1:])
    if CHECK_INDICES and num_seqs:
        if int(seq_lens.min()) < 0:
            raise ValueError(f"seq_lens must be >= 0, got {int(seq_lens.min())}")
        if int(seq_lens.max()) > max_blocks * block_size:
            raise ValueError(
                f"a sequence of {int(seq_lens.max())} tokens is longer than its block-table row can address "
                f"({max_blocks} blocks of {block_size})"
            )
        if block_tables.numel() and (int(block_tables.max()) >= num_blocks or int(block_tables.min()) < 0):
            raise ValueError(f"block_tables hold a block outside 0..{num_blocks - 1}")
    if total_tokens is None:
        total = int(cu[-1])
    else:
        total = int(total_tokens)
        if CHECK_INDICES and int(cu[-1]) != total:
            raise ValueError(f"total_tokens is {total} but seq_lens sum to {int(cu[-1])}; pass sum(seq_lens)")
    row = int(cache.shape[2]) * int(cache.shape[3])
    out = torch.empty((total, cache.shape[2], cache.shape[3]), dtype=cache.dtype, device=device)
    w = _width(cache)
    vec = _aligned(row * w, cache.data_ptr(), out.data_ptr())
    args = (cache, out, block_tables, cu, num_seqs, max_blocks, row, block_size, total, num_blocks)
    return Launch(
        f"gather_kv<{_WIDTHS[w]}, {_b(vec)}>", (max(1, min(total, MAX_GRID)),), (THREADS,), args, device, w, vec
    )


def copy_waves(
    pairs: Sequence[tuple[int, int]], num_blocks: int
) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int]]]:
    """Order block-copy pairs so that running each wave in parallel, one wave after another,
    equals copying every ``src`` from a snapshot taken before the call (the torch reference).

    A pair ``(s, d)`` must run before the pair that overwrites ``s``. Chains such as
    ``(1, 2), (2, 3)`` become waves ``[(2, 3)], [(1, 2)]``; a pair ``(b, b)`` is dropped; in a
    cycle such as ``(1, 2), (2, 1)`` one pair is *cut*: returned apart, for the caller to copy
    through a saved copy of its source. Pure and O(len(pairs)); runs on the host.

    Returns:
        ``(waves, cut)``.

    Raises:
        ValueError: a block outside ``0..num_blocks-1``, or one destination named twice (the
            result would depend on which copy lands last).
    """
    ps = [(int(s), int(d)) for s, d in pairs]
    seen: set[int] = set()
    for s, d in ps:
        if not (0 <= s < num_blocks and 0 <= d < num_blocks):
            raise ValueError(f"block pair ({s}, {d}) lies outside 0..{num_blocks - 1}")
        if d in seen:
            raise ValueError(f"block {d} is the destination of two pairs; each block may be written once per call")
        seen.add(d)
    ps = [(s, d) for s, d in ps if s != d]
    if not {s for s, _ in ps} & seen:
        return ([ps] if ps else []), []  # the common case: no block is both read and written
    writer = {d: i for i, (_, d) in enumerate(ps)}
    # nxt[i]: the pair that overwrites pair i's source, so must run after it (at most one).
    nxt = [writer.get(s, -1) for s, _ in ps]
    # Cycles in this functional graph: walk each path once, colouring nodes by the walk's id.
    cut = set()
    colour = [-1] * len(ps)
    for start in range(len(ps)):
        i = start
        while i != -1 and colour[i] == -1:
            colour[i] = start
            i = nxt[i]
        if i != -1 and colour[i] == start:  # this walk closed a cycle through i
            cut.add(i)
    indeg = [0] * len(ps)
    for i, j in enumerate(nxt):
        if i not in cut and j != -1 and j not in cut:
            indeg[j] += 1
    wave = [0] * len(ps)
    ready = [i for i in range(len(ps)) if i not in cut and indeg[i] == 0]
    order = []
    while ready:  # Kahn's algorithm; each node has at most one successor
        i = ready.pop()
        order.append(i)
        j = nxt[i]
        if j != -1 and j not in cut:
            wave[j] = max(wave[j], wave[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    waves: list[list[tuple[int, int]]] = [[] for _ in range(max((wave[i] for i in order), default=-1) + 1)]
    for i in sorted(order):
        waves[wave[i]].append(ps[i])
    return waves, [ps[i] for i in sorted(cut)]


def plan_copy_blocks(caches: Tensor, pairs: Any) -> CopyPlan:
    """Check a block copy's arguments and decide its launches. ``caches`` is
    ``[num_caches, num_blocks, ...]`` contiguous; ``pairs`` a sequence of (src, dst) on the host
    (a tensor is read back). See :func:`copy_waves` for the ordering and what is refused."""
    import torch

    device = _require_cuda(caches)
    if caches.dim() < 3 or not caches.is_contiguous():
        raise ValueError("caches must be a contiguous [num_caches, num_blocks, ...] tensor")
    num_caches, num_blocks = int(caches.shape[0]), int(caches.shape[1])
    flat = torch.as_tensor(pairs, dtype=torch.int64, device="cpu").view(-1, 2).tolist()
    waves, cut = copy_waves([(s, d) for s, d in flat], num_blocks)
    block_elems = int(caches[0, 0].numel())
    w = _width(caches)
    vec = _aligned(block_elems * w, caches.data_ptr())
    name = f"copy_blocks<{_WIDTHS[w]}, {_b(vec)}>"
    launches = []
    if waves:
        # One upload for every wave; each launch reads its own slice.
        p = torch.tensor([x for wv in waves for pair in wv for x in pair], dtype=torch.int64).view(-1, 2).to(device)
        start = 0
        for wv in waves:
            n = len(wv)
            args = (caches, p[start : start + n], n, num_blocks * block_elems, block_elems)
            launches.append(Launch(name, (min(n, MAX_GRID), num_caches), (THREADS,), args, device, w, vec))
            start += n
    return CopyPlan(tuple(launches), tuple(cut))


# --------------------------------------------------------------------------- launching

_modules: dict[int, Any] = {}
_functions: dict[tuple[int, str], Any] = {}
_modules_lock = threading.RLock()


def _module(device_index: int) -> Any:
    mod = _modules.get(device_index)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(device_index)
            if mod is None:
                import cupy

                with cupy.cuda.Device(device_index):
                    mod = cupy.RawModule(code=source(), options=COMPILE_OPTIONS, name_expressions=kernel_names())
                _modules[device_index] = mod
    return mod


def _function(device_index: int, name: str) -> Any:
    """The loaded kernel ``name`` on a device (CuPy's low-level ``Function``), looked up once
    and cached: the module loads here, never inside a CUDA-graph capture."""
    fn = _functions.get((device_index, name))
    if fn is None:
        with _modules_lock:
            fn = _functions.get((device_index, name))
            if fn is None:
                import cupy

                mod = _module(device_index)
                with cupy.cuda.Device(device_index):
                    fn = mod.get_function(name).kernel
                _functions[device_index, name] = fn
    return fn


class _Stream:
    """All that CuPy's low-level launch reads of a stream: its handle. Passing the handle this
    way avoids CuPy's stream objects (``ExternalStream`` is deprecated in CuPy 14) and their
    current-stream bookkeeping."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def kernel_args(launch: Launch) -> tuple[Any, ...]:
    """The launch's arguments as the kernel takes them: each tensor as its device pointer
    (``numpy.uint64``), each int as ``numpy.int64``. No CuPy array is made."""
    import numpy as np

    return tuple(np.int64(a) if isinstance(a, int) else np.uint64(a.data_ptr()) for a in launch.args)


def _launch(launch: Launch) -> None:
    """Run a planned launch on torch's current stream of its device."""
    import cupy
    import torch

    index = launch.device.index if launch.device.index is not None else torch.cuda.current_device()
    fn = _function(index, launch.kernel)
    stream = _Stream(torch.cuda.current_stream(index).cuda_stream)
    args = kernel_args(launch)
    if cupy.cuda.runtime.getDevice() == index:
        fn(launch.grid, launch.block, args, 0, stream)
    else:
        with cupy.cuda.Device(index):
            fn(launch.grid, launch.block, args, 0, stream)


def scatter_kv(key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, heads, head_dim]`` into paged caches at
    ``slot_mapping`` (int32 or int64; negative slots skipped): vLLM's ``reshape_and_cache``
    contract. Tokens may be strided; each token's ``[heads, head_dim]`` must be contiguous.
    Slots past the cache are refused (``CHECK_INDICES``) or skipped by the kernel (without).

    Raises:
        ValueError: a dtype, device, shape, stride or index the kernel cannot take.
    """
    launch = plan_scatter(key_cache, value_cache, key, value, slot_mapping)
    if key.shape[0]:
        _launch(launch)


def gather_kv(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, total_tokens: int | None = None) -> Tensor:
    """Sequences' pages to a contiguous ``[sum(seq_lens), heads, head_dim]`` tensor.

    Pass ``total_tokens`` (= ``sum(seq_lens)``) to avoid a device synchronisation; the output has
    exactly that many rows and the kernel never writes past them. With ``CHECK_INDICES`` off,
    rows past ``sum(seq_lens)``, rows of a sequence with a negative length, and rows whose block
    id lies outside the cache (or past the block-table row) are zero-filled; nothing outside the
    tensors is read or written.

    Raises:
        ValueError: a dtype, device or shape the kernel cannot take; with ``CHECK_INDICES``,
            also an index or length out of range or a wrong ``total_tokens``.
    """
    launch = plan_gather(cache, block_tables, seq_lens, total_tokens)
    out: Tensor = launch.args[1]
    if out.shape[0]:
        _launch(launch)
    return out


def copy_blocks(caches: Tensor, pairs: Any) -> None:
    """Copy blocks ``src -> dst`` in every cache of ``caches`` ``[num_caches, num_blocks, ...]``,
    with the reference's semantics: every source is read as it was before the call, whatever
    the order of the pairs (chains run as dependency-ordered waves, cycles through a saved
    copy; see :func:`copy_waves`). Not capturable in a CUDA graph: the pairs are uploaded.

    Raises:
        ValueError: a block outside the cache, or a destination named twice.
    """
    import torch

    plan = plan_copy_blocks(caches, pairs)
    saved = None
    if plan.cut:
        src = torch.tensor([s for s, _ in plan.cut], dtype=torch.int64, device=caches.device)
        saved = caches.index_select(1, src)
    for launch in plan.waves:
        _launch(launch)
    if saved is not None:
        dst = torch.tensor([d for _, d in plan.cut], dtype=torch.int64, device=caches.device)
        caches.index_copy_(1, dst, saved)
