// The dot path of slab_attention_cpu.cpp (included inside its anonymous namespace, after
// the panel and tile paths, whose Task, slot_planes, exp_neg_lanes and amx_column it
// uses): many grouped rows over bfloat16 K/V on CPUs with AVX-512 BF16 dot products
// (vdpbf16ps) and no tiles, when bfloat16 products are allowed (set_bf16_products).
//
// With 32 grouped rows (8 decodes over one document, 4 query heads per kv head) attention
// does 16 multiply-adds per byte of bfloat16 K/V, and the panel path (floats) is bound
// by the FMA units: bfloat16 takes as long as float32 for half the bytes. vdpbf16ps does
// two multiply-adds per 32-bit lane, one instruction as fast as an FMA on CPUs that run it
// at full rate (2-core AMD EPYC: both 1 a cycle on 16 lanes), so twice the work per
// instruction, on K/V read as they are stored (no widening). Its operands are bfloat16:
//
// - q is rounded to bfloat16 (nearest even) once per task, or, with two parts, split into
//   hi = bf16(q) and lo = bf16(q - hi) (16 significant bits; twice the score products);
// - the probabilities are rounded to bfloat16 before the output product, as GPU attention
//   kernels do; their sum l is taken over the rounded values, so the output is an exact
//   weighted mean with weights within 2^-9 (relative) of the softmax's.
//
// Sums are float32. Layout as in the panel path, rows in the lanes: a lane holds one row's
// pair of bfloat16 values (dims 2p, 2p + 1 of q; tokens 2i, 2i + 1 of the probabilities),
// and the other operand is one broadcast 32-bit pair: K's two dims of a token, read in
// place; V's two tokens of a dim, interleaved once per block by vpunpck{l,h}wd, whose
// column order (amx_column) the transposed output keeps until the task's end.

#if defined(__x86_64__)

#define TL_TARGET_DOT "avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"

constexpr int64_t kDotTok = 32;  // tokens per block
constexpr int kDotJ = 8;         // tokens per score pass
constexpr int kDotC = 8;         // output dims per pass
// Blocks between the one computed and the one prefetched (into L2: prefetcht2). On a
// 2-core AMD EPYC, one thread, 64K tokens, 32 rows: none 8.6 ms, 1 block 6.7, 2 6.4-6.7,
// 4 7.5; in L2 already, 5.9.
constexpr int64_t kDotAhead = 2;
// The dot path from this many grouped rows (a lane per row). Against the vector path with
// exact products, alternately in one process (2-core AMD EPYC, 2 threads, 16K tokens, q in
// one part): 32/8 heads x 128, 4 grouped rows 0.78x, 8 1.41x, 12 2.05x, 16 2.70x; 9/3 x
// 64, 3 rows 0.70x, 6 1.22x, 9 1.91x, 12 2.45x.
constexpr int64_t kDotRows = 6;

// Whether bfloat16 products may serve (0: no, the exact paths only; 1 or 2: q's parts).
inline int& bf16_products() {
  static int parts = 0;
  return parts;
}

inline bool cpu_has_bf16_dots() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

struct DotState {
  uint32_t* qp;  // [parts, E / 2, Rp] q's bfloat16 pairs, rows in lanes
  float* ot;     // [E, Rp] unnormalised output, transposed, dims in unpack order
  float* st;     // [kDotTok, Rp] a block's scores
  uint32_t* pp;  // [kDotTok / 2, Rp] its probabilities' bfloat16 pairs
  float* m;      // [Rp] running max
  float* l;      // [Rp] running sum of the rounded probabilities
  uint32_t* vp;  // [kDotTok / 2, E] V's token pairs, dims in unpack order
  uint16_t* pad; // [2, kDotTok, E] K and V of a partial block, zero past its tokens
};

