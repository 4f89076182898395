// Port of PaddlePaddle's V1 ("vectorized") fused rotary position embedding kernels:
//   PaddlePaddle/Paddle@09d06946d919bc338915788c5bbae50c0db44458:paddle/phi/kernels/fusion/gpu/fused_rope_utils.h
// launched as fused_rope_kernel.cu@e5b22f5e (forward, sign = +1) and
// fused_rope_grad_kernel.cu@5f908167 (backward, sign = -1) launch them. Licence of the original:
// Apache-2.0. This is an independent re-implementation of the design, not a copy.
//
// Design kept: a 1-D grid-stride loop over the flat, contiguous [B,S,H,D] / [S,B,H,D] tensor, two
// consecutive elements per thread iteration (VecSize = 2) stored as one aligned 2-vector; int64
// index math; per-element sin/cos taken from given tables (rows indexed by position or
// position_ids) or computed from rotary_emb_base in MPType (float for float/half/bf16, double for
// double), with a specialisation for the default base 10000; up to three tensors (q, k, v) per
// launch; results computed in MPType and rounded once at the store.
//
// Departures (see ports/paddle/__init__.py for the full list):
//  * phi::Array<const T*, 3> / phi::Array<T*, 3> / phi::Array<const T*, 2> passed by value are
//    flattened into separate pointer arguments (in0..in2, sin, cos, out0..out2); the bool
//    flag_sin_cos is passed as an int.
//  * The rotate-half kernel's non-default-base branch (no grid-stride loop upstream) gets an
//    `index < size` bounds check: upstream, threads past the end read and write out of bounds.
//  * x is read through `const` pointers; the rest of the arithmetic and its order are upstream's.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace paddle_v1 {

constexpr int kDefaultRotaryBase = 10000;
constexpr float kEpsilon = 1e-7f;

