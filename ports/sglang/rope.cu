// Port of SGLang's sgl-kernel RoPE (Apache-2.0; Copyright (c) 2023-2025 by FlashInfer team and
// SGLang team). Written anew from the originals, keeping their structure:
// * sgl-project/sglang@54ac12ace81e:sgl-kernel/csrc/elementwise/pos_enc.cuh: SGLang's "Enhanced"
//   cos/sin-cache kernels (sequential heads and head-parallel), which add to FlashInfer's
//   BatchQKApplyRotaryPosIdsCosSinCache the fused store of k (rotated) and v into the KV cache
//   (save_kv_cache) and programmatic dependent launch (griddepcontrol on sm_90+);
// * sgl-project/sglang@02f22ef8fc3a:sgl-kernel/csrc/multimodal/rotary_embedding.cu: SGLang's
//   any-head-size kernel (head size 80 and the others FlashInfer's dispatch does not take),
//   written from vLLM's rotary_embedding: per-token cos/sin rows, one block per token.
// sgl-kernel builds these for sm_90 with -use_fast_math and -maxrregcount=128
// (sgl-kernel/CMakeLists.txt, SGL_KERNEL_CUDA_FLAGS of the sm_90 library); NVRTC is given the same.
//
// FlashInfer's parts, rewritten here because a port imports no other port (FlashInfer's own port
// has them too): vec_t's cast_load / cast_store and float load (16-byte vectors),
// vec_apply_llama_rope_cos_sin (rotate-half) and vec_apply_llama_rope_cos_sin_interleave_reuse_half
// (interleaved, cos[i / 2]) from flashinfer-ai/flashinfer include/flashinfer/pos_enc.cuh, read at
// fb28d7242b35 (sgl-kernel's CMakeLists pins FlashInfer bc29697ba20b, not read here; these helpers
// are the ones SGLang's Enhanced kernels call by name), get_elem_offset_impl (64-bit offsets).
//
// Design kept (ports/sglang/__init__.py lists every departure):
// * vec_size = max(16 / sizeof(T), HEAD_DIM / 32) elements per thread, bdx = HEAD_DIM / vec_size
//   threads per head (a head is at most one warp), block (bdx, bdy), bdy = max(128, bdx) / bdx
//   tokens per block; grid (ceil(nnz / bdy)) for the sequential-head kernel, or
//   (ceil(nnz / bdy), num_qo_heads + num_kv_heads) for the head-parallel one;
// * a thread loads its cos and sin vectors from the fp32 cache row once and reuses them for every
//   head; x is loaded whole, rotated in fp32, rounded once at the store;
// * save_kv_cache: v's vector and the token's kv_cache_loc are read before k is rotated, then k
//   (rotated) and v are stored at row kv_cache_loc[token] of k_buffer and v_buffer;
// * the any-head-size kernel: scalar loads (__ldg for cos/sin), pairs strided over threadIdx.x,
//   int32 token and head offsets, as the original.
// Departures (kernel):
// * the interleaved cache kernels load vec_size / 2 floats of cos and sin (the half the rotation
//   uses) instead of vec_size: for the last thread of a row the unused half lies past the row,
//   and past the cache on its last row (an out-of-bounds read in the original);
// * the cache kernels take the cache's row count (max_pos, after pos_ids) and give a token whose
//   position lies outside [0, max_pos) NaN cos/sin (its rotated lanes come out NaN, the others
//   are copied) instead of reading past the cache, as the FlashInfer port's cache kernels do;
// * they take the rows both KV buffers have (kv_rows, after kv_cache_loc) and skip the store of a
//   token whose kv_cache_loc lies outside [0, kv_rows) (its k_rope is still written) instead of
//   writing past k_buffer and v_buffer.
// Either is reached only where the host's range check was skipped (check_positions_on_host /
// check_cache_loc_on_host False) or could not run (inside a CUDA-graph capture).
// The any-head-size kernel indexes only by token (cos/sin rows gathered per token), so it has
// no index to bound.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long size_t_;

