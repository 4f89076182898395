// FlashInfer's fused_qk_rmsnorm_rope kernel (across-heads RMSNorm + 3-D RoPE + V copy, for video
// diffusion transformers), ported to a CuPy RawKernel (NVRTC, --use_fast_math as FlashInfer's
// JIT builds it).
// Upstream: flashinfer-ai/flashinfer@fb28d7242b3506a2348265962041acc1fb56cca4:
// include/flashinfer/norm/fused_qk_rmsnorm_rope.cuh (Apache-2.0, Copyright the FlashInfer team).
// Written anew from the design, keeping its structure:
// * grid (tokens, 3): blockIdx.y 0 = q, 1 = k, 2 = v; block max(hq, hk, hv) warps, warp = head;
//   head_dim / 32 bf16 channels a lane, loaded and stored as one 4/8/16-byte vector;
// * q/k blocks: each warp's sum of squares (float2 FMAs, butterfly shuffle), the warps' sums
//   through shared memory, rsqrt(total / (heads * head_dim) + eps), times the [heads * head_dim]
//   weight, then rounded to bf16 and back (unless the output is FP8), then RoPE with angles
//   pos * freq_table[i] through __sincosf, the position of a channel's section (frame, height or
//   width of the token's (t, h, w) patch index); optional YaRN attention factor; one rounding to
//   bf16 (or FP8 E4M3 with a scale) at the store into q_out / k_out [tokens, heads * head_dim];
// * v blocks: copy (or FP8-quantize) v into v_out;
// * int64 token offsets, int within a token.
// Departures (see ports/flashinfer_port/qknorm.py for the list):
// * __builtin_ctz(head_dim) is a constexpr log2 (the same value for the powers of two here);
// * IntFastDiv (magic-number division) is plain int division: the same quotients for the
//   non-negative operands here;
// * the frequency table is built by the port's host code (the same fp32 formula) and passed in.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace fi_qknorm {

constexpr int THREADS_PER_WARP = 32;

// __builtin_ctz of a power of two (NVRTC has no __builtin_ctz in constant expressions).
__host__ __device__ constexpr int log2_pow2(int v) { return v <= 1 ? 0 : 1 + log2_pow2(v / 2); }

template <int N> struct packed_uint;
template <> struct packed_uint<1> { using type = unsigned int; };
template <> struct packed_uint<2> { using type = uint2; };
template <> struct packed_uint<4> { using type = uint4; };

__device__ __forceinline__ __nv_fp8_e4m3 quantize_fp8_e4m3(float val, float scale) {
  return __nv_fp8_e4m3(val * scale);
}

__device__ __forceinline__ unsigned short float2_to_fp8x2(float2 v, float scale) {
  __nv_fp8_e4m3 a = quantize_fp8_e4m3(v.x, scale);
  __nv_fp8_e4m3 b = quantize_fp8_e4m3(v.y, scale);
  return (*reinterpret_cast<unsigned char*>(&a)) | ((*reinterpret_cast<unsigned char*>(&b)) << 8);
}

__device__ __forceinline__ unsigned int float4_to_fp8x4(float f0, float f1, float f2, float f3,
                                                       float scale) {
  float s0 = f0 * scale, s1 = f1 * scale, s2 = f2 * scale, s3 = f3 * scale;
  unsigned int r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "{\n\t"
      ".reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %4, %3;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %2, %1;\n\t"
      "mov.b32 %0, {hi, lo};\n\t"
      "}"
      : "=r"(r)
      : "f"(s0), "f"(s1), "f"(s2), "f"(s3));
#else
  __nv_fp8_e4m3 a = __nv_fp8_e4m3(s0), b = __nv_fp8_e4m3(s1), c = __nv_fp8_e4m3(s2),
                d = __nv_fp8_e4m3(s3);
  r = (*reinterpret_cast<unsigned char*>(&a)) | ((*reinterpret_cast<unsigned char*>(&b)) << 8) |
      ((*reinterpret_cast<unsigned char*>(&c)) << 16) |
      ((*reinterpret_cast<unsigned char*>(&d)) << 24);
#endif
  return r;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
__device__ __forceinline__ float2 fmul2(const float2& a, const float2& b) {
  unsigned long long c;
  asm volatile("mul.f32x2 %0, %1, %2;\n"
               : "=l"(c)
               : "l"(reinterpret_cast<const unsigned long long&>(a)),
                 "l"(reinterpret_cast<const unsigned long long&>(b)));
  return reinterpret_cast<float2&>(c);
}
__device__ __forceinline__ float2 ffma2(const float2& a, const float2& b, const float2& c) {
  unsigned long long d;
  asm volatile("fma.rn.f32x2 %0, %1, %2, %3;\n"
               : "=l"(d)
               : "l"(reinterpret_cast<const unsigned long long&>(a)),
                 "l"(reinterpret_cast<const unsigned long long&>(b)),
                 "l"(reinterpret_cast<const unsigned long long&>(c)));
  return reinterpret_cast<float2&>(d);
}
#else
__device__ __forceinline__ float2 fmul2(const float2& a, const float2& b) {
  return make_float2(a.x * b.x, a.y * b.y);
}
__device__ __forceinline__ float2 ffma2(const float2& a, const float2& b, const float2& c) {
  return make_float2(a.x * b.x + c.x, a.y * b.y + c.y);
}
#endif

