// Port of NVIDIA/apex csrc/megatron/fused_rotary_positional_embedding.h (HEAD 6424da3b; kernel
// semantics unchanged since 23c1f865). Written anew from the design, not copied. Compiled
// WITHOUT --use_fast_math: apex's setup.py builds this extension with
// -O3 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ --expt-relaxed-constexpr
// --expt-extended-lambda, so sincosf / sinf / cosf are the accurate libdevice routines.
//
// Design kept from the original (see ports/apex/__init__.py for the full list of departures):
// * one block per token: grid (s, b) for sbhd, (max_s, b) for thd, (ih, iw, b) for 2-D;
//   block (32, 4 if h < 16 else 8); threadIdx.x strides over the rotated dims j < d2,
//   threadIdx.y over heads; then a separate loop copies the tail d2 <= j < d;
// * every input and output stride is a kernel argument (arbitrary strides), all index math int32;
// * rotate-half only: element j pairs with j + d2/2 (first half) or j - d2/2 (second half);
// * angles (freqs) are fp32; the forward takes sincosf, the backward separate cosf / sinf;
// * arithmetic in the storage type T. For fp16 / bf16 that is PyTorch's c10::Half / c10::BFloat16:
//   each binary operator converts both operands to float, computes in float and rounds back to T
//   (round to nearest even); cos / sin are rounded to T before use. ApexHalf / ApexBFloat16 below
//   reproduce exactly those semantics, so results are bit-identical to apex's compiled kernel
//   whatever the compiler does (no float expression spans more than one operator, so there is
//   nothing to contract into an FMA). For fp32 the expression x*c + r*s is plain float arithmetic
//   and NVRTC, like nvcc, contracts it to an FMA (--fmad=true by default).
//
// bf16 / fp16 tensors arrive as raw 2-byte storage (torch's layout), reinterpreted here.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// ---- c10-style 16-bit floating types ---------------------------------------------------------
struct ApexHalf {
  unsigned short bits;
  ApexHalf() = default;
  __device__ ApexHalf(float f) : bits(__half_as_ushort(__float2half_rn(f))) {}
  __device__ operator float() const { return __half2float(__ushort_as_half(bits)); }
};

struct ApexBFloat16 {
  unsigned short bits;
  ApexBFloat16() = default;
  __device__ ApexBFloat16(float f) : bits(__bfloat16_as_ushort(__float2bfloat16_rn(f))) {}
  __device__ operator float() const { return __bfloat162float(__ushort_as_bfloat16(bits)); }
};

// Binary operators: float in, float math, one rounding back (c10's Half-inl.h / BFloat16-inl.h).
// Unary minus flips the sign bit: exact, as c10's (__hneg, or -float then an exact conversion).
#define APEX_C10_OPERATORS(T)                                                                   \
  __device__ __forceinline__ T operator*(const T &a, const T &b) {                              \
    return T(static_cast<float>(a) * static_cast<float>(b));                                    \
  }                                                                                             \
  __device__ __forceinline__ T operator+(const T &a, const T &b) {                              \
    return T(static_cast<float>(a) + static_cast<float>(b));                                    \
  }                                                                                             \
  __device__ __forceinline__ T operator-(const T &a) {                                          \
    T r;                                                                                        \
    r.bits = a.bits ^ 0x8000u;                                                                  \
    return r;                                                                                   \
  }

APEX_C10_OPERATORS(ApexHalf)
APEX_C10_OPERATORS(ApexBFloat16)

// ---- per-token block routines ----------------------------------------------------------------
// One token (a [h, d] slab): `in` / `out` are the slab's base offsets into src / dst; `row` picks
// the angle / cos / sin row (the token's position).

