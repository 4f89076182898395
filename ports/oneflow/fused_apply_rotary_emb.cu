// Port of OneFlow's fused_apply_rotary_emb CUDA kernels (IntervalKernel, PlaneKernel):
//   Oneflow-Inc/oneflow:oneflow/user/kernels/fused_attention_kernels.cu (FusedApplyRotaryEmbParam,
//   IntervalKernel, PlaneKernel, LaunchKernel, DispatchPackSize, DispatchIndex,
//   DispatchRotaryEmbeddingDimension); read at the stored version 05ec5c10 (the rotary code from
//   8c489e45, unchanged up to 25c8978c). Licence of the original:
//   Apache-2.0. This is an independent re-implementation of the design, not a copy.
//
// Design kept:
//  * a 1-D grid of 128-thread blocks with a grid-stride loop; IntervalKernel handles one pack of
//    PackSize (2, 4 or 8) elements per thread with vector loads/stores (Packed<T, P>, aligned to
//    P * sizeof(T)); PlaneKernel handles one element per thread with scalar loads;
//  * each thread decomposes its flat offset into logical (b, m, h, k) by dividing by the reference
//    strides {M*H*K, H*K, K, 1}, then addresses x and out through their own layout strides (K is
//    unit-stride), x from x_offset (the tensor_index slice of packed (H2K)/(H3K) layouts);
//  * IndexType int32 or int64 (the host picks), PositionType int32 or int64, RotaryEmbDim 1 or 2
//    as template parameters, as upstream (RotaryEmbDim does not enter the kernel bodies upstream
//    either: the sections come in through k0/k1/actual_rotary_size);
//  * the angle and the arithmetic in T: theta = T(1.0f / base);
//    angle = T(pos * expf(2.0f * j * inv_actual_rotary_size * logf(theta))),
//    cos = T(cosf(angle)), sin = T(sinf(angle)); y = x*cos -/+ x'*sin with T operators (__half and
//    __nv_bfloat16 operators from cuda_fp16.h / cuda_bf16.h: every operation rounds to T);
//  * given cos/sin are read per element: interval at cos[pos * sinuous_m_stride + kk] (a pack),
//    plane at cos[pos * table_stride + kk] (scalar; upstream's row stride is K, see below).
//
// Departures (the full list is in ports/oneflow/__init__.py):
//  * The parameter struct passed by value is flattened into scalar arguments (pointers, two floats,
//    IndexType scalars); the 4-entry stride arrays become three scalars each plus the constant 1.
//  * theta arrives as the float 1.0f / base and is rounded to T in the kernel (upstream rounds it
//    on the host with static_cast<T>: both round to nearest even, same bits).
//  * Fp32Angle = true (an opt-in variant, not upstream): theta and the angle stay in float; cos
//    and sin are still rounded to T and the arithmetic is still T. Fp32Angle = false is upstream.
//  * PlaneKernel: pass-through elements (k >= rotary_size) read no position_ids, cos or sin.
//    Upstream reads them for every element; with 1-D position_ids and rotary_size < K the
//    pass-through elements pick section 1 and read position_ids[b*M + M + m], past the end for
//    the last batch. Their output (a copy of x) is unchanged.
//  * PlaneKernel reads given tables with row stride `table_stride`: the host passes K, as
//    upstream, and refuses the cases where K != rotary_size / E (upstream then reads wrong rows
//    and out of bounds) unless the caller opts into the fixed stride
//    rotary_size / E.
//  * The unused local `actual_ndim` of IntervalKernel is dropped.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace oneflow_port {

constexpr int kNumDims = 4;  // b, m, h, k

template <typename T, int PackSize>
struct alignas(sizeof(T) * PackSize) Packed {
  T elem[PackSize];
};

// The type the angle (and theta) is held in: T upstream, float in the opt-in fp32-angle variant.
template <typename T, bool Fp32Angle>
struct AngleType {
  using type = T;
};
template <typename T>
struct AngleType<T, true> {
  using type = float;
};

}  // namespace oneflow_port

