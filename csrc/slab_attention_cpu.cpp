// Partial attention of a few query rows over slots of segment slabs (one shape), on CPU.
//
// The layout and the contract are those of tokenlake.dataplane.attention_slab
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
// K/V blocks a few blocks ahead (across slot ends) are prefetched into L2.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

// exp_neg on 16 lanes (the same polynomial as the scalar one).
inline __attribute__((always_inline)) v16f exp_neg16(v16f x) {
  x = x < -87.f ? splat(-87.f) : x;
  const v16f t = x * 1.44269504088896341f;
  v16i ti = __builtin_convertvector(t, v16i);  // toward zero
  ti += (__builtin_convertvector(ti, v16f) > t);  // -1 where that rounded up: floor
  const v16f f = t - __builtin_convertvector(ti, v16f);
  v16f p = splat(2.1690609e-4f);
  p = p * f + 1.2443082e-3f;
  p = p * f + 9.6784726e-3f;
  p = p * f + 5.5483525e-2f;
  p = p * f + 2.4022980e-1f;
  p = p * f + 6.9314699e-1f;
  p = p * f + 1.f;
  const v16i bits = (ti + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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

template <typename T, int kE>
inline __attribute__((always_inline)) void dispatch_task(const Task& t) {
  if constexpr (kE > 0 && kE % 32 == 0) {
    run_task_v<T, kE>(t);
  } else {
    run_task<T, kE>(t);
  }
}

#define TL_VARIANT(NAME, TARGET)                                          \
  template <typename T, int kE>                                           \
  __attribute__((target(TARGET), noinline)) void NAME(const Task& t) {    \
    dispatch_task<T, kE>(t);                                              \
  }

TL_VARIANT(task_avx512, TL_TARGET_AVX512)
TL_VARIANT(task_avx2, TL_TARGET_AVX2)

template <typename T, int kE>
__attribute__((noinline)) void task_base(const Task& t) {
  dispatch_task<T, kE>(t);
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

}  // namespace

// Returns (o, lse); see the file comment. Slot i lives in slabs[sources[i]] (slabs of one
// shape and dtype: an instance's own and the co-located peers' it maps). tokens[i] == 0
// slots are skipped; if no slot has a token, o = 0 and lse = -inf.
std::tuple<torch::Tensor, torch::Tensor> slab_attention(torch::Tensor q, std::vector<torch::Tensor> slabs,
                                                        int64_t layer, torch::Tensor slots,
                                                        torch::Tensor tokens, double scale,
                                                        torch::Tensor sources) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu(),
              "q must be a [rows, q_heads, head_dim] float32 CPU tensor");
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

  // q in the grouped, pre-scaled layout: [kv_heads, R, E], row r * group + g.
  auto qg = (q.reshape({rows, kv_heads, group, E}).transpose(0, 1).reshape({kv_heads, R, E}) *
             static_cast<float>(scale)).contiguous();
  const int threads = std::max(1, at::get_num_threads());
  const int64_t per_head = std::max<int64_t>(
      1, std::min<int64_t>(n, (2 * threads + kv_heads - 1) / kv_heads));
  const int64_t tasks = kv_heads * per_head;
  // Each task's output rows and scratch start on a 64-byte line (a vector load that
  // straddles two lines costs two): sizes rounded up to 16 floats, bases aligned.
  const auto lines = [](int64_t floats) { return (floats + kLanes - 1) / kLanes * kLanes; };
  const int64_t o_size = lines(R * E);
  // The scalar path's blocks and scores, or the vector path's SplitState and padded block.
  const int64_t scratch = lines(std::max(2 * kBlock * E + R * kBlock, (R + 2 * kLanes) * E + 2 * R * kLanes + 4 * kLanes));
  std::vector<float> o_store(tasks * o_size + kLanes), m_parts(tasks * R), l_parts(tasks * R);
  std::vector<float> scratch_store(tasks * scratch + kLanes);
  const auto aligned = [](std::vector<float>& v) {
    const auto at = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((64 - at % 64) % 64) / sizeof(float);
  };
  float* o_parts = aligned(o_store);
  float* scratch_all = aligned(scratch_store);
  void (*fn)(const Task&) = nullptr;
  const Isa isa = forced_isa();
  if (dtype == torch::kFloat32) fn = pick<float>(isa, E);
  else if (dtype == torch::kBFloat16) fn = pick<c10::BFloat16>(isa, E);
  else fn = pick<c10::Half>(isa, E);
  const float* qp = qg.data_ptr<float>();

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
  auto o = torch::empty({rows, q_heads, E}, q.options());
  auto lse = torch::empty({rows, q_heads}, q.options());
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
