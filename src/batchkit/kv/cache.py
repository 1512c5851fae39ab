"""PagedKVCache: the K/V tensors of a paged cache and the operations on them.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0
of the second axis is K, 1 is V). A token's K (or V) for one layer is a contiguous row of
``num_kv_heads * head_dim`` elements, so a scatter moves whole rows (16-byte vector copies on a
GPU) and a block is one contiguous run of ``block_size`` rows, which is what block copies and
swaps move. One allocation for all layers keeps swap and copy a single indexed operation.

Each operation dispatches on the tensor's device: the CUDA kernels of :mod:`batchkit._cuda` for
CUDA tensors when they compile and load there (checked once, on first use), the torch reference
(:mod:`batchkit.kv.ops`) otherwise. ``backend="torch"`` or ``"cuda"`` forces one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .._validate import positive_int
from . import ops

__all__ = ["Backend", "PagedKVCache", "choose_backend"]

Backend = Literal["auto", "torch", "cuda"]
Tensor = Any


def choose_backend(backend: Backend, device_type: str, cuda_available: Callable[[], bool]) -> str:
    """Which implementation serves a cache: ``"cuda"`` kernels or the ``"torch"`` reference.

    Raises:
        ValueError: ``backend="cuda"`` for a cache that is not on a CUDA device.
    """
    if backend == "cuda":
        if device_type != "cuda":
            raise ValueError("backend='cuda' needs the cache on a CUDA device")
        return "cuda"
    if backend == "torch" or device_type != "cuda":
        return "torch"
    return "cuda" if cuda_available() else "torch"


def _gib(nbytes: int) -> str:
    if nbytes < 2**30:
        return f"{nbytes / 2**20:,.1f} MiB"
    return f"{nbytes / 2**30:,.1f} GiB"


def _too_large(shape: tuple[int, ...], dtype: Any, nbytes: int, why: str) -> str:
    layers, _, blocks, block_size, heads, head_dim = shape
    return (
        f"a KV cache of {blocks:,} blocks x {block_size} tokens ({layers} layers, K and V, {heads} KV heads x "
        f"{head_dim}, {str(dtype).removeprefix('torch.')}) needs {_gib(nbytes)}; {why}: use fewer blocks "
        "or smaller ones"
    )


def _device_memory(device: Any) -> int | None:
    """The memory of ``device`` in bytes (the machine's for the CPU), or None where unknown."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
            return None
    return None


def _is_integer(index: Tensor) -> bool:
    """Whether an index tensor holds integers (bool and floating dtypes do not)."""
    return not (index.dtype.is_floating_point or index.dtype.is_complex) and str(index.dtype) != "torch.bool"


class PagedKVCache:
    """K/V tensors for ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the shape.
        dtype: any float torch dtype (default float16 on CUDA, float32 on CPU).
        device: where the cache lives.
        backend: ``"auto"`` (CUDA kernels for CUDA tensors when they compile and load on the
            device, else the torch reference after one logged warning), ``"torch"`` or
            ``"cuda"`` (fails at first use if the kernels cannot load).

    Raises:
        ValueError: non-positive sizes or an unknown backend.
        MemoryError: the tensor would not fit: larger than the device's memory (the machine's
            for the CPU), or its allocation failed. The message gives the bytes it needs.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: Any = None,
        device: Any = "cpu",
        backend: Backend = "auto",
    ) -> None:
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            # Still a ModuleNotFoundError (code that catches ImportError keeps working), naming the extra.
            raise ModuleNotFoundError("PagedKVCache needs torch: pip install 'batchkit[torch]'", name="torch") from exc

        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            positive_int(name, v)
        if backend not in ("auto", "torch", "cuda"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'cuda', got {backend!r}")
        device = torch.device(device)
        if dtype is None:
            dtype = torch.float16 if device.type == "cuda" else torch.float32
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.backend: Backend = backend
        self._resolved: str | None = None  # the backend "auto" chose, decided on first use
        self._checked: Tensor | None = None  # the last int64 slot_mapping a CPU scatter checked
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        memory = _device_memory(device)
        if memory is not None and nbytes > memory:
            raise MemoryError(_too_large(shape, dtype, nbytes, f"{device} has {_gib(memory)} in all"))
        try:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's refusal
            raise MemoryError(_too_large(shape, dtype, nbytes, f"allocating it failed: {exc}")) from exc

    # ------------------------------------------------------------------ views

    def key(self, layer: int) -> Tensor:
        """Layer ``layer``'s K pages ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Raises:
            IndexError: ``layer`` is not in ``[0, num_layers)`` (a negative index would read
                another layer's pages).
        """
        return self.kv[self._layer(layer), 0]

    def value(self, layer: int) -> Tensor:
        """Layer ``layer``'s V pages (``IndexError`` as for :meth:`key`)."""
        return self.kv[self._layer(layer), 1]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.kv.shape[0]:
            raise IndexError(f"layer {layer!r} is out of range: the cache has {self.kv.shape[0]} layers (0 to n-1)")
        return layer

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())

    def _use_cuda(self) -> bool:
        if self._resolved is None:
            from .. import _cuda

            self._resolved = choose_backend(self.backend, self.device.type, lambda: _cuda.available(self.device.index))
        return self._resolved == "cuda"

    # ------------------------------------------------------------------ operations

    def scatter(self, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """Write new tokens' K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

        Negative slots are padding and are skipped. ``slot_mapping`` may be a tensor, or the numpy
        array (or list) :meth:`PagedKVAllocator.slot_mapping` hands out. On the CUDA kernels, the
        slot range is checked only while ``batchkit._cuda.CHECK_INDICES`` is on (a device
        synchronisation); with it off nothing here waits for the device, and the kernel skips a
        slot past the cache.

        Raises:
            ValueError: shapes that do not match the cache, or a slot outside it.
        """
        slot_mapping = self._index(slot_mapping)
        self._check_tokens(key, value, slot_mapping)
        if self._use_cuda():
            from .. import _cuda

            _cuda.scatter_kv(self.key(layer), self.value(layer), key, value, slot_mapping)
        else:
            slots, keep = self._checked_slots(slot_mapping)
            if keep is not None:
                key, value = key[keep], value[keep]
            ops.write_slots(self.key(layer), self.value(layer), key, value, slots)

    def gather(
        self, layer: int, block_tables: Tensor, seq_lens: Tensor, total_tokens: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Sequences' pages to contiguous K and V ``[sum(seq_lens), num_kv_heads, head_dim]``.

        ``block_tables`` and ``seq_lens`` may be tensors, or numpy arrays (or lists) as the
        allocator hands them out. ``total_tokens`` (= ``sum(seq_lens)``) spares the CUDA kernels a
        device synchronisation.

        Raises:
            ValueError: ``total_tokens`` is given and differs from ``sum(seq_lens)`` (on every
                backend; the CUDA one checks it only with ``CHECK_INDICES`` on).
        """
        block_tables, seq_lens = self._index(block_tables), self._index(seq_lens)
        if not block_tables.numel() and block_tables.dim() == 1:  # no sequences, e.g. []
            block_tables = block_tables.view(0, 0)
        if self._use_cuda():
            from .. import _cuda

            k = _cuda.gather_kv(self.key(layer), block_tables, seq_lens, total_tokens)
            return k, _cuda.gather_kv(self.value(layer), block_tables, seq_lens, int(k.shape[0]))
        self._check_tables(block_tables, seq_lens)
        k = ops.gather(self.key(layer), block_tables, seq_lens)
        if total_tokens is not None and int(k.shape[0]) != total_tokens:
            raise ValueError(f"total_tokens={total_tokens!r} differs from sum(seq_lens)={int(k.shape[0])}")
        return k, ops.gather(self.value(layer), block_tables, seq_lens)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` in every layer, K and V (copy-on-write).

        Every source is read as it was before the call, whatever the order of the pairs (a block
        may be both a source and a destination: chains and cycles are fine).

        Raises:
            ValueError: a block outside the cache, or a destination named twice.
        """
        if len(pairs) == 0:
            return
        self._check_blocks(pairs, self.num_blocks, self.num_blocks)
        if self._use_cuda():
            from .. import _cuda

            _cuda.copy_blocks(self.kv.view(self.num_layers * 2, self.num_blocks, -1), pairs)
        else:
            flat = self.kv.view(self.num_layers * 2, self.num_blocks, -1)
            ops.copy_blocks([flat[i] for i in range(flat.shape[0])], pairs)

    def swap_blocks(self, other: PagedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``self[src] -> other[dst]`` for every layer (device <-> CPU swap pools)."""
        if len(pairs) == 0:
            return
        if (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim) != (
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError("swap_blocks needs two caches of the same layers, block size, heads and head_dim")
        self._check_blocks(pairs, self.num_blocks, other.num_blocks)
        src = self.kv.transpose(0, 2)  # [num_blocks, 2, num_layers, ...]
        dst = other.kv.transpose(0, 2)
        ops.swap_blocks(src, dst, pairs)

    def paged_attention(
        self,
        layer: int,
        query: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_lens: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """Attention over this layer's pages (see :func:`batchkit.kv.ops.paged_attention`);
        ``block_tables``, ``seq_lens`` and ``query_lens`` may be numpy arrays or lists too."""
        block_tables, seq_lens = self._index(block_tables), self._index(seq_lens)
        self._check_tables(block_tables, seq_lens)
        if query_lens is not None:
            query_lens = self._index(query_lens)
        return ops.paged_attention(query, self.key(layer), self.value(layer), block_tables, seq_lens, query_lens, scale)

    # ------------------------------------------------------------------ validation

    def _index(self, x: Any) -> Tensor:
        """An index array as a tensor: the allocator's numpy arrays (and lists) move to the cache's
        device; a tensor is used as it is."""
        import torch

        if isinstance(x, torch.Tensor):
            return x
        t = torch.as_tensor(x, device=self.device)
        return t.long() if t.numel() == 0 else t

    def _check_tokens(self, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        want = (self.num_kv_heads, self.head_dim)
        if key.dim() != 3 or tuple(key.shape[1:]) != want or key.shape != value.shape:
            raise ValueError(
                f"key and value must both be [num_tokens, {want[0]}, {want[1]}], got {tuple(key.shape)} "
                f"and {tuple(value.shape)}"
            )
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(
                f"slot_mapping must be 1-D with one slot per token ({key.shape[0]}), got {tuple(slot_mapping.shape)}"
            )

    def _check_tables(self, block_tables: Tensor, seq_lens: Tensor) -> None:
        """The checks the CUDA gather kernel makes of its index arrays (with ``CHECK_INDICES``), made
        on the torch path, where they cost no device synchronisation."""
        if block_tables.dim() != 2 or not _is_integer(block_tables):
            raise ValueError(
                f"block_tables must be a 2-D integer tensor, got {block_tables.dtype} {tuple(block_tables.shape)}"
            )
        if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0] or not _is_integer(seq_lens):
            raise ValueError(
                f"seq_lens must be 1-D integers, one length per block-table row ({block_tables.shape[0]}), got "
                f"{seq_lens.dtype} {tuple(seq_lens.shape)}"
            )
        if not seq_lens.numel():
            return
        if int(seq_lens.min()) < 0:
            raise ValueError(f"seq_lens must be >= 0, got {int(seq_lens.min())}")
        capacity = block_tables.shape[1] * self.block_size
        if int(seq_lens.max()) > capacity:
            raise ValueError(
                f"a sequence of {int(seq_lens.max())} tokens is longer than its block-table row can address "
                f"({block_tables.shape[1]} blocks of {self.block_size})"
            )
        if block_tables.numel() and (int(block_tables.max()) >= self.num_blocks or int(block_tables.min()) < 0):
            raise ValueError(f"block_tables hold a block outside 0..{self.num_blocks - 1}")

    def _check_slots(self, slot_mapping: Tensor) -> None:
        if not _is_integer(slot_mapping):  # the CUDA kernel refuses it in its own checks
            raise ValueError(f"slot_mapping must hold integer slots, got {slot_mapping.dtype}")
        if slot_mapping.numel() and int(slot_mapping.max()) >= self.num_blocks * self.block_size:
            raise ValueError(
                f"slot {int(slot_mapping.max())} is outside the cache ({self.num_blocks * self.block_size} slots)"
            )

    def _checked_slots(self, slot_mapping: Tensor) -> tuple[Tensor, Tensor | None]:
        """``slot_mapping`` checked, as the int64 slots to write and the mask of the tokens that are
        not padding (None when none is).

        Every layer of a step scatters at the same slots: int64 slots without padding, once
        checked, are written through as they are at the next calls with the same tensor, without
        the check's two reductions. (Rewritten in place in between, a slot outside the cache is
        still refused, by ``index_copy_``'s IndexError.)"""
        if slot_mapping is self._checked:
            return slot_mapping, None
        self._check_slots(slot_mapping)
        if slot_mapping.numel() == 0 or int(slot_mapping.min()) >= 0:
            slots = slot_mapping.long()
            if slots is slot_mapping:
                self._checked = slot_mapping
            return slots, None
        keep = slot_mapping >= 0
        return slot_mapping[keep].long(), keep

    @staticmethod
    def _check_blocks(pairs: Sequence[tuple[int, int]], n_src: int, n_dst: int) -> None:
        seen: set[int] = set()
        for s, d in pairs:
            if not (0 <= s < n_src and 0 <= d < n_dst):
                raise ValueError(f"block pair ({s}, {d}) is outside the pools ({n_src} and {n_dst} blocks)")
            if d in seen:
                raise ValueError(f"block {d} is the destination of two pairs; each block may be written once per call")
            seen.add(d)

    def __repr__(self) -> str:
        return (
            f"<PagedKVCache layers={self.num_layers} blocks={self.num_blocks}x{self.block_size} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} {self.dtype} {self.device}>"
        )
