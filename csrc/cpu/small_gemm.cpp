// elmo_fast._cpu: the per-step products of an LSTMP chain, x (M, K) · w (K, N) (+ add), for few rows.
//
// An LSTMP step multiplies the B rows of the batch (16-32 in training and embedding) by a weight of 32 MiB
// (512 x 16384) or 8 MiB (4096 x 512) that does not stay in cache between steps: the product streams the weight
// from memory once per step. The weight is packed once into panels of 16 columns (P = ceil(N/16) panels of K x 16,
// the last zero-padded), so that each panel is one contiguous stream; x is transposed (K x M) so that each k reads
// one line of it. A panel's product keeps up to 16 rows x 16 columns in 16 AVX-512 accumulators, one fused
// multiply-add per row and k with the x value broadcast from memory; the panel is read from memory once and from
// L1/L2 for the further row blocks. Panels are split over torch's intra-op threads.
//
// Measured against oneDNN's packed product on a 2-core AVX-512 Xeon (bench/bench_cpu_products.py, rows of
// bench/results/cpu_products.csv; bench/results/cpu_train.md): faster at 16 rows and about even at 32 with the
// weight out of cache, slower at a long inner dimension; elmo_fast.cpu.packed takes it for at most 16 rows and an
// inner dimension of at most 1024. AVX-512 only (functions with a target attribute, chosen at run time); elsewhere
// small_mm_available() is false.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ELMO_X86 1
#endif

namespace {

constexpr int64_t kLanes = 16;  // columns per panel

bool avx512() {
#ifdef ELMO_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
#else
  return false;
#endif
}

void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim, "elmo_fast._cpu: ", name,
              " must be a ", dim, "-d CPU float32 tensor, got ", t.scalar_type(), " ", t.sizes(), " on ",
              t.device());
}

// w (K, N), any strides -> panels (ceil(N/16), K, 16), zero past column N.
at::Tensor pack_panels(const at::Tensor& w) {
  check_f32(w, "w", 2);
  const int64_t K = w.size(0), N = w.size(1), P = (N + kLanes - 1) / kLanes;
  at::Tensor out = at::zeros({P, K, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  const int64_t sk = w.stride(0), sn = w.stride(1);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kLanes, width = std::min(kLanes, N - n0);
      for (int64_t k = 0; k < K; ++k) {
        float* d = dst + (p * K + k) * kLanes;
        const float* s = src + k * sk + n0 * sn;
        for (int64_t j = 0; j < width; ++j) d[j] = s[j * sn];
      }
    }
  });
  return out;
}

#ifdef ELMO_X86
#define ELMO_AVX512 __attribute__((target("avx512f")))

constexpr int64_t kBlock = 256;   // k per accumulation block: partial sums of 256 products, then summed
constexpr int64_t kAhead = 64;    // prefetch distance in k (4 KiB of panel): the weight streams from memory

// rows r0..r0+R-1 of one panel: out[r][n0 + j] = sum_k xt[k][r] * panel[k][j] (+ add[r][n0 + j]), j < width. The
// sum over k runs in blocks of kBlock (each block's sum in registers, the blocks' sums added in order): error
// growing with K/kBlock + kBlock rather than with K, as blocked GEMMs do.
template <int R>
ELMO_AVX512 inline void panel_rows(const float* xt, int64_t M, const float* panel, int64_t K, float* out,
                                   int64_t ldo, const float* add, int64_t lda, int64_t r0, int64_t n0,
                                   __mmask16 mask, const float* next) {
  __m512 acc[R], tot[R];
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 b = _mm512_loadu_ps(panel + k * kLanes);
      if (next == nullptr)  // the first row block streams this panel in
        _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kLanes), _MM_HINT_T0);
      else  // the others (panel in cache) stream the next panel into L2, so that memory and FMAs overlap
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kLanes), _MM_HINT_T1);
      const float* xk = xt + k * M + r0;
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), b, acc[r]);
    }
    for (int r = 0; r < R; ++r) tot[r] = k0 == 0 ? acc[r] : _mm512_add_ps(tot[r], acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + (r0 + r) * ldo + n0;
    __m512 v = K > 0 ? tot[r] : _mm512_setzero_ps();
    if (add != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, add + (r0 + r) * lda + n0));
    _mm512_mask_storeu_ps(o, mask, v);
  }
}

