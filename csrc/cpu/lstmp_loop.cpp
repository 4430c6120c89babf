// elmo_fast._cpu: the backward time loop of one LSTMP chain (elmo_fast/cpu/lstmp.py, _backward_through_time), when
// both per-step products run on small_mm's panels.
//
// A step of the loop is a handful of small operations on (rows, 512) and (rows, 4096) blocks around the two products:
// the output gradient plus the carried one, the projection clip's mask, the copy kept for the projection's weight
// gradient, the clip of the previous cell, the fused gate backward, and the carried gradients written back. As torch
// ops from Python that is ~10 dispatches a step, each 10-20 us, about 1/8 of the step's products at B = 16. Here the
// same arithmetic, in the same order, runs with no dispatch between the products: results are bit-identical to the
// Python loop (tests/test_cpu_lstmp_loop.py).
//
//   backward_loop(n, off, dys, carry_h, carry_c, c_init, gates, c_pre, tc, h_pre, dh_all, dz, rec, proj,
//                 cell_clip, proj_clip)
//     n, off: rows running at each step and the step's first packed row; dys (N, P) the packed output gradients;
//     carry_h (B, P), carry_c (B, H): gradients w.r.t. the final state in, w.r.t. the initial state out (sorted rows);
//     c_init (B, H) the initial cell; gates (N, 4H), c_pre, tc (N, H), h_pre (N, P) the forward's saved buffers
//     (h_pre None without a projection); dh_all (N, P) out, the gradients w.r.t. the projection's output (None
//     without one); dz (N, 4H) out; rec: w_recᵀ's panels (4H x P), proj: w_projᵀ's (P x H) or None.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using elmo_cpu::check_matrix;

