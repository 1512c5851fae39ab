"""TenantQuotas: how many KV blocks each tenant holds, and the most it may hold.

A sans-I/O core: a tenant over its quota gets :class:`KVCacheExhausted`, never its neighbours.
A block shared by several sequences counts once for each sequence that holds it.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping

from .._errors import KVCacheExhausted

__all__ = ["TenantQuotas"]


class TenantQuotas:
    """Per-tenant block usage and quotas.

    Args:
        quotas: ``{tenant: max blocks}`` (an int, or a float fraction of ``total_blocks``).
        total_blocks: the pool the fractions refer to.

    Raises:
        ValueError: a negative quota, or a float outside [0, 1].
    """

    __slots__ = ("_quotas", "_usage")

    def __init__(self, quotas: Mapping[Hashable, int | float] | None, total_blocks: int) -> None:
        self._quotas: dict[Hashable, int] = {}
        for tenant, q in (quotas or {}).items():
            if isinstance(q, float) and not 0.0 <= q <= 1.0:
                raise ValueError(
                    f"tenant_quotas[{tenant!r}] = {q!r}: a float is a fraction of the pool, in [0, 1]; "
                    "give an int for a number of blocks"
                )
            if isinstance(q, float):
                blocks = int(q * total_blocks)
            else:
                try:
                    if isinstance(q, bool):
                        raise TypeError
                    blocks = operator.index(q)  # ints, numpy ints
                except TypeError:
                    raise TypeError(
                        f"tenant_quotas[{tenant!r}] = {q!r}: give an int (a number of blocks) or a float in [0, 1] "
                        "(a fraction of the pool)"
                    ) from None
            if blocks < 0:
                raise ValueError(f"tenant_quotas[{tenant!r}] must be >= 0, got {q!r}")
            self._quotas[tenant] = blocks
        self._usage: dict[Hashable, int] = {}

    def __bool__(self) -> bool:
        """Whether any tenant has a quota."""
        return bool(self._quotas)

    def quota_of(self, tenant: Hashable) -> int | None:
        """The tenant's block quota (None: unlimited)."""
        return self._quotas.get(tenant)

    def usage_of(self, tenant: Hashable) -> int:
        """Blocks the tenant's sequences hold now."""
        return self._usage.get(tenant, 0)

    def usage(self) -> dict[Hashable, int]:
        """Blocks held per tenant (tenants holding none are left out; a copy)."""
        return dict(self._usage)

    def allows(self, tenant: Hashable, num_blocks: int) -> bool:
        """Whether the tenant may take ``num_blocks`` more blocks."""
        quota = self._quotas.get(tenant)
        return quota is None or self._usage.get(tenant, 0) + num_blocks <= quota

    def check(self, tenant: Hashable, num_blocks: int) -> None:
        """Raise :class:`KVCacheExhausted` if the tenant may not take ``num_blocks`` more blocks."""
        if not self.allows(tenant, num_blocks):
            held = self._usage.get(tenant, 0) + num_blocks
            raise KVCacheExhausted(
                f"tenant {tenant!r} would hold {held} blocks, over its quota of "
                f"{self._quotas[tenant]}; free some of its sequences or raise its quota"
            )

    def charge(self, tenant: Hashable, num_blocks: int) -> None:
        """The tenant took ``num_blocks`` more blocks."""
        if num_blocks:
            self._usage[tenant] = self._usage.get(tenant, 0) + num_blocks

    def refund(self, tenant: Hashable, num_blocks: int) -> None:
        """The tenant gave back ``num_blocks`` blocks."""
        left = self._usage.get(tenant, 0) - num_blocks
        if left:
            self._usage[tenant] = left
        else:
            self._usage.pop(tenant, None)

    def __repr__(self) -> str:
        return f"<TenantQuotas quotas={self._quotas!r} usage={self._usage!r}>"
