// Torch glue for the persistent LSTMP kernels (csrc/include/elmo_fast/lstmp.h): argument checks, device
// guard, current stream, allocation, dtype dispatch, the input-projection GEMM before the time loop and
// the weight-gradient GEMMs after it. Registered into elmo_fast._C by module.cpp.
//
// Entry points (all tensors on one CUDA device; weights in the TF layout of elmo_fast/reference/lstmp.py):
//   lstmp(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, *, cell_clip, proj_clip, forget_bias, reverse, residual)
//       -> (y, h_n, c_n)                                   inference, no caches
//   lstmp_forward(<same>) -> (y, h_n, c_n, gates, cpre, hpre)   training: also the caches backward needs
//   lstmp_backward(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, gates, cpre, hpre, dy, dh_n, dc_n, *, <flags>)
//       -> (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0)
//   lstmp_unsupported_reason(x, H, P) -> "" when the kernel can run for x's device/dtype/batch and (H, P),
//       else why not (used by elmo_fast.ops.lstmp to fall back under backend="auto").
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
// The ATen ops it calls, one header each (<torch/extension.h> is the whole C++ frontend: 4x the compile time).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <tuple>

#include "elmo_fast/lstmp.h"

namespace elmo_fast_bind {
namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;
using OptDouble = c10::optional<double>;

constexpr const char* kOp = "elmo_fast._C.lstmp";

struct Dims {
  int64_t B, T, D, H, P;
  elmo_fast::LstmpDtype dtype;
};

elmo_fast::LstmpDtype to_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return elmo_fast::LstmpDtype::kFloat32;
    case at::kBFloat16: return elmo_fast::LstmpDtype::kBFloat16;
    default:
      TORCH_CHECK(false, kOp, ": x must be float32 or bfloat16, got ", st,
                  " (float16 is not supported by the persistent kernel; use backend='triton')");
  }
  return elmo_fast::LstmpDtype::kFloat32;  // unreachable
}

// fp32_ok: the tensor may also be float32 while x is bfloat16 (autocast's fp32 bias and recurrent states, which
// elmo_fast.ops._precision keeps in fp32); it is converted where the kernel needs x's dtype.
void check_tensor(const Tensor& t, const char* name, const Tensor& x, at::IntArrayRef shape, bool fp32_ok = false) {
  TORCH_CHECK(t.defined(), kOp, ": ", name, " is required");
  TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == x.device(), kOp, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  TORCH_CHECK(t.sizes() == shape, kOp, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type() || (fp32_ok && t.scalar_type() == at::kFloat), kOp, ": ", name,
              " must have x's dtype ", x.scalar_type(), fp32_ok ? " or float32" : "", ", got ", t.scalar_type());
}

