// Port of NVIDIA/TransformerEngine transformer_engine/common/fused_rope/fused_rope.cu
// (d0067d0da6cb, 2026-08-22; the single-tensor kernels, forward and backward). Written anew from
// the design, not copied. TE compiles this file without --use_fast_math (it is not in the
// fast-math list of transformer_engine/common/CMakeLists.txt), so sincosf is libdevice's accurate
// routine; NVRTC is called with no options here, likewise.
//
// Design kept (ports/te/__init__.py lists every departure):
// * one block per token: grid (s, b) for sbhd/bshd and for thd (s = freqs rows, b = sequences;
//   blocks past a sequence's end return), or, for thd when that grid wastes many blocks, a linear
//   grid of one block per packed token that finds its sequence by binary search over cu_seqlens;
// * block (32, 4 if h < 16 else 8); first the block's threads compute sincosf of the token's d2
//   fp32 angles ONCE into shared memory (2 * d2 floats), then threadIdx.y strides over heads and
//   threadIdx.x over the rotated dims, every head reusing the shared cos/sin; a second loop copies
//   the tail d2 <= j < d;
// * rotate-half (pair j +- d2/2) or interleaved (pair j ^ 1), both in fp32: the element and its
//   partner are converted to float, out = x * cos + partner * sin (partner negated for the first
//   member), one rounding to the storage type at the store;
// * backward: the transposed rotation, reading the partner's sine from shared memory;
// * positions: the token's index in its sequence plus start_positions[b] (if given), shifted by
//   the context-parallel dual-chunk order when cp_size > 1;
// * every input stride is an argument; the output is dense in the input's format; all index
//   math in int32.
// Departure: the freqs row is bounds-checked in the kernel (te_rope_block's freqs_rows).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ int te_thd_find_seq_id(const int *cu_seqlens, int nseq, int t_id,
                                                  int cp_size) {
  int lo = 0, hi = nseq;
  while (lo + 1 < hi) {
    int mid = (lo + hi) >> 1;
    if (cu_seqlens[mid] / cp_size <= t_id) lo = mid; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ int te_freqs_row(int s_id, int cur_seqlens, const int *start_positions,
                                            int b_id, int cp_size, int cp_rank) {
  int row = s_id + (start_positions == nullptr ? 0 : start_positions[b_id]);
  if (cp_size > 1) {  // dual-chunk order: rank r holds chunks r and 2 * cp_size - 1 - r
    if (s_id < cur_seqlens / 2) {
      row += cp_rank * cur_seqlens / 2;
    } else {
      row += cur_seqlens * cp_size - (cp_rank + 1) * cur_seqlens / 2 - cur_seqlens / 2;
    }
  }
  return row;
}

// Departure: freqs_rows bounds the table row. A row past it (a start position the host could
// not check, during CUDA-graph capture) gives NaN cos/sin instead of an out-of-bounds read.
template <typename T, bool BACKWARD>
__device__ void te_rope_block(const T *src, const float *freqs, int freqs_rows, T *dst,
                              bool interleaved, int s_id, int offset_block, int offset_block_dst,
                              int h, int d, int d2, int stride_h, int stride_d, int o_stride_h,
                              int o_stride_d) {
  extern __shared__ float shared_cos_sin[];
  float *shared_cos = shared_cos_sin;
  float *shared_sin = shared_cos_sin + d2;
  int tid = threadIdx.x * blockDim.y + threadIdx.y;
  for (int i = tid; i < d2; i += blockDim.x * blockDim.y) {
    float angle = s_id < freqs_rows ? freqs[s_id * d2 + i] : __int_as_float(0x7fc00000);
    sincosf(angle, &shared_sin[i], &shared_cos[i]);
  }
  __syncthreads();

  for (int h_id = threadIdx.y; h_id < h; h_id += blockDim.y) {
    for (int d_id = threadIdx.x; d_id < d2; d_id += blockDim.x) {
      int offset_src = offset_block + h_id * stride_h + d_id * stride_d;
      int offset_dst = offset_block_dst + h_id * o_stride_h + d_id * o_stride_d;
      float v_src = static_cast<float>(src[offset_src]);
      float v_cos = shared_cos[d_id];
      float v_rot, v_sin;
      if (!BACKWARD) {
        v_sin = shared_sin[d_id];
        if (!interleaved) {
          v_rot = (d_id + d2 / 2 < d2) ? -static_cast<float>(src[offset_src + (d2 / 2) * stride_d])
                                       : static_cast<float>(src[offset_src + (d2 / 2 - d2) * stride_d]);
        } else {
          v_rot = (d_id % 2 == 0) ? -static_cast<float>(src[offset_src + stride_d])
                                  : static_cast<float>(src[offset_src - stride_d]);
        }
      } else if (!interleaved) {
        if (d_id + d2 / 2 < d2) {
          v_rot = static_cast<float>(src[offset_src + (d2 / 2) * stride_d]);
          v_sin = shared_sin[d_id + d2 / 2];
        } else {
          v_rot = static_cast<float>(src[offset_src + (d2 / 2 - d2) * stride_d]);
          v_sin = -shared_sin[d_id + d2 / 2 - d2];
        }
      } else if (d_id % 2 == 0) {
        v_rot = static_cast<float>(src[offset_src + stride_d]);
        v_sin = shared_sin[d_id + 1];
      } else {
        v_rot = static_cast<float>(src[offset_src - stride_d]);
        v_sin = -shared_sin[d_id - 1];
      }
      dst[offset_dst] = T(v_src * v_cos + v_rot * v_sin);
    }
  }

  if (d > d2) {  // copy the tail
    for (int d_id = d2 + threadIdx.x; d_id < d; d_id += blockDim.x) {
      for (int h_id = threadIdx.y; h_id < h; h_id += blockDim.y) {
        dst[offset_block_dst + h_id * o_stride_h + d_id * o_stride_d] =
            src[offset_block + h_id * stride_h + d_id * stride_d];
      }
    }
  }
}

// grid (s, b): sbhd/bshd (cu_seqlens null) or thd (s = freqs rows, b = sequences).
template <typename T, bool BACKWARD>
__global__ void te_rope(const T *src, const int *cu_seqlens, const float *freqs,
                        int freqs_rows, const int *start_positions, T *dst, bool interleaved, int cp_size,
                        int cp_rank, int s, int h, int d, int d2, int stride_s_or_t, int stride_b,
                        int stride_h, int stride_d, int o_stride_s_or_t, int o_stride_b,
                        int o_stride_h, int o_stride_d) {
  int s_id = blockIdx.x, b_id = blockIdx.y;
  int offset_block, offset_block_dst, cur_seqlens;
  if (cu_seqlens != nullptr) {
    int start = cu_seqlens[b_id] / cp_size;
    int end = cu_seqlens[b_id + 1] / cp_size;
    int t_id = s_id + start;
    if (t_id >= end) return;
    offset_block = t_id * stride_s_or_t;
    offset_block_dst = t_id * o_stride_s_or_t;
    cur_seqlens = end - start;
  } else {
    offset_block = s_id * stride_s_or_t + b_id * stride_b;
    offset_block_dst = s_id * o_stride_s_or_t + b_id * o_stride_b;
    cur_seqlens = s;
  }
  int row = te_freqs_row(s_id, cur_seqlens, start_positions, b_id, cp_size, cp_rank);
  te_rope_block<T, BACKWARD>(src, freqs, freqs_rows, dst, interleaved, row, offset_block,
                             offset_block_dst, h, d, d2, stride_h, stride_d, o_stride_h,
                             o_stride_d);
}

// thd, one block per packed token (grid (t)); the block finds its sequence by binary search.
template <typename T, bool BACKWARD>
__global__ void te_rope_thd_linear(const T *src, const int *cu_seqlens, const float *freqs,
                                   int freqs_rows, const int *start_positions, T *dst, bool interleaved,
                                   int cp_size, int cp_rank, int nseq, int h, int d, int d2,
                                   int stride_t, int stride_h, int stride_d, int o_stride_t,
                                   int o_stride_h, int o_stride_d) {
  int t_id = blockIdx.x;
  __shared__ int valid_token;
  __shared__ int seq_id;
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    valid_token = t_id < cu_seqlens[nseq] / cp_size;
    seq_id = valid_token ? te_thd_find_seq_id(cu_seqlens, nseq, t_id, cp_size) : 0;
  }
  __syncthreads();
  if (!valid_token) return;
  int start = cu_seqlens[seq_id] / cp_size;
  int end = cu_seqlens[seq_id + 1] / cp_size;
  int s_id = t_id - start;
  int row = te_freqs_row(s_id, end - start, start_positions, seq_id, cp_size, cp_rank);
  te_rope_block<T, BACKWARD>(src, freqs, freqs_rows, dst, interleaved, row, t_id * stride_t,
                             t_id * o_stride_t, h, d, d2, stride_h, stride_d, o_stride_h,
                             o_stride_d);
}