#define ONEFLOW_ROTARY_PARAMS                                                                    \
  const T *x, const T *cos, const T *sin, const PositionType *position_ids, T *out,              \
      float theta_f32, float inv_actual_rotary_size, IndexType actual_rotary_size,               \
      IndexType rotary_size, IndexType rotate_stride, IndexType k0, IndexType k1,                \
      IndexType num_elements, IndexType table_stride, IndexType x_offset, IndexType ref_stride0, \
      IndexType ref_stride1, IndexType ref_stride2, IndexType x_stride0, IndexType x_stride1,    \
      IndexType x_stride2, IndexType out_stride0, IndexType out_stride1, IndexType out_stride2,  \
      IndexType position_b_stride, IndexType position_rotate_stride, IndexType sinuous_m_stride

// IntervalKernel: interleaved pairs (2i, 2i+1) inside each rotary section, PackSize elements per
// thread. Packs never straddle rotary_size or k0 (the host's pack-size checks guarantee it).
template <typename T, typename PositionType, typename IndexType, int PackSize, int RotaryEmbDim,
          bool Fp32Angle>
__global__ void oneflow_interval(ONEFLOW_ROTARY_PARAMS) {
  using namespace oneflow_port;
  using AngleT = typename AngleType<T, Fp32Angle>::type;
  const AngleT theta = static_cast<AngleT>(theta_f32);
  const IndexType ref_stride[kNumDims] = {ref_stride0, ref_stride1, ref_stride2, 1};
  const IndexType x_stride[kNumDims] = {x_stride0, x_stride1, x_stride2, 1};
  const IndexType out_stride[kNumDims] = {out_stride0, out_stride1, out_stride2, 1};
  for (IndexType packed_offset = threadIdx.x + blockIdx.x * blockDim.x;
       packed_offset < num_elements; packed_offset += blockDim.x * gridDim.x) {
    using LoadPack = Packed<T, PackSize>;
    IndexType offset = packed_offset * PackSize;
    IndexType index[kNumDims];  // b, m, h, k
    IndexType temp_offset = offset;
    for (int i = 0; i < kNumDims - 1; i++) {
      IndexType stride = ref_stride[i];
      IndexType idx = temp_offset / stride;
      index[i] = idx;
      temp_offset = temp_offset - idx * stride;
    }
    index[kNumDims - 1] = temp_offset;

    IndexType x_off = x_offset;
    IndexType out_off = 0;
#pragma unroll
    for (int i = 0; i < kNumDims; i++) {
      x_off = x_off + x_stride[i] * index[i];
      out_off = out_off + out_stride[i] * index[i];
    }
    const LoadPack x_vec = *reinterpret_cast<const LoadPack*>(x + x_off);

    const IndexType k_index = index[kNumDims - 1];
    if (k_index < rotary_size) {
      const IndexType position_rotate_index = (k_index >= k0) ? 1 : 0;
      const IndexType b_index = index[0], m_index = index[1];
      const IndexType position_id_offset = b_index * position_b_stride
                                           + position_rotate_index * position_rotate_stride
                                           + m_index;
      const PositionType position = position_ids ? position_ids[position_id_offset] : m_index;
      const IndexType actual_k_index = k_index % actual_rotary_size;
      const IndexType sinuous_offset = position * sinuous_m_stride + actual_k_index;

      LoadPack cos_vec, sin_vec, out_vec;
      if (cos && sin) {
        cos_vec = *reinterpret_cast<const LoadPack*>(cos + sinuous_offset);
        sin_vec = *reinterpret_cast<const LoadPack*>(sin + sinuous_offset);
      } else {
#pragma unroll
        for (int i = 0; i < PackSize / 2; i++) {
          const AngleT val = static_cast<AngleT>(
              position * expf(2.0f * static_cast<float>(((actual_k_index >> 1) + i))
                              * inv_actual_rotary_size * logf(static_cast<float>(theta))));
          const T cos_val = static_cast<T>(cosf(static_cast<float>(val)));
          const T sin_val = static_cast<T>(sinf(static_cast<float>(val)));
          cos_vec.elem[i * 2] = cos_val;
          cos_vec.elem[i * 2 + 1] = cos_val;
          sin_vec.elem[i * 2] = sin_val;
          sin_vec.elem[i * 2 + 1] = sin_val;
        }
      }

#pragma unroll
      for (int i = 0; i < PackSize / 2; i++) {
        out_vec.elem[i * 2] =
            x_vec.elem[i * 2] * cos_vec.elem[i * 2] - x_vec.elem[i * 2 + 1] * sin_vec.elem[i * 2];
        out_vec.elem[i * 2 + 1] = x_vec.elem[i * 2 + 1] * cos_vec.elem[i * 2 + 1]
                                  + x_vec.elem[i * 2] * sin_vec.elem[i * 2 + 1];
      }
      *reinterpret_cast<LoadPack*>(out + out_off) = out_vec;
    } else {
      *reinterpret_cast<LoadPack*>(out + out_off) = x_vec;
    }
  }
}

