"""A numpy emulation of the kernels in ``paged_kv.cu``, for machines without a GPU.

Each function below runs a planned :class:`~batchkit._cuda.Launch` the way the GPU would: the
same grid-stride loop over ``blockIdx``, the same per-thread striding inside ``copy_row``, the
same 64-bit offset arithmetic and the same 16-byte units when the launch is vectorised. Keep it
line-for-line with the CUDA source: the CPU tests compare it with the torch reference on random
inputs, so an indexing mistake in the kernels' mapping shows up without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import Launch

__all__ = ["run"]

_INTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _flat(t: Any, width: int) -> np.ndarray:
    """A flat, writable numpy view of a CPU tensor's memory from its first element on."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_floating_point:
        t = t.view(ints[width])
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return np.asarray(t.as_strided((extent,), (1,)).numpy()).view(_INTS[t.element_size()])


def _copy_row(dst: np.ndarray, dst_off: int, src: np.ndarray, src_off: int, n: int, vec: bool, block_dim: int) -> None:
    if vec:
        width = dst.itemsize
        if (dst_off * width) % 16 or (src_off * width) % 16:
            raise AssertionError("a vectorised row does not start on a 16-byte boundary")
        units = n * width // 16
        d = dst[dst_off : dst_off + n].view("V16")
        s = src[src_off : src_off + n].view("V16")
        for tid in range(block_dim):  # i = threadIdx.x; i < units; i += blockDim.x
            d[tid:units:block_dim] = s[tid:units:block_dim]
    else:
        for tid in range(block_dim):
            dst[dst_off + tid : dst_off + n : block_dim] = src[src_off + tid : src_off + n : block_dim]


def _scatter(launch: Launch) -> None:
    key, value, key_cache, value_cache, slot_mapping, num_tokens, key_stride, value_stride, row, num_slots = launch.args
    w = launch.width
    k, v = _flat(key, w), _flat(value, w)
    kc, vc = _flat(key_cache, w), _flat(value_cache, w)
    slots = slot_mapping.numpy()
    (grid,), (block,) = launch.grid, launch.block
    for bx in range(grid):
        t = bx
        while t < num_tokens:
            slot = int(slots[t])
            if 0 <= slot < num_slots:
                _copy_row(kc, slot * row, k, t * key_stride, row, launch.vec, block)
                _copy_row(vc, slot * row, v, t * value_stride, row, launch.vec, block)
            t += grid


def _gather(launch: Launch) -> None:
    cache, out, block_tables, cu_seq_lens, num_seqs, bt_stride, row, block_size = launch.args
    w = launch.width
    c, o = _flat(cache, w), _flat(out, w)
    bt = block_tables.numpy().reshape(-1)
    cu = cu_seq_lens.numpy()
    total = int(cu[num_seqs])
    (grid,), (block,) = launch.grid, launch.block
    for bx in range(grid):
        t = bx
        while t < total:
            lo, hi = 0, num_seqs - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if cu[mid] <= t:
                    lo = mid
                else:
                    hi = mid - 1
            pos = t - int(cu[lo])
            blk = int(bt[lo * bt_stride + pos // block_size])
            slot = blk * block_size + pos % block_size
            _copy_row(o, t * row, c, slot * row, row, launch.vec, block)
            t += grid


def _copy_blocks(launch: Launch) -> None:
    caches, pairs, num_pairs, cache_stride, block_elems = launch.args
    c = _flat(caches, launch.width)
    p = pairs.numpy().reshape(-1)
    grid_x, grid_y = launch.grid
    (block,) = launch.block
    for by in range(grid_y):
        base = by * cache_stride
        for bx in range(grid_x):
            i = bx
            while i < num_pairs:
                src, dst = int(p[2 * i]), int(p[2 * i + 1])
                _copy_row(c, base + dst * block_elems, c, base + src * block_elems, block_elems, launch.vec, block)
                i += grid_x


def run(launch: Launch) -> None:
    """Execute a planned launch on CPU tensors, as the kernel would."""
    kind = launch.kernel.split("<", 1)[0]
    {"scatter_kv": _scatter, "gather_kv": _gather, "copy_blocks": _copy_blocks}[kind](launch)
