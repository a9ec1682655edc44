// The panel path of slab_attention_cpu.cpp (included inside its anonymous namespace, after
// the vector path it shares Task, slot_planes and exp_neg16 with): many grouped rows on a
// CPU without tiles, any K/V dtype, head dim 64 or 128.
//
// With many grouped rows (a batch of decodes over one document, a short chunk) attention is
// two small matrix products per block, and the vector path's layout (a row's dot products
// along the head dim, reduced by a transpose tree, at most 4 rows per pass) is bound by its
// shuffles and, on AVX2, by spilling its 16 accumulators from 16 registers. Here the rows
// lie in the lanes instead, as in a GEMM's outer-product kernel:
//
// - q is transposed once per task (qt [E, Rp], Rp = rows rounded up to 16, the padding
//   rows zero), the output kept transposed (ot [E, Rp]) and put back at the task's end;
// - a block of 16 tokens of K and of V is widened to floats once (float32 read in place),
//   whatever its dtype: each element then serves every row of the task;
// - scores st [16, Rp]: for a run of kJ tokens and 16 rows, kJ accumulators take one
//   broadcast K element times the 16 rows' q at that dim, for every dim (no reduction
//   across lanes, no shuffle);
// - the online softmax runs lane-wise (a row per lane): max and sum over the block's
//   tokens are plain vector max and add;
// - output: for kC dims and 16 rows, kC accumulators take one broadcast V element times
//   the 16 rows' probabilities of that token, for every token of the block.
//
// Float32 accumulation and the exp polynomial of the vector path: the answers agree with
// the float64 reference as the other paths do.

// The panel path from this many grouped rows, for K/V elements of `elem_bytes`. AVX2
// (2-core AMD EPYC, 16K tokens, 2 threads, against the vector path alternately in one
// process): 4 rows 0.93-1.33x, 6 1.49-1.81x, 12 2.2-2.6x, 32 3.6-4.2x; 1-3 rows
// 0.47-0.94x. AVX-512 (2-core Intel Xeon, 16K and 64K tokens, the same way; its vector
// path does not spill; 32/8 heads x 128): bfloat16 16 rows 0.83-0.89x, 24 0.80-0.91x, 32
// 1.12x, 40 0.97-1.10x, 48 1.17-1.30x, 64 1.33x; float32 16 rows 0.74-0.86x, 32
// 0.85-1.03x, 48 0.91-1.06x, 64 1.05-1.13x (rows are padded to 32: a count just past a
// multiple of 32 pays for lanes it does not use). SmolLM2's 9/3 x 64 agrees (float32 66
// rows 1.17-1.20x, 33 0.94x). set_panel_rows overrides it (tests and benchmarks compare
// the paths); 0 goes back to these.
inline int64_t& panel_rows_forced() {
  static int64_t rows = 0;
  return rows;
}

inline int64_t panel_rows(int64_t elem_bytes) {
  if (panel_rows_forced() > 0) return panel_rows_forced();
  if (forced_isa() == Isa::kAvx512 || forced_isa() == Isa::kAmx) return elem_bytes >= 4 ? 64 : 32;
  return 6;
}

constexpr int64_t kPB = 24;  // tokens per block

// The vectors of one variant: kL lanes, the width of the target's registers (16 on
// AVX-512, 8 on AVX2, 4 baseline), so that an array of accumulators stays in registers
// (GCC keeps 16-lane vectors of AVX2 code on the stack when they are indexed in a loop).
// A pass holds kJ x kW (scores) or kC x kW (output) accumulators of kW x kL rows: 12 of
// the 16 registers of AVX2 and SSE, 16 of AVX-512's 32.
template <int kL>
struct Panel;
template <>
struct Panel<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
  static constexpr int kJ = 8, kW = 2, kC = 8;
};
template <>
struct Panel<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  static constexpr int kJ = 6, kW = 2, kC = 6;
};
template <>
struct Panel<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  static constexpr int kJ = 6, kW = 2, kC = 6;
};