// Bytes of a dot task's scratch, and its pieces pointed into `base` (64-byte aligned).
inline int64_t dot_layout(int64_t R, int64_t E, int parts, char* base = nullptr, DotState* ds = nullptr) {
  const int64_t Rp = (R + 31) / 32 * 32;
  int64_t at = 0;
  const auto take = [&](int64_t bytes) {
    const int64_t off = at;
    at += (bytes + 63) / 64 * 64;
    return off;
  };
  const int64_t qp = take(parts * (E / 2) * Rp * 4), ot = take(E * Rp * 4), st = take(kDotTok * Rp * 4),
                pp = take(kDotTok / 2 * Rp * 4), m = take(Rp * 4), l = take(Rp * 4),
                vp = take(kDotTok / 2 * E * 4), pad = take(2 * kDotTok * E * 2);
  if (ds != nullptr) {
    ds->qp = reinterpret_cast<uint32_t*>(base + qp);
    ds->ot = reinterpret_cast<float*>(base + ot);
    ds->st = reinterpret_cast<float*>(base + st);
    ds->pp = reinterpret_cast<uint32_t*>(base + pp);
    ds->m = reinterpret_cast<float*>(base + m);
    ds->l = reinterpret_cast<float*>(base + l);
    ds->vp = reinterpret_cast<uint32_t*>(base + vp);
    ds->pad = reinterpret_cast<uint16_t*>(base + pad);
  }
  return at;
}

// The bfloat16 nearest (ties to even) to a finite float, as the top half of its bits.
inline uint32_t round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
}

__attribute__((target(TL_TARGET_DOT), always_inline)) inline v16u round_bf16v(v16f x) {
  v16u b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
}

