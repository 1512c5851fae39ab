"""BlockSupply: device blocks handed out and taken back, and the room check before any is.

Blocks come from the pool's free stack first, then evicted from the prefix cache's LRU list (the
least recently used first); a block whose last reference goes returns to the pool unless the
prefix cache keeps it (then it waits there, evictable). :meth:`BlockSupply.check_room` refuses
what the pool (less the watermark, at admission) or a tenant's quota cannot give. It counts
blocks only: it knows no sequence, no token and no block table.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from .._errors import KVCacheExhausted
from .blocks import BlockPool
from .prefix import PrefixCache
from .quotas import TenantQuotas

__all__ = ["BlockSupply"]


class BlockSupply:
    """Blocks out of and back into a :class:`BlockPool` and a :class:`PrefixCache`, within the
    watermark and the tenants' quotas (:class:`TenantQuotas`)."""

    __slots__ = ("pool", "prefix", "quotas", "watermark_blocks")

    def __init__(self, pool: BlockPool, prefix: PrefixCache, quotas: TenantQuotas, watermark_blocks: int) -> None:
        self.pool = pool
        self.prefix = prefix
        self.quotas = quotas
        self.watermark_blocks = watermark_blocks
        """Blocks admission leaves free for running sequences to grow into."""

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return self.pool.num_free + self.prefix.num_evictable

    def take(self, n: int) -> np.ndarray:
        """Hand out ``n`` blocks (reference count 1): free ones first, then evicted cached ones in
        LRU order. Callers check availability first, so this never fails half-way."""
        k = min(n, self.pool.num_free)
        out = self.pool.pop_free(k)
        if k < n:
            out = np.concatenate((out, np.asarray(self.prefix.evict(n - k), dtype=np.int32)))
        self.pool.hold(out)
        return out

    def release(self, blocks: np.ndarray) -> None:
        """Drop one reference from each of one sequence's (distinct) blocks; a block nobody holds
        goes back to the pool, or onto the prefix cache's LRU list if it is cached."""
        self.pool.push_free(self.prefix.park(self.pool.release(blocks)))

    def check_room(self, n: int, tenant: Hashable, *, admission: bool, charged: int | None = None) -> None:
        """Refuse taking ``n`` blocks from the pool, or charging ``tenant`` for ``charged`` (default
        ``n``: more when cached blocks another sequence holds are shared, which each holder pays).

        Raises:
            KVCacheExhausted: fewer than ``n`` blocks available (above the watermark when
                ``admission``), or over the tenant's quota.
        """
        avail = self.num_free - (self.watermark_blocks if admission else 0)
        if n > avail:
            raise KVCacheExhausted(
                f"need {n} KV blocks, {max(avail, 0)} available"
                + (f" above the watermark ({self.watermark_blocks} kept free)" if admission else "")
                + "; free or preempt sequences, or give the cache more blocks"
            )
        self.quotas.check(tenant, n if charged is None else charged)

    def __repr__(self) -> str:
        return f"<BlockSupply free={self.num_free} watermark_blocks={self.watermark_blocks}>"
