// vLLM's fused_qk_norm_rope kernels, ported to CuPy RawKernels (NVRTC).
// Upstream: vllm-project/vllm@0f5257e245116449bfbe78a87c22aeef632eba8f:csrc/fused_qknorm_rope_kernel.cu
// (Apache-2.0; vLLM adapted it from TensorRT-LLM's fusedQKNormRopeKernel.cu). Written anew from
// the design, keeping its structure:
// * qkv [tokens, (hq + hk + hv) * head_dim], contiguous, normalised and rotated in place (q and k
//   heads; v untouched); one warp per (token, q-or-k head), head_dim / 32 channels a lane, loaded
//   and stored as one 4/8/16-byte vector; the head's sum of squares by a butterfly shuffle;
// * fp32 math: x * rsqrt(sum / head_dim + eps) * w, then the rotation with cos/sin from the
//   cat(cos, sin) cache row of the token's position, one rounding at the store;
// * NeoX pairs (i, i + R/2) through __shfl_xor_sync by (R/2) / (head_dim/32) lanes, GPT-J pairs
//   (2i, 2i+1) within a lane;
// * the "token heads" kernel: a warp takes HEADS_PER_WARP (2, 4, 8) heads of one token, fetches
//   them and the cos/sin row into shared memory with cp.async (two commit groups), weights in
//   registers once;
// * int offsets (32-bit), as upstream: the host refuses a qkv of 2^31 elements or more;
// * griddepcontrol.wait / launch_dependents (what cudaGridDependencySynchronize and
//   cudaTriggerProgrammaticLaunchCompletion are on sm_90) stay; without the PDL launch attribute,
//   which a CuPy launch does not set, they are no-ops, as upstream's are above 16 tokens.
// Departures (see ports/vllm_port/qknorm.py for the list):
// * max_position is passed in: a token whose position is outside [0, max_position) gets NaN in its
//   rotated channels instead of reading past cos_sin_cache (the host check refuses such positions
//   before launch except during CUDA-graph capture);
// * the token-heads kernel syncs the warp after waiting for the cos/sin row: a lane reads pieces
//   that other lanes copied, and cp.async.wait_group orders only the waiting lane's own copies
//   (upstream's GPT-J branch reads them with no barrier; its NeoX branch has one before the
//   shuffle);
// * torch's Half/BFloat16 are __half/__nv_bfloat16; vllm::_typeConvert is written out below with
//   the same intrinsics (__half22float2, __float22half2_rn, __bfloat1622float2,
//   __float22bfloat162_rn); cp.async and the warp reduction are inline here (upstream includes
//   async_util.cuh and tensorrt_llm::common).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace vllm_qknorm {

template <typename T> struct Convert;
template <> struct Convert<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float2 to_float2(T2 v) { return __half22float2(v); }
  static __device__ __forceinline__ T2 from_float2(float2 v) { return __float22half2_rn(v); }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
};
template <> struct Convert<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(T2 v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ T2 from_float2(float2 v) { return __float22bfloat162_rn(v); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct Convert<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
};

// packed_as<uint, N>: the vector type a lane loads its head_dim / 32 16-bit channels as.
template <int N> struct packed_uint;
template <> struct packed_uint<1> { using type = unsigned int; };
template <> struct packed_uint<2> { using type = uint2; };
template <> struct packed_uint<4> { using type = uint4; };

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask, 32);
  return v;
}