template <uint32_t N>
struct fvec {
  float d[N];
  __device__ __forceinline__ float &operator[](uint32_t i) { return d[i]; }
  __device__ __forceinline__ const float &operator[](uint32_t i) const { return d[i]; }
  // M (a multiple of 4) fp32 values as float4 loads.
  template <uint32_t M>
  __device__ __forceinline__ void load(const float *p) {
#pragma unroll
    for (uint32_t i = 0; i < M / 4; ++i) {
      float4 v = reinterpret_cast<const float4 *>(p)[i];
      d[4 * i] = v.x; d[4 * i + 1] = v.y; d[4 * i + 2] = v.z; d[4 * i + 3] = v.w;
    }
  }
};

__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void from_float2(__half2 &o, float2 v) { o = __float22half2_rn(v); }
__device__ __forceinline__ void from_float2(__nv_bfloat162 &o, float2 v) {
  o = __float22bfloat162_rn(v);
}
template <typename T> struct pair_of;
template <> struct pair_of<__half> { typedef __half2 type; };
template <> struct pair_of<__nv_bfloat16> { typedef __nv_bfloat162 type; };

// N 16-bit elements with 16-byte loads, widened to fp32 (vec_t<T, N>::cast_load).
template <uint32_t N, typename T>
__device__ __forceinline__ void cast_load(fvec<N> &v, const T *p) {
  typedef typename pair_of<T>::type T2;
#pragma unroll
  for (uint32_t c = 0; c < N / 8; ++c) {
    uint4 raw = reinterpret_cast<const uint4 *>(p)[c];
    const T2 *h = reinterpret_cast<const T2 *>(&raw);
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      float2 f = to_float2(h[j]);
      v[8 * c + 2 * j] = f.x;
      v[8 * c + 2 * j + 1] = f.y;
    }
  }
}

// Narrowed with round-to-nearest-even, stored with 16-byte stores (vec_t<float, N>::cast_store).
template <uint32_t N, typename T>
__device__ __forceinline__ void cast_store(const fvec<N> &v, T *p) {
  typedef typename pair_of<T>::type T2;
#pragma unroll
  for (uint32_t c = 0; c < N / 8; ++c) {
    uint4 raw;
    T2 *h = reinterpret_cast<T2 *>(&raw);
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      from_float2(h[j], make_float2(v[8 * c + 2 * j], v[8 * c + 2 * j + 1]));
    }
    reinterpret_cast<uint4 *>(p)[c] = raw;
  }
}

__device__ __forceinline__ size_t_ elem_offset(size_t_ elem_idx, size_t_ head_idx,
                                               size_t_ stride_n, size_t_ stride_h) {
  return elem_idx * stride_n + head_idx * stride_h;
}

// FlashInfer's vec_apply_llama_rope_cos_sin: rotate-half, partner vector x[j +- R/2].
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> rope_cos_sin(const T *x, const fvec<vec_size> &cos,
                                                       const fvec<vec_size> &sin,
                                                       uint32_t rotary_dim) {
  fvec<vec_size> permuted_vec, vec;
  cast_load(vec, x + threadIdx.x * vec_size);
  if (threadIdx.x * vec_size < rotary_dim) {
    cast_load(permuted_vec, x + ((threadIdx.x * vec_size < rotary_dim / 2)
                                     ? threadIdx.x * vec_size + rotary_dim / 2
                                     : threadIdx.x * vec_size - rotary_dim / 2));
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      vec[i] = vec[i] * cos[i] +
               ((threadIdx.x * vec_size < rotary_dim / 2) ? -permuted_vec[i] : permuted_vec[i]) *
                   sin[i];
    }
  }
  return vec;
}

// FlashInfer's vec_apply_llama_rope_cos_sin_interleave_reuse_half: pairs (2i, 2i+1) inside the
// vector, cos/sin[i / 2].
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> rope_cos_sin_interleave_reuse_half(
    const T *x, const fvec<vec_size> &cos, const fvec<vec_size> &sin, uint32_t rotary_dim) {
  fvec<vec_size> vec, vec_before;
  cast_load(vec, x + threadIdx.x * vec_size);
  if (threadIdx.x * vec_size < rotary_dim) {
    vec_before = vec;
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      vec[i] = vec[i] * cos[i / 2] +
               ((i % 2 == 0) ? -vec_before[i ^ 1] : vec_before[i ^ 1]) * sin[i / 2];
    }
  }
  return vec;
}

