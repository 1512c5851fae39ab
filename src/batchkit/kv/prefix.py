"""PrefixCache: full KV blocks indexed by the content of the tokens they hold.

A sans-I/O core with no tensors. A full block's key is a chained hash: the hash of its tokens
and of the previous block's key (the first block mixes in a salt, the tenant, so that tenants
never share blocks). A hit is served only if the stored tokens equal the asked ones, so a hash
collision never serves another prompt's K/V.

A block enters the index once its K/V are written (:meth:`mark_computed`). A cached block
nobody holds any more is *evictable*: it stays indexed, on an LRU list, until the pool needs
it back (:meth:`evict`), or until a new sequence hits it (:meth:`revive`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

__all__ = ["PrefixCache"]


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
        """Cached blocks (and their keys) holding the prompt's leading full blocks.

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

    def mark_computed(
        self, hashes: list[int], tokens: Sequence[int], blocks: np.ndarray, num_computed: int, salt: Hashable
    ) -> None:
        """Index a sequence's full blocks among its first ``num_computed`` tokens (their K/V are
        written now).

        ``hashes`` holds the keys of the sequence's blocks indexed so far (its prefix hits, then
        what earlier calls added); it is extended in place. ``blocks`` is the sequence's block
        table. A key or block already indexed is left as it is (the first writer owns the key).
        """
        bs = self.block_size
        full = min(num_computed, len(tokens)) // bs
        for i in range(len(hashes), full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.block_hash(hashes[-1] if hashes else None, chunk, salt)
            hashes.append(h)
            block = int(blocks[i])
            if h not in self._hash_to_block and block not in self._block_key:
                self._hash_to_block[h] = block
                self._block_key[block] = (h, chunk)

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
        """The index as (key, block, tokens) triples."""
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