template <typename F>
inline __attribute__((always_inline)) F loadv(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename F>
inline __attribute__((always_inline)) void storev(float* p, F v) {
  std::memcpy(p, &v, sizeof v);
}

// exp_neg16's polynomial on kL lanes.
template <int kL>
inline __attribute__((always_inline)) typename Panel<kL>::F exp_negv(typename Panel<kL>::F x) {
  return exp_neg_lanes<typename Panel<kL>::F, typename Panel<kL>::I>(x);
}

struct PanelState {
  float* qt;  // [E, Rp] pre-scaled q, transposed (rows in lanes)
  float* ot;  // [E, Rp] unnormalised output, transposed
  float* st;  // [kPB, Rp] a block's scores, then its probabilities
  float* m;   // [Rp] running max
  float* l;   // [Rp] running sum
  float* kw;  // [kPB, E] the block's K as floats, zero past its tokens
  float* vw;  // [kPB, E] its V
};

// Rows rounded up to a whole pass of every variant (32: AVX-512's 2 x 16).
inline int64_t panel_rows_padded(int64_t R) { return (R + 31) / 32 * 32; }

// Floats of a panel task's scratch (every piece a whole number of 64-byte lines).
inline int64_t panel_floats(int64_t R, int64_t E) {
  const int64_t Rp = panel_rows_padded(R);
  return 2 * E * Rp + kPB * Rp + 2 * Rp + 2 * kPB * E;
}

// nb rows of E elements of a K or V plane as floats in dst, rows nb .. kPB zero. Float32 is
// copied too: the copy streams the block in, where reading it in place (six rows at a time
// in the score passes) ran 1.3x slower at 16 rows.
template <typename T, int kE>
inline __attribute__((always_inline)) void widen_block(const T* src, float* dst, int64_t nb) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, nb * kE * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint16_t v16h __attribute__((vector_size(32)));
    for (int64_t i = 0; i < nb * kE; i += kLanes) {
      v16h h;
      std::memcpy(&h, src + i, sizeof h);
      const v16u w = __builtin_convertvector(h, v16u) << 16;
      std::memcpy(dst + i, &w, sizeof w);
    }
  } else {
    for (int64_t i = 0; i < nb * kE; i += kLanes) {
      v16fp16 h;
      std::memcpy(&h, src + i, sizeof h);
      store16(dst + i, __builtin_convertvector(h, v16f));
    }
  }
  std::fill(dst + nb * kE, dst + kPB * kE, 0.f);
}

// Scores of tokens j0 .. j0 + kJ for the kW x kL rows from r0. Each sums its products in
// chunks of kDots dims, the chunks' sums then added up: one chain of 64-128 products ran
// 3-5x further from the float64 reference on logits near 1e3 than the vector path's tree
// (chunks of 8 were the most accurate of 8-32, and as fast).
constexpr int kDots = 8;

template <int kE, int kL, int kW>
inline __attribute__((always_inline)) void panel_scores(const PanelState& ps, const float* k, int64_t Rp,
                                                        int64_t r0, int64_t j0) {
  using P = Panel<kL>;
  using F = typename P::F;
  static_assert(kE % kDots == 0, "whole chunks");
  F sum[P::kJ][kW];
  const float* qt = ps.qt + r0;
  for (int e0 = 0; e0 < kE; e0 += kDots) {
    F acc[P::kJ][kW];
    for (int jj = 0; jj < P::kJ; ++jj)
      for (int w = 0; w < kW; ++w) acc[jj][w] = F{};
#pragma GCC unroll 2
    for (int e = e0; e < e0 + kDots; ++e) {
      F qv[kW];
      for (int w = 0; w < kW; ++w) qv[w] = loadv<F>(qt + e * Rp + w * kL);
#pragma GCC unroll 8
      for (int jj = 0; jj < P::kJ; ++jj) {
        const float kv = k[(j0 + jj) * kE + e];  // a scalar operand: one broadcast load
        for (int w = 0; w < kW; ++w) acc[jj][w] += kv * qv[w];
      }
    }
    for (int jj = 0; jj < P::kJ; ++jj)
      for (int w = 0; w < kW; ++w) sum[jj][w] = e0 == 0 ? acc[jj][w] : sum[jj][w] + acc[jj][w];
  }
  for (int jj = 0; jj < P::kJ; ++jj)
    for (int w = 0; w < kW; ++w) storev<F>(ps.st + (j0 + jj) * Rp + r0 + w * kL, sum[jj][w]);
}

// The online softmax of the kL rows from r0 over a block of nb tokens: probabilities in
// place of the scores, m and l updated; returns the factor the output is rescaled by.
// Past nb the scores are left as they are: 0 (K's rows there are zero), against V rows
// of zeros, so they add nothing.
template <int kL>
inline __attribute__((always_inline)) typename Panel<kL>::F panel_softmax(const PanelState& ps, int64_t Rp,
                                                                          int64_t r0, int64_t nb) {
  using F = typename Panel<kL>::F;
  float* s = ps.st + r0;
  F mx = loadv<F>(s);
  for (int64_t j = 1; j < nb; ++j) {
    const F x = loadv<F>(s + j * Rp);
    mx = mx > x ? mx : x;
  }
  const F m_old = loadv<F>(ps.m + r0);
  const F mb = m_old > mx ? m_old : mx;
  const F corr = exp_negv<kL>(m_old - mb);  // ~0 on the first block (m = -inf)
  F sum = F{};
  for (int64_t j = 0; j < nb; ++j) {
    const F p = exp_negv<kL>(loadv<F>(s + j * Rp) - mb);
    sum += p;
    storev<F>(s + j * Rp, p);
  }
  storev<F>(ps.l + r0, loadv<F>(ps.l + r0) * corr + sum);
  storev<F>(ps.m + r0, mb);
  return corr;
}

