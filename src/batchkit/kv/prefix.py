"""PrefixCache: full KV blocks indexed by the content of the tokens they hold.

A sans-I/O core with no tensors. A full block's key is a chained hash: the hash of its tokens
and of the previous block's key (the first block mixes in a salt, the tenant, so that tenants
never share blocks). A hit is served only if the stored tokens equal the asked ones, so a hash
collision never serves another prompt's K/V.

A sequence's keys (:class:`SeqKeys`) are computed as its tokens arrive, so that the cache keeps
no sequence's tokens: only the key of each full block, the tokens of its partial last block, and
the tokens of full blocks whose K/V are not written yet (those enter the index, as the block's
content for the token check, once they are).

A block enters the index once its K/V are written (:meth:`mark_computed`). A cached block
nobody holds any more is *evictable*: it stays indexed, on an LRU list, until the pool needs
it back (:meth:`evict`), or until a new sequence hits it (:meth:`revive`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

__all__ = ["PrefixCache", "SeqKeys"]


class SeqKeys:
    """One sequence's prefix-cache keys (see :meth:`PrefixCache.new_keys`).

    ``hashes`` holds the key of each full block of the sequence's known tokens, in order; the
    first ``num_indexed`` blocks are indexed (or were found in the index), ``pending`` holds the
    tokens of the others, and ``tail`` the tokens of the partial last block.
    """

    __slots__ = ("hashes", "num_indexed", "pending", "salt", "tail")

    def __init__(self, salt: Hashable, hashes: list[int] | None = None) -> None:
        self.salt = salt
        self.hashes: list[int] = hashes if hashes is not None else []
        self.num_indexed = len(self.hashes)
        self.pending: list[tuple[int, ...]] = []
        self.tail: list[int] = []

    def copy(self) -> SeqKeys:
        """An independent copy (a forked sequence's)."""
        out = SeqKeys(self.salt, list(self.hashes))
        out.num_indexed = self.num_indexed
        out.pending = list(self.pending)
        out.tail = list(self.tail)
        return out

    def __repr__(self) -> str:
        return f"<SeqKeys blocks={len(self.hashes)} indexed={self.num_indexed} tail={len(self.tail)}>"


class PrefixCache:
    """Content hash -> block index, the LRU list of evictable cached blocks, hit counters.

    Args:
        block_size: token slots per block.
    """

    __slots__ = ("_block_key", "_evictable", "_hash_to_block", "block_size", "evictions", "hits", "queries")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hash_to_block: dict[int, int] = {}
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        #: Prompt tokens looked up, and of those, served from the cache (:meth:`count_lookup`).
        self.queries = 0
        self.hits = 0
        #: Cached blocks handed back to the pool (:meth:`evict`).
        self.evictions = 0

    # ------------------------------------------------------------------ keys

    @staticmethod
    def block_hash(prev: int | None, tokens: tuple[int, ...], salt: Hashable) -> int:
        """The key of a full block: its tokens chained to the previous block's key (``prev``,
        None for the first block, which mixes in ``salt`` instead)."""
        return hash(("batchkit-kv", salt, tokens) if prev is None else (prev, tokens))

    def lookup(self, tokens: Sequence[int], salt: Hashable) -> tuple[list[int], list[int]]:
        """Cached blocks (and their keys) holding the prompt's leading full blocks (``tokens``:
        Python ints).

        At least one prompt token is left out of the match, so that the step that computes the
        rest yields logits.
        """
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        prev: int | None = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.block_hash(prev, chunk, salt)
            b = self._hash_to_block.get(h)
            if b is None or self._block_key[b][1] != chunk:  # a collision never serves others' cache
                break
            blocks.append(b)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record a prompt of ``num_tokens`` of which ``num_hit_tokens`` came from the cache."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens looked up (0 before any lookup)."""
        return self.hits / self.queries if self.queries else 0.0

    def new_keys(self, tokens: Sequence[int], salt: Hashable, hit_hashes: list[int]) -> SeqKeys:
        """The keys of a new sequence with these prompt tokens (Python ints), whose first blocks were found in
        the index under ``hit_hashes`` (from :meth:`lookup`; the list is taken, not copied)."""
        keys = SeqKeys(salt, hit_hashes)
        self.extend(keys, tokens[len(hit_hashes) * self.block_size :])
        return keys

    def extend(self, keys: SeqKeys, token_ids: Sequence[int]) -> None:
        """Add a sequence's next tokens (Python ints): each block they fill gets its key
        (indexed later, by :meth:`mark_computed`)."""
        bs = self.block_size
        tail = keys.tail
        i, n = 0, len(token_ids)
        if len(tail) + n < bs:  # the common decode step: the partial last block stays partial
            tail.extend(token_ids)
            return
        if tail:
            i = min(bs - len(tail), n)
            tail.extend(token_ids[:i])
            if len(tail) < bs:
                return
            self._add_block(keys, tuple(tail))
            keys.tail = []
        while i + bs <= n:
            self._add_block(keys, tuple(token_ids[i : i + bs]))
            i += bs
        if i < n:
            keys.tail.extend(token_ids[i:])

    def _add_block(self, keys: SeqKeys, chunk: tuple[int, ...]) -> None:
        keys.hashes.append(self.block_hash(keys.hashes[-1] if keys.hashes else None, chunk, keys.salt))
        keys.pending.append(chunk)

    def mark_computed(self, keys: SeqKeys, blocks: np.ndarray, num_computed: int) -> None:
        """Index a sequence's full blocks among its first ``num_computed`` tokens: their K/V are
        written now. ``blocks`` is the sequence's block table. A key or block already indexed
        is left as it is (the first writer owns the key)."""
        start = keys.num_indexed
        full = min(num_computed // self.block_size, len(keys.hashes))
        if full <= start:
            return
        for i, chunk in zip(range(start, full), keys.pending, strict=False):
            h = keys.hashes[i]
            block = int(blocks[i])
            if h not in self._hash_to_block and block not in self._block_key:
                self._hash_to_block[h] = block
                self._block_key[block] = (h, chunk)
        del keys.pending[: full - start]
        keys.num_indexed = full

    # ------------------------------------------------------------------ blocks nobody holds

    def __contains__(self, block: object) -> bool:
        """Whether the block is indexed (held by sequences or evictable)."""
        return block in self._block_key

    def __len__(self) -> int:
        """Indexed blocks."""
        return len(self._block_key)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody holds: reusable for new work after :meth:`evict`."""
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        """The evictable blocks, least recently released first."""
        return list(self._evictable)

    def entries(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """The index as (key, block, tokens) triples, read from the key side; ``tokens`` is ()
        where the block's own record names another key (which would be a corrupt index)."""
        for h, b in self._hash_to_block.items():
            key, tokens = self._block_key[b]
            yield h, b, tokens if key == h else ()

    def park(self, blocks: np.ndarray) -> np.ndarray:
        """Take the indexed ones of these blocks (whose last reference just went) onto the LRU
        list; return the others, which the pool takes back."""
        if not self._block_key or not blocks.size:
            return blocks
        cached = np.fromiter((b in self._block_key for b in blocks.tolist()), dtype=bool, count=blocks.size)
        for b in blocks[cached].tolist():
            self._evictable[b] = None
        rest: np.ndarray = blocks[~cached]
        return rest

    def revive(self, block: int) -> None:
        """Take an evictable block off the LRU list: a new sequence holds it again."""
        del self._evictable[block]

    def evict(self, n: int) -> list[int]:
        """Hand back the ``n`` least recently released evictable blocks (``n <= num_evictable``),
        dropping them from the index."""
        out: list[int] = []
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            h, _tokens = self._block_key.pop(block)
            del self._hash_to_block[h]
            out.append(block)
        self.evictions += n
        return out

    def __repr__(self) -> str:
        return (
            f"<PrefixCache indexed={len(self._block_key)} evictable={len(self._evictable)} "
            f"hit_rate={self.hit_rate:.2f}>"
        )