template <typename T>
__device__ __forceinline__ void apex_copy_tail(const T *src, T *dst, int in, int out, int h, int d,
                                               int d2, int stride_h, int stride_d, int o_stride_h,
                                               int o_stride_d) {
  if (d <= d2) return;
#pragma unroll
  for (int hh = threadIdx.y; hh < h; hh += blockDim.y) {
    const int in_head = in + hh * stride_h;
    const int out_head = out + hh * o_stride_h;
#pragma unroll
    for (int j = d2 + threadIdx.x; j < d; j += blockDim.x) {
      dst[out_head + j * o_stride_d] = src[in_head + j * stride_d];
    }
  }
}

// y_j = x_j * T(cos f) + rot_j * T(sin f), rot_j = -x_{j+d2/2} (first half) or x_{j-d2/2}.
template <typename T>
__device__ __forceinline__ void apex_block_fwd(const T *src, const float *freqs, T *dst, int row,
                                               int in, int out, int h, int d, int d2, int stride_h,
                                               int stride_d, int o_stride_h, int o_stride_d) {
  const int half = d2 / 2;
#pragma unroll
  for (int j = threadIdx.x; j < d2; j += blockDim.x) {
    float sn, cs;
    sincosf(freqs[row * d2 + j], &sn, &cs);
#pragma unroll
    for (int hh = threadIdx.y; hh < h; hh += blockDim.y) {
      const int i = in + hh * stride_h + j * stride_d;
      const int o = out + hh * o_stride_h + j * o_stride_d;
      const T x = src[i];
      const T rot = (j + half < d2) ? -src[i + half * stride_d] : src[i + (half - d2) * stride_d];
      dst[o] = x * (T)cs + rot * (T)sn;
    }
  }
  apex_copy_tail(src, dst, in, out, h, d, d2, stride_h, stride_d, o_stride_h, o_stride_d);
}

// The exact transpose: dx_j = g_j * T(cos f_j) + g_p * (+-T(sin f_p)) with the PARTNER's angle
// f_p (p = j + d2/2 with +, or j - d2/2 with -), so it is right for any per-element angles.
template <typename T>
__device__ __forceinline__ void apex_block_bwd(const T *src, const float *freqs, T *dst, int row,
                                               int in, int out, int h, int d, int d2, int stride_h,
                                               int stride_d, int o_stride_h, int o_stride_d) {
  const int half = d2 / 2;
#pragma unroll
  for (int j = threadIdx.x; j < d2; j += blockDim.x) {
    const T cs = cosf(freqs[row * d2 + j]);
    const T sn = (j + half < d2) ? sinf(freqs[row * d2 + j + half])
                                 : -sinf(freqs[row * d2 + j + half - d2]);
#pragma unroll
    for (int hh = threadIdx.y; hh < h; hh += blockDim.y) {
      const int i = in + hh * stride_h + j * stride_d;
      const int o = out + hh * o_stride_h + j * o_stride_d;
      const T g = src[i];
      const T partner =
          (j + half < d2) ? src[i + half * stride_d] : src[i + (half - d2) * stride_d];
      dst[o] = g * cs + partner * sn;
    }
  }
  apex_copy_tail(src, dst, in, out, h, d, d2, stride_h, stride_d, o_stride_h, o_stride_d);
}

// Given tables: cos / sin of type T1 (float or T) converted to T before use.
template <typename T, typename T1>
__device__ __forceinline__ void apex_block_cached_fwd(const T *src, const T1 *cos_t,
                                                      const T1 *sin_t, T *dst, int row, int in,
                                                      int out, int h, int d, int d2, int stride_h,
                                                      int stride_d, int o_stride_h,
                                                      int o_stride_d) {
  const int half = d2 / 2;
#pragma unroll
  for (int j = threadIdx.x; j < d2; j += blockDim.x) {
    const T cs = cos_t[row * d2 + j];
    const T sn = sin_t[row * d2 + j];
#pragma unroll
    for (int hh = threadIdx.y; hh < h; hh += blockDim.y) {
      const int i = in + hh * stride_h + j * stride_d;
      const int o = out + hh * o_stride_h + j * o_stride_d;
      const T x = src[i];
      const T rot = (j + half < d2) ? -src[i + half * stride_d] : src[i + (half - d2) * stride_d];
      dst[o] = x * cs + rot * sn;
    }
  }
  apex_copy_tail(src, dst, in, out, h, d, d2, stride_h, stride_d, o_stride_h, o_stride_d);
}

