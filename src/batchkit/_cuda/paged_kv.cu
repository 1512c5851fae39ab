// batchkit paged-KV kernels: scatter (reshape_and_cache), gather and block copies.
//
// These kernels only move bytes, so they are templated on the element *width* (W = unsigned
// char, unsigned short, unsigned int or unsigned long long for 1-, 2-, 4- and 8-byte dtypes)
// rather than on the float type: fp16 and bf16 share one instantiation and every copy is
// bit-exact by construction.
//
// Layout: a cache is [num_blocks, block_size, row] with row = num_kv_heads * head_dim elements
// contiguous; slot s addresses row s of the flat [num_blocks * block_size, row] view.
//
// Mapping (mirrored line by line by batchkit/_cuda/emulate.py, which the CPU tests run):
//   scatter_kv:  one CUDA block per token (grid-stride over tokens), threads stride the row.
//   gather_kv:   one CUDA block per output row (grid-stride), threads stride the row.
//   copy_blocks: blockIdx.y = cache, blockIdx.x strides the pairs, threads stride the block.
// Rows move in 16-byte units (uint4) when VEC is true (the launcher checks that every row
// start and the row length are 16-byte aligned), element by element otherwise.
// All offsets and counts are 64-bit: a cache may exceed 2^31 elements.
//
// Memory safety does not depend on the host's index checks: every index read from device
// memory (slot, block id, sequence length) is checked against the size it addresses, and a row
// whose index is out of range is skipped (scatter) or zero-filled (gather).

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

template <typename W, bool VEC>
__device__ __forceinline__ void zero_row(W* __restrict__ dst, i64 n) {
  if (VEC) {
    const i64 units = n * (i64)sizeof(W) / 16;
    Vec16* d = reinterpret_cast<Vec16*>(dst);
    const Vec16 z = {0u, 0u, 0u, 0u};
    for (i64 i = threadIdx.x; i < units; i += blockDim.x) d[i] = z;
  } else {
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = (W)0;
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

// out: [num_out_rows, row]; cu_seq_lens: [num_seqs + 1] prefix sums of the sequence lengths;
// block_tables: [num_seqs, max_blocks] int32, contiguous; cache: [num_blocks * block_size, row].
// Output row t is token t of the concatenated sequences. It is zero-filled instead when t is past
// the last token, when its sequence has a negative length (cu_seq_lens not increasing there), or
// when its block-table entry lies outside 0..num_blocks-1 or past the table row. The loop is
// bounded by num_out_rows, the rows the output really has, never by the device-side total.
template <typename W, bool VEC>
__global__ void gather_kv(const W* __restrict__ cache, W* __restrict__ out,
                          const int* __restrict__ block_tables, const i64* __restrict__ cu_seq_lens,
                          i64 num_seqs, i64 max_blocks, i64 row, i64 block_size, i64 num_out_rows,
                          i64 num_blocks) {
  for (i64 t = blockIdx.x; t < num_out_rows; t += gridDim.x) {
    // The sequence holding token t: the last s with cu_seq_lens[s] <= t (binary search).
    i64 lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const i64 mid = (lo + hi + 1) >> 1;
      if (cu_seq_lens[mid] <= t) lo = mid; else hi = mid - 1;
    }
    bool ok = num_seqs > 0 && cu_seq_lens[lo] <= t && t < cu_seq_lens[lo + 1];
    i64 slot = 0;
    if (ok) {
      const i64 pos = t - cu_seq_lens[lo];
      const i64 col = pos / block_size;
      ok = col < max_blocks;
      if (ok) {
        const i64 block = (i64)block_tables[lo * max_blocks + col];
        ok = block >= 0 && block < num_blocks;
        slot = block * block_size + pos % block_size;
      }
    }
    if (ok) {
      copy_row<W, VEC>(out + t * row, cache + slot * row, row);
    } else {
      zero_row<W, VEC>(out + t * row, row);
    }
  }
}

// caches: [num_caches, num_blocks, block_elems] contiguous; pairs: [num_pairs, 2] (src, dst).
// The pairs of one launch must be independent (no block both read and written, no destination
// twice): the launcher orders a call's pairs into such waves, one launch each.
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