// The token's cos and sin vectors from cache row pos: [cos (R/2) | sin (R/2)].
template <bool interleave, uint32_t vec_size>
__device__ __forceinline__ void load_cos_sin(fvec<vec_size> &cos, fvec<vec_size> &sin,
                                             const float *cos_sin_cache, int64_t pos,
                                             uint32_t rotary_dim, int64_t max_pos) {
  // Departure: a position outside the cache (reached only where the host check was skipped or
  // could not run) gives NaN cos/sin instead of a read past the cache.
  if (pos < 0 || pos >= max_pos) {
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      cos[i] = __int_as_float(0x7fc00000);
      sin[i] = cos[i];
    }
    return;
  }
  if (threadIdx.x * vec_size < rotary_dim) {
    const int half_rotary_dim = rotary_dim / 2;
    int vec_idx;
    if (interleave) {
      vec_idx = (threadIdx.x * vec_size) / 2;
      // Departure: the used half only (see the file header).
      cos.template load<vec_size / 2>(cos_sin_cache + pos * rotary_dim + vec_idx);
      sin.template load<vec_size / 2>(cos_sin_cache + pos * rotary_dim + half_rotary_dim + vec_idx);
    } else {
      vec_idx = (threadIdx.x * vec_size) % half_rotary_dim;
      cos.template load<vec_size>(cos_sin_cache + pos * rotary_dim + vec_idx);
      sin.template load<vec_size>(cos_sin_cache + pos * rotary_dim + half_rotary_dim + vec_idx);
    }
  }
}

template <bool interleave, uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> rotate(const T *x, const fvec<vec_size> &cos,
                                                 const fvec<vec_size> &sin, uint32_t rotary_dim) {
  if (interleave) return rope_cos_sin_interleave_reuse_half<vec_size, bdx>(x, cos, sin, rotary_dim);
  return rope_cos_sin<vec_size, bdx>(x, cos, sin, rotary_dim);
}

__device__ __forceinline__ void pdl_wait() {
#if (defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900))
  asm volatile("griddepcontrol.wait;");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if (defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900))
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// One kv head of one token: rotate k into k_rope; with save_kv_cache also store k (rotated) and v
// at row kv_cache_loc[idx] of the KV buffers (kv_buffer_saver::prepare / save), skipped
// (departure) for a row outside [0, kv_rows).
template <bool save_kv_cache, bool interleave, uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ void k_head(
    const T *k, const T *v, T *k_rope, T *k_buffer, T *v_buffer, const fvec<vec_size> &cos,
    const fvec<vec_size> &sin, uint32_t idx, uint32_t kv_head_idx, uint32_t rotary_dim,
    size_t_ k_stride_n, size_t_ k_stride_h, size_t_ v_stride_n, size_t_ v_stride_h,
    size_t_ k_rope_stride_n, size_t_ k_rope_stride_h, size_t_ k_buffer_stride_n,
    size_t_ k_buffer_stride_h, size_t_ v_buffer_stride_n, size_t_ v_buffer_stride_h,
    const int64_t *kv_cache_loc, int64_t kv_rows) {
  const T *k_ptr = k + elem_offset(idx, kv_head_idx, k_stride_n, k_stride_h);
  T *k_rope_ptr = k_rope + elem_offset(idx, kv_head_idx, k_rope_stride_n, k_rope_stride_h);
  fvec<vec_size> v_vec;
  int64_t kv_cache_offset = 0;
  if (save_kv_cache) {
    kv_cache_offset = kv_cache_loc[idx];
    cast_load(v_vec, v + elem_offset(idx, kv_head_idx, v_stride_n, v_stride_h) +
                         threadIdx.x * vec_size);
  }
  fvec<vec_size> k_vec = rotate<interleave, vec_size, bdx>(k_ptr, cos, sin, rotary_dim);
  cast_store(k_vec, k_rope_ptr + threadIdx.x * vec_size);
  if (save_kv_cache && kv_cache_offset >= 0 && kv_cache_offset < kv_rows) {
    cast_store(k_vec, k_buffer + elem_offset(kv_cache_offset, kv_head_idx, k_buffer_stride_n,
                                             k_buffer_stride_h) + threadIdx.x * vec_size);
    cast_store(v_vec, v_buffer + elem_offset(kv_cache_offset, kv_head_idx, v_buffer_stride_n,
                                             v_buffer_stride_h) + threadIdx.x * vec_size);
  }
}