template <typename T, typename T1>
__device__ __forceinline__ void apex_block_cached_bwd(const T *src, const T1 *cos_t,
                                                      const T1 *sin_t, T *dst, int row, int in,
                                                      int out, int h, int d, int d2, int stride_h,
                                                      int stride_d, int o_stride_h,
                                                      int o_stride_d) {
  const int half = d2 / 2;
#pragma unroll
  for (int j = threadIdx.x; j < d2; j += blockDim.x) {
    const T cs = cos_t[row * d2 + j];
    const T sn = (j + half < d2) ? sin_t[row * d2 + j + half] : -sin_t[row * d2 + j + half - d2];
#pragma unroll
    for (int hh = threadIdx.y; hh < h; hh += blockDim.y) {
      const int i = in + hh * stride_h + j * stride_d;
      const int o = out + hh * o_stride_h + j * o_stride_d;
      const T g = src[i];
      const T partner =
          (j + half < d2) ? src[i + half * stride_d] : src[i + (half - d2) * stride_d];
      dst[o] = g * cs + partner * sn;
    }
  }
  apex_copy_tail(src, dst, in, out, h, d, d2, stride_h, stride_d, o_stride_h, o_stride_d);
}

// ---- kernels ---------------------------------------------------------------------------------
// sbhd (any strides): grid (s, b), block (32, 4|8); token (s_id = blockIdx.x, b_id = blockIdx.y),
// angle row = s_id.
#define APEX_SBHD_PARAMS                                                                        \
  int h, int d, int d2, int stride_s, int stride_b, int stride_h, int stride_d, int o_stride_s, \
      int o_stride_b, int o_stride_h, int o_stride_d

#define APEX_SBHD_OFFSETS                                                                       \
  const int s_id = blockIdx.x, b_id = blockIdx.y;                                               \
  const int in = s_id * stride_s + b_id * stride_b;                                             \
  const int out = s_id * o_stride_s + b_id * o_stride_b;

template <typename T>
__global__ void apex_rope_fwd(APEX_SBHD_PARAMS, const T *src, const float *freqs, T *dst) {
  APEX_SBHD_OFFSETS
  apex_block_fwd(src, freqs, dst, s_id, in, out, h, d, d2, stride_h, stride_d, o_stride_h,
                 o_stride_d);
}

template <typename T>
__global__ void apex_rope_bwd(APEX_SBHD_PARAMS, const T *src, const float *freqs, T *dst) {
  APEX_SBHD_OFFSETS
  apex_block_bwd(src, freqs, dst, s_id, in, out, h, d, d2, stride_h, stride_d, o_stride_h,
                 o_stride_d);
}

template <typename T, typename T1>
__global__ void apex_rope_cached_fwd(APEX_SBHD_PARAMS, const T *src, const T1 *cos_t,
                                     const T1 *sin_t, T *dst) {
  APEX_SBHD_OFFSETS
  apex_block_cached_fwd(src, cos_t, sin_t, dst, s_id, in, out, h, d, d2, stride_h, stride_d,
                        o_stride_h, o_stride_d);
}

template <typename T, typename T1>
__global__ void apex_rope_cached_bwd(APEX_SBHD_PARAMS, const T *src, const T1 *cos_t,
                                     const T1 *sin_t, T *dst) {
  APEX_SBHD_OFFSETS
  apex_block_cached_bwd(src, cos_t, sin_t, dst, s_id, in, out, h, d, d2, stride_h, stride_d,
                        o_stride_h, o_stride_d);
}

// thd (packed varlen): grid (max_s, b); block (s_id, b_id) is token cu_seqlens[b_id] + s_id of
// the packed tensor, angle row s_id (the position inside its sequence). Blocks past the end of
// their sequence return at once; tokens of a sequence longer than max_s are never visited (the
// host refuses such cu_seqlens).
#define APEX_THD_PARAMS                                                                         \
  int h, int d, int d2, int stride_t, int stride_h, int stride_d, int o_stride_t,               \
      int o_stride_h, int o_stride_d

