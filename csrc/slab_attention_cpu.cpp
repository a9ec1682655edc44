// Partial attention of a few query rows over slots of segment slabs (one shape), on CPU.
//
// The layout and the contract are those of tokenlake.kernels.slab
// (docs/design.md §4): slab [slots, layers, 2, kv_heads, C, head_dim] (index 0 = K,
// 1 = V), slot s holding tokens[s] <= C valid tokens at its front; q [rows, q_heads,
// head_dim] float32. Returns float32 o [rows, q_heads, head_dim] and the natural-log
// lse [rows, q_heads] of the softmax over every valid token of the listed slots.
//
// Work: each kv head's query heads are its group; a task is one kv head and a run of
// slots, walked block by block with an online softmax (float32 accumulation). Head dims
// that are multiples of 32 take the vector path, which reads K/V in place and turns
// bfloat16 into floats by two bit operations per 32 elements (see below); others take a
// scalar loop that widens a block at a time. Tasks run on ATen's intra-op
// threads and are merged exactly by log-sum-exp. The inner loops are compiled three
// times (AVX-512, AVX2, baseline) and picked at run time from what the CPU supports.
// K/V blocks a few blocks ahead (across slot ends) are prefetched into L2. On CPUs with
// AMX, bfloat16 calls of many grouped rows take a tile path instead (see "The tile path");
// on CPUs with AVX-512 BF16 and no tiles, where bfloat16 products are allowed, the dot
// path (slab_dot.h); elsewhere, and for other dtypes, calls of many grouped rows take the
// panel path (slab_panel.h): rows in the lanes, K/V broadcast, no reduction across lanes.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec16.h"

