// y = x @ w.T for a few rows of x (decode: one to a few rows per request), float32, on CPU.
//
// A decode step of a small model is a chain of matrix-vector products: every weight is
// read once per step and used by only a few rows, so the time is the weight's bytes over
// the memory bandwidth. BLAS sgemm with M of 1-8 stays far below that (about a third of
// the read bandwidth for SmolLM2's shapes on the development machine; `tokenlake bench
// kernel` measures both). Here w [N, K] (row-major, as a model stores it) is read from
// memory once per call: a block of kBlock rows of w is taken against every row of x in
// turn (chunks of up to 8 rows, which then stay in the cache), and within a chunk a step
// takes kAcc / kM rows of w and kM rows of x and keeps the kAcc dot products as kAcc
// vectors of partial sums, reduced together at the end by a transpose tree. kAcc is 16
// with 16-lane vectors (AVX-512: 16 registers of partial sums) and 8 with 8-lane vectors
// on AVX2, whose 16 registers could not hold 16 pairs (spilled, that variant ran 3-6x
// slower than BLAS at 8-32 rows). Blocks of w are spread over ATen's threads. A row of y
// depends only on its own row of x, never on how many rows came with it (batch
// invariant): its partial sums and their tree are the same in every kernel of one
// instruction set.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec16.h"

namespace {

using namespace tokenlake_cpu;

constexpr int64_t kChunk = 8;  // rows of x per kernel call
// Rows of w per block: a multiple of every kernel's step (kAcc / kM), few enough that the
// block stays in the cache while every chunk of x passes over it.
constexpr int64_t kBlock = 16;
// Below this many bytes of w a call runs on the calling thread (waking a thread costs
// more than reading a small matrix).
constexpr int64_t kParallelBytes = 256 * 1024;

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

template <typename V>
inline __attribute__((always_inline)) V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) v16f lane_sums(v16f* a) { return transpose_sum(a); }

// Lane j of the result is the sum of every lane of a[j] (a holds 8 vectors; overwritten):
// the tree of transpose_sum on 8 lanes, the same for every a[j].
inline __attribute__((always_inline)) v8f lane_sums(v8f* a) {
  const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11};
  const v8i hi4 = lo4 + 4;
  const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13};
  const v8i hi2 = lo2 + 2;
  const v8i lo1 = {0, 8, 2, 10, 4, 12, 6, 14};
  const v8i hi1 = lo1 + 1;
  for (int i = 0; i < 4; ++i) a[i] = __builtin_shuffle(a[i], a[i + 4], lo4) + __builtin_shuffle(a[i], a[i + 4], hi4);
  for (int i = 0; i < 2; ++i) a[i] = __builtin_shuffle(a[i], a[i + 2], lo2) + __builtin_shuffle(a[i], a[i + 2], hi2);
  return __builtin_shuffle(a[0], a[1], lo1) + __builtin_shuffle(a[0], a[1], hi1);
}

struct Pass {
  const float* x;  // [kM, K], rows at or past `rows` zero
  const float* w;  // [N, K]
  float* y;        // row m at y + m * ldy
  int64_t K, N, ldy, rows;
};

// Rows [n0, n1) of w (n0 a multiple of kAcc / kM) against the pass's kM rows of x, with
// vectors V of kAcc lanes (and kAcc of them as partial sums).
template <typename V, int kAcc, int kM>
inline __attribute__((always_inline)) void pass_rows(const Pass& p, int64_t n0, int64_t n1) {
  constexpr int kW = kAcc / kM;
  const int64_t K = p.K, Kv = K - K % kAcc;
  for (int64_t n = n0; n < n1; n += kW) {
    const float* wr[kW];
    for (int i = 0; i < kW; ++i) wr[i] = p.w + std::min(n + i, p.N - 1) * K;  // past N: read, not stored
    V acc[kAcc];
    for (int j = 0; j < kAcc; ++j) acc[j] = V{};
    for (int64_t k = 0; k < Kv; k += kAcc) {
      V wv[kW];
#pragma GCC unroll 16
      for (int i = 0; i < kW; ++i) {
        wv[i] = load<V>(wr[i] + k);
        // The next rows of w (past N: harmless), with low locality (L2), as the attention
        // kernel does: into L1 the projections ran 1.1-1.3x slower.
        __builtin_prefetch(wr[i] + kW * K + k, 0, 1);
      }
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const V xv = load<V>(p.x + m * K + k);
#pragma GCC unroll 16
        for (int i = 0; i < kW; ++i) acc[i * kM + m] += xv * wv[i];
      }
    }
    const V s = lane_sums(acc);  // lane i * kM + m: row m of x . row n + i of w
    for (int i = 0; i < kW && n + i < p.N; ++i) {
      for (int m = 0; m < kM && m < p.rows; ++m) {
        float t = s[i * kM + m];
        for (int64_t k = Kv; k < K; ++k) t += p.x[m * K + k] * wr[i][k];
        p.y[m * p.ldy + n + i] = t;
      }
    }
  }
}

// AVX-512 (and the baseline): 16-lane vectors, 16 partial sums. AVX2: 8-lane vectors and
// 8 partial sums, which fit its 16 registers beside the rows of w.
template <int kM>
__attribute__((target(TL_TARGET_AVX512), noinline)) void pass_avx512(const Pass& p, int64_t n0, int64_t n1) {
  pass_rows<v16f, 16, kM>(p, n0, n1);
}

template <int kM>
__attribute__((target(TL_TARGET_AVX2), noinline)) void pass_avx2(const Pass& p, int64_t n0, int64_t n1) {
  pass_rows<v8f, 8, kM>(p, n0, n1);
}

template <int kM>
__attribute__((noinline)) void pass_base(const Pass& p, int64_t n0, int64_t n1) {
  pass_rows<v16f, 16, kM>(p, n0, n1);
}

using PassFn = void (*)(const Pass&, int64_t, int64_t);

template <int kM>
PassFn pick_m(Isa isa) {
  return for_isa<PassFn>(isa, &pass_avx512<kM>, &pass_avx2<kM>, &pass_base<kM>);
}

// The narrowest kernel taking `rows` rows: 1, 2, 4 or 8.
int rows_kernel(int64_t rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }

PassFn pick(Isa isa, int m) {
  switch (m) {
    case 1: return pick_m<1>(isa);
    case 2: return pick_m<2>(isa);
    case 4: return pick_m<4>(isa);
    default: return pick_m<8>(isa);
  }
}

struct Call {
  Pass pass;
  PassFn fn;
};

}  // namespace

// x [M, K] and w [N, K] float32 CPU (w contiguous); returns x @ w.T [M, N]. Any M works;
// the kernel pays for a few rows (decode); w is read from memory once.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "x must be [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "x and w must be float32 CPU tensors");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = forced_isa();
  std::vector<float> padded;  // the last chunk of x, when its kernel takes more rows
  std::vector<Call> calls;
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    const int m = rows_kernel(rows);
    const float* xs = xp + m0 * K;
    if (rows < m) {  // 3, 5, 6 or 7 rows (only the last chunk): the next kernel up, over zero rows
      padded.assign(m * K, 0.f);
      std::copy(xs, xs + rows * K, padded.begin());
      xs = padded.data();
    }
    calls.push_back({Pass{xs, wp, yp + m0 * N, K, N, N, rows}, pick(isa, m)});
  }
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = N * K * 4 < kParallelBytes ? blocks : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {  // each block of w once from memory, for every chunk
      const int64_t n0 = b * kBlock, n1 = std::min(N, n0 + kBlock);
      for (const Call& c : calls) c.fn(c.pass, n0, n1);
    }
  });
  return y;
}