__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// cp.async.ca of 4, 8 or 16 bytes (a lane's slice of a head) and cp.async.cg of 16 (cos/sin).
template <int BYTES>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_cg16(void* smem, const void* gmem) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Norm then rotate one head held as `elements` (this lane's head_dim / 32 channels, fp32).
// cos/sin come through `load(i)` for pair index i; `pos_ok` false writes NaN (added bound).
template <typename T_cache, int head_dim, bool interleave, typename CosSinLoad>
__device__ __forceinline__ void rotate_head(float* elements, int lane, int rotary_dim, bool pos_ok,
                                            CosSinLoad load) {
  constexpr int n = head_dim / 32;
  int const rotary_lanes = rotary_dim / n;
  if (lane < rotary_lanes) {
    if (interleave) {
#pragma unroll
      for (int i = 0; i < n / 2; ++i) {
        int const i0 = 2 * i, i1 = 2 * i + 1;
        int const dim = lane * n + i0;
        float const a = elements[i0], b = elements[i1];
        float2 const cs = pos_ok ? load(dim / 2) : make_float2(__int_as_float(0x7fffffff), 0.f);
        elements[i0] = a * cs.x - b * cs.y;
        elements[i1] = a * cs.y + b * cs.x;
      }
    } else {
      float partner[n];
      __syncwarp();
      int const pair_offset = (rotary_dim / 2) / n;
#pragma unroll
      for (int i = 0; i < n; ++i) {
        partner[i] = __shfl_xor_sync(0xffffffffu, elements[i], pair_offset);
        if (lane < pair_offset) partner[i] = -partner[i];
        int dim = lane * n + i;
        dim = (dim * 2) % rotary_dim;
        float2 const cs = pos_ok ? load(dim / 2) : make_float2(__int_as_float(0x7fffffff), 0.f);
        elements[i] = elements[i] * cs.x + partner[i] * cs.y;
      }
      __syncwarp();
    }
  }
}

}  // namespace vllm_qknorm

// grid ceil(tokens * (hq + hk) / 8), block 256: warp w of the grid takes token w / (hq + hk),
// head w % (hq + hk) (q heads first, then k heads).
template <typename T_in, typename T_cache, int head_dim, bool interleave>
__global__ void fused_qk_norm_rope_kernel(
    void* qkv_void, const int num_heads_q, const int num_heads_k, const int num_heads_v,
    const float eps, const void* q_weight_void, const void* k_weight_void,
    const void* cos_sin_cache_void, const long long* position_ids, const int num_tokens,
    const int rotary_dim, const long long max_position) {
  using C = vllm_qknorm::Convert<T_in>;
  using CC = vllm_qknorm::Convert<T_cache>;
  using T2 = typename C::T2;
  T_in* qkv = reinterpret_cast<T_in*>(qkv_void);
  const T_in* q_weight = reinterpret_cast<const T_in*>(q_weight_void);
  const T_in* k_weight = reinterpret_cast<const T_in*>(k_weight_void);
  const T_cache* cos_sin_cache = reinterpret_cast<const T_cache*>(cos_sin_cache_void);

  int const warps_per_block = blockDim.x / 32;
  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const global_warp = blockIdx.x * warps_per_block + warp;
  int const total_qk_heads = num_heads_q + num_heads_k;
  int const token = global_warp / total_qk_heads;
  int const local_head = global_warp % total_qk_heads;
  if (token >= num_tokens) return;
  bool const is_q = local_head < num_heads_q;
  int const head = is_q ? local_head : local_head - num_heads_q;
  int const num_heads = num_heads_q + num_heads_k + num_heads_v;

  static_assert(head_dim % 64 == 0, "head_dim must be a multiple of 64");
  constexpr int n = head_dim / 32;
  constexpr int elem_bytes = n * 2;
  constexpr int vec_words = elem_bytes / 4;
  using vec_t = typename vllm_qknorm::packed_uint<vec_words>::type;
  float elements[n];

  int const warp_offset = is_q ? token * num_heads * head_dim + head * head_dim
                               : token * num_heads * head_dim + num_heads_q * head_dim +
                                     head * head_dim;
  int const thread_offset = warp_offset + lane * n;

  vllm_qknorm::grid_dependency_wait();

  float sum_sq = 0.0f;
  {
    vec_t vec = *reinterpret_cast<const vec_t*>(&qkv[thread_offset]);
#pragma unroll
    for (int i = 0; i < elem_bytes / 4; ++i) {
      float2 v = C::to_float2(*(reinterpret_cast<T2*>(&vec) + i));
      sum_sq += v.x * v.x;
      sum_sq += v.y * v.y;
      elements[2 * i] = v.x;
      elements[2 * i + 1] = v.y;
    }
  }
  sum_sq = vllm_qknorm::warp_reduce_sum(sum_sq);
  float const rms_rcp = rsqrtf(sum_sq / static_cast<float>(head_dim) + eps);
#pragma unroll
  for (int i = 0; i < n; ++i) {
    int const dim = lane * n + i;
    float const w = is_q ? C::to_float(q_weight[dim]) : C::to_float(k_weight[dim]);
    elements[i] *= rms_rcp * w;
  }

  long long const pos = position_ids[token];
  bool const pos_ok = pos >= 0 && pos < max_position;
  const T_cache* cos_ptr = cos_sin_cache + (pos_ok ? pos : 0) * rotary_dim;
  const T_cache* sin_ptr = cos_ptr + rotary_dim / 2;
  vllm_qknorm::rotate_head<T_cache, head_dim, interleave>(
      elements, lane, rotary_dim, pos_ok, [&](int i) {
        return make_float2(CC::to_float(__ldg(cos_ptr + i)), CC::to_float(__ldg(sin_ptr + i)));
      });

  {
    vec_t vec;
#pragma unroll
    for (int i = 0; i < elem_bytes / 4; ++i)
      *(reinterpret_cast<T2*>(&vec) + i) =
          C::from_float2(make_float2(elements[2 * i], elements[2 * i + 1]));
    *reinterpret_cast<vec_t*>(&qkv[thread_offset]) = vec;
  }
  vllm_qknorm::launch_dependents();
}

