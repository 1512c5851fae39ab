// batchkit paged-KV kernels: scatter (reshape_and_cache), gather and block copies.
//
// These kernels only move bytes, so they are templated on the element *width* (W = unsigned
// char, unsigned short or unsigned int for 1-, 2- and 4-byte dtypes) rather than on the float
// type: fp16 and bf16 share one instantiation and every copy is bit-exact by construction.
//
// Layout: a cache is [num_blocks, block_size, row] with row = num_kv_heads * head_dim elements
// contiguous; slot s addresses row s of the flat [num_blocks * block_size, row] view.
//
// Mapping (mirrored line by line by batchkit/_cuda/emulate.py, which the CPU tests run):
//   scatter_kv:  one CUDA block per token (grid-stride over tokens), threads stride the row.
//   gather_kv:   one CUDA block per output token (grid-stride), threads stride the row.
//   copy_blocks: blockIdx.y = cache, blockIdx.x strides the pairs, threads stride the block.
// Rows move in 16-byte units (uint4) when VEC is true (the launcher checks that every row
// start and the row length are 16-byte aligned), element by element otherwise.
// All offsets are 64-bit: a cache may exceed 2^31 elements.

typedef long long i64;

struct alignas(16) Vec16 {
  unsigned int x, y, z, w;
};

template <typename W, bool VEC>
__device__ __forceinline__ void copy_row(W* __restrict__ dst, const W* __restrict__ src, i64 n) {
  if (VEC) {
    const i64 units = n * (i64)sizeof(W) / 16;
    Vec16* d = reinterpret_cast<Vec16*>(dst);
    const Vec16* s = reinterpret_cast<const Vec16*>(src);
    for (i64 i = threadIdx.x; i < units; i += blockDim.x) d[i] = s[i];
  } else {
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

// key/value: [num_tokens, row] with a token stride (in elements) of key_stride/value_stride.
// Slots < 0 are padding and are skipped; slots >= num_slots are skipped too, so that a bad index
// can never write outside the cache (the launcher refuses them before launch when asked to).
template <typename W, typename I, bool VEC>
__global__ void scatter_kv(const W* __restrict__ key, const W* __restrict__ value,
                           W* __restrict__ key_cache, W* __restrict__ value_cache,
                           const I* __restrict__ slot_mapping, i64 num_tokens, i64 key_stride,
                           i64 value_stride, i64 row, i64 num_slots) {
  for (i64 t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const i64 slot = (i64)slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    copy_row<W, VEC>(key_cache + slot * row, key + t * key_stride, row);
    copy_row<W, VEC>(value_cache + slot * row, value + t * value_stride, row);
  }
}

// out: [total_tokens, row]; cu_seq_lens: [num_seqs + 1] prefix sums of the sequence lengths;
// block_tables: [num_seqs, bt_stride] int32.
template <typename W, bool VEC>
__global__ void gather_kv(const W* __restrict__ cache, W* __restrict__ out,
                          const int* __restrict__ block_tables, const i64* __restrict__ cu_seq_lens,
                          int num_seqs, i64 bt_stride, i64 row, i64 block_size) {
  const i64 total = cu_seq_lens[num_seqs];
  for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
    // The sequence holding token t: the last s with cu_seq_lens[s] <= t (binary search).
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (cu_seq_lens[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const i64 pos = t - cu_seq_lens[lo];
    const i64 block = (i64)block_tables[(i64)lo * bt_stride + pos / block_size];
    const i64 slot = block * block_size + pos % block_size;
    copy_row<W, VEC>(out + t * row, cache + slot * row, row);
  }
}

// caches: [num_caches, num_blocks, block_elems] contiguous; pairs: [num_pairs, 2] (src, dst).
template <typename W, bool VEC>
__global__ void copy_blocks(W* __restrict__ caches, const i64* __restrict__ pairs, i64 num_pairs,
                            i64 cache_stride, i64 block_elems) {
  W* cache = caches + (i64)blockIdx.y * cache_stride;
  for (i64 p = blockIdx.x; p < num_pairs; p += gridDim.x) {
    const i64 src = pairs[2 * p];
    const i64 dst = pairs[2 * p + 1];
    copy_row<W, VEC>(cache + dst * block_elems, cache + src * block_elems, block_elems);
  }
}
