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

from .._errors import InvalidBlock, KVCacheExhausted, UnknownSequence
from .._validate import positive_int
from .blocks import BlockPool
from .growth import Growth
from .prefix import PrefixCache
from .quotas import TenantQuotas
from .sequences import SeqBatch, SeqInfo, Sequences
from .supply import BlockSupply
from .swap import SwapSpace
from .swapping import Swapper
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
    (:class:`~batchkit.kv.quotas.TenantQuotas`), and the parts that work across them:
    ``supply`` (:class:`~batchkit.kv.supply.BlockSupply`: blocks out and back, the room check),
    ``growth`` (:class:`~batchkit.kv.growth.Growth`: more slots, copy-on-write), ``sequences``
    (:class:`~batchkit.kv.sequences.Sequences`) and ``swapper``
    (:class:`~batchkit.kv.swapping.Swapper`); read them, change state only through the
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
        positive_int("block_size", block_size)
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
        self.pool = BlockPool(num_blocks)
        self.tables = BlockTables(block_size)
        self.prefix = PrefixCache(block_size)
        self.swap_space = SwapSpace(num_cpu_blocks)
        self.quotas = TenantQuotas(tenant_quotas, self.total_blocks)
        self.supply = BlockSupply(self.pool, self.prefix, self.quotas, int(watermark * self.total_blocks))
        self.growth = Growth(self.tables, self.supply)
        self.sequences = Sequences()
        self.swapper = Swapper(self.swap_space, self.sequences, self.tables, self.supply)
        self._seqs = self.sequences.by_id  # read directly on the per-step paths

    # ------------------------------------------------------------------ blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return self.supply.num_free

    # ------------------------------------------------------------------ sequences

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
            info = self.sequences.resident(seq_id)  # raises
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
        return self.supply.watermark_blocks

    @property
    def admission_blocks(self) -> int:
        """The most blocks admission can ever give one sequence: the cache's blocks less the
        watermark. A sequence that needs more :meth:`never_fits`."""
        return self.total_blocks - self.supply.watermark_blocks

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
            self.supply.check_room(self.blocks_needed(num_tokens), tenant, admission=True)
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
        self.supply.check_room(fresh + len(revived), tenant, admission=True, charged=need_total)
        # Checks passed: mutate.
        for b in revived:
            self.prefix.revive(b)
        self.pool.share(hit_blocks)
        new = self.supply.take(fresh)
        row = self.tables.new_row()
        self.tables.set_blocks(row, np.concatenate((np.asarray(hit_blocks, dtype=np.int32), new)), n)
        info = SeqInfo(row, tenant)
        if tokens is not None:
            # The hits are indexed; the prompt's other full blocks are once marked computed.
            info.keys = self.prefix.new_keys(tokens, tenant, hashes)
            self.prefix.count_lookup(n, len(hit_blocks) * self.block_size)
        self.sequences.add(seq_id, info)
        self.quotas.charge(tenant, need_total)
        return len(hit_blocks) * self.block_size

    # ------------------------------------------------------------------ growth (one path for one or many)

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
        infos = [self.sequences.resident(sid) for sid in seq_ids]
        rows = np.fromiter((i.row for i in infos), dtype=np.int64, count=len(infos))
        return self.growth.fits(rows, [i.tenant for i in infos], n)

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
            info = self.sequences.resident(seq_id)  # raises
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids has {len(token_ids)} ids for n={n} slots")
        # Read as ints before anything changes (a bad id leaves the sequence as it was).
        ids = None if token_ids is None or info.keys is None else _token_ints(token_ids)
        slots = self.growth.append_row(info.row, n, info.tenant)
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
        return self.sequences.batch(seq_ids, any_swapped=bool(self.swap_space.num_swapped))

    def blocks_needed_batch(self, seqs: SeqBatch) -> int:
        """Blocks one more token for each sequence of the handle would take (copy-on-write included)."""
        return self.growth.blocks_needed(self.sequences.rows(seqs, any_swapped=bool(self.swap_space.num_swapped)))

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
        rows = self.sequences.rows(seqs, any_swapped=bool(self.swap_space.num_swapped))
        if token_ids is not None and len(token_ids) != rows.size:
            raise ValueError(f"token_ids has {len(token_ids)} ids for {rows.size} sequences")
        if not rows.size:
            return np.empty(0, dtype=np.int64)
        ids = None if token_ids is None or not self.enable_prefix_caching else _token_ints(token_ids)
        seq_ids, by_id = seqs.seq_ids, self._seqs
        slots = self.growth.append(rows, 1, lambda i: by_id[seq_ids[i]].tenant)
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
        info = self.sequences.resident(parent)
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
        new = SeqInfo(row, info.tenant)
        new.num_dropped = dropped
        if info.keys is not None:
            new.keys = info.keys.copy()
        self.sequences.add(child, new)
        self.quotas.charge(info.tenant, nb)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (cached ones stay reusable until evicted).

        Raises:
            UnknownSequence: not allocated, or freed already.
        """
        info = self.sequences.remove(seq_id)
        row = info.row
        nb = int(self.tables.num_blocks[row]) - info.num_dropped
        if info.cpu_blocks is not None:
            self.swap_space.discard(info.cpu_blocks)
        else:
            self.supply.release(self.tables.blocks(row)[info.num_dropped :].copy())
        self.quotas.refund(info.tenant, nb)
        self.tables.release_row(row)

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
        info = self.sequences.resident(seq_id)
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
        self.supply.release(table[row, start:end].copy())
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
        return self.swapper.swap_out(seq_id)

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; return the (cpu, device) block copies to do.

        Raises:
            UnknownSequence, BatchkitError (not swapped out), KVCacheExhausted (nothing changes).
        """
        return self.swapper.swap_in(seq_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self.sequences.get(seq_id).cpu_blocks is not None

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
        return int(self.tables.lens[self.sequences.get(seq_id).row])

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's blocks, in order (a copy, int32); blocks given back by
        :meth:`release_before` read as the null block 0."""
        return self.tables.blocks(self.sequences.resident(seq_id).row).copy()

    def block_tables(self, seq_ids: Sequence[Hashable], width: int | None = None) -> np.ndarray:
        """Block tables of several sequences as one ``[n, width]`` int32 array, padded with block 0."""
        try:
            rows = self.batch(seq_ids).rows
        except ValueError:  # a sequence listed twice: fine for a view, look each one up
            rows = np.fromiter((self.sequences.resident(s).row for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        return self.tables.padded(rows, width)

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> np.ndarray:
        """Slots (int64) of the sequence's token positions ``start..end-1``."""
        info = self.sequences.resident(seq_id)
        length = int(self.tables.lens[info.row])
        start = _int(start, "start")
        end = length if end is None else _int(end, "end")
        if not 0 <= start <= end <= length:
            raise ValueError(f"positions {start}..{end} are outside the sequence's {length} tokens")
        return self.tables.row_slots(info.row, start, end - start)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies (src, dst) queued since the last call; perform them
        (``PagedKVCache.copy_blocks``) before the next step writes to those blocks."""
        return self.growth.take_copies()

    def ref_count(self, block: int) -> int:
        if not 0 < block < self.num_blocks:
            raise InvalidBlock(f"block {block} is not in 1..{self.num_blocks - 1}")
        return int(self.pool.ref[block])

    def statistics(self) -> AllocatorStatistics:
        used = self.pool.num_used
        tokens, slots, dropped_slots = self.sequences.occupancy(self.tables)
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
            copies=self.growth.num_copies,
            evictions=prefix.evictions,
            tenant_usage=self.quotas.usage(),
        )

    def __repr__(self) -> str:
        return (
            f"<PagedKVAllocator blocks={self.total_blocks} free={self.num_free_blocks} "
            f"seqs={len(self._seqs)} block_size={self.block_size}>"
        )