Dims check_inputs(const Tensor& x, const Tensor& w_in, const Tensor& w_rec, const Tensor& bias,
                  const OptTensor& w_proj, const Tensor& h0, const Tensor& c0, const Tensor& lengths, bool residual) {
  TORCH_CHECK(x.defined() && x.is_cuda(), kOp, ": x must be a CUDA tensor, got ",
              x.defined() ? x.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK(x.dim() == 3, kOp, ": x must be (B, T, D), got shape ", x.sizes());
  Dims d{};
  d.dtype = to_dtype(x.scalar_type());
  d.B = x.size(0);
  d.T = x.size(1);
  d.D = x.size(2);
  TORCH_CHECK(w_in.dim() == 2 && w_in.size(0) == d.D && w_in.size(1) % 4 == 0, kOp, ": w_in must be (D=", d.D,
              ", 4H), got ", w_in.sizes());
  d.H = w_in.size(1) / 4;
  TORCH_CHECK(h0.dim() == 2, kOp, ": h0 must be (B, P), got ", h0.sizes());
  d.P = h0.size(1);
  TORCH_CHECK(w_proj.has_value() && w_proj->defined(), kOp,
              ": the persistent kernel needs a projection (w_proj of shape (H, P)); got None. Use backend='triton'.");
  check_tensor(w_in, "w_in", x, {d.D, 4 * d.H});
  check_tensor(w_rec, "w_rec", x, {d.P, 4 * d.H});
  check_tensor(bias, "bias", x, {4 * d.H}, /*fp32_ok=*/true);
  check_tensor(*w_proj, "w_proj", x, {d.H, d.P});
  check_tensor(h0, "h0", x, {d.B, d.P}, /*fp32_ok=*/true);
  check_tensor(c0, "c0", x, {d.B, d.H}, /*fp32_ok=*/true);
  TORCH_CHECK(lengths.defined() && lengths.dim() == 1 && lengths.size(0) == d.B, kOp, ": lengths must be (B=", d.B,
              ",), got ", lengths.defined() ? lengths.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isIntegralType(lengths.scalar_type(), /*includeBool=*/false), kOp,
              ": lengths must be an integer tensor, got ", lengths.scalar_type());
  TORCH_CHECK(!residual || d.D == d.P, kOp, ": residual needs D == P, got D=", d.D, ", P=", d.P);
  TORCH_CHECK(d.B < (int64_t{1} << 31) && d.T < (int64_t{1} << 31) && d.H < (int64_t{1} << 28) &&
                  d.P < (int64_t{1} << 28) && d.B * d.P < (int64_t{1} << 31),
              kOp, ": sizes too large for the kernel's int indexing: B=", d.B, " T=", d.T, " H=", d.H, " P=", d.P);
  return d;
}

// Contiguous and 16-byte aligned (the kernels use 16-byte accesses).
Tensor dense(const Tensor& t) {
  Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

elmo_fast::LstmpPlan make_plan(const Dims& d, const Tensor& x) {
  elmo_fast::LstmpPlan plan;
  char msg[768];
  const int rc = elmo_fast::lstmp_plan(d.dtype, x.get_device(), static_cast<int>(d.B), static_cast<int>(d.H),
                                       static_cast<int>(d.P), &plan, msg, sizeof msg);
  TORCH_CHECK(rc == 0, kOp, ": ", msg);
  return plan;
}

// The fields LstmpForwardArgs and LstmpBackwardArgs share: sizes, recurrent weights, lengths, clips, direction.
template <typename Args>
void fill_shared(Args& a, int64_t B, int64_t T, int64_t H, int64_t P, const Tensor& wr, const Tensor& wp,
                 const Tensor& len32, OptDouble cell_clip, OptDouble proj_clip, bool reverse) {
  a.B = static_cast<int>(B);
  a.T = static_cast<int>(T);
  a.H = static_cast<int>(H);
  a.P = static_cast<int>(P);
  a.w_rec = wr.data_ptr();
  a.w_proj = wp.data_ptr();
  a.lengths = len32.data_ptr<int32_t>();
  a.has_cell_clip = cell_clip.has_value();
  a.cell_clip = cell_clip.has_value() ? static_cast<float>(*cell_clip) : 0.f;
  a.has_proj_clip = proj_clip.has_value();
  a.proj_clip = proj_clip.has_value() ? static_cast<float>(*proj_clip) : 0.f;
  a.reverse = reverse;
}

void check_launch(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, kOp, ": ", what, " launch failed: ", cudaGetErrorString(e));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> forward_impl(
    const Tensor& x, const Tensor& w_in, const Tensor& w_rec, const Tensor& bias, const OptTensor& w_proj,
    const Tensor& h0, const Tensor& c0, const Tensor& lengths, OptDouble cell_clip, OptDouble proj_clip,
    double forget_bias, bool reverse, bool residual, bool training) {
  const Dims d = check_inputs(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, residual);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options();
  const auto fopts = x.options().dtype(at::kFloat);
  const int64_t B = d.B, T = d.T, H = d.H, P = d.P;

  Tensor h = h0.to(x.scalar_type()).contiguous().clone();  // the kernel keeps h in x's dtype
  Tensor c = c0.to(at::kFloat).contiguous().clone();
  Tensor gates, cpre, hpre;
  if (training) {
    gates = at::zeros({B, T, 4 * H}, opts);
    cpre = at::zeros({B, T, H}, fopts);
    hpre = at::zeros({B, T, P}, fopts);
  }
  if (B == 0 || T == 0) {
    return {at::zeros({B, T, P}, opts), h.to(h0.scalar_type()), c.to(c0.scalar_type()), gates, cpre, hpre};
  }
  const elmo_fast::LstmpPlan plan = make_plan(d, x);

  Tensor xc = dense(x);
  Tensor gx = at::matmul(xc.view({B * T, d.D}), w_in).view({B, T, 4 * H});  // hoisted input projection
  gx = dense(gx);
  Tensor wr = dense(w_rec), wp = dense(*w_proj), bs = dense(bias.to(x.scalar_type()));
  Tensor len32 = lengths.to(x.device(), at::kInt).contiguous();
  Tensor y = at::empty({B, T, P}, opts);
  Tensor partial = at::empty({static_cast<int64_t>(elmo_fast::lstmp_partial_bytes(plan, static_cast<int>(P)) / 4)},
                             fopts);

  elmo_fast::LstmpForwardArgs a;
  fill_shared(a, B, T, H, P, wr, wp, len32, cell_clip, proj_clip, reverse);
  a.gx = gx.data_ptr();
  a.x = residual ? xc.data_ptr() : nullptr;
  a.bias = bs.data_ptr();
  a.forget_bias = static_cast<float>(forget_bias);
  a.residual = residual;
  a.y = y.data_ptr();
  a.h = h.data_ptr();
  a.c = c.data_ptr<float>();
  a.partial = partial.data_ptr<float>();
  if (training) {
    a.gates = gates.data_ptr();
    a.cpre = cpre.data_ptr<float>();
    a.hpre = hpre.data_ptr<float>();
  }
  check_launch(elmo_fast::lstmp_forward(d.dtype, plan, a, c10::cuda::getCurrentCUDAStream().stream()), "forward kernel");
  return {y, h.to(h0.scalar_type()), c.to(c0.scalar_type()), gates, cpre, hpre};
}

std::tuple<Tensor, Tensor, Tensor> lstmp(const Tensor& x, const Tensor& w_in, const Tensor& w_rec, const Tensor& bias,
                                         const OptTensor& w_proj, const Tensor& h0, const Tensor& c0,
                                         const Tensor& lengths, OptDouble cell_clip, OptDouble proj_clip,
                                         double forget_bias, bool reverse, bool residual) {
  auto r = forward_impl(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse,
                        residual, /*training=*/false);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstmp_forward(
    const Tensor& x, const Tensor& w_in, const Tensor& w_rec, const Tensor& bias, const OptTensor& w_proj,
    const Tensor& h0, const Tensor& c0, const Tensor& lengths, OptDouble cell_clip, OptDouble proj_clip,
    double forget_bias, bool reverse, bool residual) {
  return forward_impl(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, cell_clip, proj_clip, forget_bias, reverse,
                      residual, /*training=*/true);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstmp_backward(
    const Tensor& x, const Tensor& w_in, const Tensor& w_rec, const Tensor& bias, const OptTensor& w_proj,
    const Tensor& h0, const Tensor& c0, const Tensor& lengths, const Tensor& gates, const Tensor& cpre,
    const Tensor& hpre, const OptTensor& dy_opt, const OptTensor& dh_n, const OptTensor& dc_n, OptDouble cell_clip,
    OptDouble proj_clip, double forget_bias, bool reverse, bool residual) {
  (void)forget_bias;  // already folded into the cached gate activations
  const Dims d = check_inputs(x, w_in, w_rec, bias, w_proj, h0, c0, lengths, residual);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options();
  const auto fopts = x.options().dtype(at::kFloat);
  const int64_t B = d.B, T = d.T, D = d.D, H = d.H, P = d.P;
  check_tensor(gates, "gates", x, {B, T, 4 * H});
  TORCH_CHECK(cpre.is_cuda() && cpre.scalar_type() == at::kFloat && cpre.sizes() == at::IntArrayRef({B, T, H}), kOp,
              ": cpre must be a float32 CUDA tensor of shape (", B, ", ", T, ", ", H, "), got ", cpre.scalar_type(),
              " ", cpre.sizes());
  TORCH_CHECK(hpre.is_cuda() && hpre.scalar_type() == at::kFloat && hpre.sizes() == at::IntArrayRef({B, T, P}), kOp,
              ": hpre must be a float32 CUDA tensor of shape (", B, ", ", T, ", ", P, "), got ", hpre.scalar_type(),
              " ", hpre.sizes());
  Tensor dy = dy_opt.has_value() && dy_opt->defined() ? dy_opt->to(x.scalar_type()) : at::zeros({B, T, P}, opts);
  check_tensor(dy, "dy", x, {B, T, P});
  Tensor dh = dh_n.has_value() && dh_n->defined() ? dh_n->to(at::kFloat).contiguous().clone() : at::zeros({B, P}, fopts);
  Tensor dc = dc_n.has_value() && dc_n->defined() ? dc_n->to(at::kFloat).contiguous().clone() : at::zeros({B, H}, fopts);
  TORCH_CHECK(dh.sizes() == at::IntArrayRef({B, P}), kOp, ": dh_n must be (", B, ", ", P, "), got ", dh.sizes());
  TORCH_CHECK(dc.sizes() == at::IntArrayRef({B, H}), kOp, ": dc_n must be (", B, ", ", H, "), got ", dc.sizes());
  TORCH_CHECK(dh.device() == x.device() && dc.device() == x.device(), kOp, ": dh_n and dc_n must be on ", x.device());

  Tensor dz = at::zeros({B, T, 4 * H}, opts);
  Tensor dhpre = at::zeros({B, T, P}, fopts);
  if (B > 0 && T > 0) {
    const elmo_fast::LstmpPlan plan = make_plan(d, x);
    Tensor wr = dense(w_rec), wp = dense(*w_proj), gt = dense(gates), cp = dense(cpre), hp = dense(hpre);
    Tensor c0f = c0.to(at::kFloat).contiguous();
    Tensor dyc = dense(dy);
    Tensor len32 = lengths.to(x.device(), at::kInt).contiguous();
    Tensor dh_op = at::empty({B, P}, opts);
    Tensor partial = at::empty(
        {static_cast<int64_t>(elmo_fast::lstmp_partial_bytes(plan, static_cast<int>(P)) / 4)}, fopts);
    elmo_fast::LstmpBackwardArgs a;
    fill_shared(a, B, T, H, P, wr, wp, len32, cell_clip, proj_clip, reverse);
    a.gates = gt.data_ptr();
    a.cpre = cp.data_ptr<float>();
    a.hpre = hp.data_ptr<float>();
    a.c0 = c0f.data_ptr<float>();
    a.dy = dyc.data_ptr();
    a.dh = dh.data_ptr<float>();
    a.dc = dc.data_ptr<float>();
    a.dh_op = dh_op.data_ptr();
    a.partial = partial.data_ptr<float>();
    a.dz = dz.data_ptr();
    a.dhpre = dhpre.data_ptr<float>();
    check_launch(elmo_fast::lstmp_backward(d.dtype, plan, a, c10::cuda::getCurrentCUDAStream().stream()), "backward kernel");
  }

  // Weight gradients: large GEMMs over all B*T positions (dz and dL/dh' are 0 at padded positions).
  const auto st = x.scalar_type();
  Tensor dz2 = dz.view({B * T, 4 * H});
  Tensor dbias = dz.sum(at::IntArrayRef{0, 1}, /*keepdim=*/false, at::kFloat).to(bias.scalar_type());
  Tensor dw_in = at::matmul(x.reshape({B * T, D}).t(), dz2);
  Tensor dx = at::matmul(dz2, w_in.t()).view({B, T, D});
  Tensor steps = at::arange(T, lengths.options().dtype(at::kLong).device(x.device()));
  Tensor len_l = lengths.to(x.device(), at::kLong);
  if (residual) {
    Tensor live = (steps.unsqueeze(0) < len_l.unsqueeze(1)).unsqueeze(2).to(st);  // (B, T, 1)
    dx = dx + dy * live;
  }
  // h_t as the kernel stored it (dtype-rounded clip of h'), then h_{t-1} for every (row, step).
  Tensor hseq = proj_clip.has_value() ? hpre.clamp(-*proj_clip, *proj_clip) : hpre;
  hseq = hseq.to(st);
  Tensor hprev;
  if (T == 0) {
    hprev = at::zeros({B, 0, P}, opts);
  } else if (!reverse) {
    hprev = at::cat({h0.to(st).unsqueeze(1), hseq.slice(1, 0, T - 1)}, 1);
  } else {
    Tensor shifted = at::cat({hseq.slice(1, 1, T), at::zeros({B, 1, P}, opts)}, 1);
    Tensor has_prev = ((steps.unsqueeze(0) + 1) < len_l.unsqueeze(1)).unsqueeze(2);
    hprev = at::where(has_prev, shifted, h0.to(st).unsqueeze(1));
  }
  Tensor dw_rec = at::matmul(hprev.reshape({B * T, P}).t(), dz2);
  Tensor cseq = cell_clip.has_value() ? cpre.clamp(-*cell_clip, *cell_clip) : cpre;
  Tensor m = (gates.slice(2, 3 * H, 4 * H).to(at::kFloat) * cseq.tanh()).to(st);
  Tensor dw_proj = at::matmul(m.view({B * T, H}).t(), dhpre.to(st).view({B * T, P}));
  return {dx, dw_in, dw_rec, dbias, dw_proj, dh.to(h0.scalar_type()), dc.to(c0.scalar_type())};
}

std::string lstmp_unsupported_reason(const Tensor& x, int64_t H, int64_t P) {
  if (!x.is_cuda()) return "x is not a CUDA tensor";
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)
    return std::string("dtype ") + c10::toString(x.scalar_type()) + " is not supported (float32, bfloat16 only)";
  if (x.dim() != 3) return "x must be (B, T, D)";
  const c10::cuda::CUDAGuard guard(x.device());
  elmo_fast::LstmpPlan plan;
  char msg[768];
  const int rc = elmo_fast::lstmp_plan(to_dtype(x.scalar_type()), x.get_device(), static_cast<int>(x.size(0)),
                                       static_cast<int>(H), static_cast<int>(P), &plan, msg, sizeof msg);
  return rc == 0 ? std::string() : std::string(msg);
}

}  // namespace

void register_lstmp(pybind11::module_& m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
#define EF_LSTMP_ARGS                                                                                          \
  py::arg("x"), py::arg("w_in"), py::arg("w_rec"), py::arg("bias"), py::arg("w_proj"), py::arg("h0"),         \
      py::arg("c0"), py::arg("lengths")
#define EF_LSTMP_FLAGS                                                                                         \
  py::kw_only(), py::arg("cell_clip") = py::none(), py::arg("proj_clip") = py::none(),                        \
      py::arg("forget_bias") = 1.0, py::arg("reverse") = false, py::arg("residual") = false
  m.def("lstmp", &lstmp, "One LSTMP chain, persistent kernel, inference: -> (y, h_n, c_n)", EF_LSTMP_ARGS,
        EF_LSTMP_FLAGS, nogil);
  m.def("lstmp_forward", &lstmp_forward,
        "One LSTMP chain, persistent kernel, training: -> (y, h_n, c_n, gates, cpre, hpre)", EF_LSTMP_ARGS,
        EF_LSTMP_FLAGS, nogil);
  m.def("lstmp_backward", &lstmp_backward,
        "Backward of lstmp_forward: -> (dx, dw_in, dw_rec, dbias, dw_proj, dh0, dc0)", EF_LSTMP_ARGS,
        py::arg("gates"), py::arg("cpre"), py::arg("hpre"), py::arg("dy"), py::arg("dh_n"), py::arg("dc_n"),
        EF_LSTMP_FLAGS, nogil);
  m.def("lstmp_unsupported_reason", &lstmp_unsupported_reason,
        "'' when the persistent kernel runs for x's device, dtype and batch with cell size H and projection P; "
        "else the reason",
        py::arg("x"), py::arg("H"), py::arg("P"), nogil);
#undef EF_LSTMP_ARGS
#undef EF_LSTMP_FLAGS
}

}  // namespace elmo_fast_bind
