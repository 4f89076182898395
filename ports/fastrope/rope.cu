// fastrope, the package's own RoPE kernel: one launch rotates q and k (any head counts) in any of
// the sbhd / bshd / bhsd / thd layouts, with any strides whose last dimension is contiguous,
// rotate-half or interleaved, from given cos/sin tables [L, R] or [L, R/2] or from angles
// computed in fp64; the backward is the same kernel rotating by -theta.
//
// Thread map (no integer division on the hot path):
//   grid  (ceil(S / blockDim.z), B, head_splits)   token-in-sequence blocks x sequences x head ranges
//   block (chunks, head_lanes, tokens)              chunk threads x head lanes x tokens
// sbhd walks the (s, b) tokens in memory order instead (Params.fold).
// A chunk thread owns V elements (16 bytes when sizes and strides allow) of one half, loading
// their partners (rotate-half), or of each half (PAIR_PER_THREAD), or V/2 pairs (interleaved), and
// walks the heads of its token UNROLL heads per step, reusing its cos/sin for every head of q
// and k. Math is fp32 with one rounding at the store. The host (plan.py) picks V, UNROLL and the
// shape; ports/fastrope/DESIGN.md gives the design, where each idea came from and what it is worth.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Resident blocks of 256 threads per SM the register budget of rope_rows must allow: one head per
// step from given tables with a thread per chunk of one half (the one_half_per_thread ablation)
// fits 6 blocks (<= 40 registers, no spills); computed angles out of place with 4 heads per step
// (a thread per half) fit 3 (<= 80 registers, no spills), so that more warps hide the per-token
// fp64 sincos. The other kernels keep their registers: with tables (a pair per thread) a cap
// spills the 16-bit ones and gains nothing for fp32; computed angles in place were not measured
// with one. DESIGN.md ("Registers") has the measurements.
#define ROWS_MIN_BLOCKS(unroll, computed, flags)                          \
  (((flags) & PAIR_PER_THREAD) ? 1                                        \
   : (unroll) == 1 && !(computed) ? 6 : (unroll) == 4 && (computed) ? 3 : 1)

// Build options for experiments (ports/fastrope/experiment.py); the design is built with none:
//   ROPE_PLAIN_LOADS, ROPE_PLAIN_STORES  plain data loads / stores where the plan streams them
//   ROPE_TRAFFIC_ONLY    no rotation: each chunk stored as loaded, every table load kept live
//                        (the memory traffic alone)
//   ROPE_MIN_BLOCKS=N    rope_rows' __launch_bounds__ minimum blocks (else ROWS_MIN_BLOCKS)
#ifdef ROPE_MIN_BLOCKS
#define ROWS_LAUNCH_MIN_BLOCKS(unroll, computed, flags) ROPE_MIN_BLOCKS
#else
#define ROWS_LAUNCH_MIN_BLOCKS(unroll, computed, flags) ROWS_MIN_BLOCKS(unroll, computed, flags)
#endif
#ifdef ROPE_PLAIN_LOADS
constexpr bool kStreamingLoads = false;
#else
constexpr bool kStreamingLoads = true;
#endif
#ifdef ROPE_PLAIN_STORES
constexpr bool kStreamingStores = false;
#else
constexpr bool kStreamingStores = true;
#endif

// The FLAGS template argument: each bit chooses between two ways of doing one thing (kernel.py
// names the same bits; plan.py's rules set them per problem).
#define TABLE_PER_HEAD 1   // on: cos/sin loaded again for every head; off: once per token
#define PLAIN_ACCESSES 2   // on: plain loads/stores; off: streaming (evict-first) ones
#define FP32_ANGLES 4      // computed angles: on: fp32 pos * inv_freq and sincosf; off: fp64
#define FLAT_INDEX 8       // on: (b, s, h, chunk) from a flat index by div/mod per head
#define PAIR_PER_THREAD 16 // rotate-half: on: a thread owns a chunk of each half; off: one half,
                           // loading its partners
#define TOKEN_TILES 32     // step kernel: on: grid (head blocks, S / tokens, B), a block takes
                           // blockDim.z tokens of one head block; off: grid (S, B, head blocks)
#define BATCH_TILES 64     // with TOKEN_TILES: the tiles run across the batch, grid (head blocks,
                           // B / tokens, S): a block takes one position of blockDim.z sequences

// How each token's position is found (Params.positions; problem.Positions spells the same).
enum Positions { POSITIONS_ARANGE = 0, POSITIONS_OFFSETS = 1, POSITIONS_IDS = 2 };

