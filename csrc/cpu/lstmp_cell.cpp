// elmo_fast._cpu: the fused gate math of one LSTMP step on the CPU (forward and backward), one pass over memory.
//
// The products of a step stay in oneDNN/MKL (called from Python, elmo_fast/cpu/lstmp.py); what is fused here is
// everything between them, which torch runs as ~8 (forward) and ~20 (backward) separate passes. Shapes: n rows,
// H cell, gates in the TF order i | j | f | o (z and g are (n, 4H), the rest (n, H)); every tensor fp32 and
// contiguous. The math is elmo_fast.reference.lstmp (spec §3.2); the forget bias is already in z.
//
// Transcendentals: exp by range reduction (x = n ln2 + r) and Cephes' degree-6 polynomial on r (about 1 ulp),
// sigmoid(x) = 1 / (1 + exp(-x)), tanh as tanh_v below (a few ulp). One body over vector
// types, compiled for AVX-512 and AVX2 inside functions with target attributes and chosen once at run time
// (__builtin_cpu_supports), and as scalar code for any CPU. No global -m flags: the build runs anywhere.
// Only the headers it uses (not <torch/extension.h>, the whole C++ frontend): 12 s to compile instead of 58.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor and optional casters

#include "common.h"
#include "../include/elmo_fast/built_with.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace {

struct FwdArgs {
  const float* z;
  const float* c_prev;
  float* g;      // activated gates (nullptr: not kept)
  float* c_pre;  // pre-clip cell (nullptr: not kept)
  float* c;      // clipped cell: the next state
  float* tc;     // tanh(c) (nullptr: not kept)
  float* m;      // sigmoid(o) * tanh(c)
  int64_t H;
  float clip;  // +inf: no clip
};

// A highway layer's gate math (elmo_fast/cpu/highway.py), n rows of F: forward a <- g = σ(a), b <- r = relu(b),
// y = g·r + (1 - g)·x; backward from dy: dgp = dy·(r - x)·g(1 - g), dbp = dy·g unless r <= 0 (then 0),
// dxd = dy·(1 - g).
struct HwFwdArgs {
  float* a;  // x·W_carry + b_carry in, g out
  float* b;  // x·W_transform + b_transform in, r out
  const float* x;
  float* y;
  int64_t H;  // F (the columns; named as the cell kernels' for run_rows)
};

struct HwBwdArgs {
  const float* dy;
  const float* x;
  const float* g;
  const float* r;
  float* dgp;
  float* dbp;
  float* dxd;
  int64_t H;
};

struct BwdArgs {
  const float* dm;
  const float* dc;  // gradient w.r.t. the clipped cell, from the next step
  const float* g;
  const float* c_pre;
  const float* tc;
  const float* c_prev;
  float* dz;
  float* dc_prev;  // may alias dc
  int64_t H;
  float clip;
};

// ---- the kernels, written once over GCC/Clang vector types of W lanes ---------------------------------------------
// The same body is compiled three times: 16 lanes inside an AVX-512 function, 8 inside an AVX2 function, 1 lane
// (plain scalar code) for any CPU and for the tails. Comparisons give lane masks; `m ? a : b` selects per lane.
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float F1 __attribute__((vector_size(4)));
typedef int32_t I1 __attribute__((vector_size(4)));

