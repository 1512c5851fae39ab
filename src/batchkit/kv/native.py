"""A native CPU kernel for the decode half of paged attention, built on this machine on request.

:func:`planned_attention` runs a step's decodes (one new token per sequence) as torch operators:
two page gathers, a transposed copy of the keys and values, two small batched matmuls and a
softmax per layer. On a small CPU their fixed costs are most of the attention's time. This kernel
reads each sequence's pages where they lie (no gather, no copy), one (sequence, KV head) pair per
task across torch's intra-op threads, and accumulates in float32: the scores, the softmax and
the weighted sum of the values. Each sequence's keys are read a page at a time (no division per
key). Where the CPU has AVX-512 and the head dim is 64 or 128, sixteen keys' scores are reduced
together, the value sums stay in registers and the next page is fetched ahead (docs/benchmarks.md
has the figures). Its result agrees with the torch path's to within the rounding of the dtype
(the torch path rounds bfloat16 scores and weights once more).

It is C++ compiled with torch's extension builder at :func:`build_decode_attention`, which needs
a C++ compiler (the same one ``torch.compile`` needs on a CPU); the build is cached per CPU
kind under torch's extensions folder, so a later process loads it in about a second.
``LlamaModel.compile_step()`` builds it; nothing builds it otherwise, and without it the torch
path runs as before.

The same build registers three operators for a compiled step (``torch.ops.batchkit_native``), so
that the graph calls C++ where it would call a Python function: ``write_kv`` and
``paged_attention``, those of :mod:`batchkit.kv.compiled` (the attention in C++ for a step of
decodes alone, which :func:`decodes` sets), and ``linear``, ``x @ weight.T`` on a oneDNN copy of
the weight kept per key (made on first use and again after the weight changes;
:func:`drop_linear` frees it).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["build_decode_attention", "built", "decode_attention", "decodes", "drop_linear"]

logger = logging.getLogger(__name__)

Tensor = Any

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

static inline float to_float(float x) { return x; }
// bfloat16 is the high half of a float32: a shift, which the compiler vectorizes.
static inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// With AVX-512 and a head dim of 64 or 128, the scores and the weighted sum of the values run on
// the intrinsics below; any other head dim, or a CPU without AVX-512, runs the loops of decode_task,
// which the compiler vectorizes.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Fetch KV head g's rows of the page that key `next` starts (K or V) while the page before it is
// computed: a sequence's pages lie apart. Nothing past the last key.
template <typename T>
static inline void prefetch_page(const T* base, const int64_t* blocks, int64_t next, int64_t end, int64_t BS,
                                 int64_t G, int64_t g, int64_t D) {
  if (next >= end) return;
  const T* row = base + ((blocks[next / BS] * BS) * G + g) * D;
  const int64_t rows = std::min(BS, end - next), bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < rows; ++i, row += G * D)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}
// Sixteen vectors to one: lane t of the result is the sum of the lanes of v[t].
static inline __m512 sum16(__m512* v) {
  __m512 r[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// Scores of query heads qf[group][HD] against cnt <= 16 keys kr, kr + stride, ...: out[j * n + t].
template <typename T, int HD>
static inline void scores16(const float* qf, int64_t group, const T* kr, int64_t stride, int64_t cnt, float* out,
                            int64_t n) {
  constexpr int NV = HD / 16;
  __m512 acc[16];
  for (int64_t j = 0; j < group; ++j) {
    __m512 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qf + j * HD + 16 * c);
    for (int t = 0; t < 16; ++t) {
      if (t < cnt) {
        const T* row = kr + t * stride;
        __m512 a = _mm512_mul_ps(qv[0], load16(row));
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], load16(row + 16 * c), a);
        acc[t] = a;
      } else {
        acc[t] = _mm512_setzero_ps();
      }
    }
    _mm512_mask_storeu_ps(out + j * n, static_cast<__mmask16>((1u << cnt) - 1u), sum16(acc));
  }
}

// The weighted sum of the values: acc[j][HD] = sum over keys t of p[j * n + t] * value t, for every query
// head j of the group, a few heads at a time with their sums in registers.
template <typename T, int HD>
static inline void values16(const float* p, int64_t group, int64_t n, const T* v, const int64_t* blocks, int64_t first,
                            int64_t end, int64_t BS, int64_t G, int64_t g, float* out) {
  constexpr int NV = HD / 16, JC = NV >= 16 ? 1 : 16 / NV;
  const int64_t stride = G * HD;
  for (int64_t j0 = 0; j0 < group; j0 += JC) {
    const int64_t jn = std::min<int64_t>(JC, group - j0);
    __m512 acc[JC][NV];  // JC query heads' sums: at most 16 registers
    for (int j = 0; j < JC; ++j)
      for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t pos = first; pos < end;) {
      const int64_t off = pos % BS, cnt = std::min(BS - off, end - pos);
      const T* vr = v + ((blocks[pos / BS] * BS + off) * G + g) * HD;
      prefetch_page(v, blocks, pos + cnt, end, BS, G, g, HD);
      for (int64_t i = 0; i < cnt; ++i, vr += stride) {
        const int64_t t = pos - first + i;
        __m512 row[NV];
        for (int c = 0; c < NV; ++c) row[c] = load16(vr + 16 * c);
        for (int j = 0; j < JC; ++j) {
          if (j < jn) {  // not a break: the loop unrolls and the sums stay in registers
            const __m512 pj = _mm512_set1_ps(p[(j0 + j) * n + t]);
            for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_fmadd_ps(pj, row[c], acc[j][c]);
          }
        }
      }
      pos += cnt;
    }
    for (int j = 0; j < JC; ++j)
      if (j < jn)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + (j0 + j) * HD + 16 * c, acc[j][c]);
  }
}
#endif

// One (sequence, KV head) task. HD > 0 fixes the head dim at compile time (the loops over it unroll
// and stay in registers); HD == 0 reads it from D.
template <typename T, int HD>
static void decode_task(const T* q, const T* k, const T* v, const int64_t* blocks, int64_t first, int64_t end,
                        int64_t BS, int64_t G, int64_t g, int64_t group, int64_t D_, float sc, T* o,
                        float* qf, float* acc, std::vector<float>& scores) {
  const int64_t D = HD > 0 ? HD : D_;
  const int64_t n = end - first, stride = G * D;
  for (int64_t j = 0; j < group * D; ++j) qf[j] = to_float(q[j]) * sc;
  scores.resize(group * n);
  float* sc_ = scores.data();
  // The scores, a page's run of keys at a time: no division per key.
  for (int64_t pos = first; pos < end;) {
    const int64_t off = pos % BS, cnt = std::min(BS - off, end - pos);
    const T* kr = k + ((blocks[pos / BS] * BS + off) * G + g) * D;
#if defined(__AVX512F__)
    if constexpr (HD > 0 && HD % 16 == 0) {
      prefetch_page(k, blocks, pos + cnt, end, BS, G, g, D);
      for (int64_t i = 0; i < cnt; i += 16)
        scores16<T, HD>(qf, group, kr + i * stride, stride, std::min<int64_t>(16, cnt - i), sc_ + (pos - first + i), n);
      pos += cnt;
      continue;
    }
#endif
    for (int64_t i = 0; i < cnt; ++i, kr += stride) {
      const int64_t t = pos - first + i;
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = qf + j * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * to_float(kr[d]);
        sc_[j * n + t] = dot;
      }
    }
    pos += cnt;
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sj = sc_ + j * n;
    float top = sj[0];
    for (int64_t t = 1; t < n; ++t) top = std::max(top, sj[t]);
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
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    values16<T, HD>(sc_, group, n, v, blocks, first, end, BS, G, g, acc);
    for (int64_t j = 0; j < group * D; ++j) o[j] = static_cast<T>(acc[j]);
    return;
  }
#endif
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t pos = first; pos < end;) {
    const int64_t off = pos % BS, cnt = std::min(BS - off, end - pos);
    const T* vr = v + ((blocks[pos / BS] * BS + off) * G + g) * D;
    for (int64_t i = 0; i < cnt; ++i, vr += stride) {
      const int64_t t = pos - first + i;
      for (int64_t j = 0; j < group; ++j) {
        const float p = sc_[j * n + t];
        float* aj = acc + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) aj[d] += p * to_float(vr[d]);
      }
    }
    pos += cnt;
  }
  for (int64_t j = 0; j < group * D; ++j) o[j] = static_cast<T>(acc[j]);
}

// query [S, H, D]; key/value caches [NB, BS, G, D]; tables [S, max_blocks] int64; lens [S] int64.
// A sequence of length n attends over its keys [n - window, n) (window <= 0: all of them).
template <typename T, int HD>
static void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale,
                   int64_t window) {
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), G = key_cache.size(2), group = H / G;
  const int64_t max_blocks = tables.size(1), qs = query.stride(0);
  const T* q = query.data_ptr<T>();
  const T* k = key_cache.data_ptr<T>();
  const T* v = value_cache.data_ptr<T>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / G, g = task % G;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len[s] - window) : 0;
      const int64_t at = g * group * D;
      decode_task<T, HD>(q + s * qs + at, k, v, table + s * max_blocks, first, len[s], BS, G, g, group, D, sc,
                         o + s * H * D + at,
                         qf.data(), acc.data(), scores);
    }
  });
}

template <typename T>
static void decode_any(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale,
                       int64_t window) {
  switch (query.size(2)) {
    case 64: return decode<T, 64>(query, key_cache, value_cache, tables, lens, out, scale, window);
    case 128: return decode<T, 128>(query, key_cache, value_cache, tables, lens, out, scale, window);
    default: return decode<T, 0>(query, key_cache, value_cache, tables, lens, out, scale, window);
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "bad shapes");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "not contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and pages must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0 && query.size(2) == key_cache.size(3), "heads do not group");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "tables and lens must be int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == query.size(0) && lens.size(0) == query.size(0), "bad tables");
  auto t = tables.contiguous();
  auto l = lens.contiguous();
  // A sequence's heads must lie together; sequences may lie apart (the query a slice of wider rows).
  const auto q = query.stride(2) == 1 && query.stride(1) == query.size(2) ? query : query.contiguous();
  auto out = at::empty(query.sizes(), query.options());
  if (query.scalar_type() == at::kFloat) {
    decode_any<float>(q, key_cache, value_cache, t, l, out, scale, window);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode_any<at::BFloat16>(q, key_cache, value_cache, t, l, out, scale, window);
  } else {
    TORCH_CHECK(false, "decode_attention runs float32 and bfloat16 pages");
  }
  return out;
}

// The two operators of a compiled step that torch.compile calls as they are (torch.ops.batchkit_native):
// in C++, a call costs the dispatcher's few microseconds, not a Python function's.
//
// write_kv: key/value [N, G, D] into the slots (int64, none of them padding) of layer `layer` of the
// cache kv [layers, 2, NB, BS, G, D], in place.
void write_kv(at::Tensor kv, int64_t layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous() && kv.size(1) == 2, "kv must be a contiguous cache");
  TORCH_CHECK(0 <= layer && layer < kv.size(0), "no layer ", layer);
  const int64_t row = kv.size(4) * kv.size(5), num_slots = kv.size(2) * kv.size(3);
  const auto s = slots.to(at::kLong).contiguous();
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(0) == s.numel() &&
                  key.size(1) == kv.size(4) && key.size(2) == kv.size(5),
              "key/value do not fit the slots");
  // A token's [G, D] rows must lie together; tokens may lie apart (a slice of the q/k/v rows).
  const auto rows = [&](const at::Tensor& x) {
    const auto y = x.to(kv.scalar_type());
    return y.stride(2) == 1 && y.stride(1) == y.size(2) ? y : y.contiguous();
  };
  const auto k = rows(key), v = rows(value);
  const int64_t es = kv.element_size(), bytes = row * es;
  char* base = static_cast<char*>(kv.data_ptr()) + layer * kv.stride(0) * es;
  char* const dst[2] = {base, base + kv.stride(1) * es};
  const char* const src[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const int64_t step[2] = {k.stride(0) * es, v.stride(0) * es};
  const int64_t* at = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.numel(); ++t)  // all of them before any write
    TORCH_CHECK(0 <= at[t] && at[t] < num_slots, "slot ", at[t], " is outside the cache");
  for (int64_t t = 0; t < s.numel(); ++t)
    for (int h = 0; h < 2; ++h) std::memcpy(dst[h] + at[t] * bytes, src[h] + t * step[h], bytes);
}

// linear: x @ weight.T on a copy of weight reordered for oneDNN (torch's mkldnn ops), made on the first
// call with `key` and again when the weight is replaced or written (its storage, version or dtype
// changes). A weight oneDNN refuses runs on at::linear from then on.
struct Packed {
  const void* data;
  int64_t version;
  at::ScalarType dtype;
  at::Tensor weight;  // undefined: at::linear
};
static std::mutex packs_lock;
static std::unordered_map<int64_t, Packed> packs;

static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t key) {
  Packed entry{};
  bool found = false;
  {
    std::lock_guard<std::mutex> hold(packs_lock);
    auto it = packs.find(key);
    if (it != packs.end() && it->second.data == weight.data_ptr() && it->second.version == weight._version() &&
        it->second.dtype == weight.scalar_type()) {
      entry = it->second;
      found = true;
    }
  }
  if (found) return entry.weight.defined() ? onednn_linear(x, entry.weight) : at::linear(x, weight);
  static auto reorder = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                            .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  entry = Packed{weight.data_ptr(), weight._version(), weight.scalar_type(), at::Tensor()};
  at::Tensor out;
  try {
    at::Tensor packed = reorder.call(weight, std::nullopt);
    out = onednn_linear(x, packed);
    entry.weight = packed;
  } catch (const std::exception&) {  // a dtype or CPU oneDNN does not run: the plain matmul
    out = at::linear(x, weight);
  }
  std::lock_guard<std::mutex> hold(packs_lock);
  packs[key] = entry;
  return out;
}

// Forget key's copy (its layer is gone).
void drop_linear(int64_t key) {
  std::lock_guard<std::mutex> hold(packs_lock);
  packs.erase(key);
}

// paged_attention: batchkit::paged_attention (batchkit.kv.compiled), with the decodes of a step that has
// nothing else (set_decodes) run here on the kernel; any other step, or pages the kernel does not take,
// goes to the Python operator.
struct Decodes {
  at::Tensor tables, lens;  // undefined: none set
  int64_t window = 0;
};
static thread_local Decodes decodes;  // those of the step this thread runs

void set_decodes(const at::Tensor& tables, const at::Tensor& lens, int64_t window) {
  decodes = Decodes{tables.contiguous(), lens.contiguous(), window};
}

void clear_decodes() { decodes = Decodes{}; }

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv, int64_t layer, double scale) {
  const auto type = query.scalar_type();
  if (decodes.lens.defined() && query.dim() == 3 && query.size(0) == decodes.lens.size(0) && kv.dim() == 6 &&
      kv.is_contiguous() && kv.scalar_type() == type && (type == at::kFloat || type == at::kBFloat16)) {
    const auto pages = kv.select(0, layer);
    return decode_attention(query, pages.select(0, 0), pages.select(0, 1), decodes.tables, decodes.lens, scale,
                            decodes.window);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("batchkit::paged_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op.call(query, kv, layer, scale);
}

TORCH_LIBRARY(batchkit_native, m) {
  m.def("write_kv(Tensor(a!) kv, int layer, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def("linear(Tensor x, Tensor weight, int key) -> Tensor");
  m.def("paged_attention(Tensor query, Tensor kv, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchkit_native, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("linear", &packed_linear);
  m.impl("paged_attention", &paged_attention);
}
"""

