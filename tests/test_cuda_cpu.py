"""The CUDA kernels, checked as far as a machine without a GPU can: NVRTC compilation, the
launcher's argument checks with the device stubbed, and a numpy emulation of each kernel's
thread mapping compared with the torch reference."""

from __future__ import annotations

import pytest

from batchkit import _cuda
from batchkit._cuda import emulate
from batchkit.kv import ops
from batchkit.kv.cache import choose_backend

torch = pytest.importorskip("torch")


def _nvrtc_ok() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvrtc_ok(), reason="cupy with NVRTC is not installed (pip install 'batchkit[cuda]')")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_every_kernel_compiles_with_nvrtc(arch: str) -> None:
    """Every dtype width, slot type and vector mode compiles for Ampere and Hopper, no GPU needed."""
    lowered = _cuda.compile_ptx(arch)
    assert set(lowered) == set(_cuda.kernel_names())
    assert len(lowered) == 4 * 2 * 4  # 4 widths x {vec, scalar} x (2 scatter + gather + copy)


@pytest.fixture
def cpu_as_cuda(monkeypatch: pytest.MonkeyPatch) -> list[_cuda.Launch]:
    """Let the planners accept CPU tensors and record launches instead of running them."""
    launches: list[_cuda.Launch] = []
    monkeypatch.setattr(_cuda, "_require_cuda", lambda *ts: ts[0].device)
    monkeypatch.setattr(_cuda, "_launch", launches.append)
    return launches


def caches(dtype: torch.dtype = torch.float16, blocks: int = 16, bs: int = 4, heads: int = 2, dim: int = 8):  # type: ignore[no-untyped-def]
    return torch.zeros(blocks, bs, heads, dim, dtype=dtype), torch.zeros(blocks, bs, heads, dim, dtype=dtype)


