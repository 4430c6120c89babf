// elmo_fast._cpu: the sparse softmax rows of a training step, summed and updated in one pass each (no temporaries).
//
// The sampled softmax gives its weight M gradient rows (the targets and samples of both directions: 17,024 rows of
// 512 at the original sizes, 35 MB). elmo_fast/training/trainer.py sums the rows that share an id (sum_rows) and
// applies TF1 Adagrad to the touched rows only (adagrad_rows). As torch ops that is a gather, a zero fill and a
// scatter for the sums, then six whole-size temporaries for the update (g / f, g², the gathered accumulator, its
// sum, the quotient, the scaled step): ~10 passes over 35 MB plus the page traffic of fresh buffers. Here each is
// one pass, with the same arithmetic in the same order, so the results are bit-identical to the torch ops:
//   sums[s] = ((0 + v[perm[a]]) + v[perm[a+1]]) + ...   over the sorted rows a.. of segment s (index_add_'s order)
//   g = v / f;  a = acc + g*g;  acc = a;  p = p + (g / sqrt(a)) * (-lr)
// Plain loops, and for the update an AVX-512 loop chosen at run time (elmo_cpu::use_avx512): division and square
// root are correctly rounded at any width, and nothing here may be contracted into an FMA (the pragma below), so
// both paths give the same bits. The scalar loop's std::sqrt keeps errno and so is never vectorized: 20 ms for the
// 14,500 distinct rows of 512 of a B=16 step on 2 Xeon cores, against ~5 ms for the vector loop.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC optimize("fp-contract=off")  // a*b + c stays two roundings, as in the torch ops

namespace {

void check_ids(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 &&
                  t.size(0) == n,
              "elmo_fast._cpu: ", name, " must be a contiguous 1-d CPU int64 tensor of ", n, " ids, got ",
              t.scalar_type(), " ", t.sizes());
}

// sid (M,) sorted ids, perm (M,) the sort's permutation, vals (M, k). Writes ids (M,) and sums (M, k): every
// distinct id once with the sum of its rows, in sid's order, then id 0 with zero rows (trainer.sum_rows).
void sum_rows(const at::Tensor& sid, const at::Tensor& perm, const at::Tensor& vals, const at::Tensor& ids,
              const at::Tensor& sums) {
  elmo_cpu::check_matrix(vals, "vals", -1, -1);
  const int64_t M = vals.size(0), k = vals.size(1);
  check_ids(sid, "sid", M);
  check_ids(perm, "perm", M);
  check_ids(ids, "ids", M);
  elmo_cpu::check_matrix(sums, "sums", M, k);
  const int64_t* s = sid.data_ptr<int64_t>();
  const int64_t* pm = perm.data_ptr<int64_t>();
  std::vector<int64_t> start;  // first sorted row of every segment, then M
  start.reserve(M + 1);
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(pm[i] >= 0 && pm[i] < M, "elmo_fast._cpu: sum_rows: perm[", i, "] = ", pm[i], " is not a row of vals");
    if (i == 0 || s[i] != s[i - 1]) {
      TORCH_CHECK(i == 0 || s[i] > s[i - 1], "elmo_fast._cpu: sum_rows: sid must be sorted (sid[", i, "] = ", s[i],
                  " after ", s[i - 1], ")");
      start.push_back(i);
    }
  }
  const int64_t n = static_cast<int64_t>(start.size());
  start.push_back(M);
  int64_t* out_id = ids.data_ptr<int64_t>();
  float* out = sums.data_ptr<float>();
  const float* v = vals.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = out + r * k;
      if (r >= n) {  // padding: (id 0, zeros), an exact no-op for an index_add_ row update
        out_id[r] = 0;
        std::memset(o, 0, sizeof(float) * k);
        continue;
      }
      out_id[r] = s[start[r]];
      for (int64_t c = 0; c < k; ++c) o[c] = 0.0f;
      for (int64_t i = start[r]; i < start[r + 1]; ++i) {
        const float* src = v + pm[i] * k;
        for (int64_t c = 0; c < k; ++c) o[c] += src[c];
      }
    }
  });
}

// One row of the update: g = x / f;  a = acc + g*g;  acc = a;  p = p + (g / sqrt(a)) * step.
void adagrad_row(const float* x, float* pr, float* ar, int64_t k, float f, float step) {
  for (int64_t c = 0; c < k; ++c) {
    const float gc = x[c] / f;
    const float a = ar[c] + gc * gc;
    ar[c] = a;
    pr[c] = pr[c] + (gc / std::sqrt(a)) * step;
  }
}

#ifdef ELMO_X86
// The same, 16 columns at a time (the last vector masked).
__attribute__((target("avx512f"))) void adagrad_row_avx512(const float* x, float* pr, float* ar, int64_t k, float f,
                                                           float step) {
  const __m512 vf = _mm512_set1_ps(f), vs = _mm512_set1_ps(step);
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 m = k - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - c)) - 1u);
    const __m512 g = _mm512_maskz_div_ps(m, _mm512_maskz_loadu_ps(m, x + c), vf);
    const __m512 a = _mm512_add_ps(_mm512_maskz_loadu_ps(m, ar + c), _mm512_mul_ps(g, g));
    _mm512_mask_storeu_ps(ar + c, m, a);
    const __m512 q = _mm512_maskz_div_ps(m, g, _mm512_maskz_sqrt_ps(m, a));
    _mm512_mask_storeu_ps(pr + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, pr + c), _mm512_mul_ps(q, vs)));
  }
}
#endif