template <typename V>
inline __attribute__((always_inline)) V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline __attribute__((always_inline)) void store(float* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

// Cephes expf: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2; inputs clamped to [-87, 88] (NaN stays NaN).
template <typename V, typename I>
inline __attribute__((always_inline)) V exp_v(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * (V)((__builtin_convertvector(n, I) + 127) << 23);  // times 2^n, n in [-126, 127]
}

template <typename V, typename I>
inline __attribute__((always_inline)) V sigmoid_v(V x) {
  return 1.0f / (1.0f + exp_v<V, I>(-x));
}

// tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (no overflow), the sign put back; below |x| = 0.4, where 1 - e
// would cancel (1 - 2 / (exp(2x) + 1) gave tanh(1e-6) 5% off), the odd Taylor series to x^13 (the next term is
// under 0.1 ulp there). Within a few ulp of the result everywhere.
template <typename V, typename I>
inline __attribute__((always_inline)) V tanh_v(V x) {
  const V a = x < 0.0f ? -x : x;
  const V e = exp_v<V, I>(-2.0f * a);
  const V big = (1.0f - e) / (1.0f + e);
  const V x2 = x * x;
  V p = x2 * 3.5921280365724811e-3f - 8.8632355299021973e-3f;  // 21844/6081075, -1382/155925
  p = p * x2 + 2.1869488536155203e-2f;                           // 62/2835
  p = p * x2 - 5.3968253968253971e-2f;                           // -17/315
  p = p * x2 + 1.3333333333333333e-1f;                           // 2/15
  p = p * x2 - 3.3333333333333333e-1f;                           // -1/3
  const V small = x == 0.0f ? x : x + x * (x2 * p);  // -0.0 stays -0.0
  return a < 0.4f ? small : (x < 0.0f ? V{} - big : big);
}

template <typename V, typename I>
inline __attribute__((always_inline)) void fwd_body(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const int64_t H = a.H, G = 4 * H;
  const float* z = a.z + r * G;
  int64_t k = k0;
  for (; k + W <= k1; k += W) {
    const V i = sigmoid_v<V, I>(load<V>(z + k)), j = tanh_v<V, I>(load<V>(z + H + k));
    const V f = sigmoid_v<V, I>(load<V>(z + 2 * H + k)), o = sigmoid_v<V, I>(load<V>(z + 3 * H + k));
    const V cp = f * load<V>(a.c_prev + r * H + k) + i * j;
    V c = cp < -a.clip ? V{} - a.clip : cp;  // NaN stays NaN
    c = c > a.clip ? V{} + a.clip : c;
    const V t = tanh_v<V, I>(c);
    if (a.g) {
      float* g = a.g + r * G;
      store(g + k, i), store(g + H + k, j), store(g + 2 * H + k, f), store(g + 3 * H + k, o);
    }
    if (a.c_pre) store(a.c_pre + r * H + k, cp);
    if (a.tc) store(a.tc + r * H + k, t);
    store(a.c + r * H + k, c);
    store(a.m + r * H + k, o * t);
  }
  if constexpr (W > 1) fwd_body<F1, I1>(a, r, k, k1);
}

template <typename V>
inline __attribute__((always_inline)) void bwd_body(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const int64_t H = a.H, G = 4 * H;
  const float* g = a.g + r * G;
  float* dz = a.dz + r * G;
  int64_t k = k0;
  for (; k + W <= k1; k += W) {
    const int64_t e = r * H + k;
    const V i = load<V>(g + k), j = load<V>(g + H + k), f = load<V>(g + 2 * H + k), o = load<V>(g + 3 * H + k);
    const V t = load<V>(a.tc + e), dm = load<V>(a.dm + e), cp = load<V>(a.c_pre + e);
    V dc = load<V>(a.dc + e) + dm * o * (1.0f - t * t);
    dc = (cp > a.clip) | (cp < -a.clip) ? V{} : dc;  // zero where |c| > clip (NaN: kept)
    store(dz + k, dc * j * (i * (1.0f - i)));
    store(dz + H + k, dc * i * (1.0f - j * j));
    store(dz + 2 * H + k, dc * load<V>(a.c_prev + e) * (f * (1.0f - f)));
    store(dz + 3 * H + k, dm * t * (o * (1.0f - o)));
    store(a.dc_prev + e, dc * f);
  }
  if constexpr (W > 1) bwd_body<F1>(a, r, k, k1);
}

template <typename V, typename I>
inline __attribute__((always_inline)) void hw_fwd_body(const HwFwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  int64_t k = k0;
  for (; k + W <= k1; k += W) {
    const int64_t e = r * a.H + k;
    const V g = sigmoid_v<V, I>(load<V>(a.a + e)), b = load<V>(a.b + e);
    const V t = b < 0.0f ? V{} : b;  // relu; NaN stays NaN
    store(a.a + e, g);
    store(a.b + e, t);
    store(a.y + e, g * t + (1.0f - g) * load<V>(a.x + e));
  }
  if constexpr (W > 1) hw_fwd_body<F1, I1>(a, r, k, k1);
}

template <typename V>
inline __attribute__((always_inline)) void hw_bwd_body(const HwBwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  int64_t k = k0;
  for (; k + W <= k1; k += W) {
    const int64_t e = r * a.H + k;
    const V dy = load<V>(a.dy + e), g = load<V>(a.g + e), t = load<V>(a.r + e);
    store(a.dgp + e, dy * (t - load<V>(a.x + e)) * (g * (1.0f - g)));
    store(a.dbp + e, t <= 0.0f ? V{} : dy * g);  // relu's gradient as torch's: 0 at and below 0, passed for NaN
    store(a.dxd + e, dy * (1.0f - g));
  }
  if constexpr (W > 1) hw_bwd_body<F1>(a, r, k, k1);
}

void fwd_scalar(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) { fwd_body<F1, I1>(a, r, k0, k1); }
void hw_fwd_scalar(const HwFwdArgs& a, int64_t r, int64_t k0, int64_t k1) { hw_fwd_body<F1, I1>(a, r, k0, k1); }
void hw_bwd_scalar(const HwBwdArgs& a, int64_t r, int64_t k0, int64_t k1) { hw_bwd_body<F1>(a, r, k0, k1); }
void bwd_scalar(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) { bwd_body<F1>(a, r, k0, k1); }

#ifdef ELMO_X86
#define ELMO_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,fma")))
#define ELMO_AVX2 __attribute__((target("avx2,fma")))
ELMO_AVX512 void fwd_avx512(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) { fwd_body<F16, I16>(a, r, k0, k1); }
ELMO_AVX512 void bwd_avx512(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) { bwd_body<F16>(a, r, k0, k1); }
ELMO_AVX2 void fwd_avx2(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) { fwd_body<F8, I8>(a, r, k0, k1); }
ELMO_AVX2 void bwd_avx2(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) { bwd_body<F8>(a, r, k0, k1); }
ELMO_AVX512 void hw_fwd_avx512(const HwFwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  hw_fwd_body<F16, I16>(a, r, k0, k1);
}
ELMO_AVX512 void hw_bwd_avx512(const HwBwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  hw_bwd_body<F16>(a, r, k0, k1);
}
ELMO_AVX2 void hw_fwd_avx2(const HwFwdArgs& a, int64_t r, int64_t k0, int64_t k1) { hw_fwd_body<F8, I8>(a, r, k0, k1); }
ELMO_AVX2 void hw_bwd_avx2(const HwBwdArgs& a, int64_t r, int64_t k0, int64_t k1) { hw_bwd_body<F8>(a, r, k0, k1); }
#endif  // ELMO_X86

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa best_isa() {
#ifdef ELMO_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

const Isa kBest = best_isa();
Isa kIsa = kBest;

const char* name_of(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

std::string isa_name() { return name_of(kIsa); }

// For tests: run a lesser instruction set than the CPU's best ("scalar", "avx2", "avx512").
void set_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == name_of(isa)) {
      TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(kBest), "elmo_fast._cpu: this CPU cannot run ", name,
                  " (best: ", name_of(kBest), ")");
      kIsa = isa;
      return;
    }
  }
  TORCH_CHECK(false, "elmo_fast._cpu: unknown instruction set '", name, "'; expected scalar, avx2 or avx512");
}

