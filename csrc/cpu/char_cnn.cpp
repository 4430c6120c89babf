// elmo_fast._cpu: the max over positions of the char CNN and its backward, sparse in the positions.
//
// Each filter of the char CNN keeps one value per token: the maximum of its convolution over the token's windows
// (spec §2.2). Its gradient therefore reaches only the windows that hold that maximum: one window in most cases,
// every tied window when several hold it (TF's reduce_max and torch's amax share the gradient evenly among ties;
// ties are common for narrow filters over repeated characters). Autograd through amax and conv1d builds the dense
// (tokens, filters, positions) gradient, zero except at those windows, and runs the whole transposed convolution on
// it. Here the forward records, per token and filter, the positions of the maximum as a bit mask (at most 64
// windows), and the backward visits only those: per (token, filter, window, k) one row of the char table times the
// gradient into the filter's weight, and the filter's weight row times the gradient into the char table, where the
// dense backward spends the same work at every window.
//
//   conv_max(y, pv, n_win, m, bits)      y (n, F, P) the convolution at the first P windows, pv (F,) the value of an
//                                        all-padding window (the windows P..n_win-1), or None when P == n_win;
//                                        m (n, F) = the maximum, bits (F, n) = its windows.
//   conv_max_backward(ids, table, pad, wt, g, bits, dwt, dtable, db)
//                                        ids (n, L) int32 char ids, table (V, d), pad the padding character (the
//                                        windows of a token from its last other character on are all padding),
//                                        wt (F, w, d) the filters,
//                                        g (F, n) the gradient w.r.t. m; writes dwt (F, w, d) and db (F,), adds to
//                                        dtable (V, d).
//
// A NaN among a filter's windows gives m = NaN and an empty mask; its gradient is NaN in db, dwt and the table rows
// of the token's characters (where the dense backward's is NaN too). Sums run in double (a char's table row gathers
// the gradients of thousands of windows). Work is split over filters; each thread sums its char-table gradient apart
// and the parts are added in filter order, so results depend on the thread count but not on timing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <vector>

namespace {

using elmo_cpu::check_f32;

constexpr int64_t kMaxWindows = 64;  // one bit per window

// One (token, filter) row of P values: the maximum (NaN if any is NaN) and its positions.
inline void row_max(const float* row, int64_t P, bool pad, float pv, int64_t n_win, float* m, int64_t* bits) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t p = 0; p < P; ++p) {
    const float v = row[p];
    nan |= v != v;
    best = v > best ? v : best;
  }
  if (pad) {
    nan |= pv != pv;
    best = pv > best ? pv : best;
  }
  if (nan) {
    *m = std::numeric_limits<float>::quiet_NaN();
    *bits = 0;
    return;
  }
  uint64_t b = 0;
  for (int64_t p = 0; p < P; ++p) b |= static_cast<uint64_t>(row[p] == best) << p;
  if (pad && pv == best)
    for (int64_t p = P; p < n_win; ++p) b |= uint64_t{1} << p;
  *m = best;
  *bits = static_cast<int64_t>(b);
}

#ifdef ELMO_X86
// The same with AVX-512: the row in up to four masked vectors.
__attribute__((target("avx512f"))) void row_max_avx512(const float* row, int64_t P, bool pad, float pv, int64_t n_win,
                                                       float* m, int64_t* bits) {
  __m512 v[4];
  __mmask16 lanes[4];
  const int nv = static_cast<int>((P + 15) / 16);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int i = 0; i < nv; ++i) {
    const int64_t left = P - 16 * i;
    lanes[i] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    v[i] = _mm512_maskz_loadu_ps(lanes[i], row + 16 * i);
    nan |= _mm512_mask_cmp_ps_mask(lanes[i], v[i], v[i], _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, lanes[i], mx, v[i]);
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, mx);
  float best = lane[0];
  for (int i = 1; i < 16; ++i) best = lane[i] > best ? lane[i] : best;
  if (pad) {
    nan |= pv != pv;
    best = pv > best ? pv : best;
  }
  if (nan) {
    *m = std::numeric_limits<float>::quiet_NaN();
    *bits = 0;
    return;
  }
  const __m512 vb = _mm512_set1_ps(best);
  uint64_t b = 0;
  for (int i = 0; i < nv; ++i)
    b |= static_cast<uint64_t>(_mm512_mask_cmp_ps_mask(lanes[i], v[i], vb, _CMP_EQ_OQ)) << (16 * i);
  if (pad && pv == best)
    for (int64_t p = P; p < n_win; ++p) b |= uint64_t{1} << p;
  *m = best;
  *bits = static_cast<int64_t>(b);
}
#endif