// TF1 Adagrad on the rows `rows` (M,) of p and acc (V, k) with gradient rows g (M, k) divided by inv_factor. Rows
// whose gradient is all zero are left alone (what the update does to them where acc > 0: sum_rows's padding; where
// acc = 0 the torch ops would write 0/0 = NaN into such a row).
// The other rows must have distinct ids: returns false, changing nothing, where they do not (the caller then runs
// the general update).
bool adagrad_rows(const at::Tensor& p, const at::Tensor& acc, const at::Tensor& rows, const at::Tensor& g, double lr,
                  const at::Tensor& inv_factor) {
  TORCH_CHECK(inv_factor.device().is_cpu() && inv_factor.numel() == 1, "elmo_fast._cpu: adagrad_rows: inv_factor must "
              "be a one-element CPU tensor, got ", inv_factor.sizes(), " on ", inv_factor.device());
  elmo_cpu::check_matrix(p, "p", -1, -1);
  const int64_t V = p.size(0), k = p.size(1);
  elmo_cpu::check_matrix(acc, "acc", V, k);
  elmo_cpu::check_matrix(g, "g", -1, k);
  const int64_t M = g.size(0);
  check_ids(rows, "rows", M);
  const int64_t* id = rows.data_ptr<int64_t>();
  const float* gv = g.data_ptr<float>();
  std::vector<uint8_t> live(M);
  at::parallel_for(0, M, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = gv + r * k;
      int64_t c = 0;
      while (c < k && x[c] == 0.0f) ++c;  // NaN counts as non-zero
      live[r] = c < k;
    }
  });
  std::vector<uint8_t> seen(V, 0);
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < V, "elmo_fast._cpu: adagrad_rows: rows[", r, "] = ", id[r], " is not a row of p (",
                V, " rows)");
    if (!live[r]) continue;
    if (seen[id[r]]) return false;
    seen[id[r]] = 1;
  }
  float* pw = p.data_ptr<float>();
  float* aw = acc.data_ptr<float>();
  const float f = static_cast<float>(inv_factor.item<double>()), step = static_cast<float>(-lr);
  auto row = ELMO_PICK(adagrad_row_avx512, adagrad_row);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (live[r]) row(gv + r * k, pw + id[r] * k, aw + id[r] * k, k, f, step);
  });
  return true;
}

// The sum of squares of x[0..n), in double: every square exact, 8 partial sums (scalar) or 32 lanes (AVX-512),
// added at the end. n is at most kSquaresRun, so the order of the sums never matters at fp32's precision.
double squares_run(const float* x, int64_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += static_cast<double>(x[i + j]) * static_cast<double>(x[i + j]);
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

#ifdef ELMO_X86
__attribute__((target("avx512f"))) double squares_run_avx512(const float* x, int64_t n) {
  __m512d a[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      // (the masked form: GCC 12 warns about the unmasked one's undefined operand)
      const __m512d d = _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(x + i + 8 * j));
      a[j] = _mm512_fmadd_pd(d, d, a[j]);
    }
  double lanes[8];
  _mm512_storeu_pd(lanes, _mm512_add_pd(_mm512_add_pd(a[0], a[1]), _mm512_add_pd(a[2], a[3])));
  const double head =
      ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  return head + squares_run(x + i, n - i);
}
#endif

constexpr int64_t kSquaresRun = 1 << 14;  // elements per partial sum: the partials' order fixed by the data alone

// Σ t², in double, of a contiguous CPU float32 tensor (trainer.global_norm): runs of kSquaresRun elements summed in
// parallel, then the runs' sums in order, so that the result does not depend on the thread count. Bandwidth-bound:
// the 64 MiB weight gradient of an LSTM layer in 1.5-2.2 ms on 2 Xeon cores when it sits in cache (3.3 ms just
// after the GEMM that wrote it), where torch's vector_norm over rows of 4,096 took 3.1 ms.
double sum_squares(const at::Tensor& t) {
  elmo_cpu::check_f32(t, "t", t.dim(), true);
  const int64_t n = t.numel(), runs = (n + kSquaresRun - 1) / kSquaresRun;
  const float* x = t.data_ptr<float>();
  std::vector<double> part(static_cast<size_t>(runs));
  auto run = ELMO_PICK(squares_run_avx512, squares_run);
  at::parallel_for(0, runs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      part[r] = run(x + r * kSquaresRun, std::min(kSquaresRun, n - r * kSquaresRun));
  });
  double total = 0.0;
  for (const double p : part) total += p;
  return total;
}

}  // namespace

void add_sparse_rows(pybind11::module_& m) {
  m.def("sum_rows", &sum_rows, "the rows of vals that share an id summed into ids, sums (trainer.sum_rows)",
        pybind11::arg("sid"), pybind11::arg("perm"), pybind11::arg("vals"), pybind11::arg("ids"), pybind11::arg("sums"));
  m.def("adagrad_rows", &adagrad_rows, "TF1 Adagrad on the touched rows, in place (trainer.adagrad_rows)",
        pybind11::arg("p"), pybind11::arg("acc"), pybind11::arg("rows"), pybind11::arg("g"), pybind11::arg("lr"),
        pybind11::arg("inv_factor"));
  m.def("sum_squares", &sum_squares, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "the sum of the squares of a contiguous float32 tensor, in double (trainer.global_norm)", pybind11::arg("t"));
}