struct Params {
  // Per call (packed on every launch): pointers and the scalar position offset.
  unsigned long long in[2], out[2];             // q, k (k: 0 when absent); out == in in place
  unsigned long long cos, sin, inv_freq, position_tensor, cu_seqlens;
  long long offset;                             // the int offset added to every position
  // Per problem (packed once per shape, cached on the host).
  long long in_sb[2], in_ss[2], in_sh[2];       // element strides of batch, sequence, head
  long long out_sb[2], out_ss[2], out_sh[2];
  long long position_sb, position_ss;           // ids strides (offsets: position_sb only)
  long long table_rows, table_stride;           // rows L and row stride of cos/sin
  int heads[2];                                 // q heads, k heads (0 without k)
  int seqlen;                                   // S (thd: total tokens T)
  int nseq;                                     // thd: sequences in cu_seqlens; else 0
  int rot_chunks, tail_chunks;                  // chunk threads per row: rotary, pass-through
  int heads_per_split;                          // heads one block covers (grid.z splits)
  int positions;                                // enum Positions
  int position_int32;                           // the ids or offsets tensor is int32 (else int64)
  int half_table;                               // tables are [L, R/2] (one angle per pair)
  int half;                                     // R / 2
  int backward;                                 // rotate by -theta (the transpose)
  int fold;                                     // B when the grid walks (s, b) b-fastest, else 0
  int pad;                                      // keeps the struct a multiple of 8 bytes
};

// The step kernel's Params (rope_step, below): the same per-call part, then the per-problem
// part in 32-bit fields (the host takes this kernel only when every offset fits), 176 bytes
// against Params' 264: fewer argument lines for every block to read.
struct StepParams {
  unsigned long long in[2], out[2];
  unsigned long long cos, sin, inv_freq, position_tensor, cu_seqlens;  // inv_freq, cu_seqlens: unused
  long long offset;
  int in_sb[2], in_ss[2], in_sh[2];
  int out_sb[2], out_ss[2], out_sh[2];
  int position_sb, position_ss;
  int table_rows, table_stride;
  int heads[2];
  int rot_chunks, half;
  int positions, position_int32, half_table, backward;
  static constexpr int nseq = 0;  // no thd: token_position's search is compiled out
};
// The step kernel's argument: StepParams whose four problem switches are template constants
// (SWITCHES = positions | position_int32 << 2 | half_table << 3 | backward << 4; the host's
// kernel.step_switches), so the position form, id width, table width and direction compile to
// straight-line code; SWITCHES = -1 reads them at run time (the runtime_switches ablation). The
// constants hide StepParams' fields of the same names; the bytes are StepParams'.
template <int SWITCHES> struct StepArgs : StepParams {
  static constexpr int positions = SWITCHES & 3;
  static constexpr int position_int32 = (SWITCHES >> 2) & 1;
  static constexpr int half_table = (SWITCHES >> 3) & 1;
  static constexpr int backward = (SWITCHES >> 4) & 1;
};
template <> struct StepArgs<-1> : StepParams {};
// launcher.py packs both with struct: these sizes are its layouts' (a test compares them).
static_assert(sizeof(Params) == 264, "Params layout changed: update launcher.py");
static_assert(sizeof(StepParams) == 176, "StepParams layout changed: update launcher.py");
static_assert(sizeof(StepArgs<0>) == sizeof(StepParams) && sizeof(StepArgs<-1>) == sizeof(StepParams),
              "StepArgs must keep StepParams' bytes");

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
// Element i of a chunk's 32-bit words, as a float. A bf16 is the high half of its fp32: one shift
// (even elements) or mask (odd elements) of the word that holds it, where the conversion of a
// word's high element compiles to two instructions (sm_90, CUDA 13.0).
template <typename T> __device__ __forceinline__ float word_element(const unsigned int* w, int i) {
  return to_float(reinterpret_cast<const T*>(w)[i]);
}
template <>
__device__ __forceinline__ float word_element<__nv_bfloat16>(const unsigned int* w, int i) {
  return __uint_as_float(i % 2 ? w[i / 2] & 0xffff0000u : w[i / 2] << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Two floats rounded to a 16-bit type's pair (the first in the low half), as one word.
template <typename T> __device__ __forceinline__ unsigned int pack2(float a, float b);
template <> __device__ __forceinline__ unsigned int pack2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&v);
}
template <> __device__ __forceinline__ unsigned int pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&v);
}

template <int BYTES> struct Word;
template <> struct Word<16> { using type = uint4; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<2> { using type = unsigned short; };

template <typename W, bool STREAM> __device__ __forceinline__ W load_word(const W* p) {
  if constexpr (STREAM && kStreamingLoads) return __ldcs(p); else return *p;
}
template <typename W, bool STREAM> __device__ __forceinline__ void store_word(W* p, W v) {
  if constexpr (STREAM && kStreamingStores) __stcs(p, v); else *p = v;
}

// N elements of T at p (aligned to min(16, N * sizeof(T)) bytes), as floats.
template <typename T, int N, bool STREAM>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int BYTES = N * (int)sizeof(T) < 16 ? N * (int)sizeof(T) : 16;
  constexpr int PER = BYTES / (int)sizeof(T);
  using W = typename Word<BYTES>::type;
#pragma unroll
  for (int i = 0; i < N / PER; ++i) {
    W w = load_word<W, STREAM>(reinterpret_cast<const W*>(p) + i);
    const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int j = 0; j < PER; ++j) out[i * PER + j] = to_float(e[j]);
  }
}

