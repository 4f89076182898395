// vLLM's rotary_embedding kernel, ported to a CuPy RawKernel (NVRTC).
// Upstream: vllm-project/vllm@0f5257e245116449bfbe78a87c22aeef632eba8f:csrc/pos_encoding_kernels.cu
// (Apache-2.0, Copyright the vLLM authors). Written anew from the design, keeping its structure:
// one block per token, threads striding over (head, pair) of q then of k, fp32 math with one
// rounding at each store, int64 token and head offsets, int rot_offset / head_idx.
// Departures (see ports/vllm_port/__init__.py for the list):
// * max_position is passed in: a token whose position is outside [0, max_position) gets NaN in
//   its rotated channels instead of reading past cos_sin_cache (the host check refuses such
//   positions before launch except during CUDA-graph capture, where this bound is what applies);
// * VLLM_LDG is __ldg (what it expands to on CUDA); torch's Half/BFloat16 are __half and
//   __nv_bfloat16 (the same bits, converted to and from float with round-to-nearest-even).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace vllm_port {

template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <typename T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// One pair of one head of one token. cos_ptr == nullptr marks a position outside the cache
// (added): the pair is written as NaN.
template <typename scalar_t, typename cache_t, bool IS_NEOX>
__device__ __forceinline__ void apply_token_rotary_embedding(
    scalar_t* __restrict__ arr, const cache_t* __restrict__ cos_ptr,
    const cache_t* __restrict__ sin_ptr, int rot_offset, int embed_dim, const bool inverse) {
  int x_index, y_index;
  float cos_f, sin_f;
  if (IS_NEOX) {
    x_index = rot_offset;
    y_index = embed_dim + rot_offset;
  } else {
    x_index = 2 * rot_offset;
    y_index = 2 * rot_offset + 1;
  }
  if (cos_ptr == nullptr) {
    arr[x_index] = from_float<scalar_t>(__int_as_float(0x7fffffff));
    arr[y_index] = from_float<scalar_t>(__int_as_float(0x7fffffff));
    return;
  }
  if (IS_NEOX) {
    cos_f = to_float<cache_t>(__ldg(cos_ptr + x_index));
    sin_f = to_float<cache_t>(__ldg(sin_ptr + x_index));
  } else {
    cos_f = to_float<cache_t>(__ldg(cos_ptr + x_index / 2));
    sin_f = to_float<cache_t>(__ldg(sin_ptr + x_index / 2));
  }
  if (inverse) {
    sin_f = -sin_f;
  }
  const float x_f = to_float<scalar_t>(arr[x_index]);
  const float y_f = to_float<scalar_t>(arr[y_index]);
  arr[x_index] = from_float<scalar_t>(x_f * cos_f - y_f * sin_f);
  arr[y_index] = from_float<scalar_t>(y_f * cos_f + x_f * sin_f);
}

// query [tokens, num_heads, head_size] (token stride query_stride, head stride head_stride);
// key nullptr or [tokens, num_kv_heads, head_size] (token stride key_stride, same head stride).
template <typename scalar_t, typename cache_t, bool IS_NEOX>
__device__ __forceinline__ void apply_rotary_embedding(
    scalar_t* __restrict__ query, scalar_t* __restrict__ key, const cache_t* cache_ptr,
    const int head_size, const int num_heads, const int num_kv_heads, const int rot_dim,
    const int token_idx, const long long query_stride, const long long key_stride,
    const long long head_stride, const long long rope_dim_offset, const bool inverse) {
  const int embed_dim = rot_dim / 2;
  const cache_t* cos_ptr = cache_ptr;
  const cache_t* sin_ptr = cache_ptr == nullptr ? nullptr : cache_ptr + embed_dim;

  const int nq = num_heads * embed_dim;
  for (int i = threadIdx.x; i < nq; i += blockDim.x) {
    const int head_idx = i / embed_dim;
    const long long token_head =
        token_idx * query_stride + head_idx * head_stride + rope_dim_offset;
    const int rot_offset = i % embed_dim;
    apply_token_rotary_embedding<scalar_t, cache_t, IS_NEOX>(
        query + token_head, cos_ptr, sin_ptr, rot_offset, embed_dim, inverse);
  }

  if (key != nullptr) {
    const int nk = num_kv_heads * embed_dim;
    for (int i = threadIdx.x; i < nk; i += blockDim.x) {
      const int head_idx = i / embed_dim;
      const long long token_head =
          token_idx * key_stride + head_idx * head_stride + rope_dim_offset;
      const int rot_offset = i % embed_dim;
      apply_token_rotary_embedding<scalar_t, cache_t, IS_NEOX>(
          key + token_head, cos_ptr, sin_ptr, rot_offset, embed_dim, inverse);
    }
  }
}

}  // namespace vllm_port

// grid (num_tokens), block (min(num_heads * rot_dim / 2, 512)).
template <typename scalar_t, typename cache_t, bool IS_NEOX>
__global__ void rotary_embedding_kernel(
    const long long* __restrict__ positions,      // [num_tokens] (or [b, s], dense)
    scalar_t* __restrict__ query, scalar_t* __restrict__ key,
    const cache_t* __restrict__ cos_sin_cache,    // [max_position, rot_dim]: cos half, sin half
    const int rot_dim, const long long query_stride, const long long key_stride,
    const long long head_stride, const int num_heads, const int num_kv_heads,
    const int head_size, const long long rope_dim_offset, const bool inverse,
    const long long max_position) {
  const int token_idx = blockIdx.x;
  long long pos = positions[token_idx];
  const cache_t* cache_ptr =
      (pos >= 0 && pos < max_position) ? cos_sin_cache + pos * rot_dim : nullptr;

  vllm_port::apply_rotary_embedding<scalar_t, cache_t, IS_NEOX>(
      query, key, cache_ptr, head_size, num_heads, num_kv_heads, rot_dim, token_idx,
      query_stride, key_stride, head_stride, rope_dim_offset, inverse);
}
