// Port of flashinfer-ai/flashinfer include/flashinfer/pos_enc.cuh
// (fb28d7242b3506a2348265962041acc1fb56cca4, 2026-08-22; Apache-2.0, Copyright (c) 2023 by
// FlashInfer team). Written anew from the original's kernels, keeping their structure: the five
// kernels behind flashinfer/rope.py's apply_rope*, apply_llama31_rope* and
// apply_rope_with_cos_sin_cache* (host side: ports/flashinfer_port/_launch.py).
//
// Kept from the original (ports/flashinfer_port/__init__.py lists every departure):
// * the per-thread vector layout: vec_size = max(16 / sizeof(DType), head_dim / 32) elements per
//   thread, bdx = head_dim / vec_size threads per head (one head is at most one warp), block
//   (bdx, bdy) with bdy = max(128, bdx) / bdx tokens per block;
// * a thread's vector is loaded whole (16 bytes for 64/128/256, 32 bytes for 512), converted to
//   fp32, rotated in fp32 and rounded once at the store; rotate-half loads the partner vector
//   (x[j +- R/2]); interleaved swaps inside the vector (i ^ 1);
// * computed angles: freq = __powf(1 / theta, 2j / R) per element, the Llama 3.1 smooth blend
//   freq' = (1 - s) * freq / scale + s * freq with s = clamp(freq * a + b, 0, 1) (a = b = 0 for
//   plain RoPE), angle = float(pos) * freq', __sincosf; the file is compiled with
//   --use_fast_math, as FlashInfer's JIT compiles csrc/rope.cu (flashinfer/jit/core.py);
// * cos/sin cache: fp32 [max_pos, R], cos in the first R/2 columns and sin in the last R/2;
//   interleaved reads cos[i / 2] ("reuse half");
// * strides are size_t (64-bit offsets), token/head indices uint32; no shared memory anywhere.
// Departures (kernel): the interleaved cache kernels load vec_size / 2 floats of cos and sin
// instead of vec_size (the original loads vec_size and uses the first half; for the last thread
// of a row the unused half lies past the row, and past the cache on its last row); the cache
// kernels take the cache's row count (max_pos, after pos_ids) and give a token whose position
// lies outside it NaN cos/sin instead of reading past the cache; the indptr kernel takes nnz
// (after offsets) and skips a segment whose bounds fall outside [0, nnz] or decrease.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int uint32_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned long long size_t_;

// fp32 vector of N lanes: FlashInfer's vec_t<float, N> reduced to what the rope kernels use.
template <uint32_t N>
struct fvec {
  float d[N];
  __device__ __forceinline__ float &operator[](uint32_t i) { return d[i]; }
  __device__ __forceinline__ const float &operator[](uint32_t i) const { return d[i]; }
  // N fp32 values from 16-byte aligned memory, as float4 loads.
  template <uint32_t M>
  __device__ __forceinline__ void load_prefix(const float *p) {
#pragma unroll
    for (uint32_t i = 0; i < M / 4; ++i) {
      float4 v = reinterpret_cast<const float4 *>(p)[i];
      d[4 * i] = v.x; d[4 * i + 1] = v.y; d[4 * i + 2] = v.z; d[4 * i + 3] = v.w;
    }
  }
};

// 16-bit storage: load N elements with 16-byte loads and widen to fp32; narrow with
// round-to-nearest-even and store with 16-byte stores (vec_t<T, N>::cast_load / cast_store).
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void from_float2(__half2 &o, float2 v) { o = __float22half2_rn(v); }
__device__ __forceinline__ void from_float2(__nv_bfloat162 &o, float2 v) {
  o = __float22bfloat162_rn(v);
}
template <typename T> struct pair_of;
template <> struct pair_of<__half> { typedef __half2 type; };
template <> struct pair_of<__nv_bfloat16> { typedef __nv_bfloat162 type; };

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

// ---- the vector rotations (vec_apply_llama_rope*) ----------------------------------------------
// Rotate-half, angles computed from freq and the position (offset).
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> fi_rope_freq(const T *x, const fvec<vec_size> &freq,
                                                       int32_t offset, uint32_t rotary_dim) {
  fvec<vec_size> permuted_vec, vec;
  cast_load(vec, x + threadIdx.x * vec_size);
  if (threadIdx.x * vec_size < rotary_dim) {
    cast_load(permuted_vec, x + ((threadIdx.x * vec_size < rotary_dim / 2)
                                     ? threadIdx.x * vec_size + rotary_dim / 2
                                     : threadIdx.x * vec_size - rotary_dim / 2));
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      float embed = float(offset) * freq[i];
      float cos, sin;
      __sincosf(embed, &sin, &cos);
      vec[i] = vec[i] * cos +
               ((threadIdx.x * vec_size < rotary_dim / 2) ? -permuted_vec[i] : permuted_vec[i]) *
                   sin;
    }
  }
  return vec;
}