// ot = ot * corr + p v for dims e0 .. e0 + kC of the kW x kL rows from r0 (the block's kPB
// tokens; past its valid ones v is 0).
template <int kE, int kL, int kW, int kC>
inline __attribute__((always_inline)) void panel_output(const PanelState& ps, const float* v, int64_t Rp,
                                                        int64_t r0, int64_t e0,
                                                        const typename Panel<kL>::F* corr) {
  using F = typename Panel<kL>::F;
  float* ot = ps.ot + r0;
  const float* p = ps.st + r0;
  F acc[kC][kW];
  for (int c = 0; c < kC; ++c)
    for (int w = 0; w < kW; ++w) acc[c][w] = loadv<F>(ot + (e0 + c) * Rp + w * kL) * corr[w];
#pragma GCC unroll 4
  for (int j = 0; j < kPB; ++j) {
    F pj[kW];
    for (int w = 0; w < kW; ++w) pj[w] = loadv<F>(p + j * Rp + w * kL);
#pragma GCC unroll 8
    for (int c = 0; c < kC; ++c) {
      const float vv = v[j * kE + e0 + c];  // a scalar operand: one broadcast load
      for (int w = 0; w < kW; ++w) acc[c][w] += vv * pj[w];
    }
  }
  for (int c = 0; c < kC; ++c)
    for (int w = 0; w < kW; ++w) storev<F>(ot + (e0 + c) * Rp + w * kL, acc[c][w]);
}

// One block for the kW x kL rows from r0: scores, softmax, output.
template <int kE, int kL, int kW>
inline __attribute__((always_inline)) void panel_pass(const PanelState& ps, int64_t Rp, int64_t r0,
                                                      int64_t nb) {
  using P = Panel<kL>;
  constexpr int kTail = kE % P::kC;  // dims past whole output passes
  for (int64_t j0 = 0; j0 < kPB; j0 += P::kJ) panel_scores<kE, kL, kW>(ps, ps.kw, Rp, r0, j0);
  typename P::F corr[kW];
  for (int w = 0; w < kW; ++w) corr[w] = panel_softmax<kL>(ps, Rp, r0 + w * kL, nb);
  int64_t e0 = 0;
  for (; e0 + P::kC <= kE; e0 += P::kC) panel_output<kE, kL, kW, P::kC>(ps, ps.vw, Rp, r0, e0, corr);
  if constexpr (kTail > 0) panel_output<kE, kL, kW, kTail>(ps, ps.vw, Rp, r0, e0, corr);
}

template <typename T, int kE, int kL>
inline __attribute__((always_inline)) void run_task_panel(const Task& t) {
  static_assert(kE % 32 == 0, "the panel path needs head_dim % 32 == 0");
  using P = Panel<kL>;
  static_assert(kPB % P::kJ == 0, "whole score passes");
  const int64_t R = t.rows, Rp = panel_rows_padded(R);
  PanelState ps;
  ps.qt = t.scratch;
  ps.ot = ps.qt + kE * Rp;
  ps.st = ps.ot + kE * Rp;
  ps.m = ps.st + kPB * Rp;
  ps.l = ps.m + Rp;
  ps.kw = ps.l + Rp;
  ps.vw = ps.kw + kPB * kE;
  for (int64_t e = 0; e < kE; ++e) {
    for (int64_t r = 0; r < Rp; ++r) ps.qt[e * Rp + r] = r < R ? t.q[r * kE + e] : 0.f;
  }
  std::fill(ps.ot, ps.ot + kE * Rp, 0.f);
  std::fill(ps.m, ps.m + Rp, kNegInf);
  std::fill(ps.l, ps.l + Rp, 0.f);
  for (int64_t i = 0; i < t.n_slots; ++i) {
    const int64_t n = t.tokens[i];
    if (n <= 0) continue;
    const T *K, *V;
    slot_planes<T>(t, i, kE, &K, &V);
    for (int64_t b0 = 0; b0 < n; b0 += kPB) {
      const int64_t nb = std::min(kPB, n - b0);  // rows past a slot's tokens are never read
      widen_block<T, kE>(K + b0 * kE, ps.kw, nb);
      widen_block<T, kE>(V + b0 * kE, ps.vw, nb);
      // Passes of kW x kL rows, the last of kL where no more are left.
      for (int64_t r0 = 0; r0 < R;) {
        if (R - r0 > kL) {
          panel_pass<kE, kL, P::kW>(ps, Rp, r0, nb);
          r0 += P::kW * kL;
        } else {
          panel_pass<kE, kL, 1>(ps, Rp, r0, nb);
          r0 += kL;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    t.m[r] = ps.m[r];
    t.l[r] = ps.l[r];
    for (int64_t e = 0; e < kE; ++e) t.o[r * kE + e] = ps.ot[e * Rp + r];
  }
}
