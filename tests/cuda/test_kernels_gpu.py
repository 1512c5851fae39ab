"""The CUDA kernels on a real device, compared bit for bit with the torch reference.

Run on a machine with a GPU: ``pytest -m gpu tests/cuda`` (or ``bash benchmarks/gpu_check.sh``).
Every cache here is built with ``backend="cuda"``: with ``"auto"`` a CuPy that cannot compile
the kernels would fall back to torch and these tests would pass without testing the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import pytest

from batchkit import PagedKVAllocator, PagedKVCache, _cuda
from batchkit.kv import ops

pytestmark = pytest.mark.gpu
if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, device="cuda").to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def checks_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Index checks off (no host synchronisation), as in a decode loop or a graph capture."""
    monkeypatch.setattr(_cuda, "CHECK_INDICES", False)
    yield
    torch.cuda.synchronize()  # a fault surfaces here, in the test that caused it


def cuda_cache(*shape: int, dtype: torch.dtype = torch.float16) -> PagedKVCache:
    layers, blocks, bs, heads, dim = shape
    return PagedKVCache(layers, blocks, bs, heads, dim, dtype=dtype, device="cuda", backend="cuda")


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
    assert same_bits(kc, rk)
    assert same_bits(vc, rv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3])
def test_misaligned_base_pointer_takes_the_scalar_path(dtype: torch.dtype, offset: int) -> None:
    """Tokens starting off a 16-byte boundary are planned on the element-wise path and land
    exactly; the aligned twin of the same call takes the vector path."""
    g = torch.Generator(device="cuda").manual_seed(offset)
    n, heads, dim = 40, 8, 128
    buf = rand((n * heads * dim + offset,), dtype, g)
    k = buf[offset:].view(n, heads, dim)
    kc = torch.zeros(32, 16, heads, dim, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.randperm(32 * 16, generator=g, device="cuda")[:n]
    assert _cuda.plan_scatter(kc, vc, k, k, slots).vec is False
    aligned = k.clone()
    assert _cuda.plan_scatter(kc, vc, aligned, aligned, slots).vec is True
    _cuda.scatter_kv(kc, vc, k, k, slots)
    ops.scatter(rk, rv, k, k, slots)
    torch.cuda.synchronize()
    assert same_bits(kc, rk)
    assert same_bits(vc, rv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_then_gather_round_trip(dtype: torch.dtype) -> None:
    """Sequences written through their slot mappings come back exactly, via the cache's ops."""
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = cuda_cache(2, 128, 16, 4, 64, dtype=dtype)
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
    gk, gv = cache.gather(1, tables, torch.tensor(lens, device="cuda"), total_tokens=sum(lens))
    assert torch.equal(gk, k)
    assert torch.equal(gv, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_copy_blocks_match_reference(dtype: torch.dtype) -> None:
    """gather_kv and copy_blocks equal the torch reference bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(2)
    cache = rand((64, 16, 8, 128), dtype, g)
    tables = torch.stack([torch.randperm(63, generator=g, device="cuda")[:8] + 1 for _ in range(5)]).int()
    lens = torch.tensor([1, 16, 0, 128, 77], device="cuda")
    assert same_bits(_cuda.gather_kv(cache, tables, lens), ops.gather(cache, tables, lens))
    caches = rand((6, 64, 16 * 8 * 128), dtype, g)
    ref = caches.clone()
    pairs = [(1, 2), (3, 40), (63, 0)]
    _cuda.copy_blocks(caches, pairs)
    ops.copy_blocks([ref[i] for i in range(6)], pairs)
    assert torch.equal(caches, ref)


def test_gather_with_an_empty_block_table() -> None:
    """Sequences with no blocks gather to an empty tensor (no launch, no error)."""
    cache = torch.zeros(8, 16, 2, 64, dtype=torch.float16, device="cuda")
    out = _cuda.gather_kv(
        cache, torch.zeros((3, 0), dtype=torch.int32, device="cuda"), torch.zeros(3, device="cuda").long()
    )
    assert out.shape == (0, 2, 64)


def test_gather_keeps_bad_indices_in_bounds_with_checks_off(checks_off: None) -> None:
    """Block ids outside the cache or past the table, negative lengths and a too-short output
    never fault: the rows they address are zero, the others gathered, the output never overrun."""
    cache = torch.randn(1024, 16, 8, 128, device="cuda").half()
    flat = cache.view(-1, 8, 128)
    tables = torch.tensor([[1, -1], [10**6, 2], [3, 5]], dtype=torch.int32, device="cuda")
    out = _cuda.gather_kv(cache, tables, torch.tensor([32, 40, 20], device="cuda"), total_tokens=92)
    assert torch.equal(out[0:16], flat[16:32])
    assert not out[16:48].any()
    assert torch.equal(out[48:64], flat[32:48])
    assert not out[64:72].any()  # past the two-block table row
    assert torch.equal(out[72:88], flat[48:64])
    _cuda.gather_kv(cache, tables, torch.tensor([-5, 40, 3], device="cuda"), total_tokens=38)
    whole = torch.arange(1024, dtype=torch.int32, device="cuda").view(1, 1024)
    one = _cuda.gather_kv(cache, whole, torch.tensor([16384], device="cuda"), total_tokens=1)
    assert one.shape == (1, 8, 128)
    assert torch.equal(one[0], flat[0])


def copy_cases() -> dict[str, list[tuple[int, int]]]:
    return {
        "chain": [(i, i + 1) for i in range(255)],
        "reverse chain": [(i, i + 1) for i in reversed(range(255))],
        "cycle": [(i, (i + 1) % 64) for i in range(64)],
        "swap": [(7, 9), (9, 7)],
        "fan out": [(2, 3), (2, 4), (3, 5), (4, 6), (6, 7)],
    }


@pytest.mark.parametrize("case", list(copy_cases()))
def test_chained_copy_pairs_equal_the_snapshot_reference(case: str) -> None:
    """Blocks that are both sources and destinations copy as if from a snapshot, run after run
    (one launch would race: the result would depend on scheduling)."""
    pairs = copy_cases()[case]
    for _ in range(20):
        caches = torch.randn(4, 256, 16 * 8 * 128, device="cuda").half()
        ref = caches.clone()
        _cuda.copy_blocks(caches, pairs)
        ops.copy_blocks([ref[i] for i in range(4)], pairs)
        assert torch.equal(caches, ref)


def test_cache_copy_blocks_on_the_kernels() -> None:
    """PagedKVCache.copy_blocks on the CUDA backend copies every layer, K and V, chains included."""
    cache = cuda_cache(3, 32, 16, 2, 64)
    cache.kv.normal_()
    before = cache.kv.clone()
    cache.copy_blocks([(3, 4), (4, 5), (9, 3)])
    assert torch.equal(cache.kv[:, :, 4], before[:, :, 3])
    assert torch.equal(cache.kv[:, :, 5], before[:, :, 4])
    assert torch.equal(cache.kv[:, :, 3], before[:, :, 9])


def test_kernels_run_in_order_on_a_non_default_stream(checks_off: None) -> None:
    """Launches go to torch's current stream: a delayed producer on a side stream is always seen
    by the scatter after it, and the consumer after that sees the scatter's writes."""
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    n = 2048
    with torch.cuda.stream(s):
        kc = torch.zeros(n, 16, 8, 128, device="cuda", dtype=torch.float16)
        k = torch.zeros(n, 8, 128, device="cuda", dtype=torch.float16)
        slots = torch.arange(n, device="cuda") * 16
        table = torch.arange(n, dtype=torch.int32, device="cuda").view(n, 1)
        ones = torch.ones(n, dtype=torch.long, device="cuda")
        for i in range(5):
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # keep the side stream busy: another stream would run first
            k.fill_(float(i + 1))
            _cuda.scatter_kv(kc, kc, k, k, slots)
            got = _cuda.gather_kv(kc, table, ones, total_tokens=n)
            assert float(got.float().mean()) == float(i + 1)


R = TypeVar("R")


def capture(fn: Callable[[], R]) -> tuple[torch.cuda.CUDAGraph, R]:
    """Warm ``fn`` up on a side stream, then capture one call of it in a CUDA graph."""
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        result = fn()
    return g, result


def test_scatter_and_gather_capture_and_replay_in_a_cuda_graph(checks_off: None) -> None:
    """With checks off and total_tokens given, the kernels (directly and through PagedKVCache)
    capture into a CUDA graph, and each replay reads the inputs' current contents."""
    g = torch.Generator(device="cuda").manual_seed(4)
    cache = cuda_cache(2, 64, 16, 8, 128)
    kc = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.float16)
    vc = torch.zeros_like(kc)
    k, v = rand((32, 8, 128), torch.float16, g), rand((32, 8, 128), torch.float16, g)
    slots = torch.randperm(1024, generator=g, device="cuda")[:32]
    tables = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
    lens = torch.tensor([5, 16, 100, 1], device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _cuda.scatter_kv(kc, vc, k, v, slots)
        cache.scatter(1, k, v, slots)
        ck, cv = cache.gather(1, tables, lens, total_tokens=122)
        return _cuda.gather_kv(kc, tables, lens, total_tokens=122), ck, cv

    graph, (out, ck, cv) = capture(step)
    for _ in range(3):
        k.copy_(rand((32, 8, 128), torch.float16, g))
        v.copy_(rand((32, 8, 128), torch.float16, g))
        kc.zero_()
        vc.zero_()
        cache.kv.zero_()
        graph.replay()
        torch.cuda.synchronize()
        rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
        ops.scatter(rk, rv, k, v, slots)
        assert torch.equal(kc, rk)
        assert torch.equal(cache.key(1), rk)
        assert torch.equal(out, ops.gather(rk, tables, lens))
        assert torch.equal(ck, ops.gather(rk, tables, lens))
        assert torch.equal(cv, ops.gather(rv, tables, lens))


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


def test_the_kernels_are_available_on_this_device() -> None:
    """The kernels compile and load on this device: available() is True, so "auto" picks them."""
    assert _cuda.available(torch.cuda.current_device())