// PlaneKernel: rotate-half inside each rotary section [0, k0) and [k0, k1), one element per
// thread; the partner sits rotate_stride = rotary_size / (2 * RotaryEmbDim) away.
template <typename T, typename PositionType, typename IndexType, int RotaryEmbDim, bool Fp32Angle>
__global__ void oneflow_plane(ONEFLOW_ROTARY_PARAMS) {
  using namespace oneflow_port;
  using AngleT = typename AngleType<T, Fp32Angle>::type;
  const AngleT theta = static_cast<AngleT>(theta_f32);
  const IndexType ref_stride[kNumDims] = {ref_stride0, ref_stride1, ref_stride2, 1};
  const IndexType x_stride[kNumDims] = {x_stride0, x_stride1, x_stride2, 1};
  const IndexType out_stride[kNumDims] = {out_stride0, out_stride1, out_stride2, 1};
  for (IndexType offset = threadIdx.x + blockIdx.x * blockDim.x; offset < num_elements;
       offset += blockDim.x * gridDim.x) {
    using LoadPack = Packed<T, 2>;
    IndexType temp_offset = offset;
    IndexType index[kNumDims];
#pragma unroll
    for (int i = 0; i < kNumDims - 1; i++) {
      IndexType stride = ref_stride[i];
      IndexType idx = temp_offset / stride;
      index[i] = idx;
      temp_offset = temp_offset - idx * stride;
    }
    index[kNumDims - 1] = temp_offset;

    const IndexType b_index = index[0], m_index = index[1], k_index = index[kNumDims - 1];
    const bool rotated = k_index < k1;  // port: pass-through elements read no ids or tables
    const IndexType position_rotate_index = (k_index >= k0) ? 1 : 0;
    const IndexType position_id_offset = b_index * position_b_stride
                                         + position_rotate_index * position_rotate_stride
                                         + m_index;
    const PositionType position =
        (position_ids && rotated) ? position_ids[position_id_offset] : m_index;
    const IndexType actual_k_index = k_index % actual_rotary_size;
    const IndexType sinuous_offset = position * table_stride + actual_k_index;

    T cos_val, sin_val, out_val;
    if (cos && sin) {
      if (rotated) {
        cos_val = *(cos + sinuous_offset);
        sin_val = *(sin + sinuous_offset);
      }
    } else {
      const AngleT val = static_cast<AngleT>(
          position * expf(2.0f * static_cast<float>(k_index % (actual_rotary_size >> 1))
                          * inv_actual_rotary_size * logf(static_cast<float>(theta))));
      cos_val = static_cast<T>(cosf(static_cast<float>(val)));
      sin_val = static_cast<T>(sinf(static_cast<float>(val)));
    }

    LoadPack x_vec;
    IndexType x_off = x_offset;
    IndexType out_off = 0;
#pragma unroll
    for (int i = 0; i < kNumDims; i++) {
      x_off = x_off + x_stride[i] * index[i];
      out_off = out_off + out_stride[i] * index[i];
    }

    if (k_index < k0) {
      x_vec.elem[0] = *(x + x_off);
      x_vec.elem[1] = (k0 - k_index > rotate_stride) ? static_cast<T>(-*(x + x_off + rotate_stride))
                                                     : *(x + x_off - rotate_stride);
      out_val = cos_val * x_vec.elem[0] + sin_val * x_vec.elem[1];
    } else if (k_index < k1) {
      x_vec.elem[0] = *(x + x_off);
      x_vec.elem[1] = (k1 - k_index > rotate_stride) ? static_cast<T>(-*(x + x_off + rotate_stride))
                                                     : *(x + x_off - rotate_stride);
      out_val = cos_val * x_vec.elem[0] + sin_val * x_vec.elem[1];
    } else {
      out_val = *(x + x_off);
    }
    *(out + out_off) = out_val;
  }
}