// Storage <-> MPType conversions (phi::dtype::float16/bfloat16 convert with round-to-nearest-even).
__device__ __forceinline__ float to_mp(float v) { return v; }
__device__ __forceinline__ float to_mp(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_mp(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_mp(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_mp(float v);
template <> __device__ __forceinline__ float from_mp<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_mp<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_mp<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_mp(double v);
template <> __device__ __forceinline__ double from_mp<double>(double v) { return v; }

// The overloads CUDA's pow/sin/cos resolve to for each MPType (powf/sinf/cosf for float).
__device__ __forceinline__ float mp_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double mp_pow(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float mp_sin(float a) { return sinf(a); }
__device__ __forceinline__ double mp_sin(double a) { return sin(a); }
__device__ __forceinline__ float mp_cos(float a) { return cosf(a); }
__device__ __forceinline__ double mp_cos(double a) { return cos(a); }

template <typename T, int VecSize>
struct alignas(sizeof(T) * VecSize) AlignedVector {
  T val[VecSize];
};

// Given tables: row = position_ids[b * S + s] (or s), column = d; tables are dense [rows, D].
template <typename T, typename MPType, int VecSize>
__device__ __forceinline__ void sin_cos_from_tables(
    const T* sin_table, const T* cos_table, const long long* position_ids, long long index,
    long long batch_size, long long seq_len, long long head_dim, long long batch_stride,
    long long seq_stride, MPType* out_sin, MPType* out_cos) {
#pragma unroll
  for (long long nx = 0; nx < VecSize; ++nx) {
    long long seq_pos = (index + nx) / seq_stride % seq_len;
    long long row;
    if (position_ids) {
      long long batch_pos = (index + nx) / batch_stride % batch_size;
      row = position_ids[batch_pos * seq_len + seq_pos];
    } else {
      row = seq_pos;
    }
    long long at = row * head_dim + (index + nx) % head_dim;
    out_sin[nx] = static_cast<MPType>(to_mp(sin_table[at]));
    out_cos[nx] = static_cast<MPType>(to_mp(cos_table[at]));
  }
}

// Computed: angle = s / base^(2*floor(d/2) * div_c), div_c = (MPType)(1.0f / D); position_ids are
// not used on this path (upstream's Python API forbids the combination).
template <typename MPType, int VecSize>
__device__ __forceinline__ void sin_cos_from_base(long long index, long long seq_len,
                                                  long long head_dim, long long seq_stride,
                                                  MPType base, MPType div_c, MPType* out_sin,
                                                  MPType* out_cos) {
#pragma unroll
  for (int nx = 0; nx < VecSize; ++nx) {
    long long seq_pos = (index + nx) / seq_stride % seq_len;
    MPType idx = static_cast<MPType>(((index + nx) % head_dim) / 2 * 2.0);
    MPType inv_freq = static_cast<MPType>(1) / mp_pow(base, idx * div_c);
    MPType angle = seq_pos * inv_freq;
    out_sin[nx] = mp_sin(angle);
    out_cos[nx] = mp_cos(angle);
  }
}

// VectorizedGetSinCos: ROTARY_BASE = kDefaultRotaryBase uses the compile-time constant base.
template <typename T, typename MPType, int VecSize, int ROTARY_BASE>
__device__ __forceinline__ void get_sin_cos(
    const T* sin_table, const T* cos_table, const long long* position_ids, int flag_sin_cos,
    long long index, long long batch_size, long long seq_len, long long head_dim,
    long long batch_stride, long long seq_stride, MPType div_c, float rotary_emb_base,
    MPType* out_sin, MPType* out_cos) {
  if (flag_sin_cos) {
    sin_cos_from_tables<T, MPType, VecSize>(sin_table, cos_table, position_ids, index, batch_size,
                                            seq_len, head_dim, batch_stride, seq_stride, out_sin,
                                            out_cos);
  } else if (ROTARY_BASE == kDefaultRotaryBase) {
    sin_cos_from_base<MPType, VecSize>(index, seq_len, head_dim, seq_stride,
                                       static_cast<MPType>(kDefaultRotaryBase), div_c, out_sin,
                                       out_cos);
  } else {
    sin_cos_from_base<MPType, VecSize>(index, seq_len, head_dim, seq_stride,
                                       static_cast<MPType>(rotary_emb_base), div_c, out_sin,
                                       out_cos);
  }
}

// Every-two (GPT-J) pairs (index, index + 1). sign = +1 forward, -1 backward (exact transpose).
template <typename T, typename MPType, int VecSize>
__device__ __forceinline__ void rotate_every_two(const T* const* ins, T* const* outs,
                                                 int num_inputs, long long index, int sign,
                                                 const MPType* sin_value,
                                                 const MPType* cos_value) {
  using VecType = AlignedVector<T, VecSize>;
  constexpr int kVectorsPerThread = VecSize / 2;
  MPType result[VecSize];
  T store[VecSize];
#pragma unroll
  for (int iter = 0; iter < 3; iter++) {
    if (iter >= num_inputs) break;
    const T* input = ins[iter] + index;
    VecType* out = reinterpret_cast<VecType*>(outs[iter] + index);
#pragma unroll
    for (int nx = 0; nx < kVectorsPerThread; ++nx) {
      int first = nx * 2;
      int second = first + 1;
      MPType p0 = to_mp(input[first]);
      MPType p1 = to_mp(input[second]);
      if (sign == 1) {
        result[first] = cos_value[first] * p0;
        result[first] -= sin_value[first] * p1;
        result[second] = sin_value[second] * p0;
        result[second] += cos_value[second] * p1;
      } else if (sign == -1) {
        result[first] = cos_value[first] * p0 + sin_value[second] * p1;
        result[second] = cos_value[second] * p1 - sin_value[first] * p0;
      }
      store[first] = from_mp<T>(result[first]);
      store[second] = from_mp<T>(result[second]);
    }
    out[0] = *reinterpret_cast<VecType*>(store);
  }
}

// Rotate-half (NeoX) pairs (d, d + D/2). Partner and sign are decided once, from the first element
// of the 2-vector (so D % 4 == 0 is required; the host checks it). The backward (sign = -1) uses
// each element's own sine: exact only when sin[d] == sin[d +- D/2] (the concatenated layout).
template <typename T, typename MPType, int VecSize>
__device__ __forceinline__ void rotate_half(const T* const* ins, T* const* outs, int num_inputs,
                                            long long head_dim, long long index, int sign,
                                            const MPType* sin_value, const MPType* cos_value) {
  using VecType = AlignedVector<T, VecSize>;
  MPType result[VecSize];
  T store[VecSize];
  long long half = head_dim / 2;
#pragma unroll
  for (int iter = 0; iter < 3; iter++) {
    if (iter >= num_inputs) break;
    long long partner = (index % head_dim) < half ? (index + half) : (index - half);
    MPType sign_r = (index % head_dim) < half ? static_cast<MPType>(-1) : static_cast<MPType>(1);
    const T* input_v = ins[iter] + index;
    const T* input_r = ins[iter] + partner;
    VecType* out = reinterpret_cast<VecType*>(outs[iter] + index);
#pragma unroll
    for (int nx = 0; nx < VecSize; ++nx) {
      MPType p0 = to_mp(input_v[nx]);
      MPType p1 = to_mp(input_r[nx]);
      result[nx] = cos_value[nx] * p0 + sign * sign_r * sin_value[nx] * p1;
      store[nx] = from_mp<T>(result[nx]);
    }
    out[0] = *reinterpret_cast<VecType*>(store);
  }
}

}  // namespace paddle_v1

// VectorizedFusedRopeWithRotateEveryTwoKernel. Grid-stride over index = 2 * thread, both branches.
template <typename T, typename MPType, int VecSize>
__global__ void paddle_rope_every_two(
    const T* in0, const T* in1, const T* in2, const T* sin_table, const T* cos_table,
    const long long* position_ids, int flag_sin_cos, int sign, long long batch_size,
    long long seq_len, long long num_heads, long long head_dim, long long batch_stride,
    long long seq_stride, int num_inputs, MPType div_c, float rotary_emb_base, T* out0, T* out1,
    T* out2) {
  using namespace paddle_v1;
  const T* ins[3] = {in0, in1, in2};
  T* outs[3] = {out0, out1, out2};
  long long index = (static_cast<long long>(blockIdx.x) * static_cast<long long>(blockDim.x) +
                     threadIdx.x) * VecSize;
  long long stride = static_cast<long long>(gridDim.x) * static_cast<long long>(blockDim.x) *
                     VecSize;
  long long size = batch_size * seq_len * num_heads * head_dim;
  MPType sin_value[VecSize];
  MPType cos_value[VecSize];
  if (fabsf(rotary_emb_base - static_cast<float>(kDefaultRotaryBase)) < kEpsilon) {
    for (; index < size; index += stride) {
      get_sin_cos<T, MPType, VecSize, kDefaultRotaryBase>(
          sin_table, cos_table, position_ids, flag_sin_cos, index, batch_size, seq_len, head_dim,
          batch_stride, seq_stride, div_c, rotary_emb_base, sin_value, cos_value);
      rotate_every_two<T, MPType, VecSize>(ins, outs, num_inputs, index, sign, sin_value,
                                           cos_value);
    }
  } else {
    for (; index < size; index += stride) {
      get_sin_cos<T, MPType, VecSize, -1>(
          sin_table, cos_table, position_ids, flag_sin_cos, index, batch_size, seq_len, head_dim,
          batch_stride, seq_stride, div_c, rotary_emb_base, sin_value, cos_value);
      rotate_every_two<T, MPType, VecSize>(ins, outs, num_inputs, index, sign, sin_value,
                                           cos_value);
    }
  }
}

// VectorizedFusedRopeWithRotateHalfKernel. The default-base branch loops; the other branch runs
// the body once per thread, as upstream, but behind a bounds check upstream lacks.
template <typename T, typename MPType, int VecSize>
__global__ void paddle_rope_rotate_half(
    const T* in0, const T* in1, const T* in2, const T* sin_table, const T* cos_table,
    const long long* position_ids, int flag_sin_cos, int sign, long long batch_size,
    long long seq_len, long long num_heads, long long head_dim, long long batch_stride,
    long long seq_stride, int num_inputs, MPType div_c, float rotary_emb_base, T* out0, T* out1,
    T* out2) {
  using namespace paddle_v1;
  const T* ins[3] = {in0, in1, in2};
  T* outs[3] = {out0, out1, out2};
  long long index = (static_cast<long long>(blockIdx.x) * static_cast<long long>(blockDim.x) +
                     threadIdx.x) * VecSize;
  long long stride = static_cast<long long>(gridDim.x) * static_cast<long long>(blockDim.x) *
                     VecSize;
  long long size = batch_size * seq_len * num_heads * head_dim;
  MPType sin_value[VecSize];
  MPType cos_value[VecSize];
  if (fabsf(rotary_emb_base - static_cast<float>(kDefaultRotaryBase)) < kEpsilon) {
    for (; index < size; index += stride) {
      get_sin_cos<T, MPType, VecSize, kDefaultRotaryBase>(
          sin_table, cos_table, position_ids, flag_sin_cos, index, batch_size, seq_len, head_dim,
          batch_stride, seq_stride, div_c, rotary_emb_base, sin_value, cos_value);
      rotate_half<T, MPType, VecSize>(ins, outs, num_inputs, head_dim, index, sign, sin_value,
                                      cos_value);
    }
  } else if (index < size) {  // added: upstream has no bounds check on this branch
    get_sin_cos<T, MPType, VecSize, -1>(
        sin_table, cos_table, position_ids, flag_sin_cos, index, batch_size, seq_len, head_dim,
        batch_stride, seq_stride, div_c, rotary_emb_base, sin_value, cos_value);
    rotate_half<T, MPType, VecSize>(ins, outs, num_inputs, head_dim, index, sign, sin_value,
                                    cos_value);
  }
}