template <int n>
__device__ __forceinline__ void store_fp8(const float2* e, __nv_fp8_e4m3* out, long long off,
                                          float scale) {
  if constexpr (n == 2) {
    *reinterpret_cast<unsigned short*>(&out[off]) = float2_to_fp8x2(e[0], scale);
  } else if constexpr (n == 4) {
    *reinterpret_cast<unsigned int*>(&out[off]) =
        float4_to_fp8x4(e[0].x, e[0].y, e[1].x, e[1].y, scale);
  } else if constexpr (n == 8) {
    *reinterpret_cast<uint2*>(&out[off]) =
        make_uint2(float4_to_fp8x4(e[0].x, e[0].y, e[1].x, e[1].y, scale),
                   float4_to_fp8x4(e[2].x, e[2].y, e[3].x, e[3].y, scale));
  } else {
#pragma unroll
    for (int i = 0; i < n / 2; i++) {
      out[off + i * 2] = quantize_fp8_e4m3(e[i].x, scale);
      out[off + i * 2 + 1] = quantize_fp8_e4m3(e[i].y, scale);
    }
  }
}

}  // namespace fi_qknorm

template <int head_dim, bool interleave, bool OUTPUT_FP8, bool HAS_YARN>
__global__ void fused_qk_rmsnorm_rope_kernel(
    const __nv_bfloat16* qkv_in, void* q_out, void* k_out, void* v_out, const int num_heads_q,
    const int num_heads_k, const int num_heads_v, const float eps,
    const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight, const float* freq_table,
    const long long num_tokens, const int seq_len, const int ppw, const int pphppw,
    const int num_frame_channels, const int num_height_channels, const int num_width_channels,
    const float attention_factor, const bool is_qk_norm, const float output_quant_scale,
    const float v_quant_scale) {
  using namespace fi_qknorm;
  constexpr int MAX_HEADS = 32;
  static_assert((head_dim & (head_dim - 1)) == 0, "head_dim must be a power of 2");
  static_assert(head_dim % (THREADS_PER_WARP * 2) == 0, "head_dim must be a multiple of 64");
  constexpr int log_head_dim = log2_pow2(head_dim);
  constexpr int n = head_dim / THREADS_PER_WARP;
  constexpr int n2 = n / 2;
  constexpr int elem_bytes = n * 2;
  constexpr int vec_words = elem_bytes / 4;
  using vec_t = typename packed_uint<vec_words>::type;

  int const warp = threadIdx.x / THREADS_PER_WARP;
  int const lane = threadIdx.x % THREADS_PER_WARP;
  long long const token = blockIdx.x;
  int const block_type = blockIdx.y;
  if (token >= num_tokens) return;

  int const num_heads = num_heads_q + num_heads_k + num_heads_v;
  long long const base_offset = token * (long long)(num_heads * head_dim);
  int const head = warp;
  int const thread_head_offset = head * head_dim + lane * n;

  if (block_type == 2) {  // v: copy or quantize
    if (head >= num_heads_v) return;
    long long const in_off =
        base_offset + (long long)((num_heads_q + num_heads_k) * head_dim) + thread_head_offset;
    vec_t vec = *reinterpret_cast<const vec_t*>(&qkv_in[in_off]);
    long long const out_off = token * (long long)(num_heads_v * head_dim) + thread_head_offset;
    if constexpr (OUTPUT_FP8) {
      float2 e[n2];
#pragma unroll
      for (int i = 0; i < vec_words; i++)
        e[i] = __bfloat1622float2(
            *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<unsigned int*>(&vec) + i));
      store_fp8<n>(e, reinterpret_cast<__nv_fp8_e4m3*>(v_out), out_off, v_quant_scale);
    } else {
      *reinterpret_cast<vec_t*>(&reinterpret_cast<__nv_bfloat16*>(v_out)[out_off]) = vec;
    }
    return;
  }

  __shared__ float shared_sum[MAX_HEADS];
  bool const is_q = block_type == 0;
  int const heads_this = is_q ? num_heads_q : num_heads_k;
  bool const valid = head < heads_this;
  int const hidden_this = heads_this * head_dim;

  float2 e[n2];
  float2 w[n2];
  long long const in_off =
      base_offset + (is_q ? 0 : num_heads_q * head_dim) + thread_head_offset;
  float2 ss = make_float2(0.0f, 0.0f);
  if (valid) {
    const __nv_bfloat16* wp = is_q ? q_weight : k_weight;
    vec_t wv = *reinterpret_cast<const vec_t*>(&wp[thread_head_offset]);
    vec_t xv = *reinterpret_cast<const vec_t*>(&qkv_in[in_off]);
#pragma unroll
    for (int i = 0; i < vec_words; i++) {
      w[i] = __bfloat1622float2(
          *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<unsigned int*>(&wv) + i));
      float2 v = __bfloat1622float2(
          *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<unsigned int*>(&xv) + i));
      ss = ffma2(v, v, ss);
      e[i] = v;
    }
  }

  if (is_qk_norm) {
    float s = ss.x + ss.y;
#pragma unroll
    for (int step = THREADS_PER_WARP / 2; step > 0; step /= 2)
      s += __shfl_xor_sync(0xffffffffu, s, step);
    if (lane == 0) shared_sum[warp] = valid ? s : 0.0f;
    __syncthreads();
    int const warps = blockDim.x / THREADS_PER_WARP;
    float total = (lane < warps) ? shared_sum[lane] : 0.0f;
#pragma unroll
    for (int step = THREADS_PER_WARP / 2; step > 0; step /= 2)
      total += __shfl_xor_sync(0xffffffffu, total, step);
    float const rms_rcp = rsqrtf(total / static_cast<float>(hidden_this) + eps);
    if (valid) {
      float2 const r2 = make_float2(rms_rcp, rms_rcp);
#pragma unroll
      for (int i = 0; i < n2; i++) {
        e[i] = fmul2(fmul2(e[i], r2), w[i]);
        if constexpr (!OUTPUT_FP8) e[i] = __bfloat1622float2(__float22bfloat162_rn(e[i]));
      }
    }
  }

  if (valid) {
    float2 partner[n2], cs[n2], sn[n2];
    int const in_seq = static_cast<int>(token % seq_len);
    int const pos_t = in_seq / pphppw;
    int const pos_x = in_seq % pphppw;
    int const pos_h = pos_x / ppw;
    int const pos_w = pos_x % ppw;
    int const height_start = num_frame_channels;
    int const width_start = num_frame_channels + num_height_channels;
    if constexpr (interleave) {
#pragma unroll
      for (int i = 0; i < n2; i++) {
        int const dim = lane * n + i * 2;
        int const pos = dim >= width_start ? pos_w : dim >= height_start ? pos_h : pos_t;
        float const theta = pos * freq_table[dim >> 1];
        float s_, c_;
        __sincosf(theta, &s_, &c_);
        sn[i] = make_float2(s_, s_);
        cs[i] = make_float2(c_, c_);
        partner[i] = make_float2(-e[i].y, e[i].x);
      }
    } else {
      __syncwarp();
#pragma unroll
      for (int i = 0; i < n2; i++) {
        float px = __shfl_xor_sync(0xffffffffu, e[i].x, 16);
        float py = __shfl_xor_sync(0xffffffffu, e[i].y, 16);
        if (lane < 16) {
          px = -px;
          py = -py;
        }
        partner[i] = make_float2(px, py);
      }
#pragma unroll
      for (int i = 0; i < n2; i++) {
        int dx = lane * n + i * 2;
        dx = (dx * 2) & ((1 << log_head_dim) - 1);
        int pos = dx >= width_start ? pos_w : dx >= height_start ? pos_h : pos_t;
        float sx, cx;
        __sincosf(pos * freq_table[dx >> 1], &sx, &cx);
        int dy = lane * n + i * 2 + 1;
        dy = (dy * 2) & ((1 << log_head_dim) - 1);
        pos = dy >= width_start ? pos_w : dy >= height_start ? pos_h : pos_t;
        float sy, cy;
        __sincosf(pos * freq_table[dy >> 1], &sy, &cy);
        sn[i] = make_float2(sx, sy);
        cs[i] = make_float2(cx, cy);
      }
      __syncwarp();
    }
    if constexpr (HAS_YARN) {
      float2 const af = make_float2(attention_factor, attention_factor);
#pragma unroll
      for (int i = 0; i < n2; i++) e[i] = fmul2(ffma2(e[i], cs[i], fmul2(partner[i], sn[i])), af);
    } else {
#pragma unroll
      for (int i = 0; i < n2; i++) e[i] = ffma2(e[i], cs[i], fmul2(partner[i], sn[i]));
    }
    long long const out_off = token * (long long)(heads_this * head_dim) + thread_head_offset;
    if constexpr (OUTPUT_FP8) {
      store_fp8<n>(e, reinterpret_cast<__nv_fp8_e4m3*>(is_q ? q_out : k_out), out_off,
                   output_quant_scale);
    } else {
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(is_q ? q_out : k_out);
      vec_t vec;
      for (int i = 0; i < vec_words; i++)
        reinterpret_cast<__nv_bfloat162&>(*(reinterpret_cast<unsigned int*>(&vec) + i)) =
            __float22bfloat162_rn(e[i]);
      *reinterpret_cast<vec_t*>(&o[out_off]) = vec;
    }
  }
}