// Interleaved, angles computed from freq and the position.
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> fi_rope_freq_interleave(
    const T *x, const fvec<vec_size> &freq, int32_t offset, uint32_t rotary_dim) {
  fvec<vec_size> vec, vec_before;
  cast_load(vec, x + threadIdx.x * vec_size);
  if (threadIdx.x * vec_size < rotary_dim) {
    vec_before = vec;
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      float embed = float(offset) * freq[i];
      float cos, sin;
      __sincosf(embed, &sin, &cos);
      vec[i] = vec[i] * cos + ((i % 2 == 0) ? -vec_before[i ^ 1] : vec_before[i ^ 1]) * sin;
    }
  }
  return vec;
}

// Rotate-half with per-lane cos/sin.
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> fi_rope_cos_sin(const T *x, const fvec<vec_size> &cos,
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

// Interleaved with per-lane cos/sin (the pos_ids kernels' computed cos/sin).
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> fi_rope_cos_sin_interleave(
    const T *x, const fvec<vec_size> &cos, const fvec<vec_size> &sin, uint32_t rotary_dim) {
  fvec<vec_size> vec, vec_before;
  cast_load(vec, x + threadIdx.x * vec_size);
  if (threadIdx.x * vec_size < rotary_dim) {
    vec_before = vec;
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      vec[i] = vec[i] * cos[i] + ((i % 2 == 0) ? -vec_before[i ^ 1] : vec_before[i ^ 1]) * sin[i];
    }
  }
  return vec;
}

// Interleaved with a cache row's half-width cos/sin: lane i uses cos[i / 2], sin[i / 2].
template <uint32_t vec_size, uint32_t bdx, typename T>
__device__ __forceinline__ fvec<vec_size> fi_rope_cos_sin_interleave_reuse_half(
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

// The thread's frequencies: __powf(1/theta, 2j/R), then the Llama 3.1 smooth blend.
template <bool interleave, uint32_t vec_size>
__device__ __forceinline__ void fi_freqs(fvec<vec_size> &freq, uint32_t rotary_dim,
                                         float smooth_a, float smooth_b, float rope_rcp_scale,
                                         float rope_rcp_theta) {
  const uint32_t tx = threadIdx.x;
  if (tx * vec_size < rotary_dim) {
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      if (interleave) {
        freq[i] = __powf(rope_rcp_theta, float(2 * ((tx * vec_size + i) / 2)) / float(rotary_dim));
      } else {
        freq[i] = __powf(rope_rcp_theta,
                         float(2 * ((tx * vec_size + i) % (rotary_dim / 2))) / float(rotary_dim));
      }
      float smooth = freq[i] * smooth_a + smooth_b;
      smooth = fmaxf(0.0f, fminf(1.0f, smooth));  // clamp to [0, 1]
      freq[i] = (1 - smooth) * (freq[i] * rope_rcp_scale) + smooth * freq[i];
    }
  }
}

// One head of one token: rotate with per-lane cos/sin and store.
template <bool interleave, bool reuse_half, uint32_t vec_size, uint32_t bdx, typename DType>
__device__ __forceinline__ void fi_head_cos_sin(const DType *in, DType *out,
                                                const fvec<vec_size> &cos,
                                                const fvec<vec_size> &sin, uint32_t rotary_dim) {
  fvec<vec_size> v;
  if (interleave) {
    v = reuse_half ? fi_rope_cos_sin_interleave_reuse_half<vec_size, bdx>(in, cos, sin, rotary_dim)
                   : fi_rope_cos_sin_interleave<vec_size, bdx>(in, cos, sin, rotary_dim);
  } else {
    v = fi_rope_cos_sin<vec_size, bdx>(in, cos, sin, rotary_dim);
  }
  cast_store(v, out + threadIdx.x * vec_size);
}

// ---- pos_ids, computed angles ------------------------------------------------------------------
template <bool interleave, uint32_t vec_size, uint32_t bdx, typename IdType>
__device__ __forceinline__ void fi_pos_cos_sin(fvec<vec_size> &cos, fvec<vec_size> &sin,
                                               const fvec<vec_size> &freq, IdType pos,
                                               uint32_t rotary_dim) {
  if (threadIdx.x * vec_size < rotary_dim) {
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      float embed = float(pos) * freq[i];
      __sincosf(embed, &sin[i], &cos[i]);
    }
  }
}