void conv_max(const at::Tensor& y, const c10::optional<at::Tensor>& pv, int64_t n_win, const at::Tensor& m,
              const at::Tensor& bits) {
  check_f32(y, "y", 3, true);
  const int64_t n = y.size(0), F = y.size(1), P = y.size(2);
  TORCH_CHECK(P >= 1 && P <= n_win && n_win <= kMaxWindows, "elmo_fast._cpu: conv_max: need 1 <= P (", P,
              ") <= n_win (", n_win, ") <= ", kMaxWindows);
  const bool pad = P < n_win;
  TORCH_CHECK(!pad || pv.has_value(), "elmo_fast._cpu: conv_max: pv is needed when P < n_win");
  if (pad) elmo_cpu::check_f32(*pv, "pv", 1, true);
  TORCH_CHECK(!pad || pv->size(0) == F, "elmo_fast._cpu: conv_max: pv must have ", F, " values");
  elmo_cpu::check_matrix(m, "m", n, F);
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == at::kLong && bits.is_contiguous() && bits.dim() == 2 &&
                  bits.size(0) == F && bits.size(1) == n,
              "elmo_fast._cpu: conv_max: bits must be a contiguous (", F, ", ", n, ") CPU int64 tensor");
  const float* yp = y.data_ptr<float>();
  const float* pvp = pad ? pv->data_ptr<float>() : nullptr;
  float* mp = m.data_ptr<float>();
  int64_t* bp = bits.data_ptr<int64_t>();
  auto one = ELMO_PICK(row_max_avx512, row_max);
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t f = 0; f < F; ++f)
        one(yp + (t * F + f) * P, P, pad, pad ? pvp[f] : 0.0f, n_win, mp + t * F + f, bp + f * n + t);
  });
}

// One window's k-th row at d = 16, in GCC's vector types: whole vectors in the caller's instruction set (the
// functions below inline it into an AVX-512 one and a baseline one). dw += g·e and dtab += g·w, the products in
// float (as the dense backward's), the sums in double.
using F16 = float __attribute__((vector_size(64)));
using F8 = float __attribute__((vector_size(32)));
using D8 = double __attribute__((vector_size(64)));

inline __attribute__((always_inline)) void add_product(double* __restrict__ sum, F16 p) {
  D8 lo, hi;
  std::memcpy(&lo, sum, sizeof lo);
  std::memcpy(&hi, sum + 8, sizeof hi);
  lo += __builtin_convertvector(__builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7), D8);
  hi += __builtin_convertvector(__builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15), D8);
  std::memcpy(sum, &lo, sizeof lo);
  std::memcpy(sum + 8, &hi, sizeof hi);
}

inline __attribute__((always_inline)) void update16(float g, const float* e, const float* w, double* __restrict__ dw,
                                                    double* __restrict__ dtab) {
  F16 ev, wv;
  std::memcpy(&ev, e, sizeof ev);
  std::memcpy(&wv, w, sizeof wv);
  add_product(dw, ev * g);
  add_product(dtab, wv * g);
}

// What the backward reads and writes (conv_max_backward's arguments, as pointers).
struct Backward {
  const int32_t* ids;  // (n, L)
  const int64_t* real;  // (n,) per token: the windows before its first all-padding one
  int64_t n, L;
  const float* table;  // (V, d)
  int64_t d, pad;  // pad: the padding character's row
  const float* wt;  // (F, w, d)
  int64_t w;
  const float* g;  // (F, n)
  const int64_t* bits;  // (F, n)
  float* dwt;  // (F, w, d)
  float* db;  // (F,)
};

