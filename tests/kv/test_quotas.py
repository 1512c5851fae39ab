"""batchkit.kv.quotas, as docs/api.md promises it: a tenant's quota is a number of blocks or a
fraction of the pool, and nothing else, in the allocator and in the decode loop alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

import batchkit
from _support import one_layer_cache as _cache
from _support import zeros_step as _zeros

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")


@pytest.mark.parametrize("quota", ["5", "x", None, True])
def test_a_tenant_quota_is_an_int_or_a_fraction_nothing_else(quota: Any) -> None:
    """tenant_quotas: `{tenant: blocks}`, an int or a fraction of the pool. A string was read as
    a number ("5" became 5 blocks, "x" a ValueError about int()), True as 1 block: each is a
    TypeError naming the tenant's entry."""
    with pytest.raises(TypeError, match=r"tenant_quotas\['a'\]"):
        batchkit.PagedKVAllocator(16, 4, tenant_quotas={"a": quota})
    with pytest.raises(TypeError, match=r"tenant_quotas\['a'\]"):
        batchkit.ContinuousDecodeLoop(_zeros, _cache(), tenant_quotas={"a": quota})
    assert batchkit.PagedKVAllocator(17, 4, tenant_quotas={"a": cast(Any, np.int32(3))}).quota_of("a") == 3
