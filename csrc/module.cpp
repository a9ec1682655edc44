// The native CPU module: the kernels and the instruction set they run with.

#include <torch/extension.h>

#include <string>
#include <utility>

#include "kernels.h"
#include "vec16.h"

namespace {

using tokenlake_cpu::Isa;

// The instruction sets by name, highest first.
constexpr std::pair<const char*, Isa> kIsas[] = {
    {"amx", Isa::kAmx}, {"avx512", Isa::kAvx512}, {"avx2", Isa::kAvx2}, {"base", Isa::kBase}};

// "amx", "avx512", "avx2" or "base".
std::string isa_name() {
  for (const auto& [name, isa] : kIsas)
    if (isa == tokenlake_cpu::forced_isa()) return name;
  return "base";
}

// Forces a lower instruction set (tests compare the variants); an unsupported higher one
// is refused.
void set_isa(const std::string& name) {
  for (const auto& [known, isa] : kIsas) {
    if (name != known) continue;
    TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(tokenlake_cpu::detect_isa()),
                "this CPU does not support ", name);
    tokenlake_cpu::forced_isa() = isa;
    return;
  }
  TORCH_CHECK(false, "unknown isa ", name);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("slab_attention", &slab_attention, "partial attention over slab slots (CPU), into o and lse if given",
        py::arg("q"), py::arg("slabs"), py::arg("layer"), py::arg("slots"), py::arg("tokens"),
        py::arg("scale"), py::arg("sources"), py::arg("o") = py::none(), py::arg("lse") = py::none());
  m.def("attention_path", &attention_path, "slab_attention's path: tile, dot, panel, vector or scalar");
  m.def("set_panel_rows", &set_panel_rows, "force the fewest grouped rows the panel path takes (0: the isa's)");
  m.def("panel_rows", &get_panel_rows, "the fewest grouped rows the panel path takes for a K/V dtype",
        py::arg("dtype") = "float32");
  m.def("set_bf16_products", &set_bf16_products,
        "allow bfloat16 products for many grouped rows on CPUs with vdpbf16ps and no tiles: q in 1 or 2 "
        "bfloat16 parts, the probabilities rounded (0: exact paths only)");
  m.def("bf16_products", &get_bf16_products, "q's bfloat16 parts on the dot path (0: off)");
  m.def("has_bf16_dots", &has_bf16_dots, "whether this CPU has AVX-512 BF16 dot products");
  m.def("small_linear", &small_linear, "x @ w.T for a few rows of x (CPU, float32)");
  m.def("rms_norm", &rms_norm_rows, "x / sqrt(mean(x**2, -1) + eps) * weight (CPU, float32)");
  m.def("rope_qk", &rope_qk, "q and k with interleaved pairs rotated by cos / sin (CPU, float32)");
  m.def("merge_own_token", &merge_own_token,
        "a decode step's prefix partial merged with each row's own new token (CPU, float32)");
  m.def("roof_stream", &roof_stream, "a stream read with W multiply-adds per 64-byte line (CPU)");
  m.def("isa", &isa_name, "the instruction set in use");
  m.def("set_isa", &set_isa, "force an instruction set not above the CPU's");
}