// Filters f0..f1-1: their weight gradients (rows of dwt), bias gradients, and their part of the table's gradient
// (dtab, V x d, double); acc: w x d doubles of scratch. The windows of a token from its first all-padding one on
// are identical (the padding character throughout), so their share is summed as one number per filter and applied
// once at the end.
template <int D>
inline __attribute__((always_inline)) void backward_filters(const Backward& a, int64_t f0, int64_t f1, double* dtab,
                                                            double* acc) {
  const int64_t d = D > 0 ? D : a.d, w = a.w, n = a.n;
  for (int64_t f = f0; f < f1; ++f) {
    const float* wf = a.wt + f * w * d;
    for (int64_t i = 0; i < w * d; ++i) acc[i] = 0.0;
    double bias = 0.0, pad = 0.0;
    bool nan = false;
    for (int64_t t = 0; t < n; ++t) {
      const float gt = a.g[f * n + t];
      const uint64_t b = static_cast<uint64_t>(a.bits[f * n + t]);
      if (b == 0) {  // a NaN among the windows in the forward: NaN into the table rows of the token's characters
        nan = true;
        for (int64_t i = 0; i < a.L; ++i)
          for (int64_t j = 0; j < d; ++j) dtab[a.ids[t * a.L + i] * d + j] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if (gt == 0.0f) continue;
      bias += gt;
      const int cnt = __builtin_popcountll(b);
      const float gg = cnt == 1 ? gt : gt / static_cast<float>(cnt);
      const int64_t k_real = a.real[t];
      uint64_t r = k_real >= 64 ? b : b & ((uint64_t{1} << k_real) - 1);
      pad += static_cast<double>(gg) * __builtin_popcountll(b & ~r);
      const int32_t* id = a.ids + t * a.L;
      while (r) {
        const int64_t p = __builtin_ctzll(r);
        r &= r - 1;
        for (int64_t k = 0; k < w; ++k) {
          const int64_t c = id[p + k];
          if constexpr (D == 16)
            update16(gg, a.table + c * 16, wf + k * 16, acc + k * 16, dtab + c * 16);
          else
            for (int64_t j = 0; j < d; ++j) {
              acc[k * d + j] += static_cast<double>(gg * a.table[c * d + j]);
              dtab[c * d + j] += static_cast<double>(gg * wf[k * d + j]);
            }
        }
      }
    }
    if (pad != 0.0) {
      const float* e = a.table + a.pad * d;
      for (int64_t k = 0; k < w; ++k)
        for (int64_t j = 0; j < d; ++j) {
          acc[k * d + j] += pad * e[j];
          dtab[a.pad * d + j] += pad * wf[k * d + j];
        }
    }
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    float* dwf = a.dwt + f * w * d;
    for (int64_t i = 0; i < w * d; ++i) dwf[i] = nan ? qnan : static_cast<float>(acc[i]);
    a.db[f] = nan ? qnan : static_cast<float>(bias);
  }
}

using BackwardFn = void (*)(const Backward&, int64_t, int64_t, double*, double*);

template <int D>
void backward_generic(const Backward& a, int64_t f0, int64_t f1, double* dtab, double* acc) {
  backward_filters<D>(a, f0, f1, dtab, acc);
}

#ifdef ELMO_X86
template <int D>
__attribute__((target("avx512f"))) void backward_avx512(const Backward& a, int64_t f0, int64_t f1, double* dtab,
                                                        double* acc) {
  backward_filters<D>(a, f0, f1, dtab, acc);
}
#endif

void conv_max_backward(const at::Tensor& ids, const at::Tensor& table, int64_t pad, const at::Tensor& wt,
                       const at::Tensor& g, const at::Tensor& bits, const at::Tensor& dwt, const at::Tensor& dtable,
                       const at::Tensor& db) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.dim() == 2,
              "elmo_fast._cpu: conv_max_backward: ids must be a contiguous 2-d CPU int32 tensor, got ",
              ids.scalar_type(), " ", ids.sizes());
  const int64_t n = ids.size(0), L = ids.size(1);
  elmo_cpu::check_matrix(table, "table", -1, -1);
  const int64_t V = table.size(0), d = table.size(1);
  TORCH_CHECK(pad >= 0 && pad < V, "elmo_fast._cpu: conv_max_backward: the padding character ", pad,
              " is not a row of the ", V, "-row table");
  check_f32(wt, "wt", 3, true);
  const int64_t F = wt.size(0), w = wt.size(1);
  TORCH_CHECK(wt.size(2) == d, "elmo_fast._cpu: conv_max_backward: wt must be (F, w, ", d, "), got ", wt.sizes());
  TORCH_CHECK(w >= 1 && L - w + 1 >= 1 && L - w + 1 <= kMaxWindows, "elmo_fast._cpu: conv_max_backward: ", L,
              " characters and width ", w, " give ", L - w + 1, " windows, expected 1..", kMaxWindows);
  elmo_cpu::check_matrix(g, "g", F, n);
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == at::kLong && bits.is_contiguous() &&
                  bits.sizes() == g.sizes(),
              "elmo_fast._cpu: conv_max_backward: bits must be a contiguous (", F, ", ", n, ") CPU int64 tensor");
  TORCH_CHECK(dwt.sizes() == wt.sizes(), "elmo_fast._cpu: conv_max_backward: dwt must be ", wt.sizes());
  check_f32(dwt, "dwt", 3, true);
  elmo_cpu::check_matrix(dtable, "dtable", V, d);
  check_f32(db, "db", 1, true);
  TORCH_CHECK(db.size(0) == F, "elmo_fast._cpu: conv_max_backward: db must have ", F, " values");
  const int32_t* idp = ids.data_ptr<int32_t>();
  std::vector<int64_t> real(n);  // windows before the token's first all-padding one: 1 + its last other char
  for (int64_t t = 0; t < n; ++t) {
    int64_t last = -1;
    for (int64_t i = 0; i < L; ++i) {
      const int32_t c = idp[t * L + i];
      TORCH_CHECK(c >= 0 && c < V, "elmo_fast._cpu: conv_max_backward: char id ", c, " is not a row of the ", V,
                  "-row table");
      if (c != pad) last = i;
    }
    real[t] = last + 1;
  }
  const int64_t n_win = L - w + 1;
  const int64_t* bp = bits.data_ptr<int64_t>();
  const uint64_t valid = n_win == 64 ? ~uint64_t{0} : (uint64_t{1} << n_win) - 1;
  for (int64_t i = 0; i < F * n; ++i)
    TORCH_CHECK((static_cast<uint64_t>(bp[i]) & ~valid) == 0, "elmo_fast._cpu: conv_max_backward: bits name a window "
                "past the ", n_win, " of this width");
  const Backward args{idp, real.data(), n, L, table.data_ptr<float>(), d, pad, wt.data_ptr<float>(), w,
                      g.data_ptr<float>(), bp, dwt.data_ptr<float>(), db.data_ptr<float>()};
  BackwardFn fn;