// Sequential heads: grid (ceil(nnz / bdy)), block (bdx, bdy); each thread row loops over every
// q head, then every k head, of its token.
template <bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx, typename DType,
          typename IdType>
__global__ void fi_pos_ids(DType *q, DType *k, DType *q_rope, DType *k_rope,
                           const IdType *__restrict__ pos_ids, uint32_t nnz, uint32_t num_qo_heads,
                           uint32_t num_kv_heads, uint32_t rotary_dim, size_t_ q_stride_n,
                           size_t_ q_stride_h, size_t_ k_stride_n, size_t_ k_stride_h,
                           size_t_ q_rope_stride_n, size_t_ q_rope_stride_h,
                           size_t_ k_rope_stride_n, size_t_ k_rope_stride_h, float smooth_a,
                           float smooth_b, float rope_rcp_scale, float rope_rcp_theta) {
  // q and q_rope may be the same pointer (in place), as may k and k_rope.
  const uint32_t bx = blockIdx.x, ty = threadIdx.y, bdy = blockDim.y;
  fvec<vec_size> freq;
  fi_freqs<interleave, vec_size>(freq, rotary_dim, smooth_a, smooth_b, rope_rcp_scale,
                                 rope_rcp_theta);
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const IdType pos = pos_ids[idx];
    fi_pos_cos_sin<interleave, vec_size, bdx>(cos, sin, freq, pos, rotary_dim);
#pragma unroll 1
    for (uint32_t h = 0; h < num_qo_heads; ++h) {
      fi_head_cos_sin<interleave, false, vec_size, bdx>(
          q + elem_offset(idx, h, q_stride_n, q_stride_h),
          q_rope + elem_offset(idx, h, q_rope_stride_n, q_rope_stride_h), cos, sin, rotary_dim);
    }
#pragma unroll 1
    for (uint32_t h = 0; h < num_kv_heads; ++h) {
      fi_head_cos_sin<interleave, false, vec_size, bdx>(
          k + elem_offset(idx, h, k_stride_n, k_stride_h),
          k_rope + elem_offset(idx, h, k_rope_stride_n, k_rope_stride_h), cos, sin, rotary_dim);
    }
  }
}

// Head-parallel: grid (ceil(nnz / bdy), num_qo_heads + num_kv_heads); blockIdx.y picks the head.
template <bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx, typename DType,
          typename IdType>
__global__ void fi_pos_ids_head_parallel(
    DType *q, DType *k, DType *q_rope, DType *k_rope, const IdType *__restrict__ pos_ids,
    uint32_t nnz, uint32_t num_qo_heads, uint32_t num_kv_heads, uint32_t rotary_dim,
    size_t_ q_stride_n, size_t_ q_stride_h, size_t_ k_stride_n, size_t_ k_stride_h,
    size_t_ q_rope_stride_n, size_t_ q_rope_stride_h, size_t_ k_rope_stride_n,
    size_t_ k_rope_stride_h, float smooth_a, float smooth_b, float rope_rcp_scale,
    float rope_rcp_theta) {
  const uint32_t bx = blockIdx.x, by = blockIdx.y, ty = threadIdx.y, bdy = blockDim.y;
  fvec<vec_size> freq;
  fi_freqs<interleave, vec_size>(freq, rotary_dim, smooth_a, smooth_b, rope_rcp_scale,
                                 rope_rcp_theta);
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const IdType pos = pos_ids[idx];
    fi_pos_cos_sin<interleave, vec_size, bdx>(cos, sin, freq, pos, rotary_dim);
    if (by < num_qo_heads) {
      fi_head_cos_sin<interleave, false, vec_size, bdx>(
          q + elem_offset(idx, by, q_stride_n, q_stride_h),
          q_rope + elem_offset(idx, by, q_rope_stride_n, q_rope_stride_h), cos, sin, rotary_dim);
    } else {
      const uint32_t h = by - num_qo_heads;
      fi_head_cos_sin<interleave, false, vec_size, bdx>(
          k + elem_offset(idx, h, k_stride_n, k_stride_h),
          k_rope + elem_offset(idx, h, k_rope_stride_n, k_rope_stride_h), cos, sin, rotary_dim);
    }
  }
}

