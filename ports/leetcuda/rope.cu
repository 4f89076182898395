// Port of xlite-dev/LeetCUDA@cb6a0497:kernels/rope/rope.cu (file last changed at 04e331fa, with the
// frequency fix of e799541b). Built with --use_fast_math, as upstream's rope.py builds it.
//
// x and out are float32 [seq_len, 2N] (N pairs per row; x4: [seq_len, 4N]), one sequence of one
// head, interleaved pairs (2i, 2i+1) rotated by pos * theta^(-2i / hidden), theta = 10000.
// Departures from upstream (see ports/leetcuda/__init__.py): a bounds check in the two 1-D
// kernels, and const on x. The math and its order are upstream's.

#define LEETCUDA_THETA 10000.0f

// One thread per pair; pos = idx / N, pair = idx % N. Grid ceil(seq_len * N / 256), block 256.
extern "C" __global__ void rope_f32_kernel(const float *x, float *out, int seq_len, int N) {
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= seq_len * N) return;  // added: upstream has no bounds check
  float x1 = x[idx * 2];
  float x2 = x[idx * 2 + 1];
  int token_pos = idx / N;
  int token_idx = idx % N;
  float exp_v = 1.0f / powf(LEETCUDA_THETA, 2 * token_idx / (N * 2.0f));
  float sin_v = sinf(token_pos * exp_v);
  float cos_v = cosf(token_pos * exp_v);
  float out1 = x1 * cos_v - x2 * sin_v;
  float out2 = x1 * sin_v + x2 * cos_v;
  out[idx * 2] = out1;
  out[idx * 2 + 1] = out2;
}

// One block per token (grid seq_len), one thread per pair (block N <= 1024): no division.
extern "C" __global__ void rope_f32_v2_kernel(const float *x, float *out, int seq_len, int N) {
  int token_pos = blockIdx.x;
  int tid = threadIdx.x;
  float x1 = x[token_pos * N * 2 + tid * 2];
  float x2 = x[token_pos * N * 2 + tid * 2 + 1];
  float exp_v = 1.0f / powf(LEETCUDA_THETA, 2 * tid / (N * 2.0f));
  float sin_v = sinf(token_pos * exp_v);
  float cos_v = cosf(token_pos * exp_v);
  float out1 = x1 * cos_v - x2 * sin_v;
  float out2 = x1 * sin_v + x2 * cos_v;
  out[token_pos * N * 2 + tid * 2] = out1;
  out[token_pos * N * 2 + tid * 2 + 1] = out2;
}

// One thread per float4 (two pairs), 16-byte loads and stores; N = hidden / 4.
// Grid ceil(seq_len * N / 256), block 256.
extern "C" __global__ void rope_f32x4_pack_kernel(const float *x, float *out, int seq_len, int N) {
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= seq_len * N) return;  // added: upstream has no bounds check
  float4 x_v = reinterpret_cast<const float4 *>(x)[idx];
  int token_pos = idx / N;
  int token_idx = idx % N;
  float exp_f_v = 1.0f / powf(LEETCUDA_THETA, 2 * token_idx * 2 / (N * 4.0f));
  float exp_s_v = 1.0f / powf(LEETCUDA_THETA, 2 * (token_idx * 2 + 1) / (N * 4.0f));
  float sin_f_v = sinf(token_pos * exp_f_v);
  float cos_f_v = cosf(token_pos * exp_f_v);
  float sin_s_v = sinf(token_pos * exp_s_v);
  float cos_s_v = cosf(token_pos * exp_s_v);
  float4 out_v;
  out_v.x = x_v.x * cos_f_v - x_v.y * sin_f_v;
  out_v.y = x_v.x * sin_f_v + x_v.y * cos_f_v;
  out_v.z = x_v.z * cos_s_v - x_v.w * sin_s_v;
  out_v.w = x_v.z * sin_s_v + x_v.w * cos_s_v;
  reinterpret_cast<float4 *>(out)[idx] = out_v;
}