namespace {

using namespace tokenlake_cpu;

constexpr int64_t kBlock = 32;  // tokens per score block
// Below this much work (valid tokens x grouped rows x kv heads) a call runs on the calling
// thread: waking the pool's threads costs more than it saves (an open tail of a hundred
// tokens took 4x longer on two threads than on one).
constexpr int64_t kParallelWork = 16384;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Task {
  const float* q;        // [R, E], pre-scaled, this kv head's query rows
  const void* const* slabs;  // base of the slab of each slot of this task
  const int64_t* slots;  // slot ids of this task
  const int64_t* tokens; // valid tokens of each
  int64_t n_slots;
  int64_t kv_head, layer;
  int64_t layers, kv_heads, capacity, head_dim, rows;
  float* o;  // [R, E] unnormalised output (sum of p * v)
  float* m;  // [R] running max
  float* l;  // [R] running sum of exp(s - m)
  float* scratch;  // per task (see slab_attention)
};

template <typename T>
inline __attribute__((always_inline)) const float* widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

template <>
inline __attribute__((always_inline)) const float* widen<float>(const float* src, float*, int64_t) {
  return src;
}

// exp(x) for x <= 0 (and -inf), vectorisable: 2^(x log2 e) split into an integer power
// of two and a degree-6 polynomial of the fraction (least-squares fit of 2^f in relative
// error on Chebyshev nodes of [0, 1]); relative error below 1e-7 evaluated in float32.
inline __attribute__((always_inline)) float exp_neg(float x) {
  x = std::max(x, -87.f);  // exp(-87) ~ 1.6e-38: below, the weight is 0 to float precision
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;  // [0, 1)
  float p = 2.1690609e-4f;
  p = p * f + 1.2443082e-3f;
  p = p * f + 9.6784726e-3f;
  p = p * f + 5.5483525e-2f;
  p = p * f + 2.4022980e-1f;
  p = p * f + 6.9314699e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Empties a task's running state: m = -inf, l = 0, o = 0 (E floats per row).
inline __attribute__((always_inline)) void reset_task(const Task& t, int64_t E) {
  for (int64_t r = 0; r < t.rows; ++r) {
    t.m[r] = kNegInf;
    t.l[r] = 0.f;
  }
  std::fill(t.o, t.o + t.rows * E, 0.f);
}

// The task's kv head's K and V planes (capacity x E each) in its i-th slot.
template <typename T>
inline __attribute__((always_inline)) void slot_planes(const Task& t, int64_t i, int64_t E, const T** K,
                                                       const T** V) {
  const T* slab = static_cast<const T*>(t.slabs[i]);
  const int64_t plane = t.capacity * E;
  const int64_t base = ((t.slots[i] * t.layers + t.layer) * 2) * t.kv_heads * plane;
  *K = slab + base + t.kv_head * plane;
  *V = slab + base + (t.kv_heads + t.kv_head) * plane;
}

// kE > 0: the head dimension as a compile-time constant (64 and 128 are instantiated):
// the inner loops then unroll fully, without peeling, remainders or alias checks.
template <typename T, int kE>
inline __attribute__((always_inline)) void run_task(const Task& t) {
  const int64_t E = kE > 0 ? kE : t.head_dim, R = t.rows;
  float* kbuf = t.scratch;
  float* vbuf = kbuf + kBlock * E;
  float* s = vbuf + kBlock * E;  // [R, kBlock] scores, then probabilities
  reset_task(t, E);
  for (int64_t i = 0; i < t.n_slots; ++i) {
    const int64_t n = t.tokens[i];
    if (n <= 0) continue;
    const T *K, *V;
    slot_planes<T>(t, i, E, &K, &V);
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
      const int64_t nb = std::min(kBlock, n - b0);
      const float* k = widen<T>(K + b0 * E, kbuf, nb * E);
      for (int64_t j = 0; j < nb; ++j) {
        const float* __restrict kj = k + j * E;
        for (int64_t r = 0; r < R; ++r) {
          const float* __restrict qr = t.q + r * E;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t e = 0; e < E; ++e) acc += qr[e] * kj[e];
          s[r * kBlock + j] = acc;
        }
      }
      const float* v = widen<T>(V + b0 * E, vbuf, nb * E);
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * kBlock;
        float mb = t.m[r];
        for (int64_t j = 0; j < nb; ++j) mb = std::max(mb, sr[j]);
        const float corr = exp_neg(t.m[r] - mb);  // 0 on the first block (m = -inf)
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < nb; ++j) {
          sr[j] = exp_neg(sr[j] - mb);
          sum += sr[j];
        }
        t.l[r] = t.l[r] * corr + sum;
        t.m[r] = mb;
        float* __restrict orow = t.o + r * E;
        if (corr != 1.f) {
#pragma omp simd
          for (int64_t e = 0; e < E; ++e) orow[e] *= corr;
        }
        for (int64_t j = 0; j < nb; ++j) {
          const float p = sr[j];
          const float* __restrict vj = v + j * E;
#pragma omp simd
          for (int64_t e = 0; e < E; ++e) orow[e] += p * vj[e];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------
// The vector path (head dims that are multiples of 32): 16 lanes of float (vec16.h).
//
// K/V are read straight from the slab, 32 elements (one 64-byte line of bfloat16 or
// float16, two of float32) at a time, as two float vectors, and each pair is used for
// every query row of a row group before the next is read: nothing is widened into a
// scratch buffer and read back. bfloat16 splits a line by bit operations alone: the
// 32-bit lane i holds elements 2i (low half) and 2i + 1 (high half), so `lane << 16` and
// `lane & 0xffff0000` are the two as floats. Those vectors hold the even and the odd
// elements; q and the output are kept in that same "split order" (q rearranged once per
// task, o put back in order at its end), so no shuffle is ever needed on K or V.
//
// A row group is kRG rows (4, 2 or 1) and a block 16 tokens: its QK step accumulates
// kRG x (16 / kRG) dot products as 16 vectors of partial sums and reduces them by one
// transpose tree per 16 / kRG tokens (lane rr * kTG + jj: row rr, token jj), the online
// softmax runs on those vectors, row by row segments of kTG lanes, and the PV step keeps
// kRG rows x up to 4 pairs of output vectors in registers over the block's 16 V rows.

constexpr int64_t kAhead = 4;  // blocks between the one computed and the one prefetched

// exp_neg on the lanes of a float vector F (I: the int vector of as many lanes): the same
// polynomial as the scalar one. The constants are broadcast as `F{} + c`, exact.
template <typename F, typename I>
inline __attribute__((always_inline)) F exp_neg_lanes(F x) {
  const F lowest = F{} - 87.f;
  x = x < lowest ? lowest : x;
  const F t = x * 1.44269504088896341f;
  I ti = __builtin_convertvector(t, I);  // toward zero
  ti += (__builtin_convertvector(ti, F) > t);  // -1 where that rounded up: floor
  const F f = t - __builtin_convertvector(ti, F);
  F p = F{} + 2.1690609e-4f;
  p = p * f + 1.2443082e-3f;
  p = p * f + 9.6784726e-3f;
  p = p * f + 5.5483525e-2f;
  p = p * f + 2.4022980e-1f;
  p = p * f + 6.9314699e-1f;
  p = p * f + 1.f;
  const I bits = (ti + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline __attribute__((always_inline)) v16f exp_neg16(v16f x) { return exp_neg_lanes<v16f, v16i>(x); }

// Max or sum within each aligned segment of kSeg lanes, broadcast to the segment (log2
// kSeg halving steps).
template <int kSeg>
inline __attribute__((always_inline)) v16f segment_fold(v16f v, bool max) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int step = kSeg / 2; step; step >>= 1) {
    const v16f w = __builtin_shuffle(v, lane ^ step);
    v = max ? (v > w ? v : w) : v + w;
  }
  return v;
}

// 32 elements of K or V (or q) as two float vectors in split order.
template <typename T>
inline __attribute__((always_inline)) void split32(const T* src, v16f* a, v16f* b) {
  if constexpr (std::is_same_v<T, float>) {
    *a = load16(src);
    *b = load16(src + kLanes);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    v16u w;
    std::memcpy(&w, src, sizeof w);
    const v16u lo = w << 16, hi = w & 0xffff0000u;
    std::memcpy(a, &lo, sizeof lo);
    std::memcpy(b, &hi, sizeof hi);
  } else {
    v16fp16 x, y;
    std::memcpy(&x, src, sizeof x);
    std::memcpy(&y, src + kLanes, sizeof y);
    *a = __builtin_convertvector(x, v16f);
    *b = __builtin_convertvector(y, v16f);
  }
}

// Where element k of a row in split order sits in the row in natural order.
template <typename T>
inline int64_t natural_index(int64_t k) {
  if constexpr (!std::is_same_v<T, c10::BFloat16>) return k;
  const int64_t base = k & ~int64_t{31}, i = k & 31;
  return base + (i < kLanes ? 2 * i : 2 * (i - kLanes) + 1);
}

// Scratch of a vector-path task (floats), after the q rows in split order.
struct SplitState {
  float* q;   // [R, E] pre-scaled q in split order
  float* m;   // [R, 16]: the running max of the row group starting at row r, lane-expanded
  float* l;   // [R, 16]: its running sum
  float* p;   // [4, 16]: one row group's probabilities of a block
  void* pad;  // 16 K and 16 V rows of a partial block, zero past its tokens
};

// One block (16 tokens: K and V rows in natural order; rows past nb are the zeros the
// caller pads a partial block with, their scores masked) for rows r0 .. r0 + kRG of the task.
template <typename T, int kE, int kRG>
inline __attribute__((always_inline)) void block_rows(const Task& t, const SplitState& st, const T* K,
                                                      const T* V, int64_t nb, int64_t r0,
                                                      const char* pk, const char* pv, int64_t pf_lines) {
  constexpr int kTG = kLanes / kRG;   // tokens per transpose tree
  constexpr int kP = kE / 32;         // 32-element pieces per row
  constexpr int kCP = kP < 8 / kRG ? kP : 8 / kRG;  // pieces per PV pass (<= 16 accumulators)
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float* q = st.q + r0 * kE;
  v16f S[kRG];
#pragma GCC unroll 4
  for (int g = 0; g < kRG; ++g) {
    v16f acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = v16f{};
#pragma GCC unroll 4
    for (int p = 0; p < kP; ++p) {
#pragma GCC unroll 16
      for (int jj = 0; jj < kTG; ++jj) {
        const int64_t j = g * kTG + jj;
        // The prefetch share of this token (the lines of the block kAhead on).
        if (pf_lines > 0 && p == 0) {
          const int64_t per = (pf_lines + kLanes - 1) / kLanes;
          for (int64_t line = j * per; line < std::min(pf_lines, (j + 1) * per); ++line) {
            __builtin_prefetch(pk + line * 64, 0, 1);
            __builtin_prefetch(pv + line * 64, 0, 1);
          }
        }
        v16f ka, kb;
        split32<T>(K + j * kE + p * 32, &ka, &kb);
#pragma GCC unroll 4
        for (int rr = 0; rr < kRG; ++rr) {
          const float* qr = q + rr * kE + p * 32;
          acc[rr * kTG + jj] += load16(qr) * ka;  // two statements: two FMAs, not mul + FMA + add
          acc[rr * kTG + jj] += load16(qr + kLanes) * kb;
        }
      }
    }
    S[g] = transpose_sum(acc);
    const v16i token = (lane & (kTG - 1)) + g * kTG;
    S[g] = token < static_cast<int32_t>(nb) ? S[g] : splat(kNegInf);
  }
  // Online softmax, each row on its segment of kTG lanes.
  v16f mx = S[0];
  for (int g = 1; g < kRG; ++g) mx = mx > S[g] ? mx : S[g];
  mx = segment_fold<kTG>(mx, true);
  float* mrow = st.m + r0 * kLanes;
  float* lrow = st.l + r0 * kLanes;
  const v16f m_old = load16(mrow);
  const v16f mb = m_old > mx ? m_old : mx;
  const v16f corr = exp_neg16(m_old - mb);  // ~0 on the first block (m = -inf)
  v16f sum = v16f{};
#pragma GCC unroll 4
  for (int g = 0; g < kRG; ++g) {
    const v16i token = (lane & (kTG - 1)) + g * kTG;
    v16f pg = exp_neg16(S[g] - mb);
    pg = token < static_cast<int32_t>(nb) ? pg : v16f{};
    sum += pg;
    store16(st.p + g * kLanes, pg);
  }
  sum = segment_fold<kTG>(sum, false);
  store16(lrow, load16(lrow) * corr + sum);
  store16(mrow, mb);
  // PV: o = o * corr + sum_j p_j v_j, kCP pieces of every row of the group at a time.
  float* o = t.o + r0 * kE;
#pragma GCC unroll 4
  for (int p0 = 0; p0 < kP; p0 += kCP) {
    v16f oa[kRG][kCP], ob[kRG][kCP];
#pragma GCC unroll 4
    for (int rr = 0; rr < kRG; ++rr) {
      const float c = corr[rr * kTG];
      for (int c2 = 0; c2 < kCP; ++c2) {
        oa[rr][c2] = load16(o + rr * kE + (p0 + c2) * 32) * c;
        ob[rr][c2] = load16(o + rr * kE + (p0 + c2) * 32 + kLanes) * c;
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {  // rows past nb have p = 0 and V = 0
      v16f va[kCP], vb[kCP];
#pragma GCC unroll 4
      for (int c2 = 0; c2 < kCP; ++c2) split32<T>(V + j * kE + (p0 + c2) * 32, &va[c2], &vb[c2]);
#pragma GCC unroll 4
      for (int rr = 0; rr < kRG; ++rr) {
        const v16f pj = splat(st.p[(j / kTG) * kLanes + rr * kTG + j % kTG]);
#pragma GCC unroll 4
        for (int c2 = 0; c2 < kCP; ++c2) {
          oa[rr][c2] += pj * va[c2];
          ob[rr][c2] += pj * vb[c2];
        }
      }
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < kRG; ++rr) {
      for (int c2 = 0; c2 < kCP; ++c2) {
        store16(o + rr * kE + (p0 + c2) * 32, oa[rr][c2]);
        store16(o + rr * kE + (p0 + c2) * 32 + kLanes, ob[rr][c2]);
      }
    }
  }
}

// The K and V rows `ahead` tokens into slot i, or past its valid tokens into the next
// slot with any (null if none).
template <typename T>
inline __attribute__((always_inline)) void ahead_block(const Task& t, int64_t i, int64_t ahead, int64_t E,
                                                       const char** nk, const char** nv) {
  for (; i < t.n_slots; ++i) {
    if (ahead < t.tokens[i]) {
      const T *K, *V;
      slot_planes<T>(t, i, E, &K, &V);
      *nk = reinterpret_cast<const char*>(K + ahead * E);
      *nv = reinterpret_cast<const char*>(V + ahead * E);
      return;
    }
    ahead -= std::max<int64_t>(t.tokens[i], 0);
  }
}

// The row group starting at row r0 of R: 4 rows while 4 are left, then 2, then 1.
inline int row_group(int64_t R, int64_t r0) { return R - r0 >= 4 ? 4 : R - r0 >= 2 ? 2 : 1; }

template <typename T, int kE>
inline __attribute__((always_inline)) void run_task_v(const Task& t) {
  static_assert(kE % 32 == 0, "the vector path needs head_dim % 32 == 0");
  const int64_t R = t.rows;
  SplitState st;
  st.q = t.scratch;
  st.m = st.q + R * kE;
  st.l = st.m + R * kLanes;
  st.p = st.l + R * kLanes;
  st.pad = st.p + 4 * kLanes;
  T* padk = static_cast<T*>(st.pad);
  T* padv = padk + kLanes * kE;
  reset_task(t, kE);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < kE; ++k) st.q[r * kE + k] = t.q[r * kE + natural_index<T>(k)];
    std::fill(st.m + r * kLanes, st.m + (r + 1) * kLanes, kNegInf);
    std::fill(st.l + r * kLanes, st.l + (r + 1) * kLanes, 0.f);
  }
  // Bytes of one block's K (or V) rows (64-byte lines prefetched per block), row groups.
  constexpr int64_t kBytes = kLanes * kE * static_cast<int64_t>(sizeof(T));
  int64_t groups = 0;
  for (int64_t r0 = 0; r0 < R; ++groups) r0 += row_group(R, r0);
  for (int64_t i = 0; i < t.n_slots; ++i) {
    const int64_t n = t.tokens[i];
    if (n <= 0) continue;
    const T *K, *V;
    slot_planes<T>(t, i, kE, &K, &V);
    for (int64_t b0 = 0; b0 < n; b0 += kLanes) {
      const int64_t nb = std::min(kLanes, n - b0);
      const T* k = K + b0 * kE;
      const T* v = V + b0 * kE;
      if (nb < kLanes) {  // the rows past the slot's valid tokens may hold anything (NaN)
        std::memcpy(padk, k, nb * kE * sizeof(T));
        std::memcpy(padv, v, nb * kE * sizeof(T));
        std::memset(static_cast<void*>(padk + nb * kE), 0, (kLanes - nb) * kE * sizeof(T));
        std::memset(static_cast<void*>(padv + nb * kE), 0, (kLanes - nb) * kE * sizeof(T));
        k = padk;
        v = padv;
      }
      // The block kAhead blocks on (in the next slot past this one's end) is prefetched
      // with low locality (prefetcht2, which fills L2 on this CPU), an equal share of its
      // lines per row group, spread over the group's tokens (all at once, the requests
      // queue behind each other and stall: 8 query rows ran 5-30% slower).
      const char *nk = nullptr, *nv = nullptr;
      ahead_block<T>(t, i, b0 + kAhead * kLanes, kE, &nk, &nv);
      const int64_t lines = nk != nullptr ? kBytes / 64 : 0, share = (lines + groups - 1) / groups;
      for (int64_t r0 = 0, gi = 0; r0 < R; ++gi) {
        const int rg = row_group(R, r0);
        const int64_t lo = std::min(lines, gi * share), count = std::min(lines, lo + share) - lo;
        const char *gk = nk + lo * 64, *gv = nv + lo * 64;
        if (rg == 4) block_rows<T, kE, 4>(t, st, k, v, nb, r0, gk, gv, count);
        else if (rg == 2) block_rows<T, kE, 2>(t, st, k, v, nb, r0, gk, gv, count);
        else block_rows<T, kE, 1>(t, st, k, v, nb, r0, gk, gv, count);
        r0 += rg;
      }
    }
  }
  // Back to the task's layout: m, l per row, o in natural order.
  for (int64_t r0 = 0; r0 < R;) {
    const int rg = row_group(R, r0), tg = static_cast<int>(kLanes) / rg;
    for (int rr = 0; rr < rg; ++rr) {
      t.m[r0 + rr] = st.m[r0 * kLanes + rr * tg];
      t.l[r0 + rr] = st.l[r0 * kLanes + rr * tg];
    }
    r0 += rg;
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t r = 0; r < R; ++r) {
      float* row = t.o + r * kE;
      std::memcpy(st.q, row, kE * sizeof(float));  // the q scratch is free by now
      for (int64_t k = 0; k < kE; ++k) row[natural_index<T>(k)] = st.q[k];
    }
  }
}

// ---------------------------------------------------------------------------------
#include "slab_panel.h"  // the panel path: many grouped rows without tiles

// ---------------------------------------------------------------------------------
// The tile path (bfloat16 K/V, kAmxRows or more grouped rows, CPUs with AMX): the two matrix
// products of attention on the tile unit, the softmax on 16-lane vectors.
//
// A block is 32 tokens. Scores come out token-major (st[t][r] = K q^T: K rows are the A
// tiles, read in place; q^T is prepared once per task as B tiles), so the online softmax
// reduces over tokens lane-wise, with no shuffles. The products take bfloat16 only, so
// q and the probabilities are each split into three bfloat16 parts whose sum is exactly
// the float (truncation at 8 significant bits twice leaves at most 8): every product is
// exact and sums are float32, as in the vector path. The probabilities become A tiles
// (rows by token pairs, one 16 x 16 transpose of 32-bit lanes per part) and V B tiles
// (tokens 2j, 2j + 1 interleaved by vpunpck{l,h}wd, which permutes the columns within
// 128-bit lanes: the output is kept in that order and put back at the task's end).
// The running max is raised only when a block's max passes it by kAmxSlack, so o and l
// are rarely rescaled (probabilities then reach e^8, well inside float and bfloat16).
// Stages are software-pipelined one block apart: a tile load right after vector stores
// to the same lines (or vector loads after a tile store) waits for them to land.

#if defined(__x86_64__)

#define TL_TARGET_AMX "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"

constexpr int64_t kAmxTok = 32;     // tokens per block (the depth of one probability A tile)
// The tile path from this many grouped rows (a tile holds 16): in one run of 16K-64K
// tokens on 2 threads it read 0.8-1.0x as fast as the vector path at 8 rows, 1.0-1.2x at
// 12, 1.2-1.65x at 16 and 1.45-1.65x at 32. Prefetching the block 1-4 ahead gained nothing.
// Below it, the QK step alone on tiles (K rows as A tiles, q^T's parts as B tiles of as
// many columns as rows, softmax and PV on vectors) ran 0.55-0.87x the vector path at 1-12
// grouped rows, 0.74x even with 4 products a block on q^T tiles kept in registers: on this
// CPU a tile product with its loads costs more than the multiply-adds, splits and tree it replaces.
constexpr int64_t kAmxRows = 16;
constexpr float kAmxSlack = 8.f;    // the running max is raised only past max + this
constexpr int64_t kTile = 1024;     // bytes of a tile: 16 rows x 64 bytes

struct AmxState {
  uint16_t* qt;   // [3, Rt, E / 32] B tiles of q^T (part s, row tile, 32 columns): [16 pairs, 16 rows, 2]
  float* o;       // [Rt * 16, E] unnormalised output, columns in unpack order (amx_column)
  float* m;       // [Rt * 16] the max the probabilities are taken against
  float* l;       // [Rt * 16] their running sum
  float* st;      // [2, 32, Rt * 16] scores of a block, token-major (two blocks in flight)
  uint16_t* pa;   // [3, Rt] A tiles of the probabilities (part s): [16 rows, 32 tokens]
  uint16_t* vb;   // [2, E / 16] B tiles of V: [16 token pairs, 16 columns, 2]
  uint16_t* pad;  // [2, 32, E] K and V rows of a partial block, zero past its tokens
};

// The tile path's scratch for R grouped rows and head dim E, laid out once for both its
// size and its pieces: returns the bytes it takes and, given st, points st's pieces into
// `base` (64-byte aligned; every piece is a whole number of 64-byte lines).
inline int64_t amx_layout(int64_t R, int64_t E, char* base = nullptr, AmxState* st = nullptr) {
  const int64_t Rt = (R + 15) / 16, Rp = Rt * 16;
  int64_t at = 0;
  const auto take = [&](int64_t bytes) {
    const int64_t off = at;
    at += bytes;
    return off;
  };
  const int64_t qt = take(3 * Rt * (E / 32) * kTile), o = take(Rp * E * 4), m = take(Rp * 4),
                l = take(Rp * 4), sc = take(2 * kAmxTok * Rp * 4), pa = take(3 * Rt * kTile),
                vb = take(2 * (E / 16) * kTile), pad = take(2 * kAmxTok * E * 2);
  if (st != nullptr) {
    st->qt = reinterpret_cast<uint16_t*>(base + qt);
    st->o = reinterpret_cast<float*>(base + o);
    st->m = reinterpret_cast<float*>(base + m);
    st->l = reinterpret_cast<float*>(base + l);
    st->st = reinterpret_cast<float*>(base + sc);
    st->pa = reinterpret_cast<uint16_t*>(base + pa);
    st->vb = reinterpret_cast<uint16_t*>(base + vb);
    st->pad = reinterpret_cast<uint16_t*>(base + pad);
  }
  return at;
}

// Column n of the O tile et: the element of the natural row (vpunpck{l,h}wd order).
inline int64_t amx_column(int64_t et, int64_t n) {
  return (et / 2) * 32 + (n / 4) * 8 + (et % 2) * 4 + n % 4;
}

struct alignas(64) TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The three bfloat16 parts of 16 floats (as the top half of each 32-bit lane): truncation
// at 8 significant bits twice leaves at most 8 in the last, so x = hi + mid + lo exactly.
inline __attribute__((always_inline)) void split3(v16f x, v16u* hi, v16u* mid, v16u* lo) {
  v16u b;
  std::memcpy(&b, &x, sizeof b);
  *hi = b & 0xffff0000u;
  v16f h;
  std::memcpy(&h, hi, sizeof h);
  v16f r = x - h;
  std::memcpy(&b, &r, sizeof b);
  *mid = b & 0xffff0000u;
  std::memcpy(&h, mid, sizeof h);
  r = r - h;
  std::memcpy(lo, &r, sizeof r);
  *lo &= 0xffff0000u;
}

// In-place transpose of a 16 x 16 matrix of 32-bit lanes (four bit swaps of row and column).
inline __attribute__((always_inline)) void transpose16(v16u* a) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma GCC unroll 4
  for (int h = 8; h >= 1; h >>= 1) {
    const v16i ix = (lane & h) ? lane + (16 - h) : lane;       // x keeps c, takes y[c - h]
    const v16i iy = (lane & h) ? lane + 16 : lane + h;        // y takes x[c + h], keeps c
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const v16u x = a[i], y = a[i + h];
      a[i] = __builtin_shuffle(x, y, ix);
      a[i + h] = __builtin_shuffle(x, y, iy);
    }
  }
}