// V elements of T kept as the raw words they travel in (half the registers of floats for
// 16-bit types); converted to fp32 only inside the rotation.
template <typename T, int V> struct Chunk {
  static constexpr int BYTES = V * (int)sizeof(T) < 16 ? V * (int)sizeof(T) : 16;
  using W = typename Word<BYTES>::type;
  static constexpr int WORDS = V * (int)sizeof(T) / BYTES;
  W w[WORDS];
  __device__ __forceinline__ float get(int i) const {
    if constexpr (BYTES >= 4) return word_element<T>(reinterpret_cast<const unsigned int*>(w), i);
    else return to_float(reinterpret_cast<const T*>(w)[i]);
  }
  __device__ __forceinline__ void set(int i, float v) { reinterpret_cast<T*>(w)[i] = from_float<T>(v); }
  // Elements i..i+P-1 (P = PACK, i a multiple of it), each rounded once: 16-bit types convert
  // a pair in one instruction (the same bits as two conversions).
  static constexpr int PACK = sizeof(T) == 2 && V >= 2 ? 2 : 1;
  __device__ __forceinline__ void set_packed(int i, const float (&v)[PACK]) {
    if constexpr (PACK == 2) reinterpret_cast<unsigned int*>(w)[i / 2] = pack2<T>(v[0], v[1]);
    else set(i, v[0]);
  }
};

template <typename T, int V, bool STREAM>
__device__ __forceinline__ void load_chunk(const T* p, Chunk<T, V>& c) {
  using W = typename Chunk<T, V>::W;
#pragma unroll
  for (int i = 0; i < Chunk<T, V>::WORDS; ++i) c.w[i] = load_word<W, STREAM>(reinterpret_cast<const W*>(p) + i);
}

template <typename T, int V, bool STREAM>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, V>& c) {
  using W = typename Chunk<T, V>::W;
#pragma unroll
  for (int i = 0; i < Chunk<T, V>::WORDS; ++i) store_word<W, STREAM>(reinterpret_cast<W*>(p) + i, c.w[i]);
}

template <typename P>
__device__ __forceinline__ long long read_position(const P& p, long long i) {
  return p.position_int32 ? (long long)reinterpret_cast<const int*>(p.position_tensor)[i]
                          : reinterpret_cast<const long long*>(p.position_tensor)[i];
}

// The token's rotary position; for thd also its sequence.
template <typename P>
__device__ __forceinline__ long long token_position(const P& p, int b, int s) {
  long long local = s;
  int seq = b;
  if (p.nseq > 0) {  // thd: the sequence holding token s, by binary search over cu_seqlens
    const int* cu = reinterpret_cast<const int*>(p.cu_seqlens);
    int lo = 0, hi = p.nseq;
    while (hi - lo > 1) {
      int mid = (lo + hi) >> 1;
      if (cu[mid] <= s) lo = mid; else hi = mid;
    }
    seq = lo;
    local = s - cu[lo];
  }
  long long pos = local;
  if (p.positions == POSITIONS_OFFSETS) pos += read_position(p, seq * p.position_sb);
  else if (p.positions == POSITIONS_IDS) pos = read_position(p, b * p.position_sb + (long long)s * p.position_ss);
  return pos + p.offset;
}

// Elements one chunk thread rotates per head: rotate-half pairs (a[i], b[i]) = (x[j], x[j + R/2]);
// interleaved pairs (v[2i], v[2i+1]). cA/sA rotate the first member, cB/sB the second:
//   first' = first * cA - second * sA;   second' = second * cB + first * sB.
template <int V, bool INTERLEAVED> struct Angles {
  static constexpr int N = INTERLEAVED ? V / 2 : V;
  float cA[N], sA[N], cB[N], sB[N];
  // Computed angles for fp32 outputs: the low parts of cA, sA (cos = cA + cAl exactly to ~2^-48;
  // computed tables are symmetric, so they serve B too). Unused (and removed) otherwise.
  float cAl[N], sAl[N];
};

// A table row, clamped to [0, L): the host checks positions; the clamp keeps a skipped check
// (check_positions=False) in bounds.
template <typename P>
__device__ __forceinline__ long long table_row(const P& p, long long pos) {
  return min(max(pos, 0LL), (long long)p.table_rows - 1);  // selects, no branch
}

