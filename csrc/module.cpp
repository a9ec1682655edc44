// The native CPU module: the kernels and the instruction set they run with.

#include <torch/extension.h>

#include <string>

#include "kernels.h"
#include "vec16.h"

namespace {

using tokenlake_cpu::Isa;

// "amx", "avx512", "avx2" or "base".
std::string isa_name() {
  switch (tokenlake_cpu::forced_isa()) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "base";
  }
}

// Forces a lower instruction set (tests compare the variants); an unsupported higher one
// is refused.
void set_isa(const std::string& name) {
  Isa want = name == "amx"      ? Isa::kAmx
             : name == "avx512" ? Isa::kAvx512
             : name == "avx2"   ? Isa::kAvx2
                                : Isa::kBase;
  TORCH_CHECK(name == "amx" || name == "avx512" || name == "avx2" || name == "base", "unknown isa ", name);
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(tokenlake_cpu::detect_isa()),
              "this CPU does not support ", name);
  tokenlake_cpu::forced_isa() = want;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("slab_attention", &slab_attention, "partial attention over slab slots (CPU)");
  m.def("attention_path", &attention_path, "slab_attention's path: tile, vector or scalar");
  m.def("small_linear", &small_linear, "x @ w.T for a few rows of x (CPU, float32)");
  m.def("roof_stream", &roof_stream, "a stream read with W multiply-adds per 64-byte line (CPU)");
  m.def("isa", &isa_name, "the instruction set in use");
  m.def("set_isa", &set_isa, "force an instruction set not above the CPU's");
}
