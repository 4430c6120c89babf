// elmo_fast._cpu: the time loops of one LSTMP chain (elmo_fast/cpu/lstmp.py: _forward and _backward_through_time),
// when the recurrent product runs on small_mm's panels (and the backward's projection too).
//
// A step of the loop is a handful of small operations on (rows, 512) and (rows, 4096) blocks around the two products:
// the output gradient plus the carried one, the projection clip's mask, the copy kept for the projection's weight
// gradient, the clip of the previous cell, the fused gate backward, and the carried gradients written back. As torch
// ops from Python that is ~10 dispatches a step, each 10-20 us, about 1/8 of the step's products at B = 16. Here the
// same arithmetic, in the same order, runs with no dispatch between the products: results are bit-identical to the
// Python loop (tests/test_cpu_lstmp_loop.py). The forward's step likewise: the recurrent product (with the input
// projection added), the fused gate forward, the projection (panels, or torch.mm where its pack did not pay), its
// clip, and the final states of the rows that end there.
//
//   forward_loop(n, off, gates, h_fin, c_fin, hs, c_pre, tc, m_all, h_pre, rec, proj, proj_w, cell_clip, proj_clip)
//     gates (N, 4H): the input projections in, the activated gates out when c_pre, tc and m_all (training's saved
//     buffers) are given; h_fin (B, P), c_fin (B, H): the sorted initial state in, the final state out; hs (N, P)
//     out; h_pre (N, P) out (training with a projection, else None); rec: w_rec's panels (P x 4H); proj: w_proj's
//     panels (H x P), or None with proj_w the weight (H, P) for torch.mm, or both None (no projection).
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
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using elmo_cpu::check_matrix;

// n, off describe the packed layout (rows running at each step, non-increasing, and each step's first row): returns
// N, the positions.
int64_t check_steps(const std::vector<int64_t>& n, const std::vector<int64_t>& off, int64_t B, const char* fn) {
  TORCH_CHECK(n.size() == off.size(), "elmo_fast._cpu: ", fn, ": n and off must have one entry per step");
  const int64_t S = static_cast<int64_t>(n.size());
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(n[s] >= 0 && n[s] <= B && off[s] >= 0 &&
                    (s == 0 || (n[s] <= n[s - 1] && off[s] == off[s - 1] + n[s - 1])),
                "elmo_fast._cpu: ", fn, ": step ", s, " (n = ", n[s], ", off = ", off[s],
                ") does not follow the packed layout");
  return S ? off[S - 1] + n[S - 1] : 0;
}

// dst[i] = src[i] clipped to [-clip, clip] (torch.clamp's arithmetic: NaN stays NaN), or copied without a clip.
void copy_clipped(const float* src, int64_t count, c10::optional<double> clip, float* dst) {
  if (!clip.has_value()) {
    std::copy(src, src + count, dst);
    return;
  }
  const float c = static_cast<float>(*clip);
  for (int64_t i = 0; i < count; ++i) dst[i] = std::min(std::max(src[i], -c), c);
}

// t: a contiguous (>= N, cols) float32 matrix.
void check_rows(const at::Tensor& t, const char* name, int64_t N, int64_t cols) {
  check_matrix(t, name, t.size(0), cols);
  TORCH_CHECK(t.size(0) >= N, "elmo_fast._cpu: ", name, " holds fewer than the ", N, " positions");
}

