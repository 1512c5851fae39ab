"""PagedKVAllocator: the bookkeeping of a paged KV cache, with no tensors and no I/O.

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

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import BatchkitError, InvalidBlock, KVCacheExhausted, UnknownSequence

__all__ = [
    "AllocatorStatistics",
    "InvalidBlock",
    "PagedKVAllocator",
    "SeqBatch",
    "UnknownSequence",
]

NULL_BLOCK = 0


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
    __slots__ = ("cpu_blocks", "hashes", "row", "tenant", "tokens")

    def __init__(self, row: int, tenant: Hashable) -> None:
        self.row = row
        self.tenant = tenant
        self.tokens: list[int] | None = None  # kept only with prefix caching
        self.hashes: list[int] = []  # chained hash of each full block (prefix caching)
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
        self._watermark_blocks = int(watermark * self.total_blocks)
        # Free stack: the top is at _num_free - 1. Low ids on top, so allocation order is stable.
        self._free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)
        self._num_free = num_blocks - 1
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        # Prefix cache: hash -> block, block -> (hash, tokens); evictable cached blocks in LRU order.
        self._hash_to_block: dict[int, int] = {}
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # CPU swap pool.
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        # Sequences: a dense row per live sequence in the block-table array.
        self._seqs: dict[Hashable, _SeqInfo] = {}
        self._free_rows: list[int] = []
        self._tables = np.zeros((8, 8), dtype=np.int32)
        self._lens = np.zeros(8, dtype=np.int64)  # tokens per row
        self._nblk = np.zeros(8, dtype=np.int32)  # blocks per row
        self._next_row = 0
        # Quotas.
        self._quotas: dict[Hashable, int] = {}
        for tenant, q in (tenant_quotas or {}).items():
            blocks = int(q * self.total_blocks) if isinstance(q, float) else int(q)
            if blocks < 0:
                raise ValueError(f"tenant_quotas[{tenant!r}] must be >= 0, got {q!r}")
            self._quotas[tenant] = blocks
        self._tenant_blocks: dict[Hashable, int] = {}
        self._copies: list[tuple[int, int]] = []
        self._num_swapped = 0
        self._shared = 0  # references beyond the first, over all blocks: 0 means nothing is shared
        self._epoch = 0  # bumped whenever a row may change owner (free, swap): SeqBatch handles check it
        # Statistics.
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._swaps_out = 0
        self._swaps_in = 0
        self._num_copies = 0
        self._evictions = 0

    # ------------------------------------------------------------------ blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return self._num_free + len(self._evictable)

    def _take_blocks(self, n: int) -> np.ndarray:
        """Pop ``n`` blocks (ref set to 1), evicting cached blocks in LRU order if needed.

        Callers check availability first, so this never fails half-way.
        """
        out = np.empty(n, dtype=np.int32)
        k = min(n, self._num_free)
        if k:
            top = self._num_free
            out[:k] = self._free[top - k : top][::-1]
            self._num_free -= k
        for i in range(k, n):
            block, _ = self._evictable.popitem(last=False)
            h, _tokens = self._block_key.pop(block)
            del self._hash_to_block[h]
            self._evictions += 1
            out[i] = block
        self._ref[out] = 1
        return out

    def _release_block(self, block: int) -> None:
        """Drop one reference; a block nobody holds goes back to the pool (or the LRU, if cached)."""
        r = self._ref[block] - 1
        self._ref[block] = r
        if r > 0:
            self._shared -= 1
        elif r == 0:
            if block in self._block_key:
                self._evictable[block] = None
            else:
                self._free[self._num_free] = block
                self._num_free += 1

    def _release_blocks(self, blocks: np.ndarray) -> None:
        """:meth:`_release_block` for one sequence's (distinct) blocks, vectorised."""
        if not blocks.size:
            return
        r = self._ref[blocks] - 1
        self._ref[blocks] = r
        self._shared -= int(np.count_nonzero(r > 0))
        zero = blocks[r == 0]
        if self._block_key and zero.size:
            cached = np.fromiter((b in self._block_key for b in zero.tolist()), dtype=bool, count=zero.size)
            for b in zero[cached].tolist():
                self._evictable[b] = None
            zero = zero[~cached]
        k = zero.size
        self._free[self._num_free : self._num_free + k] = zero[::-1]
        self._num_free += k

    def _check_room(self, n: int, tenant: Hashable, *, admission: bool) -> None:
        avail = self.num_free_blocks - (self._watermark_blocks if admission else 0)
        if n > avail:
            raise KVCacheExhausted(
                f"need {n} KV blocks, {max(avail, 0)} available"
                + (f" above the watermark ({self._watermark_blocks} kept free)" if admission else "")
                + "; free or preempt sequences, or give the cache more blocks"
            )
        quota = self._quotas.get(tenant)
        if quota is not None and self._tenant_blocks.get(tenant, 0) + n > quota:
            raise KVCacheExhausted(
                f"tenant {tenant!r} would hold {self._tenant_blocks.get(tenant, 0) + n} blocks, over its quota of "
                f"{quota}; free some of its sequences or raise its quota"
            )

    def _charge(self, tenant: Hashable, n: int) -> None:
        if n:
            self._tenant_blocks[tenant] = self._tenant_blocks.get(tenant, 0) + n

    # ------------------------------------------------------------------ rows

    def _new_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        if row >= self._tables.shape[0]:
            rows = 2 * self._tables.shape[0]
            self._tables = _grow(self._tables, (rows, self._tables.shape[1]))
            self._lens = _grow(self._lens, (rows,))
            self._nblk = _grow(self._nblk, (rows,))
        self._next_row += 1
        return row

    def _ensure_cols(self, nblocks: int) -> None:
        cols = self._tables.shape[1]
        if nblocks > cols:
            while cols < nblocks:
                cols *= 2
            self._tables = _grow(self._tables, (self._tables.shape[0], cols))

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

    # ------------------------------------------------------------------ prefix caching

    def _block_hash(self, prev: int | None, tokens: tuple[int, ...], salt: Hashable) -> int:
        # The first block mixes in the tenant salt, so tenants never share cached blocks.
        return hash(("batchkit-kv", salt, tokens) if prev is None else (prev, tokens))

    def _lookup_prefix(self, tokens: Sequence[int], salt: Hashable) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) matching the prompt's leading full blocks."""
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        prev: int | None = None
        # Leave at least one prompt token to compute, so that the step yields logits.
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._block_hash(prev, chunk, salt)
            b = self._hash_to_block.get(h)
            if b is None or self._block_key[b][1] != chunk:  # a collision never serves others' cache
                break
            blocks.append(b)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def _register_full_blocks(self, info: _SeqInfo, salt: Hashable, num_computed: int) -> None:
        """Index the sequence's full blocks among its first ``num_computed`` tokens in the prefix cache."""
        tokens = info.tokens
        if tokens is None:
            return
        bs = self.block_size
        row = info.row
        full = min(num_computed, len(tokens)) // bs
        for i in range(len(info.hashes), full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            prev = info.hashes[-1] if info.hashes else None
            h = self._block_hash(prev, chunk, salt)
            info.hashes.append(h)
            block = int(self._tables[row, i])
            if h not in self._hash_to_block and block not in self._block_key:
                self._hash_to_block[h] = block
                self._block_key[block] = (h, chunk)

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
        info = self._resident(seq_id)
        if num_tokens > int(self._lens[info.row]) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is outside the sequence's {int(self._lens[info.row])} tokens")
        if info.tokens is not None:
            self._register_full_blocks(info, info.tenant, num_tokens)

    # ------------------------------------------------------------------ admission and allocation

    @property
    def watermark_blocks(self) -> int:
        """Blocks admission (:meth:`can_allocate`, :meth:`allocate`) leaves free for growth."""
        return self._watermark_blocks

    @property
    def has_quotas(self) -> bool:
        """Whether any tenant has a block quota."""
        return bool(self._quotas)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def quota_of(self, tenant: Hashable) -> int | None:
        """The tenant's block quota (None: unlimited)."""
        return self._quotas.get(tenant)

    def within_quota(self, num_tokens: int, tenant: Hashable) -> bool:
        """Whether the tenant may take ``num_tokens`` more tokens' blocks under its quota."""
        quota = self._quotas.get(tenant)
        return quota is None or self._tenant_blocks.get(tenant, 0) + self.blocks_needed(num_tokens) <= quota

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
        n = prompt if isinstance(prompt, int) else len(prompt)
        if n < 1:
            raise ValueError("a prompt needs at least one token")
        tokens = None if isinstance(prompt, int) else [int(t) for t in prompt]
        hit_blocks: list[int] = []
        hashes: list[int] = []
        if self.enable_prefix_caching and tokens is not None:
            hit_blocks, hashes = self._lookup_prefix(tokens, tenant)
        need_total = self.blocks_needed(n)
        fresh = need_total - len(hit_blocks)
        # Reviving an evictable hit also consumes an available block.
        revived = sum(1 for b in hit_blocks if self._ref[b] == 0)
        self._check_room(fresh + revived, tenant, admission=True)
        # Checks passed: mutate.
        for b in hit_blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
            else:
                self._shared += 1
            self._ref[b] += 1
        new = self._take_blocks(fresh)
        row = self._new_row()
        self._ensure_cols(need_total)
        self._tables[row, : len(hit_blocks)] = hit_blocks
        self._tables[row, len(hit_blocks) : need_total] = new
        self._lens[row] = n
        self._nblk[row] = need_total
        info = _SeqInfo(row, tenant)
        if self.enable_prefix_caching and tokens is not None:
            info.tokens = tokens
            info.hashes = hashes  # the hits; blocks filled from here on register in mark_computed
            self._prefix_queries += n
            self._prefix_hits += len(hit_blocks) * self.block_size
        self._seqs[seq_id] = info
        self._charge(tenant, need_total)
        return len(hit_blocks) * self.block_size

    def _cow_last_block(self, info: _SeqInfo) -> None:
        """Give the sequence its own copy of a shared, partially filled last block."""
        row = info.row
        last = int(self._nblk[row]) - 1
        old = int(self._tables[row, last])
        (new,) = self._take_blocks(1)
        self._tables[row, last] = new
        self._release_block(old)
        self._copies.append((old, int(new)))
        self._num_copies += 1

    def can_append_slots(self, seq_ids: Iterable[Hashable], n: int = 1) -> bool:
        """Whether every listed sequence can take ``n`` more tokens now (blocks and quotas)."""
        need = 0
        per_tenant: dict[Hashable, int] = {}
        for sid in seq_ids:
            info = self._resident(sid)
            k = self._blocks_for_append(info, n)
            need += k
            per_tenant[info.tenant] = per_tenant.get(info.tenant, 0) + k
        if need > self.num_free_blocks:
            return False
        for tenant, k in per_tenant.items():
            quota = self._quotas.get(tenant)
            if quota is not None and self._tenant_blocks.get(tenant, 0) + k > quota:
                return False
        return True

    def _blocks_for_append(self, info: _SeqInfo, n: int) -> int:
        row = info.row
        length = int(self._lens[row])
        nb = int(self._nblk[row])
        k = self.blocks_needed(length + n) - nb
        if length % self.block_size and self._ref[self._tables[row, nb - 1]] > 1:
            k += 1  # copy-on-write of the shared partial block
        return k

    def append_slots(self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None) -> np.ndarray:
        """Reserve slots for ``n`` new tokens of a sequence; return their slot mapping (int64).

        A block is allocated only when the last one fills. If the last block is shared (after
        :meth:`fork`) and partially filled, the sequence gets its own copy first; the copy to
        perform is queued for :meth:`take_copies`. With prefix caching, pass ``token_ids`` so that
        blocks filled by generation become reusable too.

        Raises:
            UnknownSequence, KVCacheExhausted (nothing is changed then), ValueError for n < 1.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        info = self._resident(seq_id)
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids has {len(token_ids)} ids for n={n} slots")
        k = self._blocks_for_append(info, n)
        self._check_room(k, info.tenant, admission=False)
        row = info.row
        length = int(self._lens[row])
        bs = self.block_size
        if length % bs and self._ref[self._tables[row, self._nblk[row] - 1]] > 1:
            self._cow_last_block(info)
            k -= 1
        nb = int(self._nblk[row])
        if k:
            self._ensure_cols(nb + k)
            self._tables[row, nb : nb + k] = self._take_blocks(k)
            self._nblk[row] = nb + k
            self._charge(info.tenant, k)
        self._lens[row] = length + n
        pos = np.arange(length, length + n, dtype=np.int64)
        slots: np.ndarray = self._tables[row, pos // bs].astype(np.int64) * bs + pos % bs
        if info.tokens is not None:
            if token_ids is None:
                info.tokens = None  # generated ids unknown: stop caching this sequence's blocks
            else:
                info.tokens.extend(int(t) for t in token_ids)
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
        if self._num_swapped:
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
        if seqs.epoch != self._epoch:
            fresh = self.batch(seqs.seq_ids)
            seqs.rows, seqs.epoch = fresh.rows, fresh.epoch
        rows = seqs.rows
        offs = self._lens[rows] % self.block_size
        needs_block = offs == 0
        n = int(np.count_nonzero(needs_block))
        if self._shared:
            last = self._tables[rows, np.maximum(self._nblk[rows] - 1, 0)]
            n += int(np.count_nonzero((~needs_block) & (self._ref[last] > 1)))
        return n

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
        elif seqs.epoch != self._epoch:  # rows may have changed owner: revalidate in place
            fresh = self.batch(seqs.seq_ids)
            seqs.rows, seqs.epoch = fresh.rows, fresh.epoch
        rows = seqs.rows
        if token_ids is not None and len(token_ids) != rows.size:
            raise ValueError(f"token_ids has {len(token_ids)} ids for {rows.size} sequences")
        if not rows.size:
            return np.empty(0, dtype=np.int64)
        bs = self.block_size
        lens = self._lens[rows]
        offs = lens % bs
        needs_block = offs == 0
        if self._shared:
            last = self._tables[rows, np.maximum(self._nblk[rows] - 1, 0)]
            shared_partial = (~needs_block) & (self._ref[last] > 1)
            grows = np.flatnonzero(needs_block | shared_partial)
        else:
            shared_partial = None
            grows = np.flatnonzero(needs_block)
        if grows.size:
            infos = [self._seqs[seqs.seq_ids[i]] for i in grows]
            if grows.size > self.num_free_blocks:
                self._check_room(int(grows.size), None, admission=False)
            grow_flags = needs_block[grows].tolist()
            per_tenant: dict[Hashable, int] = {}  # blocks each tenant takes this step
            charge: dict[Hashable, int] = {}  # of which new blocks (copy-on-write swaps one for one)
            for info, new_block in zip(infos, grow_flags, strict=True):
                per_tenant[info.tenant] = per_tenant.get(info.tenant, 0) + 1
                if new_block:
                    charge[info.tenant] = charge.get(info.tenant, 0) + 1
            if self._quotas:
                for t, k in per_tenant.items():
                    self._check_room(k, t, admission=False)
            if shared_partial is not None:
                for info, new_block in zip(infos, grow_flags, strict=True):
                    if not new_block:
                        self._cow_last_block(info)
            grow_rows = rows[needs_block]
            if grow_rows.size:
                cols = self._nblk[grow_rows]
                self._ensure_cols(int(cols.max()) + 1)
                self._tables[grow_rows, cols] = self._take_blocks(int(grow_rows.size))
                self._nblk[grow_rows] = cols + 1
                for t, k in charge.items():
                    self._charge(t, k)
        self._lens[rows] = lens + 1
        slots: np.ndarray = self._tables[rows, lens // bs].astype(np.int64) * bs + offs
        if self.enable_prefix_caching:
            for j, sid in enumerate(seqs.seq_ids):
                info = self._seqs[sid]
                if info.tokens is None:
                    continue
                if token_ids is None:
                    info.tokens = None
                    continue
                info.tokens.append(int(token_ids[j]))
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
        nb = int(self._nblk[info.row])
        quota = self._quotas.get(info.tenant)
        if quota is not None and self._tenant_blocks.get(info.tenant, 0) + nb > quota:
            raise KVCacheExhausted(f"tenant {info.tenant!r} would exceed its quota of {quota} blocks by forking")
        row = self._new_row()
        self._ensure_cols(nb)
        blocks = self._tables[info.row, :nb]
        self._tables[row, :nb] = blocks
        self._lens[row] = self._lens[info.row]
        self._nblk[row] = nb
        np.add.at(self._ref, blocks, 1)
        self._shared += nb
        new = _SeqInfo(row, info.tenant)
        if info.tokens is not None:
            new.tokens = list(info.tokens)
            new.hashes = list(info.hashes)
        self._seqs[child] = new
        self._charge(info.tenant, nb)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (cached ones stay reusable until evicted).

        Raises:
            UnknownSequence: not allocated, or freed already.
        """
        info = self._seq(seq_id)
        del self._seqs[seq_id]
        row = info.row
        nb = int(self._nblk[row])
        if info.cpu_blocks is not None:
            self._cpu_free.extend(info.cpu_blocks)
            self._num_swapped -= 1
        else:
            self._release_blocks(self._tables[row, :nb].copy())
        self._tenant_blocks[info.tenant] = self._tenant_blocks.get(info.tenant, 0) - nb
        if not self._tenant_blocks[info.tenant]:
            del self._tenant_blocks[info.tenant]
        self._tables[row, :nb] = NULL_BLOCK
        self._lens[row] = 0
        self._nblk[row] = 0
        self._free_rows.append(row)
        self._epoch += 1

    # ------------------------------------------------------------------ swap

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the CPU pool; return the (device, cpu) block copies to do.

        Perform the copies before the device blocks are reused (i.e. before the next allocation).

        Raises:
            UnknownSequence, KVCacheExhausted (CPU pool too small; nothing changes).
        """
        info = self._resident(seq_id)
        row = info.row
        nb = int(self._nblk[row])
        if nb > len(self._cpu_free):
            raise KVCacheExhausted(f"swap_out needs {nb} CPU blocks, {len(self._cpu_free)} free; add num_cpu_blocks")
        gpu = self._tables[row, :nb].tolist()
        cpu = [self._cpu_free.pop() for _ in range(nb)]
        self._release_blocks(self._tables[row, :nb].copy())
        info.cpu_blocks = cpu
        self._num_swapped += 1
        self._epoch += 1
        self._tables[row, :nb] = NULL_BLOCK
        self._swaps_out += 1
        return list(zip(gpu, cpu, strict=True))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; return the (cpu, device) block copies to do.

        Raises:
            UnknownSequence, BatchkitError (not swapped out), KVCacheExhausted (nothing changes).
        """
        info = self._seq(seq_id)
        if info.cpu_blocks is None:
            raise BatchkitError(f"sequence {seq_id!r} is not swapped out")
        nb = len(info.cpu_blocks)
        if nb > self.num_free_blocks:
            raise KVCacheExhausted(f"swap_in needs {nb} blocks, {self.num_free_blocks} free")
        new = self._take_blocks(nb)
        self._tables[info.row, :nb] = new
        cpu = info.cpu_blocks
        info.cpu_blocks = None
        self._num_swapped -= 1
        self._cpu_free.extend(cpu)
        # Blocks rewritten from CPU get fresh ids, so this sequence's cache index restarts; they
        # register again once marked computed (the copies run before the next step).
        info.hashes = info.hashes[:0]
        self._swaps_in += 1
        return list(zip(cpu, new.tolist(), strict=True))

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._seq(seq_id).cpu_blocks is not None

    # ------------------------------------------------------------------ views

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds slots for."""
        return int(self._lens[self._seq(seq_id).row])

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's blocks, in order (a copy, int32)."""
        info = self._resident(seq_id)
        return self._tables[info.row, : self._nblk[info.row]].copy()

    def block_tables(self, seq_ids: Sequence[Hashable], width: int | None = None) -> np.ndarray:
        """Block tables of several sequences as one ``[n, width]`` int32 array, padded with block 0."""
        try:
            rows = self.batch(seq_ids).rows
        except ValueError:  # a sequence listed twice: fine for a view, look each one up
            rows = np.fromiter((self._resident(s).row for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        need = int(self._nblk[rows].max()) if rows.size else 0
        width = need if width is None else width
        if width < need:
            raise ValueError(f"width={width} is narrower than the longest block table ({need})")
        out = np.zeros((rows.size, width), dtype=np.int32)
        k = min(width, self._tables.shape[1])
        out[:, :k] = self._tables[rows, :k]
        return out

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> np.ndarray:
        """Slots (int64) of the sequence's token positions ``start..end-1``."""
        info = self._resident(seq_id)
        length = int(self._lens[info.row])
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise ValueError(f"positions {start}..{end} are outside the sequence's {length} tokens")
        pos = np.arange(start, end, dtype=np.int64)
        bs = self.block_size
        slots: np.ndarray = self._tables[info.row, pos // bs].astype(np.int64) * bs + pos % bs
        return slots

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies (src, dst) queued since the last call; perform them
        (``PagedKVCache.copy_blocks``) before the next step writes to those blocks."""
        out, self._copies = self._copies, []
        return out

    def ref_count(self, block: int) -> int:
        if not 0 < block < self.num_blocks:
            raise InvalidBlock(f"block {block} is not in 1..{self.num_blocks - 1}")
        return int(self._ref[block])

    def statistics(self) -> AllocatorStatistics:
        used = int(np.count_nonzero(self._ref))
        cached = len(self._evictable)
        resident_rows = [i.row for i in self._seqs.values() if i.cpu_blocks is None]
        rows = np.asarray(resident_rows, dtype=np.int64)
        tokens = int(self._lens[rows].sum()) if rows.size else 0
        slots = int(self._nblk[rows].sum()) * self.block_size if rows.size else 0
        return AllocatorStatistics(
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            free_blocks=self._num_free,
            used_blocks=used,
            cached_blocks=cached,
            usage=used / self.total_blocks,
            num_seqs=len(self._seqs),
            num_tokens=tokens,
            fragmentation=(slots - tokens) / slots if slots else 0.0,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            prefix_hit_rate=self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0,
            cpu_total_blocks=self.num_cpu_blocks,
            cpu_free_blocks=len(self._cpu_free),
            swaps_out=self._swaps_out,
            swaps_in=self._swaps_in,
            copies=self._num_copies,
            evictions=self._evictions,
            tenant_usage=dict(self._tenant_blocks),
        )

    def __repr__(self) -> str:
        return (
            f"<PagedKVAllocator blocks={self.total_blocks} free={self.num_free_blocks} "
            f"seqs={len(self._seqs)} block_size={self.block_size}>"
        )


def _grow(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=arr.dtype)
    out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out