void backward_loop(const std::vector<int64_t>& n, const std::vector<int64_t>& off, const at::Tensor& dys,
                   const at::Tensor& carry_h, const at::Tensor& carry_c, const at::Tensor& c_init,
                   const at::Tensor& gates, const at::Tensor& c_pre, const at::Tensor& tc,
                   const c10::optional<at::Tensor>& h_pre, const c10::optional<at::Tensor>& dh_all,
                   const at::Tensor& dz, const at::Tensor& rec, const c10::optional<at::Tensor>& proj,
                   c10::optional<double> cell_clip, c10::optional<double> proj_clip) {
  TORCH_CHECK(elmo_cpu::has_avx512(), "elmo_fast._cpu: backward_loop needs AVX-512 (small_mm)");
  TORCH_CHECK(n.size() == off.size(), "elmo_fast._cpu: backward_loop: n and off must have one entry per step");
  const int64_t S = static_cast<int64_t>(n.size()), B = carry_h.size(0), P = carry_h.size(1), H = carry_c.size(1);
  const int64_t N = S ? off[S - 1] + n[S - 1] : 0;
  const bool has_proj = proj.has_value();
  TORCH_CHECK(has_proj == h_pre.has_value() && has_proj == dh_all.has_value(),
              "elmo_fast._cpu: backward_loop: proj, h_pre and dh_all are given together or not at all");
  TORCH_CHECK(has_proj || P == H, "elmo_fast._cpu: backward_loop: without a projection P (", P, ") must equal H (",
              H, ")");
  check_matrix(carry_h, "carry_h", B, P);
  check_matrix(carry_c, "carry_c", B, H);
  check_matrix(c_init, "c_init", B, H);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(n[s] >= 0 && n[s] <= B && off[s] >= 0 && (s == 0 || (n[s] <= n[s - 1] && off[s] == off[s - 1] + n[s - 1])),
                "elmo_fast._cpu: backward_loop: step ", s, " (n = ", n[s], ", off = ", off[s],
                ") does not follow the packed layout");
  TORCH_CHECK(dys.size(0) >= N && gates.size(0) >= N && c_pre.size(0) >= N && tc.size(0) >= N && dz.size(0) >= N,
              "elmo_fast._cpu: backward_loop: the packed buffers hold fewer than the ", N, " positions");
  check_matrix(dys, "dys", dys.size(0), P);
  check_matrix(gates, "gates", gates.size(0), 4 * H);
  check_matrix(dz, "dz", dz.size(0), 4 * H);
  check_matrix(c_pre, "c_pre", c_pre.size(0), H);
  check_matrix(tc, "tc", tc.size(0), H);
  if (has_proj) {
    check_matrix(*h_pre, "h_pre", h_pre->size(0), P);
    check_matrix(*dh_all, "dh_all", dh_all->size(0), P);
    TORCH_CHECK(h_pre->size(0) >= N && dh_all->size(0) >= N, "elmo_fast._cpu: backward_loop: h_pre and dh_all must "
                "hold the ", N, " positions");
  }
  const float pclip = proj_clip.has_value() ? static_cast<float>(*proj_clip) : 0.0f;
  const float cclip = cell_clip.has_value() ? static_cast<float>(*cell_clip) : 0.0f;
  // scratch: the gradient w.r.t. m (the projection's input), and the previous step's clipped cell
  const at::Tensor dm_all = at::empty({B, H}, carry_c.options());
  const at::Tensor c_prev_all = at::empty({B, H}, carry_c.options());
  for (int64_t s = S - 1; s >= 0; --s) {
    const int64_t r = n[s], o = off[s];
    if (r == 0) continue;
    const float* dy = dys.data_ptr<float>() + o * P;
    const float* ch = carry_h.data_ptr<float>();
    at::Tensor dm = dm_all.narrow(0, 0, r);
    // dh = dys + carry_h (masked where the projection was clipped): into dh_all, or into dm without a projection
    float* dh = has_proj ? dh_all->data_ptr<float>() + o * P : dm.data_ptr<float>();
    const float* hp = has_proj ? h_pre->data_ptr<float>() + o * P : nullptr;
    for (int64_t i = 0; i < r * P; ++i) {
      float v = dy[i] + ch[i];
      if (proj_clip.has_value() && has_proj && std::fabs(hp[i]) > pclip) v = 0.0f;
      dh[i] = v;
    }
    if (has_proj) elmo_cpu::small_mm(dh_all->narrow(0, o, r), *proj, H, c10::nullopt, dm);
    at::Tensor c_prev;
    if (s == 0) {
      c_prev = c_init.narrow(0, 0, r);
    } else {
      c_prev = c_prev_all.narrow(0, 0, r);
      const float* src = c_pre.data_ptr<float>() + off[s - 1] * H;
      float* dst = c_prev.data_ptr<float>();
      if (cell_clip.has_value())
        for (int64_t i = 0; i < r * H; ++i) dst[i] = std::min(std::max(src[i], -cclip), cclip);
      else
        std::copy(src, src + r * H, dst);
    }
    const at::Tensor dc = carry_c.narrow(0, 0, r);
    elmo_cpu::cell_backward(dm, dc, gates.narrow(0, o, r), c_pre.narrow(0, o, r), tc.narrow(0, o, r), c_prev,
                            cell_clip, dz.narrow(0, o, r), dc);
    elmo_cpu::small_mm(dz.narrow(0, o, r), rec, P, c10::nullopt, carry_h.narrow(0, 0, r));
  }
}

}  // namespace

void add_lstmp_loop(pybind11::module_& m) {
  m.def("backward_loop", &backward_loop, "the LSTMP backward's time loop with both per-step products on panels",
        pybind11::arg("n"), pybind11::arg("off"), pybind11::arg("dys"), pybind11::arg("carry_h"),
        pybind11::arg("carry_c"), pybind11::arg("c_init"), pybind11::arg("gates"), pybind11::arg("c_pre"),
        pybind11::arg("tc"), pybind11::arg("h_pre"), pybind11::arg("dh_all"), pybind11::arg("dz"),
        pybind11::arg("rec"), pybind11::arg("proj"), pybind11::arg("cell_clip"), pybind11::arg("proj_clip"));
}