// Rows x column chunks of 256, split over torch's intra-op threads.
template <typename Args, typename F>
void run_rows(const Args& a, int64_t n, F fn) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (a.H + kChunk - 1) / kChunk;
  at::parallel_for(0, n * chunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / chunks, k0 = (w % chunks) * kChunk;
      fn(a, r, k0, std::min(a.H, k0 + kChunk));
    }
  });
}

float clip_value(c10::optional<double> clip) {
  return clip.has_value() ? static_cast<float>(*clip) : std::numeric_limits<float>::infinity();
}

float* opt_ptr(const c10::optional<at::Tensor>& t, const char* name, int64_t rows, int64_t cols) {
  if (!t.has_value()) return nullptr;
  elmo_cpu::check_matrix(*t, name, rows, cols);
  return t->data_ptr<float>();
}

}  // namespace

// z (n, 4H) pre-activations; c_prev (n, H). Writes c (n, H) and m (n, H); with g / c_pre / tc also the activated
// gates, the pre-clip cell and tanh(c) (training). g may be z itself.
void elmo_cpu::cell_forward(const at::Tensor& z, const at::Tensor& c_prev, c10::optional<double> cell_clip,
                            const c10::optional<at::Tensor>& g, const c10::optional<at::Tensor>& c_pre,
                            const at::Tensor& c, const c10::optional<at::Tensor>& tc, const at::Tensor& m) {
  const int64_t n = c_prev.size(0), H = c_prev.size(1);
  elmo_cpu::check_matrix(z, "z", n, 4 * H);
  elmo_cpu::check_matrix(c_prev, "c_prev", n, H);
  elmo_cpu::check_matrix(c, "c", n, H);
  elmo_cpu::check_matrix(m, "m", n, H);
  FwdArgs a{z.data_ptr<float>(), c_prev.data_ptr<float>(), opt_ptr(g, "g", n, 4 * H),
            opt_ptr(c_pre, "c_pre", n, H), c.data_ptr<float>(), opt_ptr(tc, "tc", n, H), m.data_ptr<float>(), H,
            clip_value(cell_clip)};
  switch (kIsa) {
#ifdef ELMO_X86
    case Isa::kAvx512: return run_rows(a, n, fwd_avx512);
    case Isa::kAvx2: return run_rows(a, n, fwd_avx2);
#endif
    default: return run_rows(a, n, fwd_scalar);
  }
}