#define SGL_ROPE_PARAMS                                                                         \
  T *q, T *k, T *v, T *q_rope, T *k_rope, T *k_buffer, T *v_buffer,                            \
      const float *__restrict__ cos_sin_cache, const int64_t *__restrict__ pos_ids,            \
      int64_t max_pos, uint32_t nnz, uint32_t num_qo_heads, uint32_t num_kv_heads,             \
      uint32_t rotary_dim,                                                                     \
      size_t_ q_stride_n, size_t_ q_stride_h, size_t_ k_stride_n, size_t_ k_stride_h,          \
      size_t_ v_stride_n, size_t_ v_stride_h, size_t_ q_rope_stride_n, size_t_ q_rope_stride_h, \
      size_t_ k_rope_stride_n, size_t_ k_rope_stride_h, size_t_ k_buffer_stride_n,            \
      size_t_ k_buffer_stride_h, size_t_ v_buffer_stride_n, size_t_ v_buffer_stride_h,        \
      const int64_t *__restrict__ kv_cache_loc, int64_t kv_rows

#define SGL_K_HEAD_ARGS                                                                       \
  k, v, k_rope, k_buffer, v_buffer, cos, sin, idx, kv_head_idx, rotary_dim, k_stride_n,       \
      k_stride_h, v_stride_n, v_stride_h, k_rope_stride_n, k_rope_stride_h, k_buffer_stride_n, \
      k_buffer_stride_h, v_buffer_stride_n, v_buffer_stride_h, kv_cache_loc, kv_rows

// BatchQKApplyRotaryPosIdsCosSinCacheEnhancedKernel: a (bdx, bdy) block rotates bdy tokens, every
// q head then every kv head in turn (loops not unrolled, as the original).
template <bool save_kv_cache, bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx,
          typename T>
__global__ void sgl_rope_enhanced(SGL_ROPE_PARAMS) {
  const uint32_t bx = blockIdx.x, ty = threadIdx.y, bdy = blockDim.y;
  pdl_wait();
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const int64_t pos = pos_ids[idx];
    load_cos_sin<interleave, vec_size>(cos, sin, cos_sin_cache, pos, rotary_dim, max_pos);
#pragma unroll 1
    for (uint32_t qo_head_idx = 0; qo_head_idx < num_qo_heads; ++qo_head_idx) {
      const T *q_ptr = q + elem_offset(idx, qo_head_idx, q_stride_n, q_stride_h);
      T *q_rope_ptr = q_rope + elem_offset(idx, qo_head_idx, q_rope_stride_n, q_rope_stride_h);
      fvec<vec_size> q_vec = rotate<interleave, vec_size, bdx>(q_ptr, cos, sin, rotary_dim);
      cast_store(q_vec, q_rope_ptr + threadIdx.x * vec_size);
    }
#pragma unroll 1
    for (uint32_t kv_head_idx = 0; kv_head_idx < num_kv_heads; ++kv_head_idx) {
      k_head<save_kv_cache, interleave, vec_size, bdx>(SGL_K_HEAD_ARGS);
    }
  }
  pdl_launch_dependents();
}

// BatchQKApplyRotaryPosIdsCosSinCacheEnhancedHeadParallelismKernel: blockIdx.y picks one head
// (q heads first, then kv heads).
template <bool save_kv_cache, bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx,
          typename T>
__global__ void sgl_rope_enhanced_head_parallel(SGL_ROPE_PARAMS) {
  const uint32_t bx = blockIdx.x, ty = threadIdx.y, by = blockIdx.y, bdy = blockDim.y;
  pdl_wait();
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const int64_t pos = pos_ids[idx];
    load_cos_sin<interleave, vec_size>(cos, sin, cos_sin_cache, pos, rotary_dim, max_pos);
    if (by < num_qo_heads) {
      const uint32_t qo_head_idx = by;
      const T *q_ptr = q + elem_offset(idx, qo_head_idx, q_stride_n, q_stride_h);
      T *q_rope_ptr = q_rope + elem_offset(idx, qo_head_idx, q_rope_stride_n, q_rope_stride_h);
      fvec<vec_size> q_vec = rotate<interleave, vec_size, bdx>(q_ptr, cos, sin, rotary_dim);
      cast_store(q_vec, q_rope_ptr + threadIdx.x * vec_size);
    } else {
      const uint32_t kv_head_idx = by - num_qo_heads;
      k_head<save_kv_cache, interleave, vec_size, bdx>(SGL_K_HEAD_ARGS);
    }
  }
  pdl_launch_dependents();
}

