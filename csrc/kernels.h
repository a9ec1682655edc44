// The functions of the native CPU module (registered in module.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// slab_attention_cpu.cpp: partial attention of a few query rows over slab slots, into
// o_out and lse_out when given.
std::tuple<torch::Tensor, torch::Tensor> slab_attention(torch::Tensor q, std::vector<torch::Tensor> slabs,
                                                        int64_t layer, torch::Tensor slots,
                                                        torch::Tensor tokens, double scale,
                                                        torch::Tensor sources,
                                                        std::optional<torch::Tensor> o_out,
                                                        std::optional<torch::Tensor> lse_out);

// slab_attention_cpu.cpp: the path it takes for a dtype, grouped rows and head dim.
std::string attention_path(const std::string& dtype, int64_t grouped_rows, int64_t head_dim);

// slab_attention_cpu.cpp: the fewest grouped rows the panel path takes for a K/V dtype
// (forced to compare paths, for every dtype; 0: the instruction set's own).
void set_panel_rows(int64_t rows);
int64_t get_panel_rows(const std::string& dtype);

// slab_attention_cpu.cpp: bfloat16 products on the dot path (slab_dot.h): q in 1 or 2
// bfloat16 parts, 0 off (the default); whether this CPU has them.
void set_bf16_products(int64_t parts);
int64_t get_bf16_products();
bool has_bf16_dots();

// linear_cpu.cpp: x @ w.T for a few rows of x.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w);

// roof_cpu.cpp: a stream read with W multiply-adds per line (the read-rate roof of a kernel).
double roof_stream(torch::Tensor buf, int64_t fmas, double c);

// row_ops_cpu.cpp: a decode layer's small operations, float32, one call each.
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> rope_qk(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                 torch::Tensor sin);
torch::Tensor merge_own_token(torch::Tensor o, torch::Tensor lse, torch::Tensor q, torch::Tensor k,
                              torch::Tensor v, double scale);