template <typename TT, int V, bool INTERLEAVED, typename P>
__device__ __forceinline__ void load_table(const P& p, long long pos, int chunk,
                                           Angles<V, INTERLEAVED>& a) {
  const long long row = table_row(p, pos);
  const TT* cos = reinterpret_cast<const TT*>(p.cos) + row * p.table_stride;
  const TT* sin = reinterpret_cast<const TT*>(p.sin) + row * p.table_stride;
  constexpr int N = Angles<V, INTERLEAVED>::N;
  if constexpr (INTERLEAVED) {
    if (p.half_table) {
      load_floats<TT, N, false>(cos + chunk * N, a.cA);
      load_floats<TT, N, false>(sin + chunk * N, a.sA);
#pragma unroll
      for (int i = 0; i < N; ++i) { a.cB[i] = a.cA[i]; a.sB[i] = a.sA[i]; }
    } else {
      float c[V], s[V];
      load_floats<TT, V, false>(cos + chunk * V, c);
      load_floats<TT, V, false>(sin + chunk * V, s);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        a.cA[i] = c[2 * i]; a.cB[i] = c[2 * i + 1]; a.sA[i] = s[2 * i]; a.sB[i] = s[2 * i + 1];
      }
    }
  } else {
    // All four loads issue before any conversion waits on one (a conversion or branch between
    // them would hold the second pair a round trip behind the first); half tables read their
    // one half twice (an L1 hit) rather than branch.
    const int second = p.half_table ? 0 : p.half;
    Chunk<TT, N> c0, s0, c1, s1;
    load_chunk<TT, N, false>(cos + chunk * N, c0);
    load_chunk<TT, N, false>(sin + chunk * N, s0);
    load_chunk<TT, N, false>(cos + second + chunk * N, c1);
    load_chunk<TT, N, false>(sin + second + chunk * N, s1);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      a.cA[i] = c0.get(i); a.sA[i] = s0.get(i); a.cB[i] = c1.get(i); a.sB[i] = s1.get(i);
    }
  }
}

// Backward rotates by the transpose: first' = first*cA + second*sB; second' = second*cB - first*sA.
template <int V, bool INTERLEAVED>
__device__ __forceinline__ void transpose_angles(Angles<V, INTERLEAVED>& a) {
#pragma unroll
  for (int i = 0; i < Angles<V, INTERLEAVED>::N; ++i) {
    float t = a.sA[i];
    a.sA[i] = -a.sB[i];
    a.sB[i] = -t;
    a.sAl[i] = -a.sAl[i];  // symmetric when used (computed angles)
  }
}

// Rotate-half (unless PAIR_PER_THREAD): a thread owns V elements of one half only. It rotates them with its own cosine
// and a signed sine: forward, own sine (first half: -s, second: +s); backward (the transpose),
// the partner's sine (first half: +s, second: -s). cA holds the cosines, sA the signed sines.
template <typename TT, int V, typename P>
__device__ __forceinline__ void load_table_split(const P& p, long long pos, int elem,
                                                 bool first, Angles<V, false>& a) {
  const long long row = table_row(p, pos);
  const TT* cos = reinterpret_cast<const TT*>(p.cos) + row * p.table_stride;
  const TT* sin = reinterpret_cast<const TT*>(p.sin) + row * p.table_stride;
  const int own = p.half_table && !first ? elem - p.half : elem;
  const int partner = p.half_table ? own : (first ? elem + p.half : elem - p.half);
  load_floats<TT, V, false>(cos + own, a.cA);
  load_floats<TT, V, false>(sin + (p.backward ? partner : own), a.sA);
  const float sign = (first != (bool)p.backward) ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < V; ++i) a.sA[i] *= sign;
}

// This thread's cos/sin chunk from given tables, for the rotation direction of the call.
template <typename TT, int V, bool INTERLEAVED, bool SPLIT, typename P>
__device__ __forceinline__ void table_angles(const P& p, long long pos, int chunk, int elem,
                                             bool first_half, Angles<V, INTERLEAVED>& a) {
  if constexpr (SPLIT) {
    load_table_split<TT, V>(p, pos, elem, first_half, a);
  } else {
    load_table<TT, V, INTERLEAVED>(p, pos, chunk, a);
    if (p.backward) transpose_angles(a);
  }
}

// a*b + c*d (+ a*bl + c*dl, the low parts of computed fp32 angles). fp16/bf16 outputs: fp32 FMA,
// far below their rounding step. fp32 outputs: Kahan's product sum (w = c*d exactly split into
// w + e by an FMA), within one rounding of the exact sum, so the store stays within one step.
template <typename T, bool LO>
__device__ __forceinline__ float mul_add2(float a, float b, float c, float d, float bl, float dl) {
  if constexpr (sizeof(T) == 4) {
    const float w = c * d;
    const float e = fmaf(c, d, -w);
    const float f = fmaf(a, b, w);
    float tail = e;
    if constexpr (LO) tail += fmaf(a, bl, c * dl);
    return f + tail;
  } else {
    return fmaf(a, b, c * d);
  }
}

