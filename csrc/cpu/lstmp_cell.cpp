// elmo_fast._cpu: the fused gate math of one LSTMP step on the CPU (forward and backward), one pass over memory.
//
// The products of a step stay in oneDNN/MKL (called from Python, elmo_fast/cpu/lstmp.py); what is fused here is
// everything between them, which torch runs as ~8 (forward) and ~20 (backward) separate passes. Shapes: n rows,
// H cell, gates in the TF order i | j | f | o (z and g are (n, 4H), the rest (n, H)); every tensor fp32 and
// contiguous. The math is elmo_fast.reference.lstmp (spec §3.2); the forget bias is already in z.
//
// Transcendentals: exp by range reduction (x = n ln2 + r) and Cephes' degree-6 polynomial on r (about 1 ulp),
// sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 1 - 2 / (exp(2x) + 1) (absolute error ~1e-7). AVX-512 and AVX2
// versions are compiled with function target attributes and chosen once at run time (__builtin_cpu_supports);
// other CPUs get std::exp / std::tanh. No global -m flags: the build runs on any x86-64 (and any other CPU).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ELMO_X86 1
#endif

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

// ---- scalar (any CPU) ------------------------------------------------------------------------------------------
inline float sigmoid1(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void fwd_scalar(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* z = a.z + r * G;
  for (int64_t k = k0; k < k1; ++k) {
    const float i = sigmoid1(z[k]), j = std::tanh(z[H + k]), f = sigmoid1(z[2 * H + k]), o = sigmoid1(z[3 * H + k]);
    const float cp = f * a.c_prev[r * H + k] + i * j;
    const float c = std::min(std::max(cp, -a.clip), a.clip);
    const float t = std::tanh(c);
    if (a.g) {
      float* g = a.g + r * G;
      g[k] = i, g[H + k] = j, g[2 * H + k] = f, g[3 * H + k] = o;
    }
    if (a.c_pre) a.c_pre[r * H + k] = cp;
    if (a.tc) a.tc[r * H + k] = t;
    a.c[r * H + k] = c;
    a.m[r * H + k] = o * t;
  }
}

void bwd_scalar(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* g = a.g + r * G;
  float* dz = a.dz + r * G;
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t e = r * H + k;
    const float i = g[k], j = g[H + k], f = g[2 * H + k], o = g[3 * H + k], t = a.tc[e];
    float dc = a.dc[e] + a.dm[e] * o * (1.0f - t * t);
    if (std::fabs(a.c_pre[e]) > a.clip) dc = 0.0f;
    dz[k] = dc * j * (i * (1.0f - i));
    dz[H + k] = dc * i * (1.0f - j * j);
    dz[2 * H + k] = dc * a.c_prev[e] * (f * (1.0f - f));
    dz[3 * H + k] = a.dm[e] * t * (o * (1.0f - o));
    a.dc_prev[e] = dc * f;
  }
}

#ifdef ELMO_X86
// ---- AVX-512 ---------------------------------------------------------------------------------------------------
#define ELMO_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,fma")))

// Cephes expf: 2^n * p(r) with |r| <= ln2/2; inputs clamped to [-87, 88] (NaN stays NaN).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

ELMO_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

ELMO_AVX512 inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

ELMO_AVX512 inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  return _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp16(_mm512_mul_ps(two, x)), one)));
}

ELMO_AVX512 void fwd_avx512(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* z = a.z + r * G;
  const __m512 lo = _mm512_set1_ps(-a.clip), hi = _mm512_set1_ps(a.clip);
  int64_t k = k0;
  for (; k + 16 <= k1; k += 16) {
    const __m512 i = sigmoid16(_mm512_loadu_ps(z + k)), j = tanh16(_mm512_loadu_ps(z + H + k));
    const __m512 f = sigmoid16(_mm512_loadu_ps(z + 2 * H + k)), o = sigmoid16(_mm512_loadu_ps(z + 3 * H + k));
    const __m512 cp = _mm512_fmadd_ps(f, _mm512_loadu_ps(a.c_prev + r * H + k), _mm512_mul_ps(i, j));
    const __m512 c = _mm512_min_ps(hi, _mm512_max_ps(lo, cp));  // NaN propagates (2nd operand)
    const __m512 t = tanh16(c);
    if (a.g) {
      float* g = a.g + r * G;
      _mm512_storeu_ps(g + k, i), _mm512_storeu_ps(g + H + k, j);
      _mm512_storeu_ps(g + 2 * H + k, f), _mm512_storeu_ps(g + 3 * H + k, o);
    }
    if (a.c_pre) _mm512_storeu_ps(a.c_pre + r * H + k, cp);
    if (a.tc) _mm512_storeu_ps(a.tc + r * H + k, t);
    _mm512_storeu_ps(a.c + r * H + k, c);
    _mm512_storeu_ps(a.m + r * H + k, _mm512_mul_ps(o, t));
  }
  fwd_scalar(a, r, k, k1);
}