ELMO_AVX512 void small_mm_avx512(const float* xt, int64_t M, const float* panels, int64_t K, int64_t N,
                                 float* out, int64_t ldo, const float* add, int64_t lda) {
  const int64_t P = (N + kLanes - 1) / kLanes;
  at::parallel_for(0, P, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = panels + p * K * kLanes;
      const int64_t n0 = p * kLanes, width = std::min(kLanes, N - n0);
      const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
      const float* next = panel + K * kLanes;  // past the last panel: prefetches never fault
      int64_t r0 = 0;
      for (; r0 + 16 <= M; r0 += 16) panel_rows<16>(xt, M, panel, K, out, ldo, add, lda, r0, n0, mask, r0 ? next : nullptr);
      if (r0 + 8 <= M) panel_rows<8>(xt, M, panel, K, out, ldo, add, lda, r0, n0, mask, r0 ? next : nullptr), r0 += 8;
      if (r0 + 4 <= M) panel_rows<4>(xt, M, panel, K, out, ldo, add, lda, r0, n0, mask, r0 ? next : nullptr), r0 += 4;
      if (r0 + 2 <= M) panel_rows<2>(xt, M, panel, K, out, ldo, add, lda, r0, n0, mask, r0 ? next : nullptr), r0 += 2;
      if (r0 < M) panel_rows<1>(xt, M, panel, K, out, ldo, add, lda, r0, n0, mask, r0 ? next : nullptr);
    }
  });
}
#endif  // ELMO_X86

// out (M, N) = x (M, K) · w (+ add (M, N)), w given as pack_panels(w). out and add: row-major rows (any row stride).
void small_mm(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& add,
              const at::Tensor& out) {
  TORCH_CHECK(avx512(), "elmo_fast._cpu: small_mm needs AVX-512 (small_mm_available() is false on this CPU)");
  check_f32(x, "x", 2);
  check_f32(panels, "panels", 3);
  check_f32(out, "out", 2);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.size(1) == K && panels.size(2) == kLanes &&
                  panels.size(0) == (N + kLanes - 1) / kLanes,
              "elmo_fast._cpu: small_mm: panels must be pack_panels of a (", K, ", ", N, ") weight, got ",
              panels.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N && out.stride(1) == 1, "elmo_fast._cpu: small_mm: out must be (",
              M, ", ", N, ") with unit column stride, got ", out.sizes(), " strides ", out.strides());
  const float* add_p = nullptr;
  int64_t lda = 0;
  if (add.has_value()) {
    check_f32(*add, "add", 2);
    TORCH_CHECK(add->size(0) == M && add->size(1) == N && add->stride(1) == 1, "elmo_fast._cpu: small_mm: add must "
                "be (", M, ", ", N, ") with unit column stride, got ", add->sizes(), " strides ", add->strides());
    add_p = add->data_ptr<float>();
    lda = add->stride(0);
  }
  if (M == 0 || N == 0) return;
  std::vector<float> xt(static_cast<size_t>(K * M));  // x transposed: one line of it per k
  const float* xp = x.data_ptr<float>();
  const int64_t sm = x.stride(0), sk = x.stride(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = xp[m * sm + k * sk];
#ifdef ELMO_X86
  small_mm_avx512(xt.data(), M, panels.data_ptr<float>(), K, N, out.data_ptr<float>(), out.stride(0), add_p, lda);
#endif
}

}  // namespace

void add_small_gemm(pybind11::module_& m) {
  m.def("small_mm_available", &avx512, "whether small_mm runs on this CPU (AVX-512)");
  m.def("pack_panels", &pack_panels, "a (K, N) weight packed for small_mm", pybind11::arg("w"));
  m.def("small_mm", &small_mm, "out = x . w (+ add) for few rows, w as pack_panels(w)", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("add"), pybind11::arg("out"));
}
