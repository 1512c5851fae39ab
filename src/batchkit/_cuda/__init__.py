"""CUDA kernels for the paged-KV hot path, compiled with NVRTC and launched through CuPy.

The kernel source is ``paged_kv.cu`` beside this file. This module:

- checks every argument (dtype, device, shape, strides, index ranges) *before* any launch and
  turns the call into a :class:`Launch` (kernel name, grid, block, arguments): the planning is
  pure and runs on any machine, which is how the CPU test suite checks it;
- compiles the module lazily, once per device, and caches it;
- launches on torch's current CUDA stream, taking torch tensors zero-copy through DLPack.

``CHECK_INDICES`` (default True) also checks slot and block indices against the cache size,
which costs a device-to-host synchronisation per call; turn it off in a tuned decode loop. The
kernels never write outside the cache either way: an out-of-range slot is skipped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "CHECK_INDICES",
    "Launch",
    "available",
    "compile_ptx",
    "copy_blocks",
    "gather_kv",
    "kernel_names",
    "plan_copy_blocks",
    "plan_gather",
    "plan_scatter",
    "scatter_kv",
    "source",
]

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


def available() -> bool:
    """Whether the CUDA kernels can run here (CuPy importable and a CUDA device present)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - no driver, no device: the torch path serves
        return False


# --------------------------------------------------------------------------- planning (pure)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, fully decided: which instantiation, grid, block and arguments."""

    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    device: Any
    width: int
    vec: bool


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
    """Check a gather's arguments and decide its launch; allocates the output tensor."""
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
    block_tables = block_tables.contiguous()
    num_blocks, block_size = int(cache.shape[0]), int(cache.shape[1])
    num_seqs = int(seq_lens.shape[0])
    if CHECK_INDICES and num_seqs:
        if int(seq_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError("a sequence is longer than its block-table row can address")
        if int(block_tables.max()) >= num_blocks or int(block_tables.min()) < 0:
            raise ValueError(f"block_tables hold a block outside 0..{num_blocks - 1}")
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(seq_lens.to(torch.int64), 0, out=cu[1:])
    total = int(cu[-1]) if total_tokens is None else int(total_tokens)
    row = int(cache.shape[2]) * int(cache.shape[3])
    out = torch.empty((total, cache.shape[2], cache.shape[3]), dtype=cache.dtype, device=device)
    w = _width(cache)
    vec = _aligned(row * w, cache.data_ptr(), out.data_ptr())
    args = (cache, out, block_tables, cu, num_seqs, block_tables.stride(0), row, block_size)
    return Launch(
        f"gather_kv<{_WIDTHS[w]}, {_b(vec)}>", (max(1, min(total, MAX_GRID)),), (THREADS,), args, device, w, vec
    )


def plan_copy_blocks(caches: Tensor, pairs: Any) -> Launch:
    """Check a block copy's arguments and decide its launch. ``caches`` is
    ``[num_caches, num_blocks, ...]`` contiguous; ``pairs`` a sequence of (src, dst)."""
    import torch

    device = _require_cuda(caches)
    if caches.dim() < 3 or not caches.is_contiguous():
        raise ValueError("caches must be a contiguous [num_caches, num_blocks, ...] tensor")
    num_caches, num_blocks = int(caches.shape[0]), int(caches.shape[1])
    p = torch.as_tensor(pairs, dtype=torch.int64).view(-1, 2)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= num_blocks):
        raise ValueError(f"block pairs must lie in 0..{num_blocks - 1}")
    p = p.to(device)
    block_elems = int(caches[0, 0].numel())
    w = _width(caches)
    vec = _aligned(block_elems * w, caches.data_ptr())
    n = int(p.shape[0])
    args = (caches, p, n, num_blocks * block_elems, block_elems)
    return Launch(
        f"copy_blocks<{_WIDTHS[w]}, {_b(vec)}>",
        (max(1, min(n, MAX_GRID)), num_caches),
        (THREADS,),
        args,
        device,
        w,
        vec,
    )


# --------------------------------------------------------------------------- launching

_modules: dict[int, Any] = {}
_modules_lock = threading.Lock()


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


def _as_cupy(t: Tensor) -> Any:
    """A zero-copy CuPy view of a torch tensor, as unsigned integers of the same width."""
    import cupy
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_floating_point:
        t = t.view(ints[t.element_size()])
    return cupy.from_dlpack(t)


def _launch(launch: Launch) -> None:
    """Run a planned launch on torch's current stream of its device."""
    import cupy
    import numpy as np
    import torch

    index = launch.device.index if launch.device.index is not None else torch.cuda.current_device()
    fn = _module(index).get_function(launch.kernel)
    args = tuple(
        _as_cupy(a) if isinstance(a, torch.Tensor) else (np.int64(a) if isinstance(a, int) else a) for a in launch.args
    )
    # int-typed kernel parameters (num_seqs) must be passed as 32-bit.
    if launch.kernel.startswith("gather_kv"):
        args = (*args[:4], np.int32(launch.args[4]), *args[5:])
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream):
        fn(launch.grid, launch.block, args)


def scatter_kv(key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, heads, head_dim]`` into paged caches at
    ``slot_mapping`` (int32 or int64; negative slots skipped): vLLM's ``reshape_and_cache``
    contract. Tokens may be strided; each token's ``[heads, head_dim]`` must be contiguous.

    Raises:
        ValueError: a dtype, device, shape, stride or index the kernel cannot take.
    """
    launch = plan_scatter(key_cache, value_cache, key, value, slot_mapping)
    if key.shape[0]:
        _launch(launch)


def gather_kv(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, total_tokens: int | None = None) -> Tensor:
    """Sequences' pages to a contiguous ``[sum(seq_lens), heads, head_dim]`` tensor.

    Pass ``total_tokens`` (= ``sum(seq_lens)``) to avoid a device synchronisation.
    """
    launch = plan_gather(cache, block_tables, seq_lens, total_tokens)
    out: Tensor = launch.args[1]
    if out.shape[0]:
        _launch(launch)
    return out


def copy_blocks(caches: Tensor, pairs: Any) -> None:
    """Copy blocks ``src -> dst`` in every cache of ``caches`` ``[num_caches, num_blocks, ...]``."""
    launch = plan_copy_blocks(caches, pairs)
    if launch.args[2]:
        _launch(launch)
