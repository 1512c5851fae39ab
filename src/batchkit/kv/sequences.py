"""Sequences: the allocator's live sequences by id, and handles on sets of them.

Each sequence (:class:`SeqInfo`) has a row of the block tables, a tenant, the prefix-cache keys
of its blocks, the leading blocks a sliding window gave back, and its CPU blocks while swapped
out. A :class:`SeqBatch` is a reusable handle on a fixed set of sequences; the registry's
``epoch`` moves whenever a row may change owner (a free, a swap), and a handle whose epoch is
older is looked up again. It holds no blocks and moves none: the allocator does.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .._errors import BatchkitError, UnknownSequence
from .prefix import SeqKeys
from .tables import BlockTables

__all__ = ["SeqBatch", "SeqInfo", "Sequences"]


class SeqBatch:
    """A handle on a fixed set of sequences (see :meth:`PagedKVAllocator.batch`)."""

    __slots__ = ("epoch", "rows", "seq_ids")

    def __init__(self, seq_ids: tuple[Hashable, ...], rows: np.ndarray, epoch: int) -> None:
        self.seq_ids = seq_ids
        self.rows = rows
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.seq_ids)


class SeqInfo:
    """One live sequence, as the allocator keeps it (the caller keeps the tokens)."""

    __slots__ = ("cpu_blocks", "keys", "num_dropped", "row", "tenant")

    def __init__(self, row: int, tenant: Hashable) -> None:
        self.row = row
        self.tenant = tenant
        # Leading blocks given back by release_before (a sliding window): their table entries
        # are the null block, and nothing of the sequence holds them any more.
        self.num_dropped = 0
        # Prefix-cache keys of the sequence's blocks (None: no caching, or its ids are unknown).
        # The allocator keeps no token list: the caller holds the tokens.
        self.keys: SeqKeys | None = None
        self.cpu_blocks: list[int] | None = None  # set while swapped out


class Sequences:
    """The live sequences by id, oldest first, and the epoch that :class:`SeqBatch` handles check."""

    __slots__ = ("by_id", "epoch")

    def __init__(self) -> None:
        self.by_id: dict[Hashable, SeqInfo] = {}
        """Every live sequence (resident or swapped out); read it, change it through the methods."""
        self.epoch = 0

    def get(self, seq_id: Hashable) -> SeqInfo:
        """The sequence.

        Raises:
            UnknownSequence: not allocated, or freed already.
        """
        info = self.by_id.get(seq_id)
        if info is None:
            raise UnknownSequence(f"sequence {seq_id!r} is not allocated (never allocated, or already freed)")
        return info

    def resident(self, seq_id: Hashable) -> SeqInfo:
        """The sequence, which must be on the device.

        Raises:
            UnknownSequence; BatchkitError: it is swapped out.
        """
        info = self.get(seq_id)
        if info.cpu_blocks is not None:
            raise BatchkitError(f"sequence {seq_id!r} is swapped out; swap_in it first")
        return info

    def add(self, seq_id: Hashable, info: SeqInfo) -> None:
        self.by_id[seq_id] = info

    def remove(self, seq_id: Hashable) -> SeqInfo:
        """Forget the sequence (its row may go to another: handles look their rows up again).

        Raises:
            UnknownSequence: not allocated, or freed already.
        """
        info = self.get(seq_id)
        del self.by_id[seq_id]
        self.epoch += 1
        return info

    def moved(self) -> None:
        """A sequence's row changed hands (a swap): handles look their rows up again."""
        self.epoch += 1

    def batch(self, seq_ids: Sequence[Hashable], *, any_swapped: bool) -> SeqBatch:
        """A handle on ``seq_ids``, each resident (``any_swapped``: whether any sequence is
        swapped out now, so each must be checked).

        Raises:
            UnknownSequence, BatchkitError (a sequence is swapped out), ValueError (repeats).
        """
        seq_ids = tuple(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a batch lists each sequence once")
        if any_swapped:
            infos = [self.resident(s) for s in seq_ids]
        else:
            by_id = self.by_id
            try:
                infos = [by_id[s] for s in seq_ids]
            except KeyError as exc:
                raise UnknownSequence(f"sequence {exc.args[0]!r} is not allocated") from None
        rows = np.array([i.row for i in infos], dtype=np.int64)
        return SeqBatch(seq_ids, rows, self.epoch)

    def rows(self, seqs: SeqBatch, *, any_swapped: bool) -> np.ndarray:
        """The handle's rows, revalidated in place if a free or swap may have moved them."""
        if seqs.epoch != self.epoch:
            fresh = self.batch(seqs.seq_ids, any_swapped=any_swapped)
            seqs.rows, seqs.epoch = fresh.rows, fresh.epoch
        return seqs.rows

    def occupancy(self, tables: BlockTables) -> tuple[int, int, int]:
        """Of the resident sequences: the tokens they hold, the slots of the blocks they hold,
        and the slots of the leading blocks a sliding window gave back (neither held nor filled)."""
        resident = [i for i in self.by_id.values() if i.cpu_blocks is None]
        if not resident:
            return 0, 0, 0
        rows = np.asarray([i.row for i in resident], dtype=np.int64)
        dropped_slots = sum(i.num_dropped for i in resident) * tables.block_size
        tokens = int(tables.lens[rows].sum())
        return tokens, int(tables.num_blocks[rows].sum()) * tables.block_size - dropped_slots, dropped_slots

    def __repr__(self) -> str:
        return f"<Sequences n={len(self.by_id)} epoch={self.epoch}>"
