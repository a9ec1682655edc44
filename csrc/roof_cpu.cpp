// The attention's arithmetic on a stream, and nothing else: the read-rate roof of a kernel
// that does W multiply-adds per 64-byte line it reads (`tokenlake bench kernel`).
//
// A memory-bound kernel reaches the machine's read bandwidth only when its arithmetic
// hides behind the loads. On a core that runs one thread, the loads a loop keeps in flight
// are bounded by how far its instruction window reaches past the arithmetic, so a loop that
// does a few vector multiply-adds per line it reads reads more slowly than a bare reduction
// even where those multiply-adds take a fraction of the time the bytes do. This loop
// measures that: it reads every 64-byte line of a buffer once (as 16 floats, whatever the
// buffer's dtype), does W vector multiply-adds with it into independent accumulators and
// prefetches into L2 as the attention kernel does. With W the attention's multiply-adds
// per line of K/V it is the best read rate any kernel doing that arithmetic on these
// threads can expect; the attention kernel does more besides (softmax, reductions,
// bfloat16 conversion).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec16.h"

namespace {

using namespace tokenlake_cpu;

constexpr int kAcc = 8;               // independent accumulators (2 ports x 4 cycles)
constexpr int64_t kAheadBytes = 8192;  // prefetch distance (the attention's block size, order of)
constexpr int64_t kLine = 64;

// Lines [l0, l1) of `buf`: each loaded once and multiplied into kW accumulators (round
// robin over kAcc) by c; returns the sum of every lane of every accumulator. With kW below
// kAcc each iteration takes kAcc / kW lines, so that every accumulator index is a constant
// and the accumulators stay in registers (a rotating index put them on the stack).
template <int kW>
inline __attribute__((always_inline)) double roof_lines(const char* buf, int64_t l0, int64_t l1,
                                                        int64_t n_lines, float c) {
  constexpr int kGroup = kW < kAcc ? kAcc / kW : 1;  // lines per iteration
  v16f acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = v16f{};
  const v16f cv = splat(c);
  int64_t l = l0;
  for (; l + kGroup <= l1; l += kGroup) {
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g) {
      const int64_t line = l + g;
      if (line + kAheadBytes / kLine < n_lines) __builtin_prefetch(buf + line * kLine + kAheadBytes, 0, 1);
      const v16f x = load16(reinterpret_cast<const float*>(buf + line * kLine));
#pragma GCC unroll 64
      for (int w = 0; w < kW; ++w) acc[(g * kW + w) % kAcc] += x * cv;
    }
  }
  for (; l < l1; ++l) {  // fewer than kGroup lines left
    const v16f x = load16(reinterpret_cast<const float*>(buf + l * kLine));
#pragma GCC unroll 64
    for (int w = 0; w < kW; ++w) acc[w % kAcc] += x * cv;
  }
  double total = 0;
  for (int i = 0; i < kAcc; ++i)
    for (int j = 0; j < kLanes; ++j) total += acc[i][j];
  return total;
}

using RoofFn = double (*)(const char*, int64_t, int64_t, int64_t, float);

#define TL_ROOF_VARIANT(NAME, TARGET)                                                        \
  template <int kW>                                                                          \
  __attribute__((target(TARGET), noinline)) double NAME(const char* b, int64_t l0, int64_t l1, \
                                                        int64_t n, float c) {                \
    return roof_lines<kW>(b, l0, l1, n, c);                                                  \
  }

TL_ROOF_VARIANT(roof_avx512, TL_TARGET_AVX512)
TL_ROOF_VARIANT(roof_avx2, TL_TARGET_AVX2)

template <int kW>
__attribute__((noinline)) double roof_base(const char* b, int64_t l0, int64_t l1, int64_t n, float c) {
  return roof_lines<kW>(b, l0, l1, n, c);
}

template <int kW>
RoofFn pick_w(Isa isa) {
  return for_isa<RoofFn>(isa, &roof_avx512<kW>, &roof_avx2<kW>, &roof_base<kW>);
}

}  // namespace

// Reads every 64-byte line of `buf` (contiguous CPU, any dtype, a whole number of lines)
// once as 16 floats and does `fmas` (1, 2, 4, ..., 64) multiply-adds by `c` with it, on
// ATen's threads; returns the sum of the products (fmas * c * the sum of the buffer read
// as float32, up to rounding), which keeps the work from being optimised away.
double roof_stream(torch::Tensor buf, int64_t fmas, double c) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "buf must be a contiguous CPU tensor");
  const int64_t nbytes = buf.numel() * buf.element_size();
  TORCH_CHECK(nbytes % kLine == 0, "buf must hold a whole number of 64-byte lines, not ", nbytes, " bytes");
  const Isa isa = forced_isa();
  RoofFn fn = nullptr;
  switch (fmas) {
    case 1: fn = pick_w<1>(isa); break;
    case 2: fn = pick_w<2>(isa); break;
    case 4: fn = pick_w<4>(isa); break;
    case 8: fn = pick_w<8>(isa); break;
    case 16: fn = pick_w<16>(isa); break;
    case 32: fn = pick_w<32>(isa); break;
    case 64: fn = pick_w<64>(isa); break;
    default: TORCH_CHECK(false, "fmas must be a power of two from 1 to 64, not ", fmas);
  }
  const char* base = static_cast<const char*>(buf.data_ptr());
  const int64_t lines = nbytes / kLine;
  const int threads = std::max(1, at::get_num_threads());
  std::vector<double> parts(threads, 0.0);
  // One contiguous range per thread, as the attention kernel gives each thread whole heads.
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      parts[t] = fn(base, lines * t / threads, lines * (t + 1) / threads, lines, static_cast<float>(c));
  });
  double total = 0;
  for (double p : parts) total += p;
  return total;
}
