// elmo_fast._cpu: training's dropout on the CPU, y = x · m with m = scale where the element is kept and 0 where it is
// dropped, the mask a function of (seed, the element's index) alone: elmo_fast/reference/dropout.py is the oracle
// (the same arithmetic in torch ops) and says why. The backward is the same call on the upstream gradient with the
// same seed, so no mask is stored. Per element i (the index in the contiguous tensor, i < 2^32):
//   h = fmix32(fmix32(fmix32(i) ^ k1) + k2)   (murmur3's 32-bit finalizer; k1, k2 the seed's low and high halves)
//   kept iff h >= threshold            (threshold = round(p · 2^32): P(dropped) = p to 2^-32)
// x · scale or x · 0 (so that a NaN stays NaN, as torch's dropout multiplies). torch's bernoulli_ took 0.8-0.9 ms
// for the (16, 20, 512) inputs of a B = 16 step on 2 Xeon cores (six a step); this runs at memory speed. Plain
// loops over uint32, compiled for AVX-512 inside a function with a target attribute (chosen at run time), else for
// the baseline: the same bits either way, on any number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <cstdint>

namespace {

inline __attribute__((always_inline)) uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

struct DropoutArgs {
  const float* x;
  float* y;
  uint32_t k1, k2, threshold;
  float scale;
};

inline __attribute__((always_inline)) void dropout_body(const DropoutArgs& a, int64_t i0, int64_t i1) {
  // locals and restrict: the loop vectorizes (the stores to y could otherwise alias x and the arguments)
  const float* __restrict x = a.x;
  float* __restrict y = a.y;
  const uint32_t k1 = a.k1, k2 = a.k2, threshold = a.threshold, n = static_cast<uint32_t>(i1 - i0);
  const uint32_t base = static_cast<uint32_t>(i0);
  const float scale = a.scale;
  x += i0;
  y += i0;
  for (uint32_t j = 0; j < n; ++j) {
    const uint32_t h = fmix32(fmix32(fmix32(base + j) ^ k1) + k2);
    y[j] = x[j] * (h >= threshold ? scale : 0.0f);
  }
}

void dropout_run(const DropoutArgs& a, int64_t i0, int64_t i1) { dropout_body(a, i0, i1); }

#ifdef ELMO_X86
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"))) void dropout_run_avx512(const DropoutArgs& a, int64_t i0,
                                                                                       int64_t i1) {
  dropout_body(a, i0, i1);
}
#endif

// x: a contiguous CPU float32 tensor of fewer than 2^32 elements; y: out, the same shape, not x (restrict).
void dropout_apply(const at::Tensor& x, const at::Tensor& y, int64_t seed, int64_t threshold, double scale) {
  elmo_cpu::check_f32(x, "x", x.dim(), true);
  elmo_cpu::check_f32(y, "y", x.dim(), true);
  TORCH_CHECK(y.sizes() == x.sizes(), "elmo_fast._cpu: dropout_apply: y must have x's shape ", x.sizes(), ", got ",
              y.sizes());
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t{1} << 32), "elmo_fast._cpu: dropout_apply: at most 2^32 - 1 elements, got ", n);
  TORCH_CHECK(threshold >= 0 && threshold < (int64_t{1} << 32), "elmo_fast._cpu: dropout_apply: threshold must be "
              "in [0, 2^32), got ", threshold);
  const auto s = static_cast<uint64_t>(seed);
  const DropoutArgs a{x.data_ptr<float>(), y.data_ptr<float>(), static_cast<uint32_t>(s),
                      static_cast<uint32_t>(s >> 32), static_cast<uint32_t>(threshold), static_cast<float>(scale)};
  auto run = ELMO_PICK(dropout_run_avx512, dropout_run);
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) { run(a, b, e); });
}

}  // namespace

void add_dropout(pybind11::module_& m) {
  m.def("dropout_apply", &dropout_apply, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x · (scale where fmix32(fmix32(fmix32(i) ^ seed_lo) + seed_hi) >= threshold, else 0) "
        "(elmo_fast/reference/dropout.py)",
        pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("seed"), pybind11::arg("threshold"),
        pybind11::arg("scale"));
}