// grid ceil(tokens * ceil((hq + hk) / HEADS_PER_WARP) / 8), block 256, dynamic shared memory
// 8 * (rotary_dim * sizeof(T_cache) + HEADS_PER_WARP * 2 * head_dim) bytes: per warp, its
// token's cos/sin row, then its heads' 16-bit tiles.
template <typename T_in, typename T_cache, int head_dim, bool interleave, int HEADS_PER_WARP>
__global__ void fused_qk_norm_rope_token_heads_kernel(
    void* qkv_void, const int num_heads_q, const int num_heads_k, const int num_heads_v,
    const float eps, const void* q_weight_void, const void* k_weight_void,
    const void* cos_sin_cache_void, const long long* position_ids, const int num_tokens,
    const int rotary_dim, const long long max_position) {
  using C = vllm_qknorm::Convert<T_in>;
  using CC = vllm_qknorm::Convert<T_cache>;
  using T2 = typename C::T2;
  extern __shared__ __align__(16) char smem_storage[];
  T_cache* const smem = reinterpret_cast<T_cache*>(smem_storage);
  T_in* qkv = reinterpret_cast<T_in*>(qkv_void);
  const T_in* q_weight = reinterpret_cast<const T_in*>(q_weight_void);
  const T_in* k_weight = reinterpret_cast<const T_in*>(k_weight_void);
  const T_cache* cos_sin_cache = reinterpret_cast<const T_cache*>(cos_sin_cache_void);

  int const warps_per_block = blockDim.x / 32;
  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const total_qk_heads = num_heads_q + num_heads_k;
  int const num_heads = num_heads_q + num_heads_k + num_heads_v;
  int const chunks_per_token = (total_qk_heads + HEADS_PER_WARP - 1) / HEADS_PER_WARP;
  int const global_warp = blockIdx.x * warps_per_block + warp;
  int const token = global_warp / chunks_per_token;
  int const first_head = (global_warp % chunks_per_token) * HEADS_PER_WARP;
  int const heads_here = (first_head + HEADS_PER_WARP <= total_qk_heads)
                             ? HEADS_PER_WARP : (total_qk_heads - first_head);
  if (token >= num_tokens) return;

  static_assert(head_dim % 64 == 0, "head_dim must be a multiple of 64");
  constexpr int n = head_dim / 32;
  constexpr int elem_bytes = n * 2;
  constexpr int vec_words = elem_bytes / 4;
  using vec_t = typename vllm_qknorm::packed_uint<vec_words>::type;
  int const cos_sin_bytes = warps_per_block * rotary_dim * static_cast<int>(sizeof(T_cache));
  int const tile_bytes = 32 * elem_bytes;
  char* const warp_tiles = smem_storage + cos_sin_bytes + warp * (HEADS_PER_WARP * tile_bytes);

  vllm_qknorm::grid_dependency_wait();

  // Group 0: this warp's heads into shared memory.
  for (int h = 0; h < heads_here; ++h) {
    int const local_head = first_head + h;
    bool const is_q = local_head < num_heads_q;
    int const head = is_q ? local_head : local_head - num_heads_q;
    int const off = token * num_heads * head_dim + (is_q ? 0 : num_heads_q * head_dim) +
                    head * head_dim + lane * n;
    vllm_qknorm::cp_async_ca<elem_bytes>(warp_tiles + h * tile_bytes + lane * elem_bytes,
                                         &qkv[off]);
  }
  vllm_qknorm::cp_async_commit();
  // Group 1: the token's cos/sin row, in 16-byte pieces.
  long long const pos = position_ids[token];
  bool const pos_ok = pos >= 0 && pos < max_position;
  if (pos_ok) {
    const T_cache* row = cos_sin_cache + pos * rotary_dim;
    int const pieces = (rotary_dim * static_cast<int>(sizeof(T_cache)) + 15) / 16;
    for (int p = lane; p < pieces; p += 32)
      vllm_qknorm::cp_async_cg16(reinterpret_cast<char*>(&smem[warp * rotary_dim]) + p * 16,
                                 reinterpret_cast<const char*>(row) + p * 16);
  }
  vllm_qknorm::cp_async_commit();
  vllm_qknorm::cp_async_wait<1>();

  const T_cache* cos_s = &smem[warp * rotary_dim];
  const T_cache* sin_s = cos_s + rotary_dim / 2;
  float q_w[n], k_w[n];
#pragma unroll
  for (int i = 0; i < n; ++i) {
    int const dim = lane * n + i;
    q_w[i] = C::to_float(q_weight[dim]);
    k_w[i] = C::to_float(k_weight[dim]);
  }

  for (int h = 0; h < heads_here; ++h) {
    int const local_head = first_head + h;
    bool const is_q = local_head < num_heads_q;
    int const head = is_q ? local_head : local_head - num_heads_q;
    int const off = token * num_heads * head_dim + (is_q ? 0 : num_heads_q * head_dim) +
                    head * head_dim + lane * n;
    float elements[n];
    float sum_sq = 0.0f;
    {
      vec_t vec = *reinterpret_cast<const vec_t*>(warp_tiles + h * tile_bytes + lane * elem_bytes);
#pragma unroll
      for (int i = 0; i < elem_bytes / 4; ++i) {
        float2 v = C::to_float2(*(reinterpret_cast<T2*>(&vec) + i));
        sum_sq += v.x * v.x;
        sum_sq += v.y * v.y;
        elements[2 * i] = v.x;
        elements[2 * i + 1] = v.y;
      }
    }
    sum_sq = vllm_qknorm::warp_reduce_sum(sum_sq);
    float const rms_rcp = rsqrtf(sum_sq / static_cast<float>(head_dim) + eps);
#pragma unroll
    for (int i = 0; i < n; ++i) elements[i] *= rms_rcp * (is_q ? q_w[i] : k_w[i]);
    if (h == 0) {
      vllm_qknorm::cp_async_wait<0>();
      __syncwarp();  // added: the row's pieces were copied by other lanes (see the header)
    }
    vllm_qknorm::rotate_head<T_cache, head_dim, interleave>(
        elements, lane, rotary_dim, pos_ok, [&](int i) {
          return make_float2(CC::to_float(cos_s[i]), CC::to_float(sin_s[i]));
        });
    vec_t vec;
#pragma unroll
    for (int i = 0; i < elem_bytes / 4; ++i)
      *(reinterpret_cast<T2*>(&vec) + i) =
          C::from_float2(make_float2(elements[2 * i], elements[2 * i + 1]));
    *reinterpret_cast<vec_t*>(&qkv[off]) = vec;
  }
  vllm_qknorm::launch_dependents();
}