#define APEX_THD_OFFSETS                                                                        \
  const int s_id = blockIdx.x, b_id = blockIdx.y;                                               \
  const int t_id = cu_seqlens[b_id] + s_id;                                                     \
  if (t_id >= cu_seqlens[b_id + 1]) return;                                                     \
  const int in = t_id * stride_t;                                                               \
  const int out = t_id * o_stride_t;

template <typename T>
__global__ void apex_rope_thd_fwd(APEX_THD_PARAMS, const T *src, const int *cu_seqlens,
                                  const float *freqs, T *dst) {
  APEX_THD_OFFSETS
  apex_block_fwd(src, freqs, dst, s_id, in, out, h, d, d2, stride_h, stride_d, o_stride_h,
                 o_stride_d);
}

template <typename T>
__global__ void apex_rope_thd_bwd(APEX_THD_PARAMS, const T *src, const int *cu_seqlens,
                                  const float *freqs, T *dst) {
  APEX_THD_OFFSETS
  apex_block_bwd(src, freqs, dst, s_id, in, out, h, d, d2, stride_h, stride_d, o_stride_h,
                 o_stride_d);
}

// 2-D image RoPE: input viewed [b, ih, iw, h, d] (any strides), output [b, ih*iw, h, d].
// grid (ih, iw, b). Channels [0, d/2) are a rotate-half of width d/2 with (cos_h, sin_h) row ih_id;
// channels [d/2, d) a rotate-half of width d/2 with (cos_w, sin_w) row iw_id. Tables are dense
// [rows, d/2]. Two calls of the cached block routine with d = d2 = d/2 (no tail).
#define APEX_2D_PARAMS                                                                          \
  int ih, int iw, int h, int d, int stride_b, int stride_ih, int stride_iw, int stride_h,       \
      int stride_d, int o_stride_b, int o_stride_s, int o_stride_h, int o_stride_d

#define APEX_2D_OFFSETS                                                                         \
  const int ih_id = blockIdx.x, iw_id = blockIdx.y, b_id = blockIdx.z;                          \
  int in = b_id * stride_b + ih_id * stride_ih + iw_id * stride_iw;                             \
  int out = b_id * o_stride_b + (ih_id * iw + iw_id) * o_stride_s;                              \
  const int dh = d / 2;

template <typename T, typename T1>
__global__ void apex_rope_2d_fwd(APEX_2D_PARAMS, const T *src, const T1 *cos_h, const T1 *sin_h,
                                 const T1 *cos_w, const T1 *sin_w, T *dst) {
  APEX_2D_OFFSETS
  apex_block_cached_fwd(src, cos_h, sin_h, dst, ih_id, in, out, h, dh, dh, stride_h, stride_d,
                        o_stride_h, o_stride_d);
  in += dh * stride_d;
  out += dh * o_stride_d;
  apex_block_cached_fwd(src, cos_w, sin_w, dst, iw_id, in, out, h, dh, dh, stride_h, stride_d,
                        o_stride_h, o_stride_d);
}

template <typename T, typename T1>
__global__ void apex_rope_2d_bwd(APEX_2D_PARAMS, const T *src, const T1 *cos_h, const T1 *sin_h,
                                 const T1 *cos_w, const T1 *sin_w, T *dst) {
  APEX_2D_OFFSETS
  apex_block_cached_bwd(src, cos_h, sin_h, dst, ih_id, in, out, h, dh, dh, stride_h, stride_d,
                        o_stride_h, o_stride_d);
  in += dh * stride_d;
  out += dh * o_stride_d;
  apex_block_cached_bwd(src, cos_w, sin_w, dst, iw_id, in, out, h, dh, dh, stride_h, stride_d,
                        o_stride_h, o_stride_d);
}
