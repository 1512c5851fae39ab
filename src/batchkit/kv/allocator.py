"""PagedKVAllocator: the bookkeeping of a paged KV cache, with no tensors and no I/O.

A thin facade over one sans-I/O core per concern: :class:`BlockPool` (reference counts, free
stack; ``kv/blocks.py``), :class:`BlockTables` (a row of block ids per sequence;
``kv/tables.py``), :class:`PrefixCache` (content hash -> block, the LRU of evictable cached
blocks; ``kv/prefix.py``), :class:`SwapSpace` (CPU blocks; ``kv/swap.py``) and
:class:`TenantQuotas` (``kv/quotas.py``). The facade checks every precondition before it
changes anything, and keeps the sequences: each one's row, tenant and prefix-cache keys (the
caller keeps the tokens).

KV memory is cut into blocks of ``block_size`` token slots. Each sequence owns a block table (the
blocks holding its tokens, in order); token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``. Block 0 is reserved as the null
block: padded block-table entries point at it and nothing is ever written there.

Free blocks are a stack in a numpy int32 array, reference counts a numpy int32 array, and the
block tables one 2-D numpy int32 array with a row per live sequence, so that the per-step work of
a decode loop (:meth:`append_slots_batch`) is a handful of vectorised operations however many
sequences run. Python objects appear only where they must: the prefix-cache index (hash -> block)
and the rare copy-on-write and block-filling paths.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import BatchkitError, InvalidBlock, KVCacheExhausted, UnknownSequence
from .blocks import BlockPool
from .prefix import PrefixCache, SeqKeys
from .quotas import TenantQuotas
from .swap import SwapSpace
from .tables import BlockTables

__all__ = [
    "AllocatorStatistics",
    "InvalidBlock",
    "PagedKVAllocator",
    "SeqBatch",
    "UnknownSequence",
]


def _token_ints(token_ids: Sequence[object]) -> list[int]:
    """Token ids as Python ints (prefix keys hash alike whatever ints were given), read before
    anything changes: a ValueError for an id that is not an int leaves the pool as it was."""
    return [_int(t, "token_ids (token ids)") for t in token_ids]


def _int(value: object, name: str) -> int:
    """``value`` as an int (numpy's included); ValueError naming ``name`` for anything else (a
    float, a bool): a fractional token count would corrupt the block tables."""
    if type(value) is int:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class AllocatorStatistics:
    """A snapshot of a :class:`PagedKVAllocator`.

    ``free + used + cached == total`` always holds (the null block is not counted).
    ``fragmentation`` is the share of allocated slots that hold no token (the unused tail of each
    sequence's last block). ``prefix_hit_rate`` is cached prompt tokens / prompt tokens looked up.
    """

    block_size: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    usage: float
    num_seqs: int
    num_tokens: int
    fragmentation: float
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    cpu_total_blocks: int
    cpu_free_blocks: int
    swaps_out: int
    swaps_in: int
    copies: int
    evictions: int
    tenant_usage: dict[Hashable, int] = field(default_factory=dict)


class SeqBatch:
    """A handle on a fixed set of sequences (see :meth:`PagedKVAllocator.batch`)."""

    __slots__ = ("epoch", "rows", "seq_ids")

    def __init__(self, seq_ids: tuple[Hashable, ...], rows: np.ndarray, epoch: int) -> None:
        self.seq_ids = seq_ids
        self.rows = rows
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.seq_ids)


class _SeqInfo:
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


class PagedKVAllocator:
    """Block pool, block tables, slot mapping, reference counts, prefix caching, quotas and swap.

    Args:
        num_blocks: blocks in the device pool, including the reserved null block 0 (>= 2).
        block_size: token slots per block (>= 1).
        watermark: fraction of blocks that admission (:meth:`can_allocate`, :meth:`allocate`)
            leaves free for running sequences to grow into, in [0, 1).
        enable_prefix_caching: share full blocks between sequences whose prompts begin alike.
        num_cpu_blocks: blocks in the CPU swap pool (0: no swapping).
        tenant_quotas: ``{tenant: max blocks}`` (an int, or a float fraction of the pool); a
            tenant over its quota gets :class:`KVCacheExhausted`, never its neighbours.

    Raises:
        ValueError: for out-of-range arguments.

    The cores are attributes: ``pool`` (:class:`~batchkit.kv.blocks.BlockPool`), ``tables``
    (:class:`~batchkit.kv.tables.BlockTables`), ``prefix``
    (:class:`~batchkit.kv.prefix.PrefixCache`), ``swap_space``
    (:class:`~batchkit.kv.swap.SwapSpace`) and ``quotas``
    (:class:`~batchkit.kv.quotas.TenantQuotas`); read them, change state only through the
    allocator's methods.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        tenant_quotas: dict[Hashable, int | float] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark = watermark
        self.enable_prefix_caching = enable_prefix_caching
        self.total_blocks = num_blocks - 1
        self.num_cpu_blocks = num_cpu_blocks
        self._watermark_blocks = int(watermark * self.total_blocks)
        self.pool = BlockPool(num_blocks)
        self.tables = BlockTables(block_size)
        self.prefix = PrefixCache(block_size)
        self.swap_space = SwapSpace(num_cpu_blocks)
        self.quotas = TenantQuotas(tenant_quotas, self.total_blocks)
        self._has_quotas = bool(self.quotas)  # fixed at construction: checked once per call, not looked up
        self._seqs: dict[Hashable, _SeqInfo] = {}
        self._copies: list[tuple[int, int]] = []
        self._num_copies = 0
        self._epoch = 0  # bumped whenever a row may change owner (free, swap): SeqBatch handles check it

    # ------------------------------------------------------------------ blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return self.pool.num_free + self.prefix.num_evictable

    def _take_blocks(self, n: int) -> np.ndarray:
        """Hand out ``n`` blocks (reference count 1): free ones first, then evicted cached ones in
        LRU order. Callers check availability first, so this never fails half-way."""
        k = min(n, self.pool.num_free)
        out = self.pool.pop_free(k)
        if k < n:
            out = np.concatenate((out, np.asarray(self.prefix.evict(n - k), dtype=np.int32)))
        self.pool.hold(out)
        return out

    def _release_blocks(self, blocks: np.ndarray) -> None:
        """Drop one reference from each of one sequence's (distinct) blocks; a block nobody holds
        goes back to the pool, or onto the prefix cache's LRU list if it is cached."""
        self.pool.push_free(self.prefix.park(self.pool.release(blocks)))

    def _check_room(self, n: int, tenant: Hashable, *, admission: bool, charged: int | None = None) -> None:
        """Refuse taking ``n`` blocks from the pool, or charging ``tenant`` for ``charged`` (default
        ``n``: more when cached blocks another sequence holds are shared, which each holder pays)."""
        avail = self.num_free_blocks - (self._watermark_blocks if admission else 0)
        if n > avail:
            raise KVCacheExhausted(
                f"need {n} KV blocks, {max(avail, 0)} available"
                + (f" above the watermark ({self._watermark_blocks} kept free)" if admission else "")
                + "; free or preempt sequences, or give the cache more blocks"
            )
        self.quotas.check(tenant, n if charged is None else charged)

    # ------------------------------------------------------------------ sequences

    def _seq(self, seq_id: Hashable) -> _SeqInfo:
        info = self._seqs.get(seq_id)
        if info is None:
            raise UnknownSequence(f"sequence {seq_id!r} is not allocated (never allocated, or already freed)")
        return info

    def _resident(self, seq_id: Hashable) -> _SeqInfo:
        info = self._seq(seq_id)
        if info.cpu_blocks is not None:
            raise BatchkitError(f"sequence {seq_id!r} is swapped out; swap_in it first")
        return info

    def _rows(self, seqs: SeqBatch) -> np.ndarray:
        """The handle's rows, revalidated in place if a free or swap may have moved them."""
        if seqs.epoch != self._epoch:
            fresh = self.batch(seqs.seq_ids)
            seqs.rows, seqs.epoch = fresh.rows, fresh.epoch
        return seqs.rows

    # ------------------------------------------------------------------ prefix caching

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Tell the allocator that the K/V of the sequence's first ``num_tokens`` tokens are written.

        With prefix caching, a full block becomes reusable by other sequences (and by this one
        after a preemption) only once it is marked computed: a block whose K/V were never written
        (its request aborted or preempted before the step that fills it ran) is never a cache hit.
        Call it after each step that wrote the sequence's K/V (the :class:`Scheduler` does). A no-op
        without prefix caching or for a sequence whose generated ids were not passed.

        Raises:
            UnknownSequence, BatchkitError (swapped out), ValueError (more tokens than it holds).
        """
        info = self._seqs.get(seq_id)
        if info is None or info.cpu_blocks is not None:
            info = self._resident(seq_id)  # raises
        num_tokens = _int(num_tokens, "num_tokens")
        length = int(self.tables.lens[info.row])
        if num_tokens > length or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is outside the sequence's {length} tokens")
        keys = info.keys
        # Called after every step: most calls fill no new block, so skip the block-table view.
        if keys is not None and keys.num_indexed < min(num_tokens // self.block_size, len(keys.hashes)):
            self.prefix.mark_computed(keys, self.tables.blocks(info.row), num_tokens)

    # ------------------------------------------------------------------ admission and allocation

    @property
    def watermark_blocks(self) -> int:
        """Blocks admission (:meth:`can_allocate`, :meth:`allocate`) leaves free for growth."""
        return self._watermark_blocks

    @property
    def admission_blocks(self) -> int:
        """The most blocks admission can ever give one sequence: the cache's blocks less the
        watermark. A sequence that needs more :meth:`never_fits`."""
        return self.total_blocks - self._watermark_blocks

    @property
    def max_admitted_tokens(self) -> int:
        """The most tokens one sequence can ever be admitted with (:attr:`admission_blocks` in
        tokens): a sequence of one token more :meth:`never_fits`, whatever its tenant."""
        return self.admission_blocks * self.block_size

    @property
    def has_quotas(self) -> bool:
        """Whether any tenant has a block quota."""
        return bool(self.quotas)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy.

        Raises:
            ValueError: a negative ``num_tokens``.
        """
        num_tokens = _int(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        return -(-num_tokens // self.block_size)

    def quota_of(self, tenant: Hashable) -> int | None:
        """The tenant's block quota (None: unlimited)."""
        return self.quotas.quota_of(tenant)

    def never_fits(self, num_tokens: int, tenant: Hashable = None) -> str | None:
        """Why one sequence of ``num_tokens`` tokens of ``tenant`` could never be admitted, even
        with the cache to itself: its blocks against the cache less the watermark, then against the
        tenant's quota; None if it could. The reason reads after its subject ("a 9-token prompt
        ..."): ``"needs 3 KV blocks but admission has 2 (...)"``."""
        need = self.blocks_needed(num_tokens)
        room = self.admission_blocks
        if need > room:
            return (
                f"needs {need} KV blocks but admission has {room} (the cache's {self.total_blocks} blocks less "
                f"the watermark's {self.watermark_blocks})"
            )
        quota = self.quota_of(tenant)
        if quota is not None and need > quota:
            return f"needs {need} KV blocks but tenant {tenant!r} has a quota of {quota}"
        return None

    def within_quota(self, num_tokens: int, tenant: Hashable) -> bool:
        """Whether the tenant may take ``num_tokens`` more tokens' blocks under its quota."""
        return self.quotas.allows(tenant, self.blocks_needed(num_tokens))

    def can_allocate(self, num_tokens: int, *, tenant: Hashable = None) -> bool:
        """Whether a whole prompt of ``num_tokens`` fits now, above the watermark and within quota.

        Prefix-cache hits are not counted, so the answer is conservative.
        """
        try:
            self._check_room(self.blocks_needed(num_tokens), tenant, admission=True)
        except KVCacheExhausted:
            return False
        return True

    def allocate(
        self,
        seq_id: Hashable,
        prompt: int | Sequence[int],
        *,
        tenant: Hashable = None,
    ) -> int:
        """Allocate blocks for a new sequence's whole prompt.

        Args:
            seq_id: a new, hashable id.
            prompt: the prompt's token ids (needed for prefix caching), or just its length.
            tenant: owner for quotas and the prefix-cache salt (tenants never share blocks).

        Returns:
            How many leading prompt tokens are already in the cache (a multiple of
            ``block_size``; 0 without prefix caching): the step need not recompute them.

        Raises:
            ValueError: ``seq_id`` already allocated, or an empty prompt.
            KVCacheExhausted: not enough blocks above the watermark, or over the tenant's quota.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or use a new id")
        ids: Sequence[int] | None = None if isinstance(prompt, int) or not hasattr(prompt, "__len__") else prompt
        n = _int(prompt, "prompt (a token count)") if ids is None else len(ids)
        if n < 1:
            raise ValueError("a prompt needs at least one token")
        # With prefix caching the prompt is keyed, not kept: the caller holds the tokens (read
        # here as Python ints, so that keys hash and compare alike whatever ints were given).
        tokens = None if ids is None or not self.enable_prefix_caching else list(map(int, ids))
        hit_blocks: list[int] = []
        hashes: list[int] = []
        if tokens is not None:
            hit_blocks, hashes = self.prefix.lookup(tokens, tenant)
        need_total = self.blocks_needed(n)
        fresh = need_total - len(hit_blocks)
        ref = self.pool.ref
        revived = [b for b in hit_blocks if ref[b] == 0]  # reviving an evictable hit takes an available block
        self._check_room(fresh + len(revived), tenant, admission=True, charged=need_total)
        # Checks passed: mutate.
        for b in revived:
            self.prefix.revive(b)
        self.pool.share(hit_blocks)
        new = self._take_blocks(fresh)
        row = self.tables.new_row()
        self.tables.set_blocks(row, np.concatenate((np.asarray(hit_blocks, dtype=np.int32), new)), n)
        info = _SeqInfo(row, tenant)
        if tokens is not None:
            # The hits are indexed; the prompt's other full blocks are once marked computed.
            info.keys = self.prefix.new_keys(tokens, tenant, hashes)
            self.prefix.count_lookup(n, len(hit_blocks) * self.block_size)
        self._seqs[seq_id] = info
        self.quotas.charge(tenant, need_total)
        return len(hit_blocks) * self.block_size

    # ------------------------------------------------------------------ growth (one path for one or many)

    def _growth(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """For ``n`` more tokens in each row: the rows' token counts, the new blocks each row
        takes, and which rows first copy a shared, partially filled last block (None: no block
        is shared, so none does)."""
        t = self.tables
        bs = self.block_size
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

    def _append(self, seq_ids: Sequence[Hashable], rows: np.ndarray, n: int) -> np.ndarray:
        """``n`` new slots for each row (all-or-nothing); return their slot mapping, row after row."""
        lens, new, cow = self._growth(rows, n)
        if cow is None and n == 1:  # a decode step with no block shared: the common case
            grows = new.nonzero()[0]
            if grows.size:
                self._grow_one_each(seq_ids, rows, grows)
            t = self.tables
            t.lens[rows] = lens + 1
            return t.slots(rows, lens, 1)
        grows = (new if cow is None else new | cow).nonzero()[0]
        if grows.size:
            infos = [self._seqs[seq_ids[i]] for i in grows.tolist()]
            if n > 1:
                fresh: list[int] = new[grows].tolist()
            elif cow is None:  # a decode step: each growing row takes one new block
                fresh = [1] * grows.size
            else:
                fresh = [int(f) for f in new[grows].tolist()]
            per_row = fresh if cow is None else [f + c for f, c in zip(fresh, cow[grows].tolist(), strict=True)]
            total = sum(per_row)
            if total > self.num_free_blocks:
                self._check_room(total, None, admission=False)
            per_tenant: dict[Hashable, int] = {}  # blocks each tenant takes
            charge: dict[Hashable, int] = {}  # of which new blocks (copy-on-write swaps one for one)
            for info, k, f in zip(infos, per_row, fresh, strict=True):
                per_tenant[info.tenant] = per_tenant.get(info.tenant, 0) + k
                if f:
                    charge[info.tenant] = charge.get(info.tenant, 0) + f
            if self.quotas:
                for tenant, k in per_tenant.items():
                    self.quotas.check(tenant, k)
            # Checks passed: mutate.
            if cow is not None:
                for info, copies in zip(infos, cow[grows].tolist(), strict=True):
                    if copies:
                        self._cow_last_block(info)
            if charge:
                adds = grows if cow is None else grows[new[grows] > 0]
                counts = None if n == 1 else new[adds]  # None: one block each
                self.tables.add_blocks(rows[adds], counts, self._take_blocks(sum(fresh)))
                for tenant, k in charge.items():
                    self.quotas.charge(tenant, k)
        self.tables.lens[rows] = lens + n
        return self.tables.slots(rows, lens, n)

    def _grow_one_each(self, seq_ids: Sequence[Hashable], rows: np.ndarray, grows: np.ndarray) -> None:
        """One new block for each row ``rows[grows]`` (all-or-nothing; no copy-on-write)."""
        k = int(grows.size)
        if k > self.pool.num_free and k > self.num_free_blocks:
            self._check_room(k, None, admission=False)  # raises
        seqs = self._seqs
        charge: dict[Hashable, int] = {}  # blocks each tenant takes
        for i in grows.tolist():
            tenant = seqs[seq_ids[i]].tenant
            charge[tenant] = charge.get(tenant, 0) + 1
        quotas = self.quotas
        if self._has_quotas:
            for tenant, c in charge.items():
                quotas.check(tenant, c)
        # Checks passed: mutate.
        self.tables.add_blocks(rows[grows], None, self._take_blocks(k))
        for tenant, c in charge.items():
            quotas.charge(tenant, c)

    def _cow_last_block(self, info: _SeqInfo) -> None:
        """Give the sequence its own copy of a shared, partially filled last block."""
        row = info.row
        table = self.tables.table
        last = int(self.tables.num_blocks[row]) - 1
        old = int(table[row, last])
        (new,) = self._take_blocks(1)
        table[row, last] = new
        self._release_blocks(np.array([old], dtype=np.int32))
        self._copies.append((old, int(new)))
        self._num_copies += 1

    def _record_tokens(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int] | None, n: int) -> None:
        """Key the blocks that caching sequences' new tokens fill (``n`` each, row after row); a
        sequence whose new ids are unknown stops caching its blocks."""
        for j, sid in enumerate(seq_ids):
            info = self._seqs[sid]
            if info.keys is None:
                continue
            if token_ids is None:
                info.keys = None
            else:
                self.prefix.extend(info.keys, list(token_ids[j * n : (j + 1) * n]))

    def can_append_slots(self, seq_ids: Iterable[Hashable], n: int = 1) -> bool:
        """Whether every listed sequence can take ``n`` more tokens now (blocks and quotas)."""
        n = _int(n, "n")
        infos = [self._resident(sid) for sid in seq_ids]
        rows = np.fromiter((i.row for i in infos), dtype=np.int64, count=len(infos))
        _, new, cow = self._growth(rows, n)
        need = new.astype(np.int64) if cow is None else new.astype(np.int64) + cow
        if int(need.sum()) > self.num_free_blocks:
            return False
        per_tenant: dict[Hashable, int] = {}
        for info, k in zip(infos, need.tolist(), strict=True):
            per_tenant[info.tenant] = per_tenant.get(info.tenant, 0) + k
        return all(self.quotas.allows(tenant, k) for tenant, k in per_tenant.items())

    def append_slots(self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None) -> np.ndarray:
        """Reserve slots for ``n`` new tokens of a sequence; return their slot mapping (int64).

        A block is allocated only when the last one fills. If the last block is shared (after
        :meth:`fork`) and partially filled, the sequence gets its own copy first; the copy to
        perform is queued for :meth:`take_copies`. With prefix caching, pass ``token_ids`` so that
        blocks filled by generation become reusable too.

        Raises:
            UnknownSequence, KVCacheExhausted (nothing is changed then), ValueError for n < 1.
        """
        if type(n) is not int:
            n = _int(n, "n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        info = self._seqs.get(seq_id)
        if info is None or info.cpu_blocks is not None:
            info = self._resident(seq_id)  # raises
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids has {len(token_ids)} ids for n={n} slots")
        # Read as ints before anything changes (a bad id leaves the sequence as it was).
        ids = None if token_ids is None or info.keys is None else _token_ints(token_ids)
        # The one-sequence path reads the row as plain ints: a decode loop calls it every step for
        # every sequence, and index arrays cost more than the bookkeeping they would vectorise.
        t = self.tables
        row = info.row
        bs = self.block_size
        length = int(t.lens[row])
        nb = -(-length // bs)  # a resident row holds exactly blocks_needed(length) blocks
        if length % bs and self.pool.num_shared and self.pool.ref[t.table[row, nb - 1]] > 1:
            # Copy-on-write of a shared partial last block (after fork): the general path.
            slots = self._append((seq_id,), np.array([row], dtype=np.int64), n)
        else:
            new = (length + n - 1) // bs + 1 - nb
            if new:
                if self._has_quotas or new > self.pool.num_free:
                    self._check_room(new, info.tenant, admission=False)
                t.extend_row(row, nb, self._take_blocks(new))
                self.quotas.charge(info.tenant, new)
            t.lens[row] = length + n
            slots = t.row_slots(row, length, n)
        keys = info.keys
        if keys is not None:
            if ids is None:
                info.keys = None  # generated ids unknown: this sequence stops caching its blocks
            else:
                self.prefix.extend(keys, ids)
        return slots

    def batch(self, seq_ids: Sequence[Hashable]) -> SeqBatch:
        """A reusable handle on a set of running sequences for :meth:`append_slots_batch`.

        A decode loop whose running set does not change between steps keeps the handle and skips
        the per-sequence lookups; the handle revalidates itself after any free or swap.

        Raises:
            UnknownSequence, BatchkitError (a sequence is swapped out), ValueError (repeats).
        """
        seq_ids = tuple(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a batch lists each sequence once")
        if self.swap_space.num_swapped:
            infos = [self._resident(s) for s in seq_ids]
        else:
            seqs = self._seqs
            try:
                infos = [seqs[s] for s in seq_ids]
            except KeyError as exc:
                raise UnknownSequence(f"sequence {exc.args[0]!r} is not allocated") from None
        rows = np.array([i.row for i in infos], dtype=np.int64)
        return SeqBatch(seq_ids, rows, self._epoch)

    def blocks_needed_batch(self, seqs: SeqBatch) -> int:
        """Blocks one more token for each sequence of the handle would take (copy-on-write included)."""
        _, new, cow = self._growth(self._rows(seqs), 1)
        return int(np.count_nonzero(new)) + (int(np.count_nonzero(cow)) if cow is not None else 0)

    def append_slots_batch(
        self, seqs: Sequence[Hashable] | SeqBatch, token_ids: Sequence[int] | None = None
    ) -> np.ndarray:
        """One new token for each sequence (a decode step); return the slot mapping (int64).

        ``seqs`` is a list of sequence ids or a :meth:`batch` handle (faster). Vectorised over
        the sequences; all-or-nothing: if the step does not fit, raises
        :class:`KVCacheExhausted` and changes nothing (check with :meth:`can_append_slots`).
        """
        if not isinstance(seqs, SeqBatch):
            seqs = self.batch(seqs)
        rows = self._rows(seqs)
        if token_ids is not None and len(token_ids) != rows.size:
            raise ValueError(f"token_ids has {len(token_ids)} ids for {rows.size} sequences")
        if not rows.size:
            return np.empty(0, dtype=np.int64)
        ids = None if token_ids is None or not self.enable_prefix_caching else _token_ints(token_ids)
        slots = self._append(seqs.seq_ids, rows, 1)
        if self.enable_prefix_caching:
            self._record_tokens(seqs.seq_ids, ids, 1)
        return slots

    # ------------------------------------------------------------------ sharing and freeing

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Make ``child`` share all of ``parent``'s blocks (beam search, parallel sampling).

        Full blocks stay shared; the partially filled last block is copied on the first write
        by either sequence (see :meth:`append_slots`).

        Raises:
            UnknownSequence, ValueError (child exists), KVCacheExhausted (child's tenant quota).
        """
        info = self._resident(parent)
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} is already allocated")
        t = self.tables
        dropped = info.num_dropped
        nb = int(t.num_blocks[info.row]) - dropped
        if not self.quotas.allows(info.tenant, nb):
            quota = self.quotas.quota_of(info.tenant)
            raise KVCacheExhausted(f"tenant {info.tenant!r} would exceed its quota of {quota} blocks by forking")
        row = t.new_row()
        blocks = t.blocks(info.row).copy()
        t.set_blocks(row, blocks, int(t.lens[info.row]))
        self.pool.share(blocks[dropped:])
        new = _SeqInfo(row, info.tenant)
        new.num_dropped = dropped
        if info.keys is not None:
            new.keys = info.keys.copy()
        self._seqs[child] = new
        self.quotas.charge(info.tenant, nb)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (cached ones stay reusable until evicted).

        Raises:
            UnknownSequence: not allocated, or freed already.
        """
        info = self._seq(seq_id)
        del self._seqs[seq_id]
        row = info.row
        nb = int(self.tables.num_blocks[row]) - info.num_dropped
        if info.cpu_blocks is not None:
            self.swap_space.discard(info.cpu_blocks)
        else:
            self._release_blocks(self.tables.blocks(row)[info.num_dropped :].copy())
        self.quotas.refund(info.tenant, nb)
        self.tables.release_row(row)
        self._epoch += 1

    def release_before(self, seq_id: Hashable, num_tokens: int) -> int:
        """Give back the sequence's blocks that hold only tokens before position ``num_tokens``:
        no later step reads them (a model whose every layer attends over a sliding window).

        Their table entries become the null block 0 (the attention masks them out); the last
        block is always kept, and with prefix caching only blocks already indexed (marked
        computed) are given back, so that they stay reusable until evicted. Returns how many
        blocks were given back by this call.

        Raises:
            UnknownSequence, BatchkitError (swapped out), ValueError (a negative count).
        """
        info = self._resident(seq_id)
        num_tokens = _int(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        row = info.row
        end = min(num_tokens // self.block_size, int(self.tables.num_blocks[row]) - 1)
        if info.keys is not None:
            end = min(end, info.keys.num_indexed)
        start = info.num_dropped
        if end <= start:
            return 0
        table = self.tables.table
        self._release_blocks(table[row, start:end].copy())
        table[row, start:end] = 0
        info.num_dropped = end
        self.quotas.refund(info.tenant, end - start)
        return end - start

    # ------------------------------------------------------------------ swap

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the CPU pool; return the (device, cpu) block copies to do.

        Perform the copies before the device blocks are reused (i.e. before the next allocation).

        Raises:
            UnknownSequence, KVCacheExhausted (CPU pool too small; nothing changes).
        """
        info = self._resident(seq_id)
        row = info.row
        gpu = self.tables.blocks(row)[info.num_dropped :].copy()
        nb = gpu.size
        if not self.swap_space.can_swap_out(nb):
            raise KVCacheExhausted(
                f"swap_out needs {nb} CPU blocks, {self.swap_space.num_free} free; add num_cpu_blocks"
            )
        cpu = self.swap_space.swap_out(nb)
        self._release_blocks(gpu)
        info.cpu_blocks = cpu
        self._epoch += 1
        self.tables.detach(row)
        return list(zip(gpu.tolist(), cpu, strict=True))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; return the (cpu, device) block copies to do.

        Raises:
            UnknownSequence, BatchkitError (not swapped out), KVCacheExhausted (nothing changes).
        """
        info = self._seq(seq_id)
        cpu = info.cpu_blocks
        if cpu is None:
            raise BatchkitError(f"sequence {seq_id!r} is not swapped out")
        nb = len(cpu)
        if nb > self.num_free_blocks:
            raise KVCacheExhausted(f"swap_in needs {nb} blocks, {self.num_free_blocks} free")
        new = self._take_blocks(nb)
        self.tables.attach(info.row, new, info.num_dropped)
        info.cpu_blocks = None
        self.swap_space.swap_in(cpu)
        # The blocks come back under fresh ids. Those indexed before the swap-out stay indexed
        # under their old ids (evictable) until evicted; the keys of the others are kept, and
        # they enter the index under the new ids once marked computed.
        return list(zip(cpu, new.tolist(), strict=True))

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._seq(seq_id).cpu_blocks is not None

    # ------------------------------------------------------------------ views

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Hashable]:
        """The live sequences' ids (resident or swapped out), oldest first."""
        return iter(list(self._seqs))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds slots for."""
        return int(self.tables.lens[self._seq(seq_id).row])

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's blocks, in order (a copy, int32); blocks given back by
        :meth:`release_before` read as the null block 0."""
        return self.tables.blocks(self._resident(seq_id).row).copy()

    def block_tables(self, seq_ids: Sequence[Hashable], width: int | None = None) -> np.ndarray:
        """Block tables of several sequences as one ``[n, width]`` int32 array, padded with block 0."""
        try:
            rows = self.batch(seq_ids).rows
        except ValueError:  # a sequence listed twice: fine for a view, look each one up
            rows = np.fromiter((self._resident(s).row for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        t = self.tables
        need = int(t.num_blocks[rows].max()) if rows.size else 0
        width = need if width is None else width
        if width < need:
            raise ValueError(f"width={width} is narrower than the longest block table ({need})")
        out = np.zeros((rows.size, width), dtype=np.int32)
        k = min(width, t.table.shape[1])
        out[:, :k] = t.table[rows, :k]
        return out

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> np.ndarray:
        """Slots (int64) of the sequence's token positions ``start..end-1``."""
        info = self._resident(seq_id)
        length = int(self.tables.lens[info.row])
        start = _int(start, "start")
        end = length if end is None else _int(end, "end")
        if not 0 <= start <= end <= length:
            raise ValueError(f"positions {start}..{end} are outside the sequence's {length} tokens")
        return self.tables.row_slots(info.row, start, end - start)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies (src, dst) queued since the last call; perform them
        (``PagedKVCache.copy_blocks``) before the next step writes to those blocks."""
        out, self._copies = self._copies, []
        return out

    def ref_count(self, block: int) -> int:
        if not 0 < block < self.num_blocks:
            raise InvalidBlock(f"block {block} is not in 1..{self.num_blocks - 1}")
        return int(self.pool.ref[block])

    def statistics(self) -> AllocatorStatistics:
        used = self.pool.num_used
        resident = [i for i in self._seqs.values() if i.cpu_blocks is None]
        rows = np.asarray([i.row for i in resident], dtype=np.int64)
        t = self.tables
        dropped_slots = sum(i.num_dropped for i in resident) * self.block_size
        tokens = int(t.lens[rows].sum()) if rows.size else 0
        # Slots of the blocks held (a sliding window's given-back blocks are neither held nor filled).
        slots = int(t.num_blocks[rows].sum()) * self.block_size - dropped_slots if rows.size else 0
        prefix = self.prefix
        swap = self.swap_space
        return AllocatorStatistics(
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            free_blocks=self.pool.num_free,
            used_blocks=used,
            cached_blocks=prefix.num_evictable,
            usage=used / self.total_blocks,
            num_seqs=len(self._seqs),
            num_tokens=tokens,
            fragmentation=(slots - tokens + dropped_slots) / slots if slots else 0.0,
            prefix_queries=prefix.queries,
            prefix_hits=prefix.hits,
            prefix_hit_rate=prefix.hit_rate,
            cpu_total_blocks=self.num_cpu_blocks,
            cpu_free_blocks=swap.num_free,
            swaps_out=swap.swaps_out,
            swaps_in=swap.swaps_in,
            copies=self._num_copies,
            evictions=prefix.evictions,
            tenant_usage=self.quotas.usage(),
        )

    def __repr__(self) -> str:
        return (
            f"<PagedKVAllocator blocks={self.total_blocks} free={self.num_free_blocks} "
            f"seqs={len(self._seqs)} block_size={self.block_size}>"
        )
