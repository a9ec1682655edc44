// What the CPU kernels share: 16-lane float vectors written with GCC's vector extensions
// (one source compiles to AVX-512, AVX2 as pairs of registers, and SSE, through the
// target attribute of the function that inlines them) and the instruction set picked at
// run time.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenlake_cpu {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef _Float16 v16fp16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

inline __attribute__((always_inline)) v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// A broadcast (not `v16f{} + x`, which costs an add, as 0 + x is not x for x = -0).
inline __attribute__((always_inline)) v16f splat(float x) {
  return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

// Lane j of the result is the sum of every lane of a[j] (a holds 16 vectors; it is overwritten).
inline __attribute__((always_inline)) v16f transpose_sum(v16f* a) {
  // Step h pairs a[i] with a[i + h]: each 2h-lane group of the result holds h lanes of
  // partial sums of a[i] then h of a[i + h]; after h = 8, 4, 2, 1 lane j holds a[j]'s sum.
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi8 = lo8 + 8;
  const v16i lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const v16i hi4 = lo4 + 4;
  const v16i lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const v16i hi2 = lo2 + 2;
  const v16i lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const v16i hi1 = lo1 + 1;
  for (int i = 0; i < 8; ++i) a[i] = __builtin_shuffle(a[i], a[i + 8], lo8) + __builtin_shuffle(a[i], a[i + 8], hi8);
  for (int i = 0; i < 4; ++i) a[i] = __builtin_shuffle(a[i], a[i + 4], lo4) + __builtin_shuffle(a[i], a[i + 4], hi4);
  for (int i = 0; i < 2; ++i) a[i] = __builtin_shuffle(a[i], a[i + 2], lo2) + __builtin_shuffle(a[i], a[i + 2], hi2);
  return __builtin_shuffle(a[0], a[1], lo1) + __builtin_shuffle(a[0], a[1], hi1);
}

// kAmx: AVX-512 and the tile unit with bfloat16 products (Sapphire Rapids on), which the
// OS lets this process use; the kernels without a tile variant run their AVX-512 one.
enum class Isa { kBase = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// Asks Linux for the tile data state (off for a process until asked); true if granted.
inline bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

inline Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted())
      return Isa::kAmx;
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBase;
}

// The instruction set the kernels run with (one for the whole module: an inline function's
// static is shared by every source file).
inline Isa& forced_isa() {
  static Isa isa = detect_isa();
  return isa;
}

// The variant of a kernel built for `isa`, among the three built for each instruction set.
template <typename Fn>
inline Fn for_isa(Isa isa, Fn avx512, Fn avx2, Fn base) {
  switch (isa) {
    case Isa::kAmx:
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    default: return base;
  }
}

// The variants' target attributes (x86-64; elsewhere only the baseline is built).
#define TL_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define TL_TARGET_AVX2 "avx2,fma,f16c"

}  // namespace tokenlake_cpu