_lock = threading.Lock()
_kernel: Callable[..., Tensor] | None = None
_module: Any = None  # the built extension (its operators stay registered once loaded)
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
    global _kernel, _module, _failed
    with _lock:
        if _kernel is not None or _failed is not None:
            return _kernel is not None
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(  # type: ignore[no-untyped-call]
                name=f"batchkit_decode_attention_{_cpu_kind()}",
                cpp_sources=_SOURCE,
                functions=["decode_attention", "drop_linear", "set_decodes", "clear_decodes"],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - a missing compiler, headers or a failed build: keep torch's path
            _failed = f"{type(exc).__name__}: {exc}"
            logger.warning("the native decode attention did not build, attention stays on torch: %s", _failed)
            return False
        if _module is None:  # the first load in this process (a later one finds the module loaded)
            _register_fakes()
        _kernel, _module = module.decode_attention, module
        return True


def _register_fakes() -> None:
    """The output shapes of the extension's operators (``torch.ops.batchkit_native``), which
    ``torch.compile`` traces with."""
    import torch

    @torch.library.register_fake("batchkit_native::write_kv")  # type: ignore[untyped-decorator]
    def _(kv: Tensor, layer: int, key: Tensor, value: Tensor, slots: Tensor) -> None:
        return None

    @torch.library.register_fake("batchkit_native::linear")  # type: ignore[untyped-decorator]
    def _(x: Tensor, weight: Tensor, key: int) -> Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("batchkit_native::paged_attention")  # type: ignore[untyped-decorator]
    def _(query: Tensor, kv: Tensor, layer: int, scale: float) -> Tensor:
        return query.new_empty(query.shape)


def built() -> bool:
    """True once :func:`build_decode_attention` has built (or loaded) the extension in this
    process: its kernel runs the decodes, and ``torch.ops.batchkit_native.write_kv``,
    ``.paged_attention`` and ``.linear`` exist."""
    return _kernel is not None


@contextmanager
def decodes(tables: Tensor | None, lens: Tensor | None, window: int | None = None) -> Iterator[None]:
    """Make ``torch.ops.batchkit_native.paged_attention`` run every query of the block's steps on the
    kernel in this thread, as one decode per sequence over ``tables`` ``[S, max_blocks]`` and
    ``lens`` ``[S]`` (int64; see :func:`decode_attention`); None: send them all to
    ``torch.ops.batchkit.paged_attention``. Nothing where the extension is not built."""
    if _module is None:
        yield
        return
    if tables is None or lens is None:
        _module.clear_decodes()
    else:
        _module.set_decodes(tables, lens, window or 0)
    try:
        yield
    finally:
        _module.clear_decodes()


def drop_linear(key: int) -> None:
    """Free the oneDNN copy of the weight that ``torch.ops.batchkit_native.linear`` keeps for
    ``key`` (nothing if there is none, or no extension)."""
    if _module is not None:
        _module.drop_linear(key)


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
    return kernel(query, key_cache, value_cache, tables, lens, scale, window or 0)
