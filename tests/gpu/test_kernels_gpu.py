"""The CUDA kernels on a real device, compared bit for bit with the torch reference.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu`` (or ``bash benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import pytest

from batchkit import PagedKVAllocator, PagedKVCache, _cuda
from batchkit.kv import ops

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("heads", "dim", "bs"), [(8, 128, 16), (1, 3, 5), (4, 64, 32), (2, 80, 16)])
@pytest.mark.parametrize("strided", [False, True])
def test_scatter_is_bit_exact(
    dtype: torch.dtype, slot_dtype: torch.dtype, heads: int, dim: int, bs: int, strided: bool
) -> None:
    """Random slots with padding, contiguous or strided tokens: the kernel equals the reference."""
    g = torch.Generator(device="cuda").manual_seed(heads * dim + bs)
    blocks, n = 64, 300
    kc = torch.zeros(blocks, bs, heads, dim, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.randperm(blocks * bs, generator=g, device="cuda")[:n].to(slot_dtype)
    slots[::5] = -1
    if strided:
        k = rand((n, 2, heads, dim), dtype, g)[:, 0]
        v = rand((n, 3, heads, dim), dtype, g)[:, 1]
    else:
        k, v = rand((n, heads, dim), dtype, g), rand((n, heads, dim), dtype, g)
    _cuda.scatter_kv(kc, vc, k, v, slots)
    ops.scatter(rk, rv, k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_then_gather_round_trip(dtype: torch.dtype) -> None:
    """Sequences written through their slot mappings come back exactly, via the cache's dispatch."""
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = PagedKVCache(2, 128, 16, 4, 64, dtype=dtype, device="cuda")
    alloc = PagedKVAllocator(128, 16)
    lens = [1, 17, 100, 33]
    for i, n in enumerate(lens):
        alloc.allocate(i, n)
    slots = torch.cat([torch.from_numpy(alloc.slot_mapping(i)) for i in range(4)]).cuda()
    k, v = rand((sum(lens), 4, 64), dtype, g), rand((sum(lens), 4, 64), dtype, g)
    cache.scatter(1, k, v, slots)
    tables = torch.from_numpy(alloc.block_tables(list(range(4)))).cuda()
    gk, gv = cache.gather(1, tables, torch.tensor(lens, device="cuda"))
    assert torch.equal(gk, k)
    assert torch.equal(gv, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_copy_blocks_match_reference(dtype: torch.dtype) -> None:
    """gather_kv and copy_blocks equal the torch reference bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(2)
    cache = rand((64, 16, 8, 128), dtype, g)
    tables = torch.stack([torch.randperm(63, generator=g, device="cuda")[:8] + 1 for _ in range(5)]).int()
    lens = torch.tensor([1, 16, 17, 128, 77], device="cuda")
    assert torch.equal(_cuda.gather_kv(cache, tables, lens), ops.gather(cache, tables, lens))
    caches = rand((6, 64, 16 * 8 * 128), dtype, g)
    ref = caches.clone()
    pairs = [(1, 2), (3, 40), (63, 0)]
    _cuda.copy_blocks(caches, pairs)
    ops.copy_blocks([ref[i] for i in range(6)], pairs)
    assert torch.equal(caches, ref)


def test_cache_larger_than_2_pow_31_elements() -> None:
    """64-bit offsets: writes and reads beyond element 2^31 land where they should."""
    row = 8 * 128
    blocks, bs = (2**31 // (16 * row)) + 64, 16
    need = 2 * blocks * bs * row * 2
    free, _ = torch.cuda.mem_get_info()
    if need > 0.8 * free:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free device memory")
    kc = torch.zeros(blocks, bs, 8, 128, dtype=torch.float16, device="cuda")
    vc = torch.zeros_like(kc)
    top = blocks * bs - 1
    slots = torch.tensor([top, 5, top - 17], device="cuda", dtype=torch.int64)
    k = torch.randn(3, 8, 128, device="cuda").half()
    _cuda.scatter_kv(kc, vc, k, k, slots)
    flat = kc.view(-1, 8, 128)
    assert torch.equal(flat[top], k[0])
    assert torch.equal(flat[top - 17], k[2])
    tables = torch.tensor([[blocks - 1]], dtype=torch.int32, device="cuda")
    got = _cuda.gather_kv(kc, tables, torch.tensor([16], device="cuda"))
    assert torch.equal(got[15], k[0])