// dm, dc (n, H): gradients w.r.t. m and the clipped cell; g (n, 4H), c_pre, tc, c_prev (n, H) from forward.
// Writes dz (n, 4H) and dc_prev (n, H) (dc_prev may be dc).
void elmo_cpu::cell_backward(const at::Tensor& dm, const at::Tensor& dc, const at::Tensor& g,
                             const at::Tensor& c_pre, const at::Tensor& tc, const at::Tensor& c_prev,
                             c10::optional<double> cell_clip, const at::Tensor& dz, const at::Tensor& dc_prev) {
  const int64_t n = dm.size(0), H = dm.size(1);
  for (const auto& [t, name] : {std::pair{&dm, "dm"}, {&dc, "dc"}, {&c_pre, "c_pre"}, {&tc, "tc"},
                                {&c_prev, "c_prev"}, {&dc_prev, "dc_prev"}})
    elmo_cpu::check_matrix(*t, name, n, H);
  elmo_cpu::check_matrix(g, "g", n, 4 * H);
  elmo_cpu::check_matrix(dz, "dz", n, 4 * H);
  BwdArgs a{dm.data_ptr<float>(), dc.data_ptr<float>(), g.data_ptr<float>(), c_pre.data_ptr<float>(),
            tc.data_ptr<float>(), c_prev.data_ptr<float>(), dz.data_ptr<float>(), dc_prev.data_ptr<float>(), H,
            clip_value(cell_clip)};
  switch (kIsa) {
#ifdef ELMO_X86
    case Isa::kAvx512: return run_rows(a, n, bwd_avx512);
    case Isa::kAvx2: return run_rows(a, n, bwd_avx2);
#endif
    default: return run_rows(a, n, bwd_scalar);
  }
}

namespace {

// a, b (n, F): the highway's two products (biases added), overwritten with g and r; x (n, F) its input; y (n, F) out.
void highway_forward(const at::Tensor& a, const at::Tensor& b, const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.size(0), F = x.size(1);
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, "b"}, {&x, "x"}, {&y, "y"}})
    elmo_cpu::check_matrix(*t, name, n, F);
  HwFwdArgs args{a.data_ptr<float>(), b.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(), F};
  switch (kIsa) {
#ifdef ELMO_X86
    case Isa::kAvx512: return run_rows(args, n, hw_fwd_avx512);
    case Isa::kAvx2: return run_rows(args, n, hw_fwd_avx2);
#endif
    default: return run_rows(args, n, hw_fwd_scalar);
  }
}

