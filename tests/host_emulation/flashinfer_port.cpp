// Host emulation of ports/flashinfer_port/pos_enc.cu for tests/test_flashinfer_port.py: the
// kernels' source compiled by g++ with CUDA's thread indices as globals, every (block, thread)
// run in turn. It checks the kernels' index math (vector layout, partners, cache columns, head
// and token strides, segments) against a float64 RoPE on the CPU; sinf/powf stand in for the
// __sincosf/__powf intrinsics, so the fast-math error is not what is tested here. Out of place
// only: in place, a thread's loads must precede its warp's stores, which a sequential walk
// does not give.
// Output: one line per (kernel, convention): "<name> <interleave> <max abs error> <NaN count>".
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockIdx, blockDim;
#define __global__
#define __forceinline__ inline
#define __restrict__
static inline void emu_sincosf(float x, float *s, float *c) { *s = sinf(x); *c = cosf(x); }
static inline float emu_powf(float a, float b) { return powf(a, b); }
static inline float emu_int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
#include KERNEL_SOURCE  // pos_enc.cu with the intrinsics renamed (the test writes it)

template <typename F>
static void run(F kernel, unsigned gx, unsigned gy, unsigned bx, unsigned by) {
  blockDim = {bx, by, 1};
  for (unsigned b1 = 0; b1 < gy; ++b1)
    for (unsigned b0 = 0; b0 < gx; ++b0) {
      blockIdx = {b0, b1, 0};
      for (unsigned t1 = 0; t1 < by; ++t1)
        for (unsigned t0 = 0; t0 < bx; ++t0) {
          threadIdx = {t0, t1, 0};
          kernel();
        }
    }
}

template <unsigned D, unsigned VS, unsigned BDX>
static void check_all(unsigned R) {
  const unsigned nnz = 11, hq = 3, hk = 2, bdy = 128 / BDX, rows = 40;
  // token stride wider than the heads (q cut from a packed tensor): hq * D + D
  const size_t qs = (hq + 1) * D, ks = (hk + 1) * D;
  std::vector<__half> q(nnz * qs), k(nnz * ks), qo(nnz * hq * D), ko(nnz * hk * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = __float2half(sinf(i * 0.37f) * 2);
  for (size_t i = 0; i < k.size(); ++i) k[i] = __float2half(cosf(i * 0.11f) * 2);
  std::vector<float> cache(rows * R);
  for (unsigned p = 0; p < rows; ++p)
    for (unsigned j = 0; j < R / 2; ++j) {
      double a = p * pow(10000.0, -2.0 * j / R);
      cache[p * R + j] = cos(a);
      cache[p * R + R / 2 + j] = sin(a);
    }
  long long ids[nnz] = {3, 0, 17, 9, 39, 5, 5, 1, 22, 38, 2};
  long long indptr[4] = {0, 4, 5, 11}, offsets[3] = {7, 0, 30};
  long long seg_pos[nnz];
  for (unsigned s = 0; s < 3; ++s)
    for (long long t = indptr[s]; t < indptr[s + 1]; ++t) seg_pos[t] = offsets[s] + t - indptr[s];
  const unsigned gx = (nnz + bdy - 1) / bdy;
  for (int kind = 0; kind < 5; ++kind)
    for (int il = 0; il < 2; ++il) {
      std::fill(qo.begin(), qo.end(), __float2half(NAN));
      std::fill(ko.begin(), ko.end(), __float2half(NAN));
      const char *name = "";
      const long long *pos = ids;
#define ARGS q.data(), k.data(), qo.data(), ko.data()
#define STRIDES qs, D, ks, D, hq * D, D, hk * D, D
#define PARAMS 0.f, 0.f, 1.f, 1e-4f
      if (kind == 0) {
        name = "fi_pos_ids";
        run([&] { il ? fi_pos_ids<true, D, VS, BDX, __half, long long>(ARGS, ids, nnz, hq, hk, R, STRIDES, PARAMS)
                     : fi_pos_ids<false, D, VS, BDX, __half, long long>(ARGS, ids, nnz, hq, hk, R, STRIDES, PARAMS); },
            gx, 1, BDX, bdy);
      } else if (kind == 1) {
        name = "fi_pos_ids_head_parallel";
        run([&] { il ? fi_pos_ids_head_parallel<true, D, VS, BDX, __half, long long>(ARGS, ids, nnz, hq, hk, R, STRIDES, PARAMS)
                     : fi_pos_ids_head_parallel<false, D, VS, BDX, __half, long long>(ARGS, ids, nnz, hq, hk, R, STRIDES, PARAMS); },
            gx, hq + hk, BDX, bdy);
      } else if (kind == 2) {
        name = "fi_cos_sin_cache";
        run([&] { il ? fi_cos_sin_cache<true, D, VS, BDX, __half, long long>(ARGS, cache.data(), ids, rows, nnz, hq, hk, R, STRIDES)
                     : fi_cos_sin_cache<false, D, VS, BDX, __half, long long>(ARGS, cache.data(), ids, rows, nnz, hq, hk, R, STRIDES); },
            gx, 1, BDX, bdy);
      } else if (kind == 3) {
        name = "fi_cos_sin_cache_head_parallel";
        run([&] { il ? fi_cos_sin_cache_head_parallel<true, D, VS, BDX, __half, long long>(ARGS, cache.data(), ids, rows, nnz, hq, hk, R, STRIDES)
                     : fi_cos_sin_cache_head_parallel<false, D, VS, BDX, __half, long long>(ARGS, cache.data(), ids, rows, nnz, hq, hk, R, STRIDES); },
            gx, hq + hk, BDX, bdy);
      } else {
        name = "fi_indptr";
        pos = seg_pos;
        run([&] { il ? fi_indptr<true, D, VS, BDX, __half, long long>(ARGS, indptr, offsets, nnz, 3, hq, hk, R, STRIDES, PARAMS)
                     : fi_indptr<false, D, VS, BDX, __half, long long>(ARGS, indptr, offsets, nnz, 3, hq, hk, R, STRIDES, PARAMS); },
            3 * (hq + hk), 1, BDX, bdy);
      }
      double max_err = 0;
      long nans = 0;
      for (int t = 0; t < 2; ++t) {
        const std::vector<__half> &x = t ? k : q, &o = t ? ko : qo;
        const unsigned heads = t ? hk : hq;
        const size_t stride = t ? ks : qs;
        for (unsigned n = 0; n < nnz; ++n)
          for (unsigned h = 0; h < heads; ++h)
            for (unsigned d = 0; d < D; ++d) {
              const __half *row = &x[n * stride + h * D];
              double want = __half2float(row[d]);
              if (d < R) {
                unsigned j, partner;
                double sign;
                if (il) { j = d / 2; partner = d ^ 1; sign = d % 2 ? 1 : -1; }
                else { j = d % (R / 2); partner = d < R / 2 ? d + R / 2 : d - R / 2; sign = d < R / 2 ? -1 : 1; }
                double a = pos[n] * pow(10000.0, -2.0 * j / R);
                want = want * cos(a) + sign * __half2float(row[partner]) * sin(a);
              }
              float got = __half2float(o[(n * heads + h) * D + d]);
              if (std::isnan(got)) ++nans;
              else max_err = fmax(max_err, fabs(got - want));
            }
      }
      printf("%s %d %.6g %ld\n", name, il, max_err, nans);
    }
}

int main() {
  check_all<64, 8, 8>(32);     // partial: 32 of 64
  check_all<128, 8, 16>(128);
  check_all<256, 8, 32>(128);  // partial: 128 of 256
  check_all<512, 16, 32>(512);
  return 0;
}
