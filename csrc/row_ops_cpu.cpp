// The small per-layer operations of a decode step (float32, on CPU), each one call instead
// of several tensor operations.
//
// With one to a few rows, a layer's RMSNorm, RoPE and the merge of the pool's partial
// with the row's own new token are a few hundred multiply-adds each, and in ATen they cost
// their dispatch: RMSNorm 5 operations (~10 us), RoPE 9 per tensor (~18 us for q, again for
// k), the merge 12 (~26 us), against ~1 us here. A row's result depends on that row alone
// (batch invariant), and the arithmetic is ATen's, operation for operation: RoPE rounds
// each product and each sum as ATen does (no fused multiply-add: this file builds for the
// baseline instruction set), so it equals the torch path bit for bit; RMSNorm sums the
// squares in double (ATen's mean pairs float32 sums in its own order), so it agrees with
// it to float32 rounding, as does the merge.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.h"

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// Rows [r0, r1) of one RoPE: x [n, heads, E] into y, pairs (2i, 2i + 1) rotated by row r's
// cos[i], sin[i]. Never contracted into fused multiply-adds (GCC contracts by default
// where the target has them), so each product and sum is rounded as ATen rounds it.
__attribute__((optimize("fp-contract=off"))) void rope_rows(const float* x, float* y, const float* cos, const float* sin, int64_t heads, int64_t E,
               int64_t r0, int64_t r1) {
  const int64_t half = E / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* a = x + (r * heads + h) * E;
      float* b = y + (r * heads + h) * E;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = a[2 * i], x1 = a[2 * i + 1];
        const float p = x0 * c[i], q = x1 * s[i], u = x0 * s[i], w = x1 * c[i];
        b[2 * i] = p - q;
        b[2 * i + 1] = u + w;
      }
    }
  }
}

}  // namespace

torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x [n, d] and weight [d] do not fit");
  const int64_t n = x.size(0), d = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xp + r * d;
      double ss[4] = {0.0, 0.0, 0.0, 0.0};  // four chains: one would wait on each add
      int64_t i = 0;
      for (; i + 4 <= d; i += 4)
        for (int j = 0; j < 4; ++j) ss[j] += static_cast<double>(a[i + j]) * a[i + j];
      for (; i < d; ++i) ss[0] += static_cast<double>(a[i]) * a[i];
      const float mean = static_cast<float>((ss[0] + ss[1] + ss[2] + ss[3]) / static_cast<double>(d));
      const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      for (int64_t e = 0; e < d; ++e) yp[r * d + e] = a[e] * inv * wp[e];
    }
  });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> rope_qk(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                 torch::Tensor sin) {
  for (auto [t, name] : {std::pair{q, "q"}, {k, "k"}, {cos, "cos"}, {sin, "sin"}}) check_rows(t, name);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0,
              "q [n, heads, E] and k [n, kv_heads, E] with E even do not fit");
  const int64_t n = q.size(0), E = q.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == E / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be [n, E / 2]");
  auto qo = torch::empty_like(q), ko = torch::empty_like(k);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    rope_rows(q.data_ptr<float>(), qo.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
              q.size(1), E, r0, r1);
    rope_rows(k.data_ptr<float>(), ko.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
              k.size(1), E, r0, r1);
  });
  return {qo, ko};
}

torch::Tensor merge_own_token(torch::Tensor o, torch::Tensor lse, torch::Tensor q, torch::Tensor k,
                              torch::Tensor v, double scale) {
  for (auto [t, name] : {std::pair{o, "o"}, {lse, "lse"}, {q, "q"}, {k, "k"}, {v, "v"}}) check_rows(t, name);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "q [n, q_heads, E], k and v [n, kv_heads, E] do not fit");
  TORCH_CHECK(o.sizes() == q.sizes() && lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "o [n, q_heads, E] and lse [n, q_heads] do not fit q");
  const int64_t n = q.size(0), H = q.size(1), Hk = k.size(1), E = q.size(2), group = H / Hk;
  auto out = torch::empty_like(o);
  const float *op = o.data_ptr<float>(), *lp = lse.data_ptr<float>(), *qp = q.data_ptr<float>(),
              *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * H, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / H, kh = (i % H) / group;
      const float* a = qp + i * E;
      const float* kr = kp + (r * Hk + kh) * E;
      const float* vr = vp + (r * Hk + kh) * E;
      float s = 0.f;
      for (int64_t e = 0; e < E; ++e) s += a[e] * kr[e];
      s *= sc;
      const float l = lp[i], m = l > s ? l : s;  // m is finite: s is
      const float wo = std::exp(l - m), ws = std::exp(s - m), sum = wo + ws;
      for (int64_t e = 0; e < E; ++e) yp[i * E + e] = (op[i * E + e] * wo + vr[e] * ws) / sum;
    }
  });
  return out;
}
