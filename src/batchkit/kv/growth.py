"""Growth: more token slots for rows of the block tables, all-or-nothing, with copy-on-write.

One growth plan (:meth:`Growth.plan`: new blocks per row, and which rows first copy a shared,
partially filled last block) and one growth step (:meth:`Growth.append`) serve one sequence and
many alike. The step checks every block and quota before it changes anything, then takes one of
three paths by cost: a decode step with no block shared (the common case: one new block for
each row whose last block filled), a decode step with shared blocks (copy-on-write first), and
``n > 1`` new slots per row. :meth:`Growth.append_row` is the one-sequence form, on plain ints.

It knows rows and tenants, not sequence ids, prefix-cache keys or swap: the allocator tells it
each row's tenant. The copies that copy-on-write needs are queued for :meth:`take_copies`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from .supply import BlockSupply
from .tables import BlockTables

__all__ = ["Growth"]


class Growth:
    """Slots for ``n`` more tokens of rows of ``tables``, blocks from ``supply``."""

    __slots__ = ("_has_quotas", "copies", "num_copies", "pool", "quotas", "supply", "tables")

    def __init__(self, tables: BlockTables, supply: BlockSupply) -> None:
        self.tables = tables
        self.supply = supply
        self.pool = supply.pool
        self.quotas = supply.quotas
        self._has_quotas = bool(self.quotas)  # fixed at construction: checked once per call, not looked up
        self.copies: list[tuple[int, int]] = []
        """Copy-on-write block copies (src, dst) not taken yet."""
        self.num_copies = 0

    def plan(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """For ``n`` more tokens in each row: the rows' token counts, the new blocks each row
        takes, and which rows first copy a shared, partially filled last block (None: no block
        is shared, so none does)."""
        t = self.tables
        bs = t.block_size
        lens = t.lens[rows]
        # A resident row holds exactly blocks_needed(lens) blocks.
        new = (lens % bs == 0) if n == 1 else (lens + (n + bs - 1)) // bs - t.num_blocks[rows]
        if not self.pool.num_shared:
            return lens, new, None
        last = t.table[rows, np.maximum(t.num_blocks[rows] - 1, 0)]
        ref = self.pool.ref
        cow = (lens % bs != 0) & (ref[last] > 1)
        if cow.any():
            # A block every holder of which writes now: the others copy it, the last row keeps
            # it (as one append_slots after another would do), not one copy more than needed.
            blocks, writers = np.unique(last[cow], return_counts=True)
            for b in blocks[writers == ref[blocks]].tolist():
                cow[np.nonzero(cow & (last == b))[0][-1]] = False
        return lens, new, cow

    def blocks_needed(self, rows: np.ndarray) -> int:
        """Blocks one more token for each row would take (copy-on-write included)."""
        _, new, cow = self.plan(rows, 1)
        return int(np.count_nonzero(new)) + (int(np.count_nonzero(cow)) if cow is not None else 0)

    def fits(self, rows: np.ndarray, tenants: Sequence[Hashable], n: int) -> bool:
        """Whether every row (of the tenant at the same index) can take ``n`` more tokens now."""
        _, new, cow = self.plan(rows, n)
        need = new.astype(np.int64) if cow is None else new.astype(np.int64) + cow
        if int(need.sum()) > self.supply.num_free:
            return False
        per_tenant: dict[Hashable, int] = {}
        for tenant, k in zip(tenants, need.tolist(), strict=True):
            per_tenant[tenant] = per_tenant.get(tenant, 0) + k
        return all(self.quotas.allows(tenant, k) for tenant, k in per_tenant.items())

    def append_row(self, row: int, n: int, tenant: Hashable) -> np.ndarray:
        """``n`` new slots for one row of ``tenant`` (all-or-nothing); their slot mapping.

        The one-row path reads the row as plain ints: a decode loop calls it every step for
        every sequence, and index arrays cost more than the bookkeeping they would vectorise."""
        t = self.tables
        bs = t.block_size
        length = int(t.lens[row])
        nb = -(-length // bs)  # a resident row holds exactly blocks_needed(length) blocks
        if length % bs and self.pool.num_shared and self.pool.ref[t.table[row, nb - 1]] > 1:
            # Copy-on-write of a shared partial last block (after fork): the general path.
            return self.append(np.array([row], dtype=np.int64), n, lambda _: tenant)
        new = (length + n - 1) // bs + 1 - nb
        if new:
            if self._has_quotas or new > self.pool.num_free:
                self.supply.check_room(new, tenant, admission=False)
            t.extend_row(row, nb, self.supply.take(new))
            self.quotas.charge(tenant, new)
        t.lens[row] = length + n
        return t.row_slots(row, length, n)

    def append(self, rows: np.ndarray, n: int, tenant_of: Callable[[int], Hashable]) -> np.ndarray:
        """``n`` new slots for each row (all-or-nothing); return their slot mapping, row after row.
        ``tenant_of(i)``: the tenant of ``rows[i]`` (asked only of the rows that take blocks)."""
        lens, new, cow = self.plan(rows, n)
        t = self.tables
        if cow is None and n == 1:  # a decode step with no block shared: the common case
            grows = new.nonzero()[0]
            if grows.size:
                self._grow_one_each(rows, grows, tenant_of)
            t.lens[rows] = lens + 1
            return t.slots(rows, lens, 1)
        grows = (new if cow is None else new | cow).nonzero()[0]
        if grows.size:
            self._grow(rows, grows, new, cow, n, [tenant_of(i) for i in grows.tolist()])
        t.lens[rows] = lens + n
        return t.slots(rows, lens, n)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies (src, dst) queued since the last call."""
        out, self.copies = self.copies, []
        return out

    def _grow(
        self,
        rows: np.ndarray,
        grows: np.ndarray,
        new: np.ndarray,
        cow: np.ndarray | None,
        n: int,
        tenants: list[Hashable],
    ) -> None:
        """New blocks (and copies of shared last blocks) for the rows ``rows[grows]`` of
        ``tenants``, all-or-nothing: every block and quota is checked first."""
        if n > 1:
            fresh: list[int] = new[grows].tolist()
        elif cow is None:  # a decode step: each growing row takes one new block
            fresh = [1] * grows.size
        else:
            fresh = [int(f) for f in new[grows].tolist()]
        per_row = fresh if cow is None else [f + c for f, c in zip(fresh, cow[grows].tolist(), strict=True)]
        total = sum(per_row)
        if total > self.supply.num_free:
            self.supply.check_room(total, None, admission=False)
        per_tenant: dict[Hashable, int] = {}  # blocks each tenant takes
        charge: dict[Hashable, int] = {}  # of which new blocks (copy-on-write swaps one for one)
        for tenant, k, f in zip(tenants, per_row, fresh, strict=True):
            per_tenant[tenant] = per_tenant.get(tenant, 0) + k
            if f:
                charge[tenant] = charge.get(tenant, 0) + f
        if self.quotas:
            for tenant, k in per_tenant.items():
                self.quotas.check(tenant, k)
        # Checks passed: mutate.
        if cow is not None:
            for row, copies in zip(rows[grows].tolist(), cow[grows].tolist(), strict=True):
                if copies:
                    self._cow_last_block(row)
        if charge:
            adds = grows if cow is None else grows[new[grows] > 0]
            counts = None if n == 1 else new[adds]  # None: one block each
            self.tables.add_blocks(rows[adds], counts, self.supply.take(sum(fresh)))
            for tenant, k in charge.items():
                self.quotas.charge(tenant, k)

    def _grow_one_each(self, rows: np.ndarray, grows: np.ndarray, tenant_of: Callable[[int], Hashable]) -> None:
        """One new block for each row ``rows[grows]`` (all-or-nothing; no copy-on-write)."""
        k = int(grows.size)
        if k > self.pool.num_free and k > self.supply.num_free:
            self.supply.check_room(k, None, admission=False)  # raises
        charge: dict[Hashable, int] = {}  # blocks each tenant takes
        for i in grows.tolist():
            tenant = tenant_of(i)
            charge[tenant] = charge.get(tenant, 0) + 1
        quotas = self.quotas
        if self._has_quotas:
            for tenant, c in charge.items():
                quotas.check(tenant, c)
        # Checks passed: mutate.
        self.tables.add_blocks(rows[grows], None, self.supply.take(k))
        for tenant, c in charge.items():
            quotas.charge(tenant, c)

    def _cow_last_block(self, row: int) -> None:
        """Give the row its own copy of a shared, partially filled last block."""
        table = self.tables.table
        last = int(self.tables.num_blocks[row]) - 1
        old = int(table[row, last])
        (new,) = self.supply.take(1)
        table[row, last] = new
        self.supply.release(np.array([old], dtype=np.int32))
        self.copies.append((old, int(new)))
        self.num_copies += 1

    def __repr__(self) -> str:
        return f"<Growth copies_pending={len(self.copies)} copies={self.num_copies}>"