ELMO_AVX512 void bwd_avx512(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* g = a.g + r * G;
  float* dz = a.dz + r * G;
  const __m512 one = _mm512_set1_ps(1.0f), clip = _mm512_set1_ps(a.clip);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  int64_t k = k0;
  for (; k + 16 <= k1; k += 16) {
    const int64_t e = r * H + k;
    const __m512 i = _mm512_loadu_ps(g + k), j = _mm512_loadu_ps(g + H + k);
    const __m512 f = _mm512_loadu_ps(g + 2 * H + k), o = _mm512_loadu_ps(g + 3 * H + k);
    const __m512 t = _mm512_loadu_ps(a.tc + e), dm = _mm512_loadu_ps(a.dm + e);
    __m512 dc = _mm512_fmadd_ps(_mm512_mul_ps(dm, o), _mm512_fnmadd_ps(t, t, one), _mm512_loadu_ps(a.dc + e));
    const __m512 cabs = _mm512_and_ps(_mm512_loadu_ps(a.c_pre + e), absmask);
    dc = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(cabs, clip, _CMP_NGT_UQ), dc);  // zero where |c| > clip
    _mm512_storeu_ps(dz + k, _mm512_mul_ps(_mm512_mul_ps(dc, j), _mm512_mul_ps(i, _mm512_sub_ps(one, i))));
    _mm512_storeu_ps(dz + H + k, _mm512_mul_ps(_mm512_mul_ps(dc, i), _mm512_fnmadd_ps(j, j, one)));
    _mm512_storeu_ps(dz + 2 * H + k, _mm512_mul_ps(_mm512_mul_ps(dc, _mm512_loadu_ps(a.c_prev + e)),
                                                   _mm512_mul_ps(f, _mm512_sub_ps(one, f))));
    _mm512_storeu_ps(dz + 3 * H + k, _mm512_mul_ps(_mm512_mul_ps(dm, t), _mm512_mul_ps(o, _mm512_sub_ps(one, o))));
    _mm512_storeu_ps(a.dc_prev + e, _mm512_mul_ps(dc, f));
  }
  bwd_scalar(a, r, k, k1);
}

// ---- AVX2 ------------------------------------------------------------------------------------------------------
#define ELMO_AVX2 __attribute__((target("avx2,fma")))

ELMO_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT |
                                                                              _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n (in [-126, 128] after the clamp) into the exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

ELMO_AVX2 inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

ELMO_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  return _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, x)), one)));
}

ELMO_AVX2 void fwd_avx2(const FwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* z = a.z + r * G;
  const __m256 lo = _mm256_set1_ps(-a.clip), hi = _mm256_set1_ps(a.clip);
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    const __m256 i = sigmoid8(_mm256_loadu_ps(z + k)), j = tanh8(_mm256_loadu_ps(z + H + k));
    const __m256 f = sigmoid8(_mm256_loadu_ps(z + 2 * H + k)), o = sigmoid8(_mm256_loadu_ps(z + 3 * H + k));
    const __m256 cp = _mm256_fmadd_ps(f, _mm256_loadu_ps(a.c_prev + r * H + k), _mm256_mul_ps(i, j));
    const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, cp));  // NaN propagates (2nd operand)
    const __m256 t = tanh8(c);
    if (a.g) {
      float* g = a.g + r * G;
      _mm256_storeu_ps(g + k, i), _mm256_storeu_ps(g + H + k, j);
      _mm256_storeu_ps(g + 2 * H + k, f), _mm256_storeu_ps(g + 3 * H + k, o);
    }
    if (a.c_pre) _mm256_storeu_ps(a.c_pre + r * H + k, cp);
    if (a.tc) _mm256_storeu_ps(a.tc + r * H + k, t);
    _mm256_storeu_ps(a.c + r * H + k, c);
    _mm256_storeu_ps(a.m + r * H + k, _mm256_mul_ps(o, t));
  }
  fwd_scalar(a, r, k, k1);
}