// ---- the any-head-size kernel (multimodal/rotary_embedding.cu) ---------------------------------
// IS_NEOX true: pairs (2i, 2i+1), cos/sin rows of rot_dim_arg = R/2 values, one per pair.
// IS_NEOX false: pairs (i, i + R/2), cos/sin rows of rot_dim_arg = R values, one per element.
// (These are the original's names and meanings.)
template <typename T>
__device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }

template <typename T, bool IS_NEOX>
__device__ __forceinline__ void apply_token_rotary_embedding(T *__restrict__ arr,
                                                             const T *__restrict__ cos_ptr,
                                                             const T *__restrict__ sin_ptr,
                                                             int rot_offset, int embed_dim) {
  if (IS_NEOX) {
    const int x_index = 2 * rot_offset, y_index = x_index + 1;
    const float cos_val = to_f(__ldg(cos_ptr + rot_offset));
    const float sin_val = to_f(__ldg(sin_ptr + rot_offset));
    const float x = to_f(arr[x_index]);
    const float y = to_f(arr[y_index]);
    arr[x_index] = from_f<T>(x * cos_val - y * sin_val);
    arr[y_index] = from_f<T>(y * cos_val + x * sin_val);
  } else {
    const int x_index = rot_offset, y_index = rot_offset + embed_dim;
    const float cos_val_x = to_f(__ldg(cos_ptr + rot_offset));
    const float sin_val_x = to_f(__ldg(sin_ptr + rot_offset));
    const float cos_val_y = to_f(__ldg(cos_ptr + rot_offset + embed_dim));
    const float sin_val_y = to_f(__ldg(sin_ptr + rot_offset + embed_dim));
    const float x = to_f(arr[x_index]);
    const float y = to_f(arr[y_index]);
    arr[x_index] = from_f<T>(x * cos_val_x - y * sin_val_x);
    arr[y_index] = from_f<T>(y * cos_val_y + x * sin_val_y);
  }
}

// grid (num_tokens), block (min(max pairs per token, 512)); q then k, pairs strided by blockDim.x.
template <typename T, bool IS_NEOX>
__global__ void sgl_rotary_embedding(const T *__restrict__ cos_data, const T *__restrict__ sin_data,
                                     T *__restrict__ query_total, T *__restrict__ key_total,
                                     int rot_dim_arg, int64_t query_token_stride,
                                     int64_t key_token_stride, int64_t head_stride_query,
                                     int64_t head_stride_key, int num_heads, int num_kv_heads,
                                     int head_size) {
  const int token_idx = blockIdx.x;
  const T *cos_ptr = cos_data + token_idx * rot_dim_arg;
  const T *sin_ptr = sin_data + token_idx * rot_dim_arg;
  T *query = query_total + token_idx * (int)query_token_stride;
  T *key = (key_total != nullptr) ? (key_total + token_idx * (int)key_token_stride) : nullptr;
  const int embed_dim = IS_NEOX ? rot_dim_arg : (rot_dim_arg / 2);
  const int nq_pairs = num_heads * embed_dim;
  for (int i = threadIdx.x; i < nq_pairs; i += blockDim.x) {
    const int head_idx = i / embed_dim, rot_offset = i % embed_dim;
    apply_token_rotary_embedding<T, IS_NEOX>(query + head_idx * (int)head_stride_query, cos_ptr,
                                             sin_ptr, rot_offset, embed_dim);
  }
  if (key != nullptr) {
    const int nk_pairs = num_kv_heads * embed_dim;
    for (int i = threadIdx.x; i < nk_pairs; i += blockDim.x) {
      const int head_idx = i / embed_dim, rot_offset = i % embed_dim;
      apply_token_rotary_embedding<T, IS_NEOX>(key + head_idx * (int)head_stride_key, cos_ptr,
                                               sin_ptr, rot_offset, embed_dim);
    }
  }
}
