"""A numpy emulation of the kernels in ``paged_kv.cu``, for machines without a GPU.

Each function below runs a planned :class:`~batchkit._cuda.Launch` the way the GPU would: the
same grid-stride loop over ``blockIdx``, the same per-thread striding inside ``copy_row``, the
same 64-bit offset arithmetic and the same 16-byte units when the launch is vectorised. Keep it
line-for-line with the CUDA source: the CPU tests compare it with the torch reference on random
inputs, so an indexing mistake in the kernels' mapping shows up without a GPU.

Unlike numpy slicing, which clips and wraps silently, the emulation checks every index it
computes against the tensor it addresses and raises :class:`KernelFault` where a GPU would read
or write outside it (an illegal address, or silent corruption of a neighbour). It also records
which work item (one CUDA block's iteration of its grid-stride loop) touched which bytes, and
raises :class:`KernelRace` when two work items of one launch touch the same byte and one of them
writes it: on a GPU those run in parallel, in no fixed order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import Launch

__all__ = ["KernelFault", "KernelRace", "run"]

_INTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class KernelFault(RuntimeError):
    """The emulated kernel addressed memory outside a tensor (or misaligned a vector access)."""


class KernelRace(RuntimeError):
    """Two parallel work items of one emulated launch touched the same bytes, one writing."""


class _Buf:
    """A flat view of one tensor argument's memory, with its name and address for the checks."""

    def __init__(self, t: Any, name: str) -> None:
        import torch

        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if t.dtype.is_floating_point:
            t = t.view(ints[t.element_size()])
        extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
        self.arr = np.asarray(t.as_strided((extent,), (1,)).numpy()).view(_INTS[t.element_size()])
        self.name = name
        self.addr = int(t.data_ptr())
        self.storage = int(t.untyped_storage().data_ptr())
        self.storage_bytes = int(t.untyped_storage().nbytes())
        self.itemsize = int(t.element_size())

    def __len__(self) -> int:
        return int(self.arr.shape[0])

    def load(self, i: int) -> int:
        """Element ``i``, as the kernel would read it; a fault outside the tensor."""
        if not 0 <= i < len(self):
            raise KernelFault(f"read of {self.name}[{i}] outside its {len(self)} elements")
        return int(self.arr[i])

    def span(self, off: int, n: int, what: str) -> None:
        if off < 0 or off + n > len(self):
            raise KernelFault(f"{what} of {self.name}[{off}:{off + n}] outside its {len(self)} elements")


class _Accesses:
    """Who touched which bytes in one launch: a write owner per byte of each storage touched,
    and a list of reads checked against the owners at the end of the launch."""

    def __init__(self) -> None:
        self.owner: dict[int, np.ndarray] = {}
        self.reads: list[tuple[_Buf, int, int, int]] = []

    def _bytes(self, b: _Buf, off: int, n: int) -> tuple[np.ndarray, int, int]:
        owner = self.owner.get(b.storage)
        if owner is None:
            owner = self.owner[b.storage] = np.full(b.storage_bytes, -1, dtype=np.int64)
        start = b.addr - b.storage + off * b.itemsize
        return owner, start, start + n * b.itemsize

    def write(self, b: _Buf, off: int, n: int, unit: int) -> None:
        owner, lo, hi = self._bytes(b, off, n)
        seg = owner[lo:hi]
        if ((seg != -1) & (seg != unit)).any():
            raise KernelRace(f"two parallel work items write {b.name}[{off}:{off + n}]")
        seg[:] = unit

    def read(self, b: _Buf, off: int, n: int, unit: int) -> None:
        self.reads.append((b, off, n, unit))

    def check(self) -> None:
        for b, off, n, unit in self.reads:
            if b.storage not in self.owner:
                continue
            owner, lo, hi = self._bytes(b, off, n)
            seg = owner[lo:hi]
            if ((seg != -1) & (seg != unit)).any():
                raise KernelRace(f"{b.name}[{off}:{off + n}] is read by one work item and written by another")