ELMO_AVX2 void bwd_avx2(const BwdArgs& a, int64_t r, int64_t k0, int64_t k1) {
  const int64_t H = a.H, G = 4 * H;
  const float* g = a.g + r * G;
  float* dz = a.dz + r * G;
  const __m256 one = _mm256_set1_ps(1.0f), clip = _mm256_set1_ps(a.clip);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    const int64_t e = r * H + k;
    const __m256 i = _mm256_loadu_ps(g + k), j = _mm256_loadu_ps(g + H + k);
    const __m256 f = _mm256_loadu_ps(g + 2 * H + k), o = _mm256_loadu_ps(g + 3 * H + k);
    const __m256 t = _mm256_loadu_ps(a.tc + e), dm = _mm256_loadu_ps(a.dm + e);
    __m256 dc = _mm256_fmadd_ps(_mm256_mul_ps(dm, o), _mm256_fnmadd_ps(t, t, one), _mm256_loadu_ps(a.dc + e));
    const __m256 keep = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(a.c_pre + e), absmask), clip, _CMP_NGT_UQ);
    dc = _mm256_and_ps(dc, keep);
    _mm256_storeu_ps(dz + k, _mm256_mul_ps(_mm256_mul_ps(dc, j), _mm256_mul_ps(i, _mm256_sub_ps(one, i))));
    _mm256_storeu_ps(dz + H + k, _mm256_mul_ps(_mm256_mul_ps(dc, i), _mm256_fnmadd_ps(j, j, one)));
    _mm256_storeu_ps(dz + 2 * H + k, _mm256_mul_ps(_mm256_mul_ps(dc, _mm256_loadu_ps(a.c_prev + e)),
                                                   _mm256_mul_ps(f, _mm256_sub_ps(one, f))));
    _mm256_storeu_ps(dz + 3 * H + k, _mm256_mul_ps(_mm256_mul_ps(dm, t), _mm256_mul_ps(o, _mm256_sub_ps(one, o))));
    _mm256_storeu_ps(a.dc_prev + e, _mm256_mul_ps(dc, f));
  }
  bwd_scalar(a, r, k, k1);
}
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

void check(const torch::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "elmo_fast._cpu: ",
              name, " must be a contiguous CPU float32 tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "elmo_fast._cpu: ", name, " must be (", rows,
              ", ", cols, "), got ", t.sizes());
}

float clip_value(c10::optional<double> clip) {
  return clip.has_value() ? static_cast<float>(*clip) : std::numeric_limits<float>::infinity();
}

float* opt_ptr(const c10::optional<torch::Tensor>& t, const char* name, int64_t rows, int64_t cols) {
  if (!t.has_value()) return nullptr;
  check(*t, name, rows, cols);
  return t->data_ptr<float>();
}

// z (n, 4H) pre-activations; c_prev (n, H). Writes c (n, H) and m (n, H); with g / c_pre / tc also the activated
// gates, the pre-clip cell and tanh(c) (training). g may be z itself.
void cell_forward(const torch::Tensor& z, const torch::Tensor& c_prev, c10::optional<double> cell_clip,
                  const c10::optional<torch::Tensor>& g, const c10::optional<torch::Tensor>& c_pre,
                  const torch::Tensor& c, const c10::optional<torch::Tensor>& tc, const torch::Tensor& m) {
  const int64_t n = c_prev.size(0), H = c_prev.size(1);
  check(z, "z", n, 4 * H);
  check(c_prev, "c_prev", n, H);
  check(c, "c", n, H);
  check(m, "m", n, H);
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
void cell_backward(const torch::Tensor& dm, const torch::Tensor& dc, const torch::Tensor& g,
                   const torch::Tensor& c_pre, const torch::Tensor& tc, const torch::Tensor& c_prev,
                   c10::optional<double> cell_clip, const torch::Tensor& dz, const torch::Tensor& dc_prev) {
  const int64_t n = dm.size(0), H = dm.size(1);
  for (const auto& [t, name] : {std::pair{&dm, "dm"}, {&dc, "dc"}, {&c_pre, "c_pre"}, {&tc, "tc"},
                                {&c_prev, "c_prev"}, {&dc_prev, "dc_prev"}})
    check(*t, name, n, H);
  check(g, "g", n, 4 * H);
  check(dz, "dz", n, 4 * H);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "elmo_fast CPU kernels: the fused gate math of an LSTMP step (see csrc/cpu/lstmp_cell.cpp)";
  m.def("cell_forward", &cell_forward, "fused LSTMP cell forward", py::arg("z"), py::arg("c_prev"),
        py::arg("cell_clip"), py::arg("g"), py::arg("c_pre"), py::arg("c"), py::arg("tc"), py::arg("m"));
  m.def("cell_backward", &cell_backward, "fused LSTMP cell backward", py::arg("dm"), py::arg("dc"), py::arg("g"),
        py::arg("c_pre"), py::arg("tc"), py::arg("c_prev"), py::arg("cell_clip"), py::arg("dz"),
        py::arg("dc_prev"));
  m.def("isa", &isa_name, "the instruction set the kernels run with");
  m.def("set_isa", &set_isa, "run a lesser instruction set (tests)", py::arg("name"));
}