void backward_loop(const std::vector<int64_t>& n, const std::vector<int64_t>& off, const at::Tensor& dys,
                   const at::Tensor& carry_h, const at::Tensor& carry_c, const at::Tensor& c_init,
                   const at::Tensor& gates, const at::Tensor& c_pre, const at::Tensor& tc,
                   const c10::optional<at::Tensor>& h_pre, const c10::optional<at::Tensor>& dh_all,
                   const at::Tensor& dz, const at::Tensor& rec, const c10::optional<at::Tensor>& proj,
                   c10::optional<double> cell_clip, c10::optional<double> proj_clip) {
  TORCH_CHECK(elmo_cpu::has_avx512(), "elmo_fast._cpu: backward_loop needs AVX-512 (small_mm)");
  const int64_t S = static_cast<int64_t>(n.size()), B = carry_h.size(0), P = carry_h.size(1), H = carry_c.size(1);
  const int64_t N = check_steps(n, off, B, "backward_loop");
  const bool has_proj = proj.has_value();
  TORCH_CHECK(has_proj == h_pre.has_value() && has_proj == dh_all.has_value(),
              "elmo_fast._cpu: backward_loop: proj, h_pre and dh_all are given together or not at all");
  TORCH_CHECK(has_proj || P == H, "elmo_fast._cpu: backward_loop: without a projection P (", P, ") must equal H (",
              H, ")");
  check_matrix(carry_h, "carry_h", B, P);
  check_matrix(carry_c, "carry_c", B, H);
  check_matrix(c_init, "c_init", B, H);
  check_rows(dys, "dys", N, P);
  check_rows(gates, "gates", N, 4 * H);
  check_rows(dz, "dz", N, 4 * H);
  check_rows(c_pre, "c_pre", N, H);
  check_rows(tc, "tc", N, H);
  if (has_proj) {
    check_rows(*h_pre, "h_pre", N, P);
    check_rows(*dh_all, "dh_all", N, P);
  }
  const bool masked = has_proj && proj_clip.has_value();  // the projection's clip zeroes dh where it cut
  const float pclip = masked ? static_cast<float>(*proj_clip) : 0.0f;
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
      if (masked && std::fabs(hp[i]) > pclip) v = 0.0f;
      dh[i] = v;
    }
    if (has_proj) elmo_cpu::small_mm(dh_all->narrow(0, o, r), *proj, H, c10::nullopt, dm);
    // the previous step's cell, clipped (the forward saved it before its clip)
    const at::Tensor c_prev = s == 0 ? c_init.narrow(0, 0, r) : c_prev_all.narrow(0, 0, r);
    if (s > 0) copy_clipped(c_pre.data_ptr<float>() + off[s - 1] * H, r * H, cell_clip, c_prev.data_ptr<float>());
    const at::Tensor dc = carry_c.narrow(0, 0, r);
    elmo_cpu::cell_backward(dm, dc, gates.narrow(0, o, r), c_pre.narrow(0, o, r), tc.narrow(0, o, r), c_prev,
                            cell_clip, dz.narrow(0, o, r), dc);
    elmo_cpu::small_mm(dz.narrow(0, o, r), rec, P, c10::nullopt, carry_h.narrow(0, 0, r));
  }
}