def test_scatter_launches_with_good_arguments(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """A valid scatter is launched once, vectorised when rows are 16-byte multiples."""
    kc, vc = caches()
    k = torch.zeros(5, 2, 8, dtype=torch.float16)
    _cuda.scatter_kv(kc, vc, k, k.clone(), torch.tensor([1, 2, -1, 3, 4], dtype=torch.int32))
    (launch,) = cpu_as_cuda
    assert launch.kernel == "scatter_kv<unsigned short, int, true>"
    assert launch.grid == (5,)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a.update(key=a["key"].float()), "convert it first"),
        (lambda a: a.update(key=torch.zeros(5, 3, 8, dtype=torch.float16)), r"must be \[num_tokens, 2, 8\]"),
        (lambda a: a.update(key=torch.zeros(5, 8, 2, dtype=torch.float16).transpose(1, 2)), "contiguous within"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int32 or int64"),
        (lambda a: a.update(slot_mapping=torch.tensor([1, 2, 3])), "agree on num_tokens"),
        (lambda a: a.update(slot_mapping=torch.tensor([1, 2, 3, 4, 64])), "outside the cache"),
        (
            lambda a: a.update(key_cache=torch.zeros(16, 4, 16, dtype=torch.float16)),
            "key_cache and value_cache must be",
        ),
        (lambda a: a.update(key_cache=torch.zeros(16, 2, 4, 8, dtype=torch.float16).transpose(1, 2)), "contiguous"),
    ],
)
def test_scatter_refuses_bad_arguments_before_launch(cpu_as_cuda: list[_cuda.Launch], mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    """Wrong dtypes, shapes, strides and indices are ValueErrors, and nothing is launched."""
    kc, vc = caches()
    args = {
        "key_cache": kc,
        "value_cache": vc,
        "key": torch.zeros(5, 2, 8, dtype=torch.float16),
        "value": torch.zeros(5, 2, 8, dtype=torch.float16),
        "slot_mapping": torch.tensor([1, 2, 3, 4, 5]),
    }
    mutate(args)
    with pytest.raises(ValueError, match=message):
        _cuda.scatter_kv(**args)
    assert cpu_as_cuda == []


def test_planners_refuse_cpu_tensors() -> None:
    """Without the stub, CPU tensors are refused with a clear message."""
    kc, vc = caches()
    k = torch.zeros(1, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        _cuda.scatter_kv(kc, vc, k, k, torch.tensor([1]))


def test_gather_and_copy_refuse_bad_indices(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Block ids outside the pool are refused before launch."""
    kc, _ = caches()
    with pytest.raises(ValueError, match="block outside"):
        _cuda.gather_kv(kc, torch.tensor([[1, 99]], dtype=torch.int32), torch.tensor([6]))
    with pytest.raises(ValueError, match="int32"):
        _cuda.gather_kv(kc, torch.tensor([[1, 2]]), torch.tensor([6]))
    with pytest.raises(ValueError, match="longer than its block-table row"):
        _cuda.gather_kv(kc, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([9]))
    with pytest.raises(ValueError, match="block pairs"):
        _cuda.copy_blocks(kc.view(1, 16, -1), [(0, 16)])
    assert cpu_as_cuda == []


def test_backend_dispatch() -> None:
    """auto picks the kernels only for CUDA tensors with CuPy present; either path can be forced."""
    yes, no = (lambda: True), (lambda: False)
    assert choose_backend("auto", "cuda", yes) == "cuda"
    assert choose_backend("auto", "cuda", no) == "torch"
    assert choose_backend("auto", "cpu", yes) == "torch"
    assert choose_backend("torch", "cuda", yes) == "torch"
    assert choose_backend("cuda", "cuda", no) == "cuda"
    with pytest.raises(ValueError, match="CUDA device"):
        choose_backend("cuda", "cpu", yes)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("heads", "dim"), [(2, 8), (1, 3), (4, 16)])
@pytest.mark.parametrize("strided", [False, True])
def test_emulated_scatter_matches_reference(
    cpu_as_cuda: list[_cuda.Launch], dtype: torch.dtype, slot_dtype: torch.dtype, heads: int, dim: int, strided: bool
) -> None:
    """The kernel's mapping, emulated, writes exactly what the torch reference writes."""
    g = torch.Generator().manual_seed(heads * 100 + dim)
    blocks, bs, n = 12, 4, 20
    slots = torch.randperm(blocks * bs, generator=g)[:n].to(slot_dtype)
    slots[::7] = -1  # padding
    if strided:  # tokens every other row of a bigger buffer: non-contiguous in the token dim
        big = torch.randn(2 * n, heads, dim, generator=g).to(dtype)
        k, v = big[::2], torch.randn(2 * n, heads, dim, generator=g).to(dtype)[::2]
    else:
        k = torch.randn(n, heads, dim, generator=g).to(dtype)
        v = torch.randn(n, heads, dim, generator=g).to(dtype)
    kc, vc = caches(dtype, blocks, bs, heads, dim)
    rk, rv = kc.clone(), vc.clone()
    _cuda.scatter_kv(kc, vc, k, v, slots)
    (launch,) = cpu_as_cuda
    assert launch.vec == ((heads * dim * kc.element_size()) % 16 == 0)
    emulate.run(launch)
    ops.scatter(rk, rv, k, v, slots)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim"), [(2, 8), (1, 5)])
def test_emulated_gather_matches_reference(
    cpu_as_cuda: list[_cuda.Launch], dtype: torch.dtype, heads: int, dim: int
) -> None:
    """Gathering pages of several sequences equals the reference gather, bit for bit."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(16, 4, heads, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(15, generator=g)[:4] + 1 for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([5, 16, 1])
    out = _cuda.gather_kv(cache, tables, lens)
    (launch,) = cpu_as_cuda
    emulate.run(launch)
    assert torch.equal(out.view(torch.uint8), ops.gather(cache, tables, lens).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_copy_blocks_matches_reference(cpu_as_cuda: list[_cuda.Launch], dtype: torch.dtype) -> None:
    """Block copies across all caches equal the reference copies."""
    g = torch.Generator().manual_seed(3)
    caches_ = torch.randn(4, 10, 4, 2, 8, generator=g).to(dtype)
    ref = caches_.clone()
    pairs = [(1, 5), (2, 6), (9, 0)]
    _cuda.copy_blocks(caches_, pairs)
    (launch,) = cpu_as_cuda
    emulate.run(launch)
    ops.copy_blocks([ref[i] for i in range(4)], pairs)
    assert torch.equal(caches_, ref)


def test_emulation_catches_an_indexing_bug(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """The emulation is sensitive: a launch with a wrong stride writes different bytes."""
    kc, vc = caches(torch.float32)
    k = torch.randn(4, 2, 8)
    _cuda.scatter_kv(kc, vc, k, k, torch.tensor([1, 2, 3, 4]))
    (launch,) = cpu_as_cuda
    args = list(launch.args)
    args[6] = 8  # key_stride 8 instead of 16: rows overlap
    bad = _cuda.Launch(launch.kernel.replace("true", "false"), launch.grid, launch.block, tuple(args), None, 4, False)
    emulate.run(bad)
    ref_k, ref_v = caches(torch.float32)
    ops.scatter(ref_k, ref_v, k, k, torch.tensor([1, 2, 3, 4]))
    assert not torch.equal(kc, ref_k)
