// y = x @ w.T for a few rows of x (decode: one to a few rows per request), float32, on CPU.
//
// A decode step of a small model is a chain of matrix-vector products: every weight is
// read once per step and used by only a few rows, so the time is the weight's bytes over
// the memory bandwidth. BLAS sgemm with M of 1-8 stays far below that (about a third of
// the read bandwidth for SmolLM2's shapes on the development machine; `tokenlake bench
// kernel` measures both). Here w [N, K]
// (row-major, as a model stores it) is streamed once: each step takes 16 / kM rows of w
// and kM rows of x and keeps the 16 dot products as 16 vectors of partial sums, reduced
// together at the end by a transpose tree (vec16.h). Row blocks of w are spread over
// ATen's threads. A row of y depends only on its own row of x, never on how many rows
// came with it (batch invariant).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec16.h"

namespace {

using namespace tokenlake_cpu;

constexpr int64_t kChunk = 8;  // rows of x per pass over w
// Below this many bytes of w a call runs on the calling thread (waking a thread costs
// more than reading a small matrix).
constexpr int64_t kParallelBytes = 256 * 1024;

struct Pass {
  const float* x;  // [kM, K], rows at or past `rows` zero
  const float* w;  // [N, K]
  float* y;        // row m at y + m * ldy
  int64_t K, N, ldy, rows;
};

// Rows [n0, n1) of w (n0 a multiple of 16 / kM) against the pass's kM rows of x.
template <int kM>
inline __attribute__((always_inline)) void pass_rows(const Pass& p, int64_t n0, int64_t n1) {
  constexpr int kW = 16 / kM;
  const int64_t K = p.K, K16 = K - K % kLanes;
  for (int64_t n = n0; n < n1; n += kW) {
    const float* wr[kW];
    for (int i = 0; i < kW; ++i) wr[i] = p.w + std::min(n + i, p.N - 1) * K;  // past N: read, not stored
    v16f acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = v16f{};
    for (int64_t k = 0; k < K16; k += kLanes) {
      v16f wv[kW];
#pragma GCC unroll 16
      for (int i = 0; i < kW; ++i) {
        wv[i] = load16(wr[i] + k);
        // The next block's row (past N: harmless), with low locality (L2), as the attention
        // kernel does: into L1 the projections ran 1.1-1.3x slower.
        __builtin_prefetch(wr[i] + kW * K + k, 0, 1);
      }
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const v16f xv = load16(p.x + m * K + k);
#pragma GCC unroll 16
        for (int i = 0; i < kW; ++i) acc[i * kM + m] += xv * wv[i];
      }
    }
    const v16f s = transpose_sum(acc);  // lane i * kM + m: row m of x . row n + i of w
    for (int i = 0; i < kW && n + i < p.N; ++i) {
      for (int m = 0; m < kM && m < p.rows; ++m) {
        float t = s[i * kM + m];
        for (int64_t k = K16; k < K; ++k) t += p.x[m * K + k] * wr[i][k];
        p.y[m * p.ldy + n + i] = t;
      }
    }
  }
}

template <int kM>
inline __attribute__((always_inline)) void dispatch_pass(const Pass& p, int64_t n0, int64_t n1) {
  pass_rows<kM>(p, n0, n1);
}

#define TL_LINEAR_VARIANT(NAME, TARGET)                                                  \
  template <int kM>                                                                      \
  __attribute__((target(TARGET), noinline)) void NAME(const Pass& p, int64_t n0, int64_t n1) { \
    dispatch_pass<kM>(p, n0, n1);                                                        \
  }

TL_LINEAR_VARIANT(pass_avx512, TL_TARGET_AVX512)
TL_LINEAR_VARIANT(pass_avx2, TL_TARGET_AVX2)

template <int kM>
__attribute__((noinline)) void pass_base(const Pass& p, int64_t n0, int64_t n1) {
  dispatch_pass<kM>(p, n0, n1);
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

}  // namespace

// x [M, K] and w [N, K] float32 CPU (w contiguous); returns x @ w.T [M, N]. Any M works;
// the kernel pays for a few rows (decode), where it reads w once per 8 rows.
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
  std::vector<float> padded;
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    const int m = rows_kernel(rows);
    const float* xs = xp + m0 * K;
    if (rows < m) {  // 3, 5, 6 or 7 rows: the next kernel up, over zero rows
      padded.assign(m * K, 0.f);
      std::copy(xs, xs + rows * K, padded.begin());
      xs = padded.data();
    }
    const Pass pass{xs, wp, yp + m0 * N, K, N, N, rows};
    const PassFn fn = pick(isa, m);
    const int64_t step = 16 / m, blocks = (N + step - 1) / step;
    const int64_t grain = N * K * 4 < kParallelBytes ? blocks : 1;
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      fn(pass, b0 * step, std::min(N, b1 * step));
    });
  }
  return y;
}