__attribute__((target(TL_TARGET_DOT), always_inline)) inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Scores of tokens j0 .. j0 + kDotJ (k: the block's K rows) for the kW x 16 rows from r0;
// one line from pf on prefetched per dim pair (none if null).
template <int kE, int kParts, int kW>
__attribute__((target(TL_TARGET_DOT), always_inline)) inline void dot_scores(const DotState& ds, const uint16_t* k,
                                                                            int64_t Rp, int64_t r0, int64_t j0,
                                                                            const char* pf) {
  __m512 acc[kDotJ][kW];
  for (int jj = 0; jj < kDotJ; ++jj)
    for (int w = 0; w < kW; ++w) acc[jj][w] = _mm512_setzero_ps();
  const uint32_t* q = ds.qp + r0;
#pragma GCC unroll 2
  for (int p = 0; p < kE / 2; ++p) {
    if (pf != nullptr) _mm_prefetch(pf + p * 64, _MM_HINT_T2);
    __m512i qv[kParts][kW];
    for (int s = 0; s < kParts; ++s)
      for (int w = 0; w < kW; ++w) qv[s][w] = _mm512_loadu_si512(q + (s * (kE / 2) + p) * Rp + w * 16);
#pragma GCC unroll 8
    for (int jj = 0; jj < kDotJ; ++jj) {
      uint32_t pair;
      std::memcpy(&pair, k + (j0 + jj) * kE + 2 * p, sizeof pair);
      const __m512i kb = _mm512_set1_epi32(static_cast<int>(pair));  // one broadcast load
      for (int s = 0; s < kParts; ++s)
        for (int w = 0; w < kW; ++w) acc[jj][w] = dpbf16(acc[jj][w], qv[s][w], kb);
    }
  }
  for (int jj = 0; jj < kDotJ; ++jj)
    for (int w = 0; w < kW; ++w) _mm512_storeu_ps(ds.st + (j0 + jj) * Rp + r0 + w * 16, acc[jj][w]);
}

// The online softmax of the 16 rows from r0 over a block of nb tokens: the rounded
// probabilities' pairs into pp (a zero past nb), m and l updated; returns the factor the
// output is rescaled by.
__attribute__((target(TL_TARGET_DOT), always_inline)) inline v16f dot_softmax(const DotState& ds, int64_t Rp,
                                                                              int64_t r0, int64_t nb) {
  const float* s = ds.st + r0;
  v16f mx = load16(s);
  for (int64_t j = 1; j < nb; ++j) {
    const v16f x = load16(s + j * Rp);
    mx = mx > x ? mx : x;
  }
  const v16f m_old = load16(ds.m + r0);
  const v16f mb = m_old > mx ? m_old : mx;
  const v16f corr = exp_neg_lanes<v16f, v16i>(m_old - mb);  // ~0 on the first block (m = -inf)
  v16f sum = v16f{};
  for (int64_t j = 0; j < nb; j += 2) {
    const v16u a = round_bf16v(exp_tile(load16(s + j * Rp) - mb));
    const v16u b = j + 1 < nb ? round_bf16v(exp_tile(load16(s + (j + 1) * Rp) - mb)) : v16u{};
    v16f fa, fb;
    std::memcpy(&fa, &a, sizeof fa);
    std::memcpy(&fb, &b, sizeof fb);
    sum += fa + fb;
    const v16u pair = (a >> 16) | b;
    std::memcpy(ds.pp + (j / 2) * Rp + r0, &pair, sizeof pair);
  }
  store16(ds.l + r0, load16(ds.l + r0) * corr + sum);
  store16(ds.m + r0, mb);
  return corr;
}

// ot = ot * corr + p v for dims e0 .. e0 + kDotC (unpack order) of the kW x 16 rows
// from r0, over the block's np token pairs.
template <int kE, int kW>
__attribute__((target(TL_TARGET_DOT), always_inline)) inline void dot_output(const DotState& ds, int64_t Rp,
                                                                            int64_t r0, int64_t e0,
                                                                            const v16f* corr, int64_t np) {
  __m512 acc[kDotC][kW];
  float* ot = ds.ot + r0;
  for (int c = 0; c < kDotC; ++c)
    for (int w = 0; w < kW; ++w) {
      const v16f x = load16(ot + (e0 + c) * Rp + w * 16) * corr[w];
      std::memcpy(&acc[c][w], &x, sizeof x);
    }
#pragma GCC unroll 2
  for (int64_t i = 0; i < np; ++i) {
    __m512i pv[kW];
    for (int w = 0; w < kW; ++w) pv[w] = _mm512_loadu_si512(ds.pp + i * Rp + r0 + w * 16);
#pragma GCC unroll 8
    for (int c = 0; c < kDotC; ++c) {
      const __m512i vb = _mm512_set1_epi32(static_cast<int>(ds.vp[i * kE + e0 + c]));
      for (int w = 0; w < kW; ++w) acc[c][w] = dpbf16(acc[c][w], pv[w], vb);
    }
  }
  for (int c = 0; c < kDotC; ++c)
    for (int w = 0; w < kW; ++w) _mm512_storeu_ps(ot + (e0 + c) * Rp + w * 16, acc[c][w]);
}

// One block for the kW x 16 rows from r0: scores, softmax, output. nk, nv (or null): the
// K and V of the block kDotAhead on, prefetched over the score passes (a line per dim
// pair: 2 x head_dim lines in the kDotTok / kDotJ passes of a whole block).
template <int kE, int kParts, int kW>
__attribute__((target(TL_TARGET_DOT), always_inline)) inline void dot_pass(const DotState& ds, const uint16_t* k,
                                                                          int64_t Rp, int64_t r0, int64_t nb,
                                                                          const char* nk, const char* nv) {
  static_assert(kDotTok / kDotJ == 4, "two passes' lines of K, two of V");
  for (int64_t j0 = 0, jp = 0; j0 < nb; j0 += kDotJ, ++jp) {
    const char* pf = nk == nullptr ? nullptr : jp < 2 ? nk + jp * (kE / 2) * 64 : nv + (jp - 2) * (kE / 2) * 64;
    dot_scores<kE, kParts, kW>(ds, k, Rp, r0, j0, pf);
  }
  v16f corr[kW];
  for (int w = 0; w < kW; ++w) corr[w] = dot_softmax(ds, Rp, r0 + w * 16, nb);
  for (int64_t e0 = 0; e0 < kE; e0 += kDotC) dot_output<kE, kW>(ds, Rp, r0, e0, corr, (nb + 1) / 2);
}

template <int kE, int kParts>
__attribute__((target(TL_TARGET_DOT), noinline)) void run_task_dot(const Task& t) {
  static_assert(kE % 32 == 0 && kE % kDotC == 0, "head_dim 64 or 128");
  const int64_t R = t.rows, Rp = (R + 31) / 32 * 32;
  DotState ds;
  dot_layout(R, kE, kParts, reinterpret_cast<char*>(t.scratch), &ds);
  for (int64_t p = 0; p < kE / 2; ++p)
    for (int64_t r = 0; r < Rp; ++r) {
      uint32_t hi[2] = {0, 0}, lo[2] = {0, 0};
      for (int d = 0; d < 2 && r < R; ++d) {
        const float x = t.q[r * kE + 2 * p + d];
        hi[d] = round_bf16(x);
        float h;
        std::memcpy(&h, &hi[d], sizeof h);
        lo[d] = round_bf16(x - h);
      }
      ds.qp[p * Rp + r] = (hi[0] >> 16) | hi[1];
      if constexpr (kParts == 2) ds.qp[((kE / 2) + p) * Rp + r] = (lo[0] >> 16) | lo[1];
    }
  std::fill(ds.ot, ds.ot + kE * Rp, 0.f);
  std::fill(ds.m, ds.m + Rp, kNegInf);
  std::fill(ds.l, ds.l + Rp, 0.f);
  for (int64_t i = 0; i < t.n_slots; ++i) {
    const int64_t n = t.tokens[i];
    if (n <= 0) continue;
    const c10::BFloat16 *K, *V;
    slot_planes<c10::BFloat16>(t, i, kE, &K, &V);
    for (int64_t b0 = 0; b0 < n; b0 += kDotTok) {
      const int64_t nb = std::min(kDotTok, n - b0);
      const uint16_t* k = reinterpret_cast<const uint16_t*>(K + b0 * kE);
      const uint16_t* v = reinterpret_cast<const uint16_t*>(V + b0 * kE);
      if (nb < kDotTok) {  // rows past a slot's valid tokens may hold anything (NaN)
        uint16_t* pk = ds.pad;
        uint16_t* pv = ds.pad + kDotTok * kE;
        std::memcpy(pk, k, nb * kE * 2);
        std::memcpy(pv, v, nb * kE * 2);
        std::fill(pk + nb * kE, pk + kDotTok * kE, uint16_t{0});
        std::fill(pv + nb * kE, pv + kDotTok * kE, uint16_t{0});
        k = pk;
        v = pv;
      }
      for (int64_t j = 0; j < (nb + 1) / 2; ++j)
        for (int64_t c = 0; c < kE; c += 32) {
          const __m512i a = _mm512_loadu_si512(v + 2 * j * kE + c);
          const __m512i b = _mm512_loadu_si512(v + (2 * j + 1) * kE + c);
          _mm512_storeu_si512(ds.vp + j * kE + c, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(ds.vp + j * kE + c + 16, _mm512_unpackhi_epi16(a, b));
        }
      const char *nk = nullptr, *nv = nullptr;
      ahead_block<c10::BFloat16>(t, i, b0 + kDotAhead * kDotTok, kE, &nk, &nv);
      for (int64_t r0 = 0; r0 < R; nk = nv = nullptr) {  // prefetched in the first pass
        if (R - r0 > 16) {
          dot_pass<kE, kParts, 2>(ds, k, Rp, r0, nb, nk, nv);
          r0 += 32;
        } else {
          dot_pass<kE, kParts, 1>(ds, k, Rp, r0, nb, nk, nv);
          r0 += 16;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    t.m[r] = ds.m[r];
    t.l[r] = ds.l[r];
    for (int64_t c = 0; c < kE; ++c) t.o[r * kE + amx_column(c / 16, c % 16)] = ds.ot[c * Rp + r];
  }
}

#endif  // __x86_64__