template <typename T, int V, bool INTERLEAVED, bool LO>
__device__ __forceinline__ void rotate(const Angles<V, INTERLEAVED>& a, Chunk<T, V>& x,
                                       Chunk<T, V>& y) {
  // rotate-half: x holds the first members, y the second; interleaved: x holds both, y unused.
  if constexpr (INTERLEAVED) {
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      const float f = x.get(2 * i), g = x.get(2 * i + 1);
      const float r[2] = {mul_add2<T, LO>(f, a.cA[i], g, -a.sA[i], a.cAl[i], -a.sAl[i]),
                          mul_add2<T, LO>(g, a.cB[i], f, a.sB[i], a.cAl[i], a.sAl[i])};
      if constexpr (Chunk<T, V>::PACK == 2) {
        x.set_packed(2 * i, r);
      } else {
        x.set(2 * i, r[0]);
        x.set(2 * i + 1, r[1]);
      }
    }
  } else {
    constexpr int P = Chunk<T, V>::PACK;
#pragma unroll
    for (int i = 0; i < V; i += P) {
      float rx[P], ry[P];
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const float f = x.get(i + j), g = y.get(i + j);
        rx[j] = mul_add2<T, LO>(f, a.cA[i + j], g, -a.sA[i + j], a.cAl[i + j], -a.sAl[i + j]);
        ry[j] = mul_add2<T, LO>(g, a.cB[i + j], f, a.sB[i + j], a.cAl[i + j], a.sAl[i + j]);
      }
      x.set_packed(i, rx);
      y.set_packed(i, ry);
    }
  }
}

// Rotate-half, one half per thread: x holds the own elements, y their partners; x is rotated.
template <typename T, int V, bool LO>
__device__ __forceinline__ void rotate_split(const Angles<V, false>& a, Chunk<T, V>& x,
                                             const Chunk<T, V>& y) {
  constexpr int P = Chunk<T, V>::PACK;
#pragma unroll
  for (int i = 0; i < V; i += P) {
    float r[P];
#pragma unroll
    for (int j = 0; j < P; ++j)
      r[j] = mul_add2<T, LO>(x.get(i + j), a.cA[i + j], y.get(i + j), a.sA[i + j], a.cAl[i + j],
                             a.sAl[i + j]);
    x.set_packed(i, r);
  }
}

// One head's chunk: rotary threads rotate it (x, and for rotate-half with both halves y, whose
// store goes R/2 further); pass-through tail threads store their raw words unchanged (bit-exact).
template <typename T, int V, bool INTERLEAVED, bool SPLIT, bool LO, bool STREAM>
__device__ __forceinline__ void rotate_store(const Angles<V, INTERLEAVED>& ang, Chunk<T, V>& x,
                                             Chunk<T, V>& y, T* dst, int second, bool rotary) {
  if (rotary) {
    if constexpr (SPLIT) {
#ifdef ROPE_TRAFFIC_ONLY  // every table element still loaded: their sum never reaches -1e30
      { float t = 0.f; for (int i = 0; i < V; ++i) t += ang.cA[i] + ang.sA[i]; if (t == -1e30f) x = y; }
#else
      rotate_split<T, V, LO>(ang, x, y);
#endif
    } else {
#ifdef ROPE_TRAFFIC_ONLY
      { float t = 0.f; for (int i = 0; i < Angles<V, INTERLEAVED>::N; ++i) t += ang.cA[i] + ang.sA[i] + ang.cB[i] + ang.sB[i]; if (t == -1e30f) x = y; }
#else
      rotate<T, V, INTERLEAVED, LO>(ang, x, y);
#endif
      if constexpr (!INTERLEAVED) store_chunk<T, V, STREAM>(dst + second, y);
    }
  }
  store_chunk<T, V, STREAM>(dst, x);
}

template <typename T, typename TT, int V, bool INTERLEAVED, bool COMPUTED, typename IDX,
          int UNROLL, int FLAGS>
