"""A native CPU kernel for the decode half of paged attention, built on this machine on request.

:func:`planned_attention` runs a step's decodes (one new token per sequence) as torch operators:
two page gathers, a transposed copy of the keys and values, two small batched matmuls and a
softmax per layer. On a small CPU their fixed costs are most of the attention's time. This kernel
reads each sequence's pages where they lie (no gather, no copy), one (sequence, KV head) pair per
task across torch's intra-op threads, and accumulates in float32: the scores, the softmax and
the weighted sum of the values. Its result agrees with the torch path's to within the rounding
of the dtype (the torch path rounds bfloat16 scores and weights once more).

It is C++ compiled with torch's extension builder at :func:`build_decode_attention`, which needs
a C++ compiler (the same one ``torch.compile`` needs on a CPU); the build is cached per CPU
kind under torch's extensions folder, so a later process loads it in about a second.
``LlamaModel.compile_step()`` builds it; nothing builds it otherwise, and without it the torch
path runs as before.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["build_decode_attention", "decode_attention"]

logger = logging.getLogger(__name__)

Tensor = Any

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include <cstdint>
#include <cstring>

static inline float to_float(float x) { return x; }
// bfloat16 is the high half of a float32: a shift, which the compiler vectorizes.
static inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// query [S, H, D]; key/value caches [NB, BS, G, D]; tables [S, max_blocks] int64; lens [S] int64.
// A sequence of length n attends over its keys [n - window, n) (window <= 0: all of them).
template <typename T>
static void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale,
                   int64_t window) {
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), G = key_cache.size(2), group = H / G;
  const int64_t max_blocks = tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* k = key_cache.data_ptr<T>();
  const T* v = value_cache.data_ptr<T>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), row(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / G, g = task % G;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len[s] - window) : 0, n = len[s] - first;
      const int64_t* blocks = table + s * max_blocks;
      for (int64_t j = 0; j < group * D; ++j) qf[j] = to_float(q[(s * H + g * group) * D + j]) * sc;
      scores.assign(group * n, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* kr = k + ((blocks[pos / BS] * BS + pos % BS) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(kr[d]);
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qf.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qj[d] * row[d];
          scores[j * n + t] = dot;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * n;
        const float top = *std::max_element(sj, sj + n);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; ++t) {
          sj[t] = std::exp(sj[t] - top);
          total += sj[t];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* vr = v + ((blocks[pos / BS] * BS + pos % BS) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(vr[d]);
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * n + t];
          float* aj = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) aj[d] += p * row[d];
        }
      }
      for (int64_t j = 0; j < group * D; ++j) o[(s * H + g * group) * D + j] = static_cast<T>(acc[j]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "not contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and pages must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0 && query.size(2) == key_cache.size(3), "heads do not group");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "tables and lens must be int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == query.size(0) && lens.size(0) == query.size(0), "bad tables");
  auto t = tables.contiguous();
  auto l = lens.contiguous();
  auto out = at::empty_like(query);
  if (query.scalar_type() == at::kFloat) {
    decode<float>(query, key_cache, value_cache, t, l, out, scale, window);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(query, key_cache, value_cache, t, l, out, scale, window);
  } else {
    TORCH_CHECK(false, "decode_attention runs float32 and bfloat16 pages");
  }
  return out;
}
"""

_lock = threading.Lock()
_kernel: Callable[..., Tensor] | None = None
_failed: str | None = None  # why the build failed, once it has


def _cpu_kind() -> str:
    """A short name of this CPU's model and flags: the build targets them (``-march=native``),
    so a folder shared by machines of different kinds keeps one build per kind."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:12]


def build_decode_attention() -> bool:
    """Build (or load the cached build of) the kernel and make :func:`decode_attention` use it;
    True when it is in use. Idempotent. A failed build (no compiler, say) is logged once with
    its reason and returns False: attention then stays on the torch path."""
    global _kernel, _failed
    with _lock:
        if _kernel is not None or _failed is not None:
            return _kernel is not None
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(  # type: ignore[no-untyped-call]
                name=f"batchkit_decode_attention_{_cpu_kind()}",
                cpp_sources=_SOURCE,
                functions=["decode_attention"],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - a missing compiler, headers or a failed build: keep torch's path
            _failed = f"{type(exc).__name__}: {exc}"
            logger.warning("the native decode attention did not build, attention stays on torch: %s", _failed)
            return False
        _kernel = module.decode_attention
        return True


def decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor | None:
    """One query per sequence over its pages, on the native kernel: ``query`` ``[S, H, D]``,
    ``key_cache`` / ``value_cache`` one layer's ``[num_blocks, block_size, num_kv_heads,
    head_dim]``, ``tables`` ``[S, max_blocks]`` and ``lens`` ``[S]`` int64 (each sequence's
    context, its new token included); ``window``: attend over the last ``window`` keys only
    (a sliding window; None: all of them). Returns ``[S, H, D]`` in ``query``'s dtype, or None where
    the kernel is not built or does not take these tensors (a device or dtype it does not run,
    non-contiguous pages): the caller runs the torch path then."""
    kernel = _kernel
    if (
        kernel is None
        or query.device.type != "cpu"
        or key_cache.device.type != "cpu"
        or str(query.dtype) not in ("torch.float32", "torch.bfloat16")
        or not (query.dtype == key_cache.dtype == value_cache.dtype)
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        return None
    return kernel(query.contiguous(), key_cache, value_cache, tables, lens, scale, window or 0)