void forward_loop(const std::vector<int64_t>& n, const std::vector<int64_t>& off, const at::Tensor& gates,
                  const at::Tensor& h_fin, const at::Tensor& c_fin, const at::Tensor& hs,
                  const c10::optional<at::Tensor>& c_pre, const c10::optional<at::Tensor>& tc,
                  const c10::optional<at::Tensor>& m_all, const c10::optional<at::Tensor>& h_pre, const at::Tensor& rec,
                  const c10::optional<at::Tensor>& proj, const c10::optional<at::Tensor>& proj_w,
                  c10::optional<double> cell_clip, c10::optional<double> proj_clip) {
  TORCH_CHECK(elmo_cpu::has_avx512(), "elmo_fast._cpu: forward_loop needs AVX-512 (small_mm)");
  const int64_t B = h_fin.size(0), P = h_fin.size(1), H = c_fin.size(1);
  const int64_t N = check_steps(n, off, B, "forward_loop");
  const bool save = c_pre.has_value(), has_proj = proj.has_value() || proj_w.has_value();
  TORCH_CHECK(save == tc.has_value() && save == m_all.has_value() && (save && has_proj) == h_pre.has_value(),
              "elmo_fast._cpu: forward_loop: c_pre, tc, m_all (and h_pre with a projection) are given together");
  TORCH_CHECK(!(proj.has_value() && proj_w.has_value()), "elmo_fast._cpu: forward_loop: proj or proj_w, not both");
  TORCH_CHECK(has_proj || P == H, "elmo_fast._cpu: forward_loop: without a projection P (", P, ") must equal H (", H,
              ")");
  check_matrix(h_fin, "h_fin", B, P);
  check_matrix(c_fin, "c_fin", B, H);
  check_rows(gates, "gates", N, 4 * H);
  check_rows(hs, "hs", N, P);
  if (save) {
    check_rows(*c_pre, "c_pre", N, H);
    check_rows(*tc, "tc", N, H);
    check_rows(*m_all, "m_all", N, H);
    if (has_proj) check_rows(*h_pre, "h_pre", N, P);
  }
  if (proj_w.has_value()) check_matrix(*proj_w, "proj_w", H, P);
  const auto opts = c_fin.options();
  const at::Tensor z_all = at::empty({B, 4 * H}, opts), m_scr = at::empty({B, H}, opts);
  const at::Tensor hp_scr = at::empty({B, P}, opts);
  const at::Tensor c_buf[2] = {at::empty({B, H}, opts), at::empty({B, H}, opts)};
  const int64_t S = static_cast<int64_t>(n.size());
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r = n[s], o = off[s];
    if (r == 0) break;  // n never grows again
    const at::Tensor h_prev = s == 0 ? h_fin.narrow(0, 0, r) : hs.narrow(0, off[s - 1], r);
    const at::Tensor c_prev = s == 0 ? c_fin.narrow(0, 0, r) : c_buf[(s - 1) % 2].narrow(0, 0, r);
    const at::Tensor z = z_all.narrow(0, 0, r), c = c_buf[s % 2].narrow(0, 0, r);
    const at::Tensor blk_gates = gates.narrow(0, o, r);
    elmo_cpu::small_mm(h_prev, rec, 4 * H, blk_gates, z);
    const at::Tensor m = save ? m_all->narrow(0, o, r) : m_scr.narrow(0, 0, r);
    if (save)
      elmo_cpu::cell_forward(z, c_prev, cell_clip, blk_gates, c_pre->narrow(0, o, r), c, tc->narrow(0, o, r), m);
    else
      elmo_cpu::cell_forward(z, c_prev, cell_clip, c10::nullopt, c10::nullopt, c, c10::nullopt, m);
    float* h = hs.data_ptr<float>() + o * P;
    if (!has_proj) {
      std::copy(m.data_ptr<float>(), m.data_ptr<float>() + r * P, h);
    } else {
      at::Tensor hp = save ? h_pre->narrow(0, o, r) : hp_scr.narrow(0, 0, r);
      if (proj.has_value()) {
        elmo_cpu::small_mm(m, *proj, P, c10::nullopt, hp);
      } else {
        // torch.mm into the scratch's aligned start, then copied: MKL's bits for a small product depend on where
        // its output starts (an AMD EPYC, 2026-11-27), and the Python loop's product is a fresh tensor
        at::Tensor fresh = hp_scr.narrow(0, 0, r);
        at::mm_out(fresh, m, *proj_w);
        if (save) hp.copy_(fresh);
        hp = fresh;
      }
      copy_clipped(hp.data_ptr<float>(), r * P, proj_clip, h);
    }
    const int64_t e = s + 1 < S ? n[s + 1] : 0;
    if (e < r) {  // rows e..r-1 ran their last step: their state is final
      std::copy(h + e * P, h + r * P, h_fin.data_ptr<float>() + e * P);
      std::copy(c.data_ptr<float>() + e * H, c.data_ptr<float>() + r * H, c_fin.data_ptr<float>() + e * H);
    }
  }
}

}  // namespace

void add_lstmp_loop(pybind11::module_& m) {
  m.def("backward_loop", &backward_loop,
        pybind11::call_guard<pybind11::gil_scoped_release>(),  // no Python object touched: other threads run
        "the LSTMP backward's time loop with both per-step products on panels",
        pybind11::arg("n"), pybind11::arg("off"), pybind11::arg("dys"), pybind11::arg("carry_h"),
        pybind11::arg("carry_c"), pybind11::arg("c_init"), pybind11::arg("gates"), pybind11::arg("c_pre"),
        pybind11::arg("tc"), pybind11::arg("h_pre"), pybind11::arg("dh_all"), pybind11::arg("dz"),
        pybind11::arg("rec"), pybind11::arg("proj"), pybind11::arg("cell_clip"), pybind11::arg("proj_clip"));
  m.def("forward_loop", &forward_loop,
        pybind11::call_guard<pybind11::gil_scoped_release>(),  // no Python object touched: other threads run
        "the LSTMP forward's time loop with the recurrent product on panels",
        pybind11::arg("n"), pybind11::arg("off"), pybind11::arg("gates"), pybind11::arg("h_fin"),
        pybind11::arg("c_fin"), pybind11::arg("hs"), pybind11::arg("c_pre"), pybind11::arg("tc"),
        pybind11::arg("m_all"), pybind11::arg("h_pre"), pybind11::arg("rec"), pybind11::arg("proj"),
        pybind11::arg("proj_w"), pybind11::arg("cell_clip"), pybind11::arg("proj_clip"));
}