__global__ void __launch_bounds__(256, ROWS_LAUNCH_MIN_BLOCKS(UNROLL, COMPUTED, FLAGS)) rope_rows(const Params p) {
  constexpr bool STREAM = !(FLAGS & PLAIN_ACCESSES);
  constexpr bool SPLIT = !INTERLEAVED && !(FLAGS & PAIR_PER_THREAD);
  // fp32 outputs of computed angles carry each cos/sin as a float pair (hi + lo).
  constexpr bool LO = COMPUTED && sizeof(T) == 4 && !(FLAGS & FP32_ANGLES);
  constexpr int N = Angles<V, INTERLEAVED>::N;
  const int chunk = threadIdx.x;
  int s = blockIdx.x * blockDim.z + threadIdx.z;
  int b = blockIdx.y;
  if (p.fold) {  // s holds the token t = s * B + b
    b = s % p.fold;
    s = s / p.fold;
  }
  const bool live = s < p.seqlen;
  const bool rotary = chunk < p.rot_chunks;

  Angles<V, INTERLEAVED> ang;
  long long pos = (COMPUTED && live) ? token_position(p, b, s) : 0;
  const int elem = rotary ? chunk * V : 2 * p.half + (chunk - p.rot_chunks) * V;
  const bool first_half = elem < p.half;  // which half a rotate-half thread owns
  if constexpr (COMPUTED) {
    // Computed angles, once per token, before any data load: rows [R] of cos/sin (with LO, also
    // their low parts) in the style's natural layout in shared memory, each thread of the
    // token's slice computing some pairs; then this thread's angles from there.
    extern __shared__ float cs_smem[];
    const int R = 2 * p.half;
    float* c_row = cs_smem + threadIdx.z * (LO ? 4 : 2) * R;
    float* s_row = c_row + R;
    float* cl_row = s_row + R;
    float* sl_row = cl_row + R;
    if (live) {
      const double* inv_freq = reinterpret_cast<const double*>(p.inv_freq);
      for (int j = threadIdx.x + threadIdx.y * blockDim.x; j < p.half;
           j += blockDim.x * blockDim.y) {
        const int e0 = INTERLEAVED ? 2 * j : j, e1 = INTERLEAVED ? 2 * j + 1 : j + p.half;
        float c, sn, cl = 0.f, sl = 0.f;
        if constexpr (FLAGS & FP32_ANGLES) {
          sincosf((float)pos * (float)inv_freq[j], &sn, &c);
        } else {
          double cd, sd;
          sincos((double)pos * inv_freq[j], &sd, &cd);  // pos * inv_freq is exact in fp64
          c = (float)cd; sn = (float)sd;
          cl = (float)(cd - (double)c); sl = (float)(sd - (double)sn);
        }
        c_row[e0] = c_row[e1] = c;
        s_row[e0] = s_row[e1] = sn;
        if constexpr (LO) { cl_row[e0] = cl_row[e1] = cl; sl_row[e0] = sl_row[e1] = sl; }
      }
    }
    __syncthreads();
    if (live && rotary) {
      if constexpr (SPLIT) {
        // Own cosine; forward the own sine, backward the partner's (the transpose), signed.
        const int own = chunk * V, partner = first_half ? own + p.half : own - p.half;
        const int sine = p.backward ? partner : own;
        const float sign = (first_half != (bool)p.backward) ? -1.f : 1.f;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          ang.cA[i] = c_row[own + i];
          ang.sA[i] = sign * s_row[sine + i];
          if constexpr (LO) { ang.cAl[i] = cl_row[own + i]; ang.sAl[i] = sign * sl_row[sine + i]; }
        }
      } else {
        // Interleaved: members (2i, 2i+1) of the chunk; PAIR_PER_THREAD: (i, i + R/2).
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const int e0 = INTERLEAVED ? chunk * V + 2 * i : chunk * V + i;
          const int e1 = INTERLEAVED ? e0 + 1 : e0 + p.half;
          ang.cA[i] = c_row[e0]; ang.cB[i] = c_row[e1];
          ang.sA[i] = s_row[e0]; ang.sB[i] = s_row[e1];
          if constexpr (LO) { ang.cAl[i] = cl_row[e0]; ang.sAl[i] = sl_row[e0]; }
        }
        if (p.backward) transpose_angles(ang);
      }
    }
  }
  if (!live) return;
  // Given tables: each rotary thread loads its cos/sin chunk once and reuses it for every head,
  // after the first rows are in flight: its conversions wait for it, and in-order issue would
  // hold the rows behind them (or behind a position load). Unrolled steps issue an id or offset
  // load before the rows (a thd search stays after them).
  bool have_angles = COMPUTED;
  constexpr bool EARLY_POSITION = !COMPUTED && UNROLL > 1;
  if constexpr (EARLY_POSITION) {
    if (rotary && p.nseq == 0)
      pos = token_position(p, b, s);  // ids and offsets: one load, in flight before the rows
  }

  const int htot = p.heads[0] + p.heads[1];
  const int hbeg = blockIdx.z * p.heads_per_split;
  const int hend = min(hbeg + p.heads_per_split, htot);
  // This token's element offsets in q and k, in and out (tensor 1 is k; selects, not arrays
  // indexed at run time, keep everything in registers).
  const IDX q_in = (IDX)b * (IDX)p.in_sb[0] + (IDX)s * (IDX)p.in_ss[0] + (IDX)elem;
  const IDX k_in = (IDX)b * (IDX)p.in_sb[1] + (IDX)s * (IDX)p.in_ss[1] + (IDX)elem;
  const IDX q_out = (IDX)b * (IDX)p.out_sb[0] + (IDX)s * (IDX)p.out_ss[0] + (IDX)elem;
  const IDX k_out = (IDX)b * (IDX)p.out_sb[1] + (IDX)s * (IDX)p.out_ss[1] + (IDX)elem;
  const int hq = p.heads[0];
  // Offset of the rotate-half partners: the other half (PAIR_PER_THREAD: the second half).
  const int second = INTERLEAVED ? 0 : (SPLIT && !first_half) ? -p.half : p.half;
  const int lanes = blockDim.y;

  for (int h0 = hbeg + threadIdx.y; h0 < hend; h0 += UNROLL * lanes) {
    Chunk<T, V> x[UNROLL], y[UNROLL];
    const T* src[UNROLL];
    T* dst[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      // No branch between the step's loads (rope_step says why): heads past the split's last
      // load the last one again, and store nothing.
      const int h = min(h0 + u * lanes, hend - 1);
      const bool is_k = h >= hq;
      const int hh = is_k ? h - hq : h;
      IDX from, to;
      if constexpr (FLAGS & FLAT_INDEX) {
        // Ablation: the flat-index designs' div/mod, (b, s, h) recovered from one id per head.
        const IDX chunks = (IDX)(p.rot_chunks + p.tail_chunks);
        const IDX rows = (IDX)(is_k ? p.heads[1] : hq) * chunks;
        const IDX per_seq = (IDX)p.seqlen * rows;
        const IDX flat = ((IDX)b * (IDX)p.seqlen + (IDX)s) * rows + (IDX)hh * chunks + (IDX)chunk;
        const IDX fb = flat / per_seq, fs = (flat % per_seq) / rows, fh = (flat % rows) / chunks;
        from = fb * (IDX)(is_k ? p.in_sb[1] : p.in_sb[0]) + fs * (IDX)(is_k ? p.in_ss[1] : p.in_ss[0])
               + fh * (IDX)(is_k ? p.in_sh[1] : p.in_sh[0]) + (IDX)elem;
        to = fb * (IDX)(is_k ? p.out_sb[1] : p.out_sb[0]) + fs * (IDX)(is_k ? p.out_ss[1] : p.out_ss[0])
             + fh * (IDX)(is_k ? p.out_sh[1] : p.out_sh[0]) + (IDX)elem;
      } else {
        from = (is_k ? k_in : q_in) + (IDX)hh * (IDX)(is_k ? p.in_sh[1] : p.in_sh[0]);
        to = (is_k ? k_out : q_out) + (IDX)hh * (IDX)(is_k ? p.out_sh[1] : p.out_sh[0]);
      }
      src[u] = reinterpret_cast<const T*>(is_k ? p.in[1] : p.in[0]) + from;
      dst[u] = reinterpret_cast<T*>(is_k ? p.out[1] : p.out[0]) + to;
      // Every load of the step is issued before any math or store (pass-through threads load
      // their own chunk again as y).
      load_chunk<T, V, STREAM>(src[u], x[u]);
      if constexpr (!INTERLEAVED) load_chunk<T, V, STREAM>(src[u] + (rotary ? second : 0), y[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (h0 + u * lanes >= hend) continue;
      if (rotary) {
        if constexpr (!COMPUTED) {
          if ((FLAGS & TABLE_PER_HEAD) || !have_angles) {  // TABLE_PER_HEAD: again for every head
            if (!have_angles && (!EARLY_POSITION || p.nseq > 0)) pos = token_position(p, b, s);
            table_angles<TT, V, INTERLEAVED, SPLIT>(p, pos, chunk, elem, first_half, ang);
            have_angles = true;
          }
        }
      }
      rotate_store<T, V, INTERLEAVED, SPLIT, LO, STREAM>(ang, x[u], y[u], dst[u], second, rotary);
    }
  }
}

// The step kernel's minimum resident blocks (0: none). Rotate-half 16-bit data with fp32 tables
// (V = 8: a thread's cos and sin are two 16-byte loads each) asks for 1, which frees ptxas to
// give a thread 48 registers and issue its four table loads together. At its own target of 32
// registers it issued the second pair after rotating with the first: one more memory round trip
// after the position's (sm_90, CUDA 13.0). The other instantiations issue their table loads
// together at 32 registers or fewer. DESIGN.md ("The step kernel") has the measurement.
#define STEP_MIN_BLOCKS(T, TT, INTERLEAVED, HEADS) \
  (sizeof(TT) > sizeof(T) && !(INTERLEAVED) && (HEADS) == 1 ? 1 : 0)

// The step kernel, for small and mid-sized problems (a decode step: a few tokens, all heads of
// q and k; a prefill whose data is about the L2's size): one thread per (token, chunk) and
// HEADS heads of it (1 in the design), no loop, so every thread's loads are in flight at once
// and no thread waits on another; rotate-half threads own a chunk of each half (the host sets
// PAIR_PER_THREAD). Given tables only, no thd; the host (plan.py, step_work_bound) picks it when
// the chunk-rows are fewer than 8 (16-bit) or 4 (fp32) times the resident threads, 2 for sbhd
// with B > 1, and every offset fits 32 bits.
//   grid  (S, B, head_blocks)   block (chunks, head lanes); lane l of block z takes heads
//   z * lanes * HEADS + l + u * lanes, u < HEADS, and loads the token's cos/sin chunk once.
// With TOKEN_TILES the grid puts the head blocks first: grid (head_blocks, S / T, B), block
// (chunks, head lanes, T), a block T tokens of one head block (T divides S), and the blocks
// that run together cover a stretch of consecutive tokens, all their heads: flash-attn's
// launch (2 heads x 8 tokens a program). On the H200 it moves the large 16-bit prefills out
// of place at flash-attn's speed (DESIGN.md, "Token tiles"). With BATCH_TILES as well the tiles
// run across the batch: grid (head_blocks, B / T, S), a block one position of T sequences (T
// divides B), so that in sbhd with B > 1 a block's tokens, and the blocks that run together, are
// consecutive in memory.
// The data loads are issued first; the position (an id or offset load) and the table row that
// depends on it follow while they are in flight. No branch separates the loads: a branch ends
// the stretch of code the compiler schedules as one, and it then sinks later loads behind math
// that waits on earlier ones (a round trip each). So pass-through threads load their own chunk
// again as y and the table's first chunk, and a lane's heads past the last (HEADS > 1) load the
// last head; none of these is stored. The problem's switches are compile-time constants
// (StepArgs): no branch on them either, and fewer registers.
template <typename T, typename TT, int V, bool INTERLEAVED, int FLAGS, int HEADS, int SWITCHES>
__global__ void __launch_bounds__(256, STEP_MIN_BLOCKS(T, TT, INTERLEAVED, HEADS))
    rope_step(const StepArgs<SWITCHES> p) {
  constexpr bool STREAM = !(FLAGS & PLAIN_ACCESSES);
  constexpr bool SPLIT = !INTERLEAVED && !(FLAGS & PAIR_PER_THREAD);
  constexpr bool TILES = FLAGS & TOKEN_TILES;
  constexpr bool ACROSS_BATCH = TILES && (FLAGS & BATCH_TILES);
  const int hq = p.heads[0], htot = hq + p.heads[1], lanes = blockDim.y;
  const int h0 = (TILES ? blockIdx.x : blockIdx.z) * lanes * HEADS + threadIdx.y;
  if (h0 >= htot) return;
  // TOKEN_TILES: blockDim.z divides S (B with BATCH_TILES; the host's choice), so every token
  // is in range.
  const int tile = blockIdx.y * blockDim.z + threadIdx.z;
  const int s = ACROSS_BATCH ? blockIdx.z : TILES ? tile : blockIdx.x;
  const int b = ACROSS_BATCH ? tile : TILES ? blockIdx.z : blockIdx.y, chunk = threadIdx.x;
  const bool rotary = chunk < p.rot_chunks;
  const int elem = rotary ? chunk * V : 2 * p.half + (chunk - p.rot_chunks) * V;
  const bool first_half = elem < p.half;
  const int second = INTERLEAVED ? 0 : (SPLIT && !first_half) ? -p.half : p.half;
  Chunk<T, V> x[HEADS], y[HEADS];
  T* dst[HEADS];
#pragma unroll
  for (int u = 0; u < HEADS; ++u) {
    const int h = min(h0 + u * lanes, htot - 1);
    const bool is_k = h >= hq;
    const int hh = is_k ? h - hq : h;
    const int from = b * (is_k ? p.in_sb[1] : p.in_sb[0]) + s * (is_k ? p.in_ss[1] : p.in_ss[0])
                     + hh * (is_k ? p.in_sh[1] : p.in_sh[0]) + elem;
    const int to = b * (is_k ? p.out_sb[1] : p.out_sb[0]) + s * (is_k ? p.out_ss[1] : p.out_ss[0])
                   + hh * (is_k ? p.out_sh[1] : p.out_sh[0]) + elem;
    const T* src = reinterpret_cast<const T*>(is_k ? p.in[1] : p.in[0]) + from;
    dst[u] = reinterpret_cast<T*>(is_k ? p.out[1] : p.out[0]) + to;
    load_chunk<T, V, STREAM>(src, x[u]);
    if constexpr (!INTERLEAVED) load_chunk<T, V, STREAM>(src + (rotary ? second : 0), y[u]);
  }
  Angles<V, INTERLEAVED> ang;
  table_angles<TT, V, INTERLEAVED, SPLIT>(p, token_position(p, b, s), rotary ? chunk : 0,
                                          rotary ? elem : 0, !rotary || first_half, ang);
#pragma unroll
  for (int u = 0; u < HEADS; ++u) {
    if (h0 + u * lanes < htot)
      rotate_store<T, V, INTERLEAVED, SPLIT, false, STREAM>(ang, x[u], y[u], dst[u], second, rotary);
  }
}
