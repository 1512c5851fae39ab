"""Swapper: a sequence's blocks moved between the device pool and the CPU swap space.

A swap-out gives the sequence's device blocks back (cached ones stay reusable until evicted) and
detaches its row; a swap-in takes fresh device blocks and attaches them. Each returns the block
copies its runtime must do, as data ((device, cpu) pairs out, (cpu, device) pairs in, for
``PagedKVCache.swap_blocks``). Every precondition is checked before anything changes.
"""

from __future__ import annotations

from collections.abc import Hashable

from .._errors import BatchkitError, KVCacheExhausted
from .sequences import Sequences
from .supply import BlockSupply
from .swap import SwapSpace
from .tables import BlockTables

__all__ = ["Swapper"]


class Swapper:
    """Swaps the ``sequences`` between ``supply``'s device blocks and ``space``'s CPU blocks."""

    __slots__ = ("sequences", "space", "supply", "tables")

    def __init__(self, space: SwapSpace, sequences: Sequences, tables: BlockTables, supply: BlockSupply) -> None:
        self.space = space
        self.sequences = sequences
        self.tables = tables
        self.supply = supply

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a resident sequence's blocks to the CPU pool; the (device, cpu) copies to do.

        Raises:
            UnknownSequence, BatchkitError (swapped out already), KVCacheExhausted (CPU pool too
                small; nothing changes).
        """
        info = self.sequences.resident(seq_id)
        row = info.row
        gpu = self.tables.blocks(row)[info.num_dropped :].copy()
        nb = gpu.size
        if not self.space.can_swap_out(nb):
            raise KVCacheExhausted(f"swap_out needs {nb} CPU blocks, {self.space.num_free} free; add num_cpu_blocks")
        cpu = self.space.swap_out(nb)
        self.supply.release(gpu)
        info.cpu_blocks = cpu
        self.sequences.moved()
        self.tables.detach(row)
        return list(zip(gpu.tolist(), cpu, strict=True))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; the (cpu, device) copies to do.

        Raises:
            UnknownSequence, BatchkitError (not swapped out), KVCacheExhausted (nothing changes).
        """
        info = self.sequences.get(seq_id)
        cpu = info.cpu_blocks
        if cpu is None:
            raise BatchkitError(f"sequence {seq_id!r} is not swapped out")
        nb = len(cpu)
        if nb > self.supply.num_free:
            raise KVCacheExhausted(f"swap_in needs {nb} blocks, {self.supply.num_free} free")
        new = self.supply.take(nb)
        self.tables.attach(info.row, new, info.num_dropped)
        info.cpu_blocks = None
        self.space.swap_in(cpu)
        # The blocks come back under fresh ids. Those indexed before the swap-out stay indexed
        # under their old ids (evictable) until evicted; the keys of the others are kept, and
        # they enter the index under the new ids once marked computed.
        return list(zip(cpu, new.tolist(), strict=True))

    def __repr__(self) -> str:
        return f"<Swapper {self.space!r}>"