// ---- indptr + offsets, computed angles (BatchQKApplyRotaryKernel) ------------------------------
// grid (batch_size * (num_qo_heads + num_kv_heads)): one block per (segment, head), q blocks
// first; the block's bdy thread rows step through the segment's tokens.
template <bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx, typename DType,
          typename IdType>
__global__ void fi_indptr(DType *q, DType *k, DType *q_rope, DType *k_rope,
                          const IdType *__restrict__ indptr, const IdType *__restrict__ offsets,
                          uint32_t nnz, uint32_t batch_size, uint32_t num_qo_heads,
                          uint32_t num_kv_heads, uint32_t rotary_dim, size_t_ q_stride_n,
                          size_t_ q_stride_h,
                          size_t_ k_stride_n, size_t_ k_stride_h, size_t_ q_rope_stride_n,
                          size_t_ q_rope_stride_h, size_t_ k_rope_stride_n,
                          size_t_ k_rope_stride_h, float smooth_a, float smooth_b,
                          float rope_rcp_scale, float rope_rcp_theta) {
  const uint32_t bx = blockIdx.x, ty = threadIdx.y, bdy = blockDim.y;
  fvec<vec_size> freq;
  fi_freqs<interleave, vec_size>(freq, rotary_dim, smooth_a, smooth_b, rope_rcp_scale,
                                 rope_rcp_theta);
  const bool is_q = bx < batch_size * num_qo_heads;
  const uint32_t rel = is_q ? bx : bx - batch_size * num_qo_heads;
  const uint32_t heads = is_q ? num_qo_heads : num_kv_heads;
  const uint32_t batch_idx = rel / heads;
  const uint32_t head_idx = rel % heads;
  DType *src = is_q ? q : k;
  DType *dst = is_q ? q_rope : k_rope;
  const size_t_ stride_n = is_q ? q_stride_n : k_stride_n;
  const size_t_ stride_h = is_q ? q_stride_h : k_stride_h;
  const size_t_ dst_stride_n = is_q ? q_rope_stride_n : k_rope_stride_n;
  const size_t_ dst_stride_h = is_q ? q_rope_stride_h : k_rope_stride_h;
  // Departure: a segment whose bounds are not 0 <= indptr[b] <= indptr[b + 1] <= nnz (possible
  // only where the host could not check them, inside a CUDA-graph capture) is left unwritten
  // instead of reading and writing outside q and k.
  if (indptr[batch_idx] < 0 || indptr[batch_idx + 1] < indptr[batch_idx] ||
      (unsigned long long)indptr[batch_idx + 1] > nnz) {
    return;
  }
  const uint32_t seq_len = indptr[batch_idx + 1] - indptr[batch_idx];
  const uint32_t offset = offsets[batch_idx];
#pragma unroll 2
  for (uint32_t i = 0; i < (seq_len + bdy - 1) / bdy; ++i) {
    if (i * bdy + ty < seq_len) {
      const size_t_ token = indptr[batch_idx] + i * bdy + ty;
      fvec<vec_size> v;
      if (interleave) {
        v = fi_rope_freq_interleave<vec_size, bdx>(src + elem_offset(token, head_idx, stride_n,
                                                                     stride_h),
                                                   freq, offset + i * bdy + ty, rotary_dim);
      } else {
        v = fi_rope_freq<vec_size, bdx>(src + elem_offset(token, head_idx, stride_n, stride_h),
                                        freq, offset + i * bdy + ty, rotary_dim);
      }
      cast_store(v, dst + elem_offset(token, head_idx, dst_stride_n, dst_stride_h) +
                        threadIdx.x * vec_size);
    }
  }
}

// ---- pos_ids + fp32 cos/sin cache --------------------------------------------------------------
template <bool interleave, uint32_t vec_size, typename IdType>
__device__ __forceinline__ void fi_cache_row(fvec<vec_size> &cos, fvec<vec_size> &sin,
                                             const float *__restrict__ cos_sin_cache, IdType pos,
                                             uint32_t rotary_dim, uint32_t max_pos) {
  const uint32_t tx = threadIdx.x;
  // Departure: a position outside the cache (possible only where the host could not check,
  // inside a CUDA-graph capture) gives NaN cos/sin instead of a read past the cache.
  if (pos < 0 || (unsigned long long)pos >= max_pos) {
#pragma unroll
    for (uint32_t i = 0; i < vec_size; ++i) {
      cos[i] = __int_as_float(0x7fc00000);
      sin[i] = cos[i];
    }
    return;
  }
  if (tx * vec_size < rotary_dim) {
    const int sin_offset = rotary_dim / 2;
    int vec_idx;
    if (interleave) {
      vec_idx = (tx * vec_size) / 2;
    } else {
      vec_idx = (tx * vec_size) % (rotary_dim / 2);
    }
    // The original's row offset: pos * rotary_dim in IdType/uint32 arithmetic.
    const float *row = cos_sin_cache + (pos * rotary_dim);
    if (interleave) {  // departure: the half the kernel uses (see the file header)
      cos.template load_prefix<vec_size / 2>(row + vec_idx);
      sin.template load_prefix<vec_size / 2>(row + (sin_offset + vec_idx));
    } else {
      cos.template load_prefix<vec_size>(row + vec_idx);
      sin.template load_prefix<vec_size>(row + (sin_offset + vec_idx));
    }
  }
}

