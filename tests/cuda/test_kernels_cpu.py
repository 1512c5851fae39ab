"""The CUDA kernels, checked as far as a machine without a GPU can: NVRTC compilation, the
launcher's argument checks with the device stubbed, and a numpy emulation of each kernel's
thread mapping compared with the torch reference."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from batchkit import PagedKVCache, _cuda
from batchkit._cuda import emulate
from batchkit.kv import ops
from batchkit.kv.cache import choose_backend

if TYPE_CHECKING:
    import torch
else:
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


@pytest.fixture
def cpu_emulated(monkeypatch: pytest.MonkeyPatch) -> list[_cuda.Launch]:
    """Let the planners accept CPU tensors and run each launch in the emulator when it is made."""
    launches: list[_cuda.Launch] = []

    def run(launch: _cuda.Launch) -> None:
        launches.append(launch)
        emulate.run(launch)

    monkeypatch.setattr(_cuda, "_require_cuda", lambda *ts: ts[0].device)
    monkeypatch.setattr(_cuda, "_launch", run)
    return launches


@pytest.fixture
def checks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Index checks off, as in a tuned decode loop or a CUDA-graph capture."""
    monkeypatch.setattr(_cuda, "CHECK_INDICES", False)


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
    with pytest.raises(ValueError, match=r"outside 0\.\.15"):
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
    (launch,) = cpu_as_cuda  # independent pairs: one launch
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
    bad = dataclasses.replace(launch, kernel=launch.kernel.replace("true", "false"), args=tuple(args), vec=False)
    emulate.run(bad)
    ref_k, ref_v = caches(torch.float32)
    ops.scatter(ref_k, ref_v, k, k, torch.tensor([1, 2, 3, 4]))
    assert not torch.equal(kc, ref_k)


# --------------------------------------------------------------------------- issue 9, items 7-14


def _cupy_or_skip() -> Any:
    try:
        import cupy
    except Exception:
        pytest.skip("cupy is not installed (pip install 'batchkit[cuda12]')")
    return cupy


@pytest.mark.skipif(not _nvrtc_ok(), reason="cupy with NVRTC is not installed (pip install 'batchkit[cuda12]')")
def test_cupy_finds_the_cuda_headers_it_compiles_with() -> None:
    """CuPy 14 refuses to compile a RawModule without the CUDA runtime headers; the cuda extras
    install them (cuda-toolkit[cudart]), and CuPy finds them without a GPU."""
    import cupy._core.core as core

    options = core.assemble_cupy_compiler_options(_cuda.COMPILE_OPTIONS)
    includes = [o[2:] for o in options if o.startswith("-I")]
    assert any((Path(d) / "cuda_runtime.h").is_file() for d in includes), options


def test_extras_offer_one_cupy_per_cuda_major_version() -> None:
    """``cuda12`` and ``cuda13`` each bring one CuPy and the toolkit parts it compiles with;
    ``cuda`` stays an alias of ``cuda12`` for older instructions."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not run from a source checkout")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for major in ("12", "13"):
        deps = extras[f"cuda{major}"]
        assert any(d.startswith(f"cupy-cuda{major}x") for d in deps)
        assert f"cuda-toolkit[cudart,nvrtc]=={major}.*" in deps
        assert not any("torch" in d for d in deps)
    assert extras["cuda"] == ["batchkit[cuda12]"]


def test_available_is_false_with_one_warning_when_the_kernels_do_not_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device CuPy can see is not enough: if the module does not compile or load there,
    available() says False (so "auto" serves through torch) and logs exactly one warning."""
    cupy = _cupy_or_skip()
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)

    def broken(index: int) -> Any:
        raise RuntimeError("catastrophic error: cannot open source file cuda_fp16.h")

    monkeypatch.setattr(_cuda, "_module", broken)
    monkeypatch.setattr(_cuda, "_functions", {})
    monkeypatch.setattr(_cuda, "_available", {})
    monkeypatch.setattr(_cuda, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="batchkit._cuda"):
        assert _cuda.available() is False
        assert _cuda.available(0) is False
        assert _cuda.available() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cuda_fp16.h" in warnings[0].getMessage()
    assert "torch reference" in warnings[0].getMessage()