// exp_neg16 with AVX-512's floor (vrndscaleps) and power-of-two scaling (vscalefps):
// the same polynomial and the same results in 11 operations instead of 16 (the tile and
// the dot paths).
__attribute__((target(TL_TARGET_AVX512), always_inline)) inline v16f exp_tile(v16f x) {
  __m512 v;
  std::memcpy(&v, &x, sizeof v);
  v = _mm512_max_ps(v, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(2.1690609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2443082e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6784726e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5483525e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022980e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314699e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_scalef_ps(p, fi);
  v16f out;
  std::memcpy(&out, &p, sizeof out);
  return out;
}

template <int kE>
__attribute__((target(TL_TARGET_AMX), noinline)) void run_task_amx(const Task& t) {
  static_assert(kE % 32 == 0, "head_dim % 32");
  constexpr int64_t kC = kE / 32;
  const int64_t R = t.rows, Rt = (R + 15) / 16, Rp = Rt * 16;
  AmxState st;
  amx_layout(R, kE, reinterpret_cast<char*>(t.scratch), &st);
  for (int64_t rt = 0; rt < Rt; ++rt) {
    for (int64_t c = 0; c < kC; ++c) {
      v16u w[3][16];
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = rt * 16 + r;
        v16f x0 = v16f{}, x1 = v16f{};
        if (row < R) {
          x0 = load16(t.q + row * kE + c * 32);
          x1 = load16(t.q + row * kE + c * 32 + 16);
        }
        v16u h0, m0, l0, h1, m1, l1;
        split3(x0, &h0, &m0, &l0);
        split3(x1, &h1, &m1, &l1);
        const v16i ev = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        const v16u he = __builtin_shuffle(h0, h1, ev), ho = __builtin_shuffle(h0, h1, ev + 1);
        const v16u me = __builtin_shuffle(m0, m1, ev), mo = __builtin_shuffle(m0, m1, ev + 1);
        const v16u le = __builtin_shuffle(l0, l1, ev), lo = __builtin_shuffle(l0, l1, ev + 1);
        w[0][r] = (he >> 16) | ho;
        w[1][r] = (me >> 16) | mo;
        w[2][r] = (le >> 16) | lo;
      }
      for (int s = 0; s < 3; ++s) {
        transpose16(w[s]);
        uint16_t* dst = st.qt + ((s * Rt + rt) * kC + c) * (kTile / 2);
        for (int i = 0; i < 16; ++i) std::memcpy(dst + i * 32, &w[s][i], 64);
      }
    }
  }
  std::fill(st.o, st.o + Rp * kE, 0.f);
  std::fill(st.m, st.m + Rp, kNegInf);
  std::fill(st.l, st.l + Rp, 0.f);
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);

  // Stages of one block (buffer `buf` of the scores and V tiles: 0 or 1).
  const auto scores = [&](const uint16_t* k, int buf) __attribute__((target(TL_TARGET_AMX), always_inline)) {
    float* sc = st.st + buf * kAmxTok * Rp;
    // One row tile at a time: accumulators 0 (tokens 0-15) and 1 (16-31); K tiles of a
    // chunk pair in 2, 4 (even chunk) and 3, 5 (odd); q^T tiles alternate between 6 and 7,
    // so each load goes to a tile no product in flight reads.
    for (int64_t rt = 0; rt < Rt; ++rt) {
      const auto qt = [&](int s, int64_t c) { return st.qt + ((s * Rt + rt) * kC + c) * (kTile / 2); };
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < kC; c += 2) {
        _tile_loadd(2, k + c * 32, kE * 2);
        _tile_loadd(4, k + 16 * kE + c * 32, kE * 2);
        _tile_loadd(6, qt(0, c), 64);
        _tile_loadd(7, qt(1, c), 64);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(3, k + (c + 1) * 32, kE * 2);
        _tile_loadd(5, k + 16 * kE + (c + 1) * 32, kE * 2);
        _tile_loadd(6, qt(2, c), 64);
        _tile_dpbf16ps(0, 2, 7);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(7, qt(0, c + 1), 64);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(6, qt(1, c + 1), 64);
        _tile_dpbf16ps(0, 3, 7);
        _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(7, qt(2, c + 1), 64);
        _tile_dpbf16ps(0, 3, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(0, 3, 7);
        _tile_dpbf16ps(1, 5, 7);
      }
      _tile_stored(0, sc + rt * 16, Rp * 4);
      _tile_stored(1, sc + 16 * Rp + rt * 16, Rp * 4);
    }
  };
  const auto vtiles = [&](const uint16_t* v, int buf) __attribute__((target(TL_TARGET_AMX), always_inline)) {
    uint16_t* vb = st.vb + buf * (kE / 16) * (kTile / 2);
    for (int64_t j = 0; j < 16; ++j) {
      for (int64_t c = 0; c < kC; ++c) {
        const __m512i a = _mm512_loadu_si512(v + (2 * j) * kE + c * 32);
        const __m512i b = _mm512_loadu_si512(v + (2 * j + 1) * kE + c * 32);
        _mm512_store_si512(vb + (2 * c) * (kTile / 2) + j * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(vb + (2 * c + 1) * (kTile / 2) + j * 32, _mm512_unpackhi_epi16(a, b));
      }
    }
  };
  const auto softmax = [&](int64_t nb, int buf) __attribute__((target(TL_TARGET_AMX), always_inline)) {
    const float* sc = st.st + buf * kAmxTok * Rp;
    for (int64_t rt = 0; rt < Rt; ++rt) {
      v16f mb = splat(kNegInf);
      for (int64_t tk = 0; tk < nb; ++tk) {
        const v16f x = load16(sc + tk * Rp + rt * 16);
        mb = mb > x ? mb : x;
      }
      const v16f m_old = load16(st.m + rt * 16);
      const v16f m_new = mb > m_old + kAmxSlack ? mb : m_old;
      bool any = false;
      for (int r = 0; r < 16; ++r) any |= m_new[r] != m_old[r];
      if (any) {
        const v16f corr = exp_tile(m_old - m_new);
        store16(st.l + rt * 16, load16(st.l + rt * 16) * corr);
        for (int r = 0; r < 16; ++r) {
          if (corr[r] == 1.f) continue;
          float* orow = st.o + (rt * 16 + r) * kE;
          const v16f cr = splat(corr[r]);
          for (int64_t e = 0; e < kE; e += 16) store16(orow + e, load16(orow + e) * cr);
        }
        store16(st.m + rt * 16, m_new);
      }
      v16f sum = v16f{};
      v16u w[3][16];
      for (int64_t j = 0; j < 16; ++j) {
        v16u h[2], md[2], lo[2];
        for (int u = 0; u < 2; ++u) {
          const int64_t tk = 2 * j + u;
          v16f p = v16f{};
          if (tk < nb) p = exp_tile(load16(sc + tk * Rp + rt * 16) - m_new);
          sum += p;
          split3(p, &h[u], &md[u], &lo[u]);
        }
        w[0][j] = (h[0] >> 16) | h[1];
        w[1][j] = (md[0] >> 16) | md[1];
        w[2][j] = (lo[0] >> 16) | lo[1];
      }
      store16(st.l + rt * 16, load16(st.l + rt * 16) + sum);
      for (int s = 0; s < 3; ++s) {
        transpose16(w[s]);
        uint16_t* dst = st.pa + (s * Rt + rt) * (kTile / 2);
        for (int r = 0; r < 16; ++r) std::memcpy(dst + r * 32, &w[s][r], 64);
      }
    }
  };
  const auto pv = [&](int buf) __attribute__((target(TL_TARGET_AMX), always_inline)) {
    const uint16_t* vb = st.vb + buf * (kE / 16) * (kTile / 2);
    // Column tiles alternate between (output 0, V 5) and (1, 6): the next one's loads go
    // to tiles no product in flight reads; the probabilities' parts sit in 2, 3, 4.
    for (int64_t rt = 0; rt < Rt; ++rt) {
      float* orow = st.o + rt * 16 * kE;
      _tile_loadd(2, st.pa + (0 * Rt + rt) * (kTile / 2), 64);
      _tile_loadd(3, st.pa + (1 * Rt + rt) * (kTile / 2), 64);
      _tile_loadd(4, st.pa + (2 * Rt + rt) * (kTile / 2), 64);
      _tile_loadd(0, orow, kE * 4);
      _tile_loadd(5, vb, 64);
      for (int64_t et = 0; et < kE / 16; et += 2) {
        _tile_loadd(1, orow + (et + 1) * 16, kE * 4);
        _tile_loadd(6, vb + (et + 1) * (kTile / 2), 64);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(0, 4, 5);
        _tile_stored(0, orow + et * 16, kE * 4);
        if (et + 2 < kE / 16) {
          _tile_loadd(0, orow + (et + 2) * 16, kE * 4);
          _tile_loadd(5, vb + (et + 2) * (kTile / 2), 64);
        }
        _tile_dpbf16ps(1, 2, 6);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_stored(1, orow + (et + 1) * 16, kE * 4);
      }
    }
  };
  // Software pipeline: a stage's output is read a stage later, with other work between (a
  // tile load right after vector stores to its lines, or the reverse, stalls until they land).
  int64_t prev_nb = 0;
  int buf = 0;
  for (int64_t i = 0; i < t.n_slots; ++i) {
    const int64_t n = t.tokens[i];
    if (n <= 0) continue;
    const c10::BFloat16 *K, *V;
    slot_planes<c10::BFloat16>(t, i, kE, &K, &V);
    for (int64_t b0 = 0; b0 < n; b0 += kAmxTok) {
      const int64_t nb = std::min(kAmxTok, n - b0);
      const uint16_t* k = reinterpret_cast<const uint16_t*>(K + b0 * kE);
      const uint16_t* v = reinterpret_cast<const uint16_t*>(V + b0 * kE);
      if (nb < kAmxTok) {
        uint16_t* pk = st.pad;
        uint16_t* pvv = st.pad + kAmxTok * kE;
        std::memcpy(pk, k, nb * kE * 2);
        std::memcpy(pvv, v, nb * kE * 2);
        std::memset(pk + nb * kE, 0, (kAmxTok - nb) * kE * 2);
        std::memset(pvv + nb * kE, 0, (kAmxTok - nb) * kE * 2);
        k = pk;
        v = pvv;
      }
      if (prev_nb > 0) softmax(prev_nb, buf ^ 1);
      vtiles(v, buf);
      scores(k, buf);
      if (prev_nb > 0) pv(buf ^ 1);
      prev_nb = nb;
      buf ^= 1;
    }
  }
  if (prev_nb > 0) {
    softmax(prev_nb, buf ^ 1);
    pv(buf ^ 1);
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r) {
    t.m[r] = st.m[r];
    t.l[r] = st.l[r];
    for (int64_t et = 0; et < kE / 16; ++et)
      for (int64_t n2 = 0; n2 < 16; ++n2) t.o[r * kE + amx_column(et, n2)] = st.o[r * kE + et * 16 + n2];
  }
}

#endif  // __x86_64__

#include "slab_dot.h"  // the dot path: bfloat16 products without tiles, when allowed

// kL: the panel path's lanes in this variant (its registers' width).
template <typename T, int kE, int kL>
inline __attribute__((always_inline)) void dispatch_task(const Task& t) {
  if constexpr (kE > 0 && kE % 32 == 0) {
    if (t.rows >= panel_rows(sizeof(T))) run_task_panel<T, kE, kL>(t);
    else run_task_v<T, kE>(t);
  } else {
    run_task<T, kE>(t);
  }
}

#define TL_VARIANT(NAME, TARGET, LANES)                                   \
  template <typename T, int kE>                                           \
  __attribute__((target(TARGET), noinline)) void NAME(const Task& t) {    \
    dispatch_task<T, kE, LANES>(t);                                       \
  }

TL_VARIANT(task_avx512, TL_TARGET_AVX512, 16)
TL_VARIANT(task_avx2, TL_TARGET_AVX2, 8)

template <typename T, int kE>
__attribute__((noinline)) void task_base(const Task& t) {
  dispatch_task<T, kE, 4>(t);
}

template <typename T, int kE>
void (*pick_e(Isa isa))(const Task&) {
  using TaskFn = void (*)(const Task&);
  return for_isa<TaskFn>(isa, &task_avx512<T, kE>, &task_avx2<T, kE>, &task_base<T, kE>);
}

template <typename T>
void (*pick(Isa isa, int64_t head_dim))(const Task&) {
  if (head_dim == 128) return pick_e<T, 128>(isa);
  if (head_dim == 64) return pick_e<T, 64>(isa);
  return pick_e<T, 0>(isa);
}

// Whether a call takes the tile path: bfloat16 K/V, kAmxRows or more grouped rows (rows
// x query heads per kv head), head dim 64 or 128, on a CPU whose tiles are in use.
bool uses_tiles(Isa isa, at::ScalarType dtype, int64_t grouped_rows, int64_t head_dim) {
#if defined(__x86_64__)
  return isa == Isa::kAmx && dtype == torch::kBFloat16 && grouped_rows >= kAmxRows &&
         (head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

// Whether a call takes the dot path: bfloat16 products allowed (parts > 0), bfloat16 K/V, kDotRows or
// more grouped rows (or the panel path's forced threshold), head dim 64 or 128, AVX-512
// with vdpbf16ps and no tiles in use.
bool uses_dots(Isa isa, at::ScalarType dtype, int64_t grouped_rows, int64_t head_dim, int parts) {
#if defined(__x86_64__)
  const int64_t fewest = panel_rows_forced() > 0 ? panel_rows_forced() : kDotRows;
  return parts > 0 && isa == Isa::kAvx512 && cpu_has_bf16_dots() && dtype == torch::kBFloat16 &&
         grouped_rows >= fewest && (head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

// The K/V dtype a name stands for ("float32", "bfloat16" or "float16").
at::ScalarType kv_dtype(const std::string& dtype) {
  TORCH_CHECK(dtype == "bfloat16" || dtype == "float16" || dtype == "float32", "unknown dtype ", dtype);
  return dtype == "bfloat16" ? torch::kBFloat16 : dtype == "float16" ? torch::kFloat16 : torch::kFloat32;
}

// Whether a call not on the tile path takes the panel path.
bool uses_panel(int64_t grouped_rows, int64_t head_dim, at::ScalarType dtype) {
  return grouped_rows >= panel_rows(c10::elementSize(dtype)) && (head_dim == 64 || head_dim == 128);
}

}  // namespace

// The path slab_attention takes (see the file comment): "tile", "dot", "panel", "vector" or "scalar".
std::string attention_path(const std::string& dtype, int64_t grouped_rows, int64_t head_dim) {
  const at::ScalarType t = kv_dtype(dtype);
  if (uses_tiles(forced_isa(), t, grouped_rows, head_dim)) return "tile";
#if defined(__x86_64__)
  if (uses_dots(forced_isa(), t, grouped_rows, head_dim, bf16_products())) return "dot";
#endif
  if (uses_panel(grouped_rows, head_dim, t)) return "panel";
  return (head_dim == 64 || head_dim == 128) ? "vector" : "scalar";
}

void set_panel_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "the panel path's fewest rows must be at least 1 (0: the instruction set's)");
  panel_rows_forced() = rows;
}

int64_t get_panel_rows(const std::string& dtype) { return panel_rows(c10::elementSize(kv_dtype(dtype))); }

void set_bf16_products(int64_t parts) {
  TORCH_CHECK(parts >= 0 && parts <= 2, "bfloat16 products take q in 1 or 2 parts (0: off), got ", parts);
#if defined(__x86_64__)
  bf16_products() = static_cast<int>(parts);
#endif
}

int64_t get_bf16_products() {
#if defined(__x86_64__)
  return bf16_products();
#else
  return 0;
#endif
}

bool has_bf16_dots() {
#if defined(__x86_64__)
  return cpu_has_bf16_dots();
#else
  return false;
#endif
}

// Returns (o, lse); see the file comment. Slot i lives in slabs[sources[i]] (slabs of one
// shape and dtype: an instance's own and the co-located peers' it maps). tokens[i] == 0
// slots are skipped; if no slot has a token, o = 0 and lse = -inf. Given o_out and
// lse_out (contiguous float32 CPU tensors of those shapes), the results are written there
// and they are returned: a query engine writes straight into its session's out buffers.
std::tuple<torch::Tensor, torch::Tensor> slab_attention(torch::Tensor q, std::vector<torch::Tensor> slabs,
                                                        int64_t layer, torch::Tensor slots,
                                                        torch::Tensor tokens, double scale,
                                                        torch::Tensor sources,
                                                        std::optional<torch::Tensor> o_out,
                                                        std::optional<torch::Tensor> lse_out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu(),
              "q must be a [rows, q_heads, head_dim] float32 CPU tensor");
  TORCH_CHECK(o_out.has_value() == lse_out.has_value(), "give both o and lse, or neither");
  TORCH_CHECK(!slabs.empty(), "at least one slab");
  const auto& slab = slabs[0];
  for (const auto& other : slabs) {
    TORCH_CHECK(other.dim() == 6 && other.size(2) == 2 && other.is_contiguous() && other.device().is_cpu(),
                "slab must be a contiguous CPU [slots, layers, 2, kv_heads, C, head_dim] tensor");
    TORCH_CHECK(other.sizes() == slab.sizes() && other.scalar_type() == slab.scalar_type(),
                "the slabs of one call must have one shape and dtype");
  }
  const auto dtype = slab.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "slab dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(slots.dim() == 1 && tokens.dim() == 1 && slots.numel() == tokens.numel() &&
                  slots.scalar_type() == torch::kInt64 && tokens.scalar_type() == torch::kInt64,
              "slots and tokens must be int64 vectors of one length");
  TORCH_CHECK(sources.dim() == 1 && sources.scalar_type() == torch::kInt64 &&
                  sources.numel() == slots.numel(),
              "sources must be an int64 vector with one slab index per slot");
  const int64_t rows = q.size(0), q_heads = q.size(1), E = q.size(2);
  const int64_t n_slab = slab.size(0), layers = slab.size(1), kv_heads = slab.size(3);
  const int64_t capacity = slab.size(4);
  TORCH_CHECK(slab.size(5) == E && kv_heads > 0 && q_heads % kv_heads == 0,
              "q does not fit the slab's heads");
  TORCH_CHECK(layer >= 0 && layer < layers, "layer out of range");
  auto slots_c = slots.contiguous();
  auto tokens_c = tokens.contiguous();
  const int64_t* sl = slots_c.data_ptr<int64_t>();
  const int64_t* tk = tokens_c.data_ptr<int64_t>();
  const int64_t n = slots_c.numel();
  auto sources_c = sources.contiguous();
  const int64_t* src = sources_c.data_ptr<int64_t>();
  std::vector<const void*> bases(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < n_slab, "slot id out of range");
    TORCH_CHECK(tk[i] >= 0 && tk[i] <= capacity, "token count out of range");
    TORCH_CHECK(src[i] >= 0 && src[i] < static_cast<int64_t>(slabs.size()), "slab index out of range");
    bases[i] = slabs[src[i]].data_ptr();
  }
  const int64_t group = q_heads / kv_heads, R = rows * group;

  torch::Tensor o, lse;
  if (o_out.has_value()) {
    o = *o_out;
    lse = *lse_out;
    for (const auto* out : {&o, &lse})
      TORCH_CHECK(out->scalar_type() == torch::kFloat32 && out->device().is_cpu() && out->is_contiguous(),
                  "o and lse must be contiguous float32 CPU tensors");
    TORCH_CHECK(o.sizes() == q.sizes() && lse.dim() == 2 && lse.size(0) == rows && lse.size(1) == q_heads,
                "o must be [rows, q_heads, head_dim] and lse [rows, q_heads], as q");
  } else {
    o = torch::empty({rows, q_heads, E}, q.options());
    lse = torch::empty({rows, q_heads}, q.options());
  }

  // q in the grouped, pre-scaled layout: [kv_heads, R, E], row r * group + g, written by
  // a plain loop (the tensor ops it replaced took most of a decode call's time). Any
  // strides of q are read.
  std::vector<float> qg_store(kv_heads * R * E + kLanes);
  float* qg = qg_store.data() + ((64 - reinterpret_cast<std::uintptr_t>(qg_store.data()) % 64) % 64) / sizeof(float);
  {
    const float* qsrc = q.data_ptr<float>();
    const int64_t s0 = q.stride(0), s1 = q.stride(1), s2 = q.stride(2);
    const float sc = static_cast<float>(scale);
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t head = 0; head < q_heads; ++head) {
        const float* from = qsrc + row * s0 + head * s1;
        float* to = qg + ((head / group) * R + row * group + head % group) * E;
        for (int64_t e = 0; e < E; ++e) to[e] = from[e * s2] * sc;
      }
  }
  const int threads = std::max(1, at::get_num_threads());
  const int64_t per_head = std::max<int64_t>(
      1, std::min<int64_t>(n, (2 * threads + kv_heads - 1) / kv_heads));
  const int64_t tasks = kv_heads * per_head;
  // Each task's output rows and scratch start on a 64-byte line (a vector load that
  // straddles two lines costs two): sizes rounded up to 16 floats, bases aligned.
  const auto lines = [](int64_t floats) { return (floats + kLanes - 1) / kLanes * kLanes; };
  const int64_t o_size = lines(R * E);
  // The scalar path's blocks and scores, or the vector path's SplitState and padded block.
  int64_t scratch = std::max(2 * kBlock * E + R * kBlock, (R + 2 * kLanes) * E + 2 * R * kLanes + 4 * kLanes);
  void (*fn)(const Task&) = nullptr;
  const Isa isa = forced_isa();
  if (dtype == torch::kFloat32) fn = pick<float>(isa, E);
  else if (dtype == torch::kBFloat16) fn = pick<c10::BFloat16>(isa, E);
  else fn = pick<c10::Half>(isa, E);
  if (uses_panel(R, E, dtype)) scratch = std::max(scratch, panel_floats(R, E));