#ifdef ELMO_X86
  if (elmo_cpu::use_avx512())
    fn = d == 16 ? backward_avx512<16> : backward_avx512<0>;
  else
#endif
    fn = d == 16 ? backward_generic<16> : backward_generic<0>;
  std::map<int64_t, std::vector<double>> parts;  // first filter of a chunk -> its table gradient
  std::mutex lock;
  at::parallel_for(0, F, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> part(V * d, 0.0), acc(w * d);
    fn(args, begin, end, part.data(), acc.data());
    std::lock_guard<std::mutex> hold(lock);
    parts.emplace(begin, std::move(part));
  });
  std::vector<double> sum(V * d, 0.0);
  for (const auto& kv : parts)
    for (int64_t i = 0; i < V * d; ++i) sum[i] += kv.second[i];
  float* out = dtable.data_ptr<float>();
  for (int64_t i = 0; i < V * d; ++i) out[i] += static_cast<float>(sum[i]);
}

}  // namespace

void add_char_cnn(pybind11::module_& m) {
  m.def("conv_max", &conv_max,
        pybind11::call_guard<pybind11::gil_scoped_release>(),  // no Python object touched: other threads run
        "max over windows of the char CNN, with the windows holding it (bit masks)",
        pybind11::arg("y"), pybind11::arg("pv"), pybind11::arg("n_win"), pybind11::arg("m"), pybind11::arg("bits"));
  m.def("conv_max_backward", &conv_max_backward,
        pybind11::call_guard<pybind11::gil_scoped_release>(),  // no Python object touched: other threads run
        "the char CNN's weight, bias and table gradients from conv_max's windows", pybind11::arg("ids"),
        pybind11::arg("table"), pybind11::arg("pad"), pybind11::arg("wt"), pybind11::arg("g"), pybind11::arg("bits"),
        pybind11::arg("dwt"), pybind11::arg("dtable"), pybind11::arg("db"));
}