def test_gather_refuses_a_total_tokens_that_disagrees_with_seq_lens(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 7: with index checks on, an output sized by a wrong ``total_tokens`` is refused
    before launch (on the previous main it was launched and written past)."""
    kc, _ = caches()
    tables = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="total_tokens is 1 but seq_lens sum to 16"):
        _cuda.gather_kv(kc, tables, torch.tensor([16]), total_tokens=1)
    with pytest.raises(ValueError, match="total_tokens must be an int >= 0"):
        _cuda.gather_kv(kc, tables, torch.tensor([16]), total_tokens=-1)
    assert cpu_as_cuda == []


def test_gather_never_writes_past_its_output(cpu_emulated: list[_cuda.Launch], checks_off: None) -> None:
    """Item 7: with checks off, the kernel's loop is bounded by the output's rows, not by the
    device-side sum of lengths: a too-small ``total_tokens`` gets a short, correct output."""
    cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    out = _cuda.gather_kv(cache, tables, torch.tensor([16]), total_tokens=3)
    (launch,) = cpu_emulated
    assert launch.args[8] == 3  # num_out_rows
    assert torch.equal(out, ops.gather(cache, tables, torch.tensor([16]))[:3])


def test_a_too_large_total_tokens_gets_zero_rows_past_the_end(
    cpu_emulated: list[_cuda.Launch], checks_off: None
) -> None:
    """Item 7: rows past ``sum(seq_lens)`` are zero-filled, never left as uninitialised memory."""
    cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    out = _cuda.gather_kv(cache, tables, torch.tensor([5]), total_tokens=7)
    assert torch.equal(out[:5], ops.gather(cache, tables, torch.tensor([5])))
    assert not out[5:].any()


def test_emulator_faults_on_a_write_past_the_output(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 14: a gather launch that loops past its output (the defect of item 7) raises
    KernelFault in the emulator instead of being clipped silently by numpy slicing."""
    cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    _cuda.gather_kv(cache, tables, torch.tensor([16]))
    (launch,) = cpu_as_cuda
    args = list(launch.args)
    args[1] = args[1][:1]  # a one-row output, but the launch still covers 16 rows
    with pytest.raises(emulate.KernelFault, match=r"write of out\[16:32\] outside its 16 elements"):
        emulate.run(dataclasses.replace(launch, args=tuple(args)))


def test_emulator_faults_on_an_index_read_outside_its_tensor(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 14: a negative or too-large index is a KernelFault, not numpy's wrap-around or clip."""
    kc, vc = caches(torch.float32)
    k = torch.randn(4, 2, 8)
    _cuda.scatter_kv(kc, vc, k, k, torch.tensor([1, 2, 3, 4]))
    (launch,) = cpu_as_cuda
    args = list(launch.args)
    args[5] = 5  # num_tokens one more than slot_mapping holds
    with pytest.raises(emulate.KernelFault, match=r"read of slot_mapping\[4\]"):
        emulate.run(dataclasses.replace(launch, args=tuple(args)))
    args = list(launch.args)
    args[9] = 10**6  # num_slots claims a bigger cache: slot 4 * 10 rows lands outside
    args[4] = torch.tensor([1, 2, 3, 10**4])
    with pytest.raises(emulate.KernelFault, match="write of key_cache"):
        emulate.run(dataclasses.replace(launch, args=tuple(args)))


def test_emulator_faults_on_a_misaligned_vector_access(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """A base pointer one element off 16 bytes takes the scalar path; forced onto the vector
    path, the emulator reports the misaligned access."""
    kc, vc = caches(torch.float16)
    buf = torch.randn(5 * 16 + 1).half()
    k = buf[1:].view(5, 2, 8)  # rows are 32 bytes, but the base is 2 bytes off
    slots = torch.tensor([1, 2, 3, 4, 5])
    _cuda.scatter_kv(kc, vc, k, k, slots)
    (launch,) = cpu_as_cuda
    assert launch.vec is False
    assert launch.kernel.endswith("false>")
    emulate.run(launch)
    rk, rv = caches(torch.float16)
    ops.scatter(rk, rv, k, k, slots)
    assert torch.equal(kc, rk)
    with pytest.raises(emulate.KernelFault, match="not 16-byte aligned"):
        emulate.run(dataclasses.replace(launch, vec=True))


def test_gather_zero_fills_rows_with_out_of_range_block_ids(cpu_emulated: list[_cuda.Launch], checks_off: None) -> None:
    """Item 8: with checks off, a block id below 0 or past the cache zero-fills the rows it
    would address; rows with good ids are gathered; nothing outside the cache is read."""
    cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[1, -1], [99, 2], [3, 5]], dtype=torch.int32)
    out = _cuda.gather_kv(cache, tables, torch.tensor([8, 8, 6]))
    assert out.shape == (22, 2, 8)
    flat = cache.view(-1, 2, 8)
    assert torch.equal(out[0:4], flat[4:8])  # block 1
    assert not out[4:8].any()  # block -1
    assert not out[8:12].any()  # block 99
    assert torch.equal(out[12:16], flat[8:12])  # block 2
    assert torch.equal(out[16:22], flat[[12, 13, 14, 15, 20, 21]])  # blocks 3 and 5


def test_gather_zero_fills_rows_past_the_table_and_of_negative_lengths(
    cpu_emulated: list[_cuda.Launch], checks_off: None
) -> None:
    """Item 8: a length longer than the table row can address, or a negative length, never
    reads past the table: those rows come out as zeros."""
    cache = torch.randn(8, 4, 2, 8)
    flat = cache.view(-1, 2, 8)
    tables = torch.tensor([[1], [2]], dtype=torch.int32)
    out = _cuda.gather_kv(cache, tables, torch.tensor([6, 2]))  # row 0 addresses 2 blocks, has 1
    assert torch.equal(out[:4], flat[4:8])
    assert not out[4:6].any()
    assert torch.equal(out[6:8], flat[8:10])
    out = _cuda.gather_kv(cache, tables, torch.tensor([-3, 5]), total_tokens=4)
    assert out.shape == (4, 2, 8)
    assert len(cpu_emulated) == 2


def test_gather_refuses_negative_lengths_with_checks_on(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 8: with checks on, a negative length is a ValueError before launch."""
    kc, _ = caches()
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        _cuda.gather_kv(kc, torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([-3, 5]))
    assert cpu_as_cuda == []


@pytest.mark.parametrize("checks", [True, False])
def test_gather_with_an_empty_block_table(
    cpu_as_cuda: list[_cuda.Launch], monkeypatch: pytest.MonkeyPatch, checks: bool
) -> None:
    """Item 11: sequences with no blocks yet (a ``[n, 0]`` table, zero lengths) gather to an
    empty tensor without a launch; the previous main crashed on ``.max()`` of the empty table."""
    monkeypatch.setattr(_cuda, "CHECK_INDICES", checks)
    kc, _ = caches()
    tables = torch.zeros((2, 0), dtype=torch.int32)
    lens = torch.tensor([0, 0])
    out = _cuda.gather_kv(kc, tables, lens)
    assert out.shape == (0, 2, 8)
    assert cpu_as_cuda == []
    assert ops.gather(kc, tables, lens).shape == (0, 2, 8)
    none = _cuda.gather_kv(kc, torch.zeros((0, 3), dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert none.shape == (0, 2, 8)


def test_gather_of_a_too_long_sequence_with_an_empty_table_is_refused(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 11: with checks on, a positive length over an empty table row is a clear error."""
    kc, _ = caches()
    with pytest.raises(ValueError, match="longer than its block-table row can address"):
        _cuda.gather_kv(kc, torch.zeros((1, 0), dtype=torch.int32), torch.tensor([3]))


@pytest.mark.parametrize(
    ("pairs", "waves", "cut"),
    [
        ([(1, 5), (2, 6)], [[(1, 5), (2, 6)]], []),
        ([(1, 2), (2, 3), (3, 4)], [[(3, 4)], [(2, 3)], [(1, 2)]], []),
        ([(3, 4), (2, 3), (1, 2)], [[(3, 4)], [(2, 3)], [(1, 2)]], []),
        ([(1, 2), (2, 1)], [[(2, 1)]], [(1, 2)]),
        ([(4, 4), (1, 2)], [[(1, 2)]], []),
        ([(0, 1), (1, 7), (0, 3)], [[(1, 7), (0, 3)], [(0, 1)]], []),
    ],
)
def test_copy_waves_order_dependent_pairs(pairs: list[tuple[int, int]], waves: list[Any], cut: list[Any]) -> None:
    """Item 9: a pair runs before the pair that overwrites its source; cycles are cut; a pair
    onto itself is dropped; independent pairs share one wave."""
    assert _cuda.copy_waves(pairs, 8) == (waves, cut)


def test_copy_waves_refuse_a_destination_named_twice() -> None:
    """Item 9: two copies into one block have no defined result: refused on every path."""
    with pytest.raises(ValueError, match="block 3 is the destination of two pairs"):
        _cuda.copy_waves([(1, 3), (2, 3)], 8)
    with pytest.raises(ValueError, match="destination of two pairs"):
        ops.copy_blocks([torch.zeros(8, 4)], [(1, 3), (2, 3)])
    cache = PagedKVCache(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="block 3 is the destination of two pairs"):
        cache.copy_blocks([(1, 3), (2, 3)])


def _snapshot_case(name: str) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(len(name))
    perm = torch.randperm(24, generator=g).tolist()
    return {
        "chain": [(i, i + 1) for i in range(12)],
        "reverse chain": [(i, i + 1) for i in reversed(range(12))],
        "swap": [(3, 9), (9, 3)],
        "cycle with tails": [(1, 2), (2, 3), (3, 1), (3, 7), (7, 8), (0, 5)],
        "permutation": list(enumerate(perm)),
        "fan out": [(2, 3), (2, 4), (3, 5), (4, 6)],
    }[name]


@pytest.mark.parametrize("case", ["chain", "reverse chain", "swap", "cycle with tails", "permutation", "fan out"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_emulated_copy_blocks_equals_the_snapshot_reference(
    cpu_emulated: list[_cuda.Launch], case: str, dtype: torch.dtype
) -> None:
    """Item 9: blocks that are both sources and destinations copy as if from a snapshot, like
    the torch reference, and no launch has two pairs touching one block (no race). On the
    previous main the chained pairs ran in one launch, in no defined order."""
    pairs = _snapshot_case(case)
    g = torch.Generator().manual_seed(5)
    caches_ = torch.randn(3, 24, 4, 2, 8, generator=g).to(dtype)
    ref = caches_.clone()
    _cuda.copy_blocks(caches_, pairs)
    ops.copy_blocks([ref[i] for i in range(3)], pairs)
    assert torch.equal(caches_, ref)
    assert cpu_emulated, "at least one launch"


def test_emulator_detects_a_racing_copy_launch(cpu_as_cuda: list[_cuda.Launch]) -> None:
    """Item 14: a single launch whose pairs chain (1 -> 2 -> 3), as the previous main planned
    them, is reported as a race."""
    caches_ = torch.randn(2, 8, 4, 2, 8)
    _cuda.copy_blocks(caches_, [(5, 6), (6, 7)])
    waves = cpu_as_cuda
    assert len(waves) == 2
    racing = dataclasses.replace(
        waves[0], grid=(2, 2), args=(caches_, torch.tensor([[5, 6], [6, 7]]), 2, *waves[0].args[3:])
    )
    with pytest.raises(emulate.KernelRace, match="read by one work item and written by another"):
        emulate.run(racing)
    twice = dataclasses.replace(racing, args=(caches_, torch.tensor([[1, 6], [2, 6]]), 2, *waves[0].args[3:]))
    with pytest.raises(emulate.KernelRace, match="two parallel work items write"):
        emulate.run(twice)


class _FakeFunction:
    """Stands in for CuPy's low-level ``Function``: records each launch."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, grid: Any, block: Any, args: Any, shared_mem: int = 0, stream: Any = None) -> None:
        self.calls.append((grid, block, args, shared_mem, stream))


def test_launch_passes_raw_pointers_and_caches_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 10: a launch hands the kernel each tensor's ``data_ptr()`` and each int as int64,
    makes no CuPy array (``from_dlpack`` would sync the legacy stream and break graph capture)
    and no CuPy stream object, runs on torch's current stream, and looks the function up once
    per (device, name)."""

    def forbidden(*a: Any, **k: Any) -> None:
        raise AssertionError("the launch path must not call this")

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            Device=lambda index: contextlib.nullcontext(),  # the one-time function lookup selects it
            ExternalStream=forbidden,
            Stream=forbidden,
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
        ),
        from_dlpack=forbidden,
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    function = _FakeFunction()
    lookups: list[str] = []

    class Module:
        def get_function(self, name: str) -> Any:
            lookups.append(name)
            return types.SimpleNamespace(kernel=function)

    monkeypatch.setattr(_cuda, "_modules", {0: Module()})
    monkeypatch.setattr(_cuda, "_functions", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=4242))
    monkeypatch.setattr(_cuda, "_require_cuda", lambda *ts: torch.device("cuda", 0))
    kc, vc = caches()
    k = torch.zeros(3, 2, 8, dtype=torch.float16)
    slots = torch.tensor([1, 2, 3])
    _cuda.scatter_kv(kc, vc, k, k, slots)
    _cuda.scatter_kv(kc, vc, k, k, slots)
    launch = _cuda.plan_scatter(kc, vc, k, k, slots)
    assert lookups == [launch.kernel]
    (grid, block, args, shared_mem, stream), _ = function.calls
    assert (grid, block, shared_mem) == (launch.grid, launch.block, 0)
    assert stream.ptr == 4242
    assert args[:5] == tuple(np.uint64(t.data_ptr()) for t in (k, k, kc, vc, slots))
    assert all(type(a) is np.uint64 for a in args[:5])
    assert all(type(a) is np.int64 for a in args[5:])


def test_cache_scatter_leaves_the_slot_check_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 10: on the CUDA path PagedKVCache.scatter does no range check of its own (a device
    synchronisation per call); the kernels' planner checks slots only while CHECK_INDICES is on."""
    cache = PagedKVCache(1, 4, 2, 2, 8)
    calls: list[Any] = []
    monkeypatch.setattr(cache, "_use_cuda", lambda: True)
    monkeypatch.setattr(_cuda, "scatter_kv", lambda *a: calls.append(a))
    monkeypatch.setattr(_cuda, "CHECK_INDICES", False)
    k = torch.zeros(2, 2, 8)
    cache.scatter(0, k, k, torch.tensor([1, 99]))  # 99 is past the cache: the kernel skips it
    assert len(calls) == 1