#if defined(__x86_64__)
  if (uses_tiles(isa, dtype, R, E)) {
    fn = E == 128 ? &run_task_amx<128> : &run_task_amx<64>;
    scratch = std::max(scratch, amx_layout(R, E) / static_cast<int64_t>(sizeof(float)));
  } else if (const int parts = bf16_products(); uses_dots(isa, dtype, R, E, parts)) {
    fn = E == 128 ? (parts == 2 ? &run_task_dot<128, 2> : &run_task_dot<128, 1>)
                  : (parts == 2 ? &run_task_dot<64, 2> : &run_task_dot<64, 1>);
    scratch = std::max(scratch, dot_layout(R, E, parts) / static_cast<int64_t>(sizeof(float)));
  }
#endif
  scratch = lines(scratch);
  std::vector<float> o_store(tasks * o_size + kLanes), m_parts(tasks * R), l_parts(tasks * R);
  std::vector<float> scratch_store(tasks * scratch + kLanes);
  const auto aligned = [](std::vector<float>& v) {
    const auto at = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((64 - at % 64) % 64) / sizeof(float);
  };
  float* o_parts = aligned(o_store);
  float* scratch_all = aligned(scratch_store);
  const float* qp = qg;

  int64_t work = 0;
  for (int64_t i = 0; i < n; ++i) work += tk[i];
  work *= R * kv_heads;
  at::parallel_for(0, tasks, work < kParallelWork ? tasks : 1, [&](int64_t begin, int64_t end) {
    for (int64_t id = begin; id < end; ++id) {
      const int64_t h = id / per_head, part = id % per_head;
      const int64_t lo = n * part / per_head, hi = n * (part + 1) / per_head;
      Task t{qp + h * R * E, bases.data() + lo, sl + lo, tk + lo, hi - lo, h, layer, layers, kv_heads,
             capacity, E, R, o_parts + id * o_size, m_parts.data() + id * R,
             l_parts.data() + id * R, scratch_all + id * scratch};
      fn(t);
    }
  });

  // Exact merge of each head's parts, back to [rows, q_heads, E] / [rows, q_heads].
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float mx = kNegInf;
      for (int64_t p = 0; p < per_head; ++p) mx = std::max(mx, m_parts[(h * per_head + p) * R + r]);
      const int64_t row = r / group, head = h * group + r % group;
      float* out = op + (row * q_heads + head) * E;
      std::fill(out, out + E, 0.f);
      if (mx == kNegInf) {
        lp[row * q_heads + head] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int64_t p = 0; p < per_head; ++p) {
        const int64_t id = h * per_head + p;
        const float w = std::exp(m_parts[id * R + r] - mx);
        total += w * l_parts[id * R + r];
        const float* src = o_parts + id * o_size + r * E;
        for (int64_t e = 0; e < E; ++e) out[e] += w * src[e];
      }
      const float inv = 1.f / total;
      for (int64_t e = 0; e < E; ++e) out[e] *= inv;
      lp[row * q_heads + head] = mx + std::log(total);
    }
  }
  return {o, lse};
}