def _copy_row(
    acc: _Accesses,
    unit: int,
    dst: _Buf,
    dst_off: int,
    src: _Buf | None,
    src_off: int,
    n: int,
    vec: bool,
    block_dim: int,
) -> None:
    """``copy_row`` (or ``zero_row`` when ``src`` is None) of the CUDA source, checked."""
    dst.span(dst_off, n, "write")
    if src is not None:
        src.span(src_off, n, "read")
        acc.read(src, src_off, n, unit)
    acc.write(dst, dst_off, n, unit)
    if vec:
        for b, off in ((dst, dst_off), *(((src, src_off),) if src is not None else ())):
            if (b.addr + off * b.itemsize) % 16 or (n * b.itemsize) % 16:
                raise KernelFault(f"a vectorised access to {b.name}[{off}:{off + n}] is not 16-byte aligned")
    if src is None:  # zero_row: every element of the row (16-byte units or not) becomes 0
        dst.arr[dst_off : dst_off + n] = 0
    elif vec:
        units = n * dst.itemsize // 16
        d = dst.arr[dst_off : dst_off + n].view("V16")
        s = src.arr[src_off : src_off + n].view("V16")
        for tid in range(block_dim):  # i = threadIdx.x; i < units; i += blockDim.x
            d[tid:units:block_dim] = s[tid:units:block_dim]
    else:
        d_, s_ = dst.arr, src.arr
        for tid in range(block_dim):
            d_[dst_off + tid : dst_off + n : block_dim] = s_[src_off + tid : src_off + n : block_dim]


def _scatter(launch: Launch, acc: _Accesses) -> None:
    key, value, key_cache, value_cache, slot_mapping, num_tokens, key_stride, value_stride, row, num_slots = launch.args
    k, v = _Buf(key, "key"), _Buf(value, "value")
    kc, vc = _Buf(key_cache, "key_cache"), _Buf(value_cache, "value_cache")
    slots = _Buf(slot_mapping, "slot_mapping")
    if slots.itemsize == 8:
        slots.arr = slots.arr.view(np.int64)
    else:
        slots.arr = slots.arr.view(np.int32)
    (grid,), (block,) = launch.grid, launch.block
    for bx in range(grid):
        t = bx
        while t < num_tokens:
            slot = slots.load(t)
            if 0 <= slot < num_slots:
                _copy_row(acc, t, kc, slot * row, k, t * key_stride, row, launch.vec, block)
                _copy_row(acc, t, vc, slot * row, v, t * value_stride, row, launch.vec, block)
            t += grid


def _gather(launch: Launch, acc: _Accesses) -> None:
    cache, out, block_tables, cu_seq_lens, num_seqs, max_blocks, row, block_size, num_out_rows, num_blocks = launch.args
    c, o = _Buf(cache, "cache"), _Buf(out, "out")
    bt = _Buf(block_tables, "block_tables")
    bt.arr = bt.arr.view(np.int32)
    cu = _Buf(cu_seq_lens, "cu_seq_lens")
    cu.arr = cu.arr.view(np.int64)
    (grid,), (block,) = launch.grid, launch.block
    for bx in range(grid):
        t = bx
        while t < num_out_rows:
            lo, hi = 0, num_seqs - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if cu.load(mid) <= t:
                    lo = mid
                else:
                    hi = mid - 1
            ok = num_seqs > 0 and cu.load(lo) <= t < cu.load(lo + 1)
            slot = 0
            if ok:
                pos = t - cu.load(lo)
                col = pos // block_size
                ok = col < max_blocks
                if ok:
                    blk = bt.load(lo * max_blocks + col)
                    ok = 0 <= blk < num_blocks
                    slot = blk * block_size + pos % block_size
            if ok:
                _copy_row(acc, t, o, t * row, c, slot * row, row, launch.vec, block)
            else:
                _copy_row(acc, t, o, t * row, None, 0, row, launch.vec, block)
            t += grid


def _copy_blocks(launch: Launch, acc: _Accesses) -> None:
    caches, pairs, num_pairs, cache_stride, block_elems = launch.args
    c = _Buf(caches, "caches")
    p = _Buf(pairs, "pairs")
    p.arr = p.arr.view(np.int64)
    grid_x, grid_y = launch.grid
    (block,) = launch.block
    for by in range(grid_y):
        base = by * cache_stride
        for bx in range(grid_x):
            i = bx
            while i < num_pairs:
                src, dst = p.load(2 * i), p.load(2 * i + 1)
                unit = by * num_pairs + i
                _copy_row(
                    acc, unit, c, base + dst * block_elems, c, base + src * block_elems, block_elems, launch.vec, block
                )
                i += grid_x


def run(launch: Launch) -> None:
    """Execute a planned launch on CPU tensors, as the kernel would.

    Raises:
        KernelFault: the launch would read or write outside a tensor, or misalign a vector access.
        KernelRace: two work items of the launch would touch the same bytes, one writing.
    """
    kind = launch.kernel.split("<", 1)[0]
    acc = _Accesses()
    {"scatter_kv": _scatter, "gather_kv": _gather, "copy_blocks": _copy_blocks}[kind](launch, acc)
    acc.check()