// dy, x, g, r (n, F); writes dgp, dbp (the gradients of the two products) and dxd (x's direct gradient).
void highway_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& g, const at::Tensor& r,
                      const at::Tensor& dgp, const at::Tensor& dbp, const at::Tensor& dxd) {
  const int64_t n = x.size(0), F = x.size(1);
  for (const auto& [t, name] : {std::pair{&dy, "dy"}, {&x, "x"}, {&g, "g"}, {&r, "r"}, {&dgp, "dgp"}, {&dbp, "dbp"},
                                {&dxd, "dxd"}})
    elmo_cpu::check_matrix(*t, name, n, F);
  HwBwdArgs args{dy.data_ptr<float>(), x.data_ptr<float>(), g.data_ptr<float>(), r.data_ptr<float>(),
                 dgp.data_ptr<float>(), dbp.data_ptr<float>(), dxd.data_ptr<float>(), F};
  switch (kIsa) {
#ifdef ELMO_X86
    case Isa::kAvx512: return run_rows(args, n, hw_bwd_avx512);
    case Isa::kAvx2: return run_rows(args, n, hw_bwd_avx2);
#endif
    default: return run_rows(args, n, hw_bwd_scalar);
  }
}

}  // namespace

bool elmo_cpu::has_avx512() { return kBest == Isa::kAvx512; }
bool elmo_cpu::use_avx512() { return kIsa == Isa::kAvx512; }

void add_sparse_rows(pybind11::module_& m);  // csrc/cpu/sparse_rows.cpp
void add_small_gemm(pybind11::module_& m);   // csrc/cpu/small_gemm.cpp
void add_fpenv(pybind11::module_& m);        // csrc/cpu/fpenv.cpp
void add_char_cnn(pybind11::module_& m);     // csrc/cpu/char_cnn.cpp
void add_lstmp_loop(pybind11::module_& m);   // csrc/cpu/lstmp_loop.cpp
void add_dropout(pybind11::module_& m);      // csrc/cpu/dropout.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "elmo_fast CPU kernels: the fused gate math of an LSTMP step (csrc/cpu/lstmp_cell.cpp), the sparse "
            "softmax rows' sum and Adagrad update (csrc/cpu/sparse_rows.cpp), the per-step products of few rows "
            "(csrc/cpu/small_gemm.cpp), denormal flushing (csrc/cpu/fpenv.cpp), the char CNN's max over windows and "
            "its sparse backward (csrc/cpu/char_cnn.cpp), the LSTMP time loops (csrc/cpu/lstmp_loop.cpp), training's "
            "dropout (csrc/cpu/dropout.cpp), a highway layer's gate math (here)";
  m.def("cell_forward", &elmo_cpu::cell_forward, "fused LSTMP cell forward", py::arg("z"), py::arg("c_prev"),
        py::arg("cell_clip"), py::arg("g"), py::arg("c_pre"), py::arg("c"), py::arg("tc"), py::arg("m"));
  m.def("cell_backward", &elmo_cpu::cell_backward, "fused LSTMP cell backward", py::arg("dm"), py::arg("dc"),
        py::arg("g"), py::arg("c_pre"), py::arg("tc"), py::arg("c_prev"), py::arg("cell_clip"), py::arg("dz"),
        py::arg("dc_prev"));
  m.def("highway_forward", &highway_forward, "a highway layer's gate math, in place (elmo_fast/cpu/highway.py)",
        py::arg("a"), py::arg("b"), py::arg("x"), py::arg("y"));
  m.def("highway_backward", &highway_backward, "the highway gate math's backward (elmo_fast/cpu/highway.py)",
        py::arg("dy"), py::arg("x"), py::arg("g"), py::arg("r"), py::arg("dgp"), py::arg("dbp"), py::arg("dxd"));
  elmo_fast::record_torch_version(m);
  m.def("isa", &isa_name, "the instruction set the kernels run with");
  m.def("set_isa", &set_isa, "run a lesser instruction set (tests)", py::arg("name"));
  add_sparse_rows(m);
  add_small_gemm(m);
  add_fpenv(m);
  add_char_cnn(m);
  add_lstmp_loop(m);
  add_dropout(m);
}