// Sequential heads.
template <bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx, typename DType,
          typename IdType>
__global__ void fi_cos_sin_cache(DType *q, DType *k, DType *q_rope, DType *k_rope,
                                 const float *__restrict__ cos_sin_cache,
                                 const IdType *__restrict__ pos_ids, uint32_t max_pos,
                                 uint32_t nnz, uint32_t num_qo_heads, uint32_t num_kv_heads,
                                 uint32_t rotary_dim,
                                 size_t_ q_stride_n, size_t_ q_stride_h, size_t_ k_stride_n,
                                 size_t_ k_stride_h, size_t_ q_rope_stride_n,
                                 size_t_ q_rope_stride_h, size_t_ k_rope_stride_n,
                                 size_t_ k_rope_stride_h) {
  const uint32_t bx = blockIdx.x, ty = threadIdx.y, bdy = blockDim.y;
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const IdType pos = pos_ids[idx];
    fi_cache_row<interleave, vec_size>(cos, sin, cos_sin_cache, pos, rotary_dim, max_pos);
#pragma unroll 1
    for (uint32_t h = 0; h < num_qo_heads; ++h) {
      fi_head_cos_sin<interleave, true, vec_size, bdx>(
          q + elem_offset(idx, h, q_stride_n, q_stride_h),
          q_rope + elem_offset(idx, h, q_rope_stride_n, q_rope_stride_h), cos, sin, rotary_dim);
    }
#pragma unroll 1
    for (uint32_t h = 0; h < num_kv_heads; ++h) {
      fi_head_cos_sin<interleave, true, vec_size, bdx>(
          k + elem_offset(idx, h, k_stride_n, k_stride_h),
          k_rope + elem_offset(idx, h, k_rope_stride_n, k_rope_stride_h), cos, sin, rotary_dim);
    }
  }
}

// Head-parallel.
template <bool interleave, uint32_t head_dim, uint32_t vec_size, uint32_t bdx, typename DType,
          typename IdType>
__global__ void fi_cos_sin_cache_head_parallel(
    DType *q, DType *k, DType *q_rope, DType *k_rope, const float *__restrict__ cos_sin_cache,
    const IdType *__restrict__ pos_ids, uint32_t max_pos, uint32_t nnz, uint32_t num_qo_heads,
    uint32_t num_kv_heads, uint32_t rotary_dim, size_t_ q_stride_n, size_t_ q_stride_h,
    size_t_ k_stride_n, size_t_ k_stride_h, size_t_ q_rope_stride_n, size_t_ q_rope_stride_h,
    size_t_ k_rope_stride_n, size_t_ k_rope_stride_h) {
  const uint32_t bx = blockIdx.x, by = blockIdx.y, ty = threadIdx.y, bdy = blockDim.y;
  fvec<vec_size> cos, sin;
  if (bx * bdy + ty < nnz) {
    const uint32_t idx = bx * bdy + ty;
    const IdType pos = pos_ids[idx];
    fi_cache_row<interleave, vec_size>(cos, sin, cos_sin_cache, pos, rotary_dim, max_pos);
    if (by < num_qo_heads) {
      fi_head_cos_sin<interleave, true, vec_size, bdx>(
          q + elem_offset(idx, by, q_stride_n, q_stride_h),
          q_rope + elem_offset(idx, by, q_rope_stride_n, q_rope_stride_h), cos, sin, rotary_dim);
    } else {
      const uint32_t h = by - num_qo_heads;
      fi_head_cos_sin<interleave, true, vec_size, bdx>(
          k + elem_offset(idx, h, k_stride_n, k_stride_h),
          k_rope + elem_offset(idx, h, k_rope_stride_n, k_rope_stride_h), cos, sin, rotary_dim);
    }
  }
}
