// elmo_fast._cpu: the per-step products of an LSTMP chain, x (M, K) · w (K, N) (+ add), for few rows.
//
// An LSTMP step multiplies the B rows of the batch (16-32 in training and embedding) by a weight of 32 MiB
// (512 x 16384) or 8 MiB (4096 x 512) that does not stay in cache between steps: the product streams the weight
// from memory once per step. The weight is packed once into panels of 16 or 32 columns (P = ceil(N/width) panels
// of K x width, the last zero-padded), so that each panel is one contiguous stream; x is transposed (K x M) so that
// each k reads one line of it. A panel's product keeps a block of rows in AVX-512 accumulators (16 rows x 16
// columns, or 14 rows x 32 columns: 28 accumulators, so that two vector loads of the panel feed 28 fused
// multiply-adds per k, each row's x value broadcast from memory). k is summed in blocks of 256 (partial sums in
// out). Panels are split over torch's intra-op threads, and a thread runs its panels k block by k block: the
// block's 256 lines of xt stay in L1 while every panel's slice of that block streams past (each slice is read from
// memory once: its first row block streams it, prefetching ahead and into the next slice; the other row blocks
// find it in L1). The pack is a gather of 16 lanes for a column-major weight (a transposed view) and a copy of row
// runs for a row-major one, with streaming stores when the panels are larger than a core's L2: training packs its
// weights afresh every call (Adagrad has changed them), 512 x 16384 in 1.5 ms (row-major) and 2.0 ms (gathered)
// instead of 5.2 and 3.1 in the B = 16 step, where the stores' reads of the lines they fill were a third of the
// traffic.
//
// Measured against oneDNN's packed product on a 2-core AVX-512 Xeon (bench/bench_cpu_products.py; A/Bs in
// bench/results/cpu_train.md): faster at 16 rows (width 16) at every inner dimension of the chain, and at 32 rows
// (width 32) for K = 512 with the weight out of cache, slower at 32 rows and a long inner dimension;
// elmo_fast.cpu.packed takes it for at most 16 rows, and for 17-32 rows where K <= 1024. AVX-512 only (functions
// with a target attribute, chosen at run time); elsewhere small_mm_available() is false.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using elmo_cpu::check_f32;

#ifdef ELMO_X86
#define ELMO_AVX512 __attribute__((target("avx512f")))

// The lanes of a panel's V vectors that hold columns of w, for a panel of `cols` columns (all, from 16·V).
template <int V>
void panel_masks(int64_t cols, __mmask16* mask) {
  for (int v = 0; v < V; ++v) {
    const int64_t c = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * v));
    mask[v] = static_cast<__mmask16>(c == 16 ? 0xFFFFu : (1u << c) - 1u);
  }
}

constexpr int64_t kStreamBytes = int64_t{4} << 20;  // packs larger than this are written with streaming stores

// One vector of a panel: a streaming (non-temporal) store for a pack larger than a core's L2, which would only evict
// it on its way to memory, and whose write would first read every line it fills (the pack writes whole lines); a
// plain store otherwise. `d` is 64-byte aligned (panel rows are whole lines of a 64-byte-aligned tensor).
template <bool kStream>
ELMO_AVX512 inline void store_line(float* d, __m512 v) {
  if constexpr (kStream)
    _mm512_stream_ps(d, v);
  else
    _mm512_storeu_ps(d, v);
}

// Panels p0..p1-1 of a column-major w (unit row stride, column stride sn): each panel's 16·V columns gathered per k
// (the panel's columns are contiguous runs of k in memory, so consecutive k read the same lines).
template <int V, bool kStream>
ELMO_AVX512 void pack_gather(const float* src, int64_t sn, int64_t K, int64_t N, float* dst, int64_t p0, int64_t p1) {
  constexpr int64_t W = 16 * V;
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(sn)));
  for (int64_t p = p0; p < p1; ++p) {
    __mmask16 mask[V];
    panel_masks<V>(N - p * W, mask);
    for (int64_t k = 0; k < K; ++k)
      for (int v = 0; v < V; ++v)
        store_line<kStream>(dst + (p * K + k) * W + 16 * v,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask[v], idx,
                                                     src + (p * W + 16 * v) * sn + k, 4));
  }
  if constexpr (kStream) _mm_sfence();
}

// Panels p0..p1-1 of a row-major w (row stride sk, N a multiple of 16·V): blocks of 8 rows, each swept along the
// panels, so that the rows are read as 8 sequential streams and each panel receives 8 lines at once.
template <int V, bool kStream>
ELMO_AVX512 void pack_rows(const float* src, int64_t sk, int64_t K, float* dst, int64_t p0, int64_t p1) {
  constexpr int64_t W = 16 * V, kRows = 8;
  for (int64_t k0 = 0; k0 < K; k0 += kRows) {
    const int64_t k1 = std::min(K, k0 + kRows);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = k0; k < k1; ++k)
        for (int v = 0; v < V; ++v)
          store_line<kStream>(dst + (p * K + k) * W + 16 * v, _mm512_loadu_ps(src + k * sk + p * W + 16 * v));
  }
  if constexpr (kStream) _mm_sfence();
}

// A column-major weight whose lanes' offsets (j · column stride, j < width) fit the gather's 32-bit indices.
bool gather_fits(const at::Tensor& w, int64_t width) {
  return w.stride(0) == 1 && (width - 1) * w.stride(1) < (int64_t{1} << 31);
}
#endif  // ELMO_X86

// w (K, N), any strides -> panels (ceil(N/width), K, width), zero past column N; width 16 or 32.
at::Tensor pack_panels(const at::Tensor& w, int64_t width) {
  check_f32(w, "w", 2);
  TORCH_CHECK(width == 16 || width == 32, "elmo_fast._cpu: pack_panels: width must be 16 or 32, got ", width);
  const int64_t K = w.size(0), N = w.size(1), P = (N + width - 1) / width;
  at::Tensor out = at::empty({P, K, width}, w.options());
  const float* src = w.data_ptr<float>();
  const int64_t sk = w.stride(0), sn = w.stride(1);
  float* dst = out.data_ptr<float>();
#ifdef ELMO_X86
  if (elmo_cpu::has_avx512()) {
    // streaming stores past a core's L2 (2 MiB on the Xeon); 512 x 16384 out of memory, 2 threads: row-major
    // 4.2 -> 1.5 ms, column-major 2.9 -> 1.9 ms (bench/results/cpu_train.md)
    const bool stream = out.nbytes() > kStreamBytes && reinterpret_cast<std::uintptr_t>(dst) % 64 == 0;
    const bool rows = sn == 1 && N % width == 0;
    // a row-major weight: copied in blocks of rows; a column-major one (a transposed view): gathered, 16 lanes at once
    if (rows || gather_fits(w, width)) {
      at::parallel_for(0, P, rows ? 16 : 1, [&](int64_t begin, int64_t end) {
        const bool two = width == 32;
        if (!rows)
          (two ? (stream ? pack_gather<2, true> : pack_gather<2, false>)
               : (stream ? pack_gather<1, true> : pack_gather<1, false>))(src, sn, K, N, dst, begin, end);
        else
          (two ? (stream ? pack_rows<2, true> : pack_rows<2, false>)
               : (stream ? pack_rows<1, true> : pack_rows<1, false>))(src, sk, K, dst, begin, end);
      });
      return out;
    }
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * width, cols = std::min(width, N - n0);
      for (int64_t k = 0; k < K; ++k) {
        float* d = dst + (p * K + k) * width;
        const float* s = src + k * sk + n0 * sn;
        for (int64_t j = 0; j < cols; ++j) d[j] = s[j * sn];
        std::fill(d + cols, d + width, 0.0f);
      }
    }
  });
  return out;
}

#ifdef ELMO_X86
constexpr int64_t kBlock = 256;   // k per accumulation block: partial sums of 256 products, then summed
constexpr int64_t kAhead = 64;    // prefetch distance in k (4 KiB of panel): the weight streams from memory

// xt (K x M) = the rows m0..m0+15 (fewer: `rows`) of x, unit k stride, row stride sm, for k in [k0, k1), k0 a multiple
// of 16: blocks of 16 k x 16 rows transposed in registers (unpacks at 32 and 64 bits, then 128-bit block shuffles),
// 1.7-4.5x faster than the scalar strided copy it replaces (K = 16384, M = 16, the step's dz·W_recᵀ: 133 -> 77 us
// on 1 thread, 104 -> 37 us on 2).
// (GCC 12 warns that the unpack intrinsics' own _mm512_undefined operand "may be used uninitialized": a false
// positive of the header's self-initialisation idiom)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ELMO_AVX512 void transpose_rows(const float* x, int64_t sm, int64_t rows, int64_t M, int64_t m0, int64_t k0,
                                int64_t k1, int64_t K, float* xt) {
  const __mmask16 lanes = static_cast<__mmask16>(rows >= 16 ? 0xFFFFu : (1u << rows) - 1u);
  for (int64_t kb = k0; kb < k1; kb += 16) {
    const int64_t kn = std::min<int64_t>(16, K - kb);
    const __mmask16 kmask = static_cast<__mmask16>(kn >= 16 ? 0xFFFFu : (1u << kn) - 1u);
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_maskz_loadu_ps(kmask, x + (m0 + i) * sm + kb) : _mm512_setzero_ps();
    for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved, columns 4b+0,1 / 4b+2,3 of each block b
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + c], block b: rows 4i..4i+3 of column 4b + c
      const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
      const __m512d b0 = _mm512_castps_pd(t[4 * i + 2]), b1 = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    for (int c = 0; c < 4; ++c) {  // column 4b + c = block b of r[c], r[4 + c], r[8 + c], r[12 + c]
      const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
      const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
      const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
      t[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
      t[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
      t[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
      t[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
    for (int64_t j = 0; j < kn; ++j) _mm512_mask_storeu_ps(xt + (kb + j) * M + m0, lanes, t[j]);
  }
}
#pragma GCC diagnostic pop

// What a panel slice's product prefetches while it runs: the first row block streams the slice from memory and
// prefetches into L1 kAhead k ahead, running on into the next slice's first lines near its end; the other row
// blocks find the slice in L1 and prefetch the next slice into L2.
enum Prefetch { kL1, kL2 };

// rows r0..r0+R-1 of one panel of W = 16·V columns, over one k block [kb, ke) (kb a multiple of kBlock, ke - kb <=
// kBlock): out[r][n0 + j] (+)= sum_k xt[k][r] · panel[k][j] (+ add[r][n0 + j] after the last k), j < the panel's
// width in N. Each block's sum is made in registers and added to the previous blocks' in out (error growing with
// K/kBlock + kBlock rather than with K, as blocked GEMMs do). `next`: where the next slice to run starts (its
// line for k = kb).
template <int R, int V, Prefetch PF>
ELMO_AVX512 void panel_rows(const float* xt, int64_t M, const float* panel, const float* next, int64_t kb,
                            int64_t ke, int64_t K, float* out, int64_t ldo, const float* add, int64_t lda, int64_t r0,
                            int64_t n0, const __mmask16* mask) {
  constexpr int64_t W = 16 * V;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = kb; k < ke; ++k) {
    const float* pf = PF == kL2 ? next + (k - kb) * W
                                : (k + kAhead < ke ? panel + (k + kAhead) * W : next + (k + kAhead - ke) * W);
    __m512 b[V];
    for (int v = 0; v < V; ++v) {
      b[v] = _mm512_loadu_ps(panel + k * W + 16 * v);
      _mm_prefetch(reinterpret_cast<const char*>(pf + 16 * v), PF == kL1 ? _MM_HINT_T0 : _MM_HINT_T1);
    }
    const float* xk = xt + k * M + r0;
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(xk[r]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
  const bool first = kb == 0, last = ke >= K;
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      float* o = out + (r0 + r) * ldo + n0 + 16 * v;
      __m512 sum = acc[r][v];
      if (!first) sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], o), sum);
      if (last && add != nullptr)
        sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask[v], add + (r0 + r) * lda + n0 + 16 * v));
      _mm512_mask_storeu_ps(o, mask[v], sum);
    }
  }
}

// All M rows of one panel slice [kb, ke): row blocks of RMax (16 rows x 16 columns, or 14 x 32: 28 accumulators,
// two panel vectors and a broadcast in the 32 AVX-512 registers), then 8, 4, 2, 1.
template <int V, int RMax>
ELMO_AVX512 void panel_all_rows(const float* xt, int64_t M, const float* panel, const float* next, int64_t kb,
                                int64_t ke, int64_t K, float* out, int64_t ldo, const float* add, int64_t lda,
                                int64_t n0, const __mmask16* mask) {
  int64_t r0 = 0;
#define ELMO_ROWS(R)                                                                                               \
  do {                                                                                                             \
    if (r0 == 0)                                                                                                   \
      panel_rows<R, V, kL1>(xt, M, panel, next, kb, ke, K, out, ldo, add, lda, r0, n0, mask);                      \
    else                                                                                                           \
      panel_rows<R, V, kL2>(xt, M, panel, next, kb, ke, K, out, ldo, add, lda, r0, n0, mask);                      \
    r0 += R;                                                                                                       \
  } while (0)
  while (r0 + RMax <= M) ELMO_ROWS(RMax);
  if (r0 + 8 <= M) ELMO_ROWS(8);
  if (r0 + 4 <= M) ELMO_ROWS(4);
  if (r0 + 2 <= M) ELMO_ROWS(2);
  if (r0 < M) ELMO_ROWS(1);
#undef ELMO_ROWS
}

// Packed panels (pack_panels, zero-padded), a thread's panels k block by k block: every panel's slice of one block
// before the next block, so that the block's lines of xt (16 KiB at 16 rows) stay in L1 while the panel slices
// stream past them (panel by panel, the whole of a long xt, 1 MiB at K = 16384, went through L1 once per panel:
// 2 threads, the two builds in alternating processes, medians of two runs: dz·W_recᵀ at 16 rows 1.365/1.478 ->
// 1.168/1.350 ms, h·W_rec 1.168/1.271 -> 0.991/0.963 ms; bench/results/cpu_train.md).
// The sums are the same, in the same order.
template <int V, int RMax>
ELMO_AVX512 void small_mm_packed(const float* xt, int64_t M, const float* panels, int64_t K, int64_t N, float* out,
                                 int64_t ldo, const float* add, int64_t lda) {
  constexpr int64_t W = 16 * V;
  at::parallel_for(0, (N + W - 1) / W, 16 / V, [&](int64_t begin, int64_t end) {
    for (int64_t kb = 0; kb == 0 || kb < K; kb += kBlock) {
      const int64_t ke = std::min(K, kb + kBlock);
      for (int64_t p = begin; p < end; ++p) {
        // the next slice: the next panel's in this block, after the last panel the first one's next block (past
        // the last block, the prefetches read nothing of use, and never fault)
        const float* next = p + 1 < end ? panels + (p + 1) * K * W + kb * W : panels + begin * K * W + ke * W;
        __mmask16 mask[V];
        panel_masks<V>(N - p * W, mask);
        panel_all_rows<V, RMax>(xt, M, panels + p * K * W, next, kb, ke, K, out, ldo, add, lda, p * W, mask);
      }
    }
  });
}

// Split K for few panels and a long K (dz·W_recᵀ: 32 panels, K = 16384). Split by panels, each thread read the whole
// xt (1 MiB), half of it transposed by the other core, and 2 threads ran 1.6x one. Here each thread transposes and
// sums its own run of k blocks for every panel (its part of xt stays in its own caches), thread 0 into out, the
// others into their own (M, N) partial sums, added to out afterwards in thread order (then add). The sums are
// regrouped by thread (their bits depend on the thread count, as a split GEMM's do). Returns false, doing nothing,
// where it does not apply.
std::atomic<int64_t> split_k_runs{0};  // calls that took small_mm_split_k (tests: small_mm_split_k_runs)

ELMO_AVX512 bool small_mm_split_k(const float* xp, int64_t sm, int64_t M, int64_t K, const float* panels, int64_t N,
                                  float* out, int64_t ldo, const float* add, int64_t lda, float* xt) {
  const int64_t P = (N + 15) / 16, blocks = (K + kBlock - 1) / kBlock;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), blocks);
  if (nt < 2 || P > 16 * nt || K < 4 * kBlock * nt || M * N > (int64_t{1} << 16) || at::in_parallel_region())
    return false;
  std::vector<float> part(static_cast<size_t>((nt - 1) * M * N));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t k0 = blocks * t / nt * kBlock, k1 = std::min(K, blocks * (t + 1) / nt * kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += 16)
        transpose_rows(xp, sm, std::min<int64_t>(16, M - m0), M, m0, k0, k1, K, xt);
      float* o = t == 0 ? out : part.data() + (t - 1) * M * N;
      const int64_t ld = t == 0 ? ldo : N;
      for (int64_t kb = k0; kb < k1; kb += kBlock) {
        const int64_t ke = std::min(k1, kb + kBlock);
        for (int64_t p = 0; p < P; ++p) {
          const float* next = p + 1 < P ? panels + (p + 1) * K * 16 + kb * 16 : panels + ke * 16;
          __mmask16 mask[1];
          panel_masks<1>(N - p * 16, mask);
          // offsets make the thread's run [k0, k1) look like a whole K to panel_all_rows (its first and last block)
          panel_all_rows<1, 16>(xt + k0 * M, M, panels + p * K * 16 + k0 * 16, next, kb - k0, ke - k0, k1 - k0, o,
                                ld, nullptr, 0, p * 16, mask);
        }
      }
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * ldo;
    for (int64_t t = 1; t < nt; ++t) {
      const float* q = part.data() + ((t - 1) * M + m) * N;
      for (int64_t n = 0; n < N; ++n) o[n] += q[n];
    }
    if (add != nullptr)
      for (int64_t n = 0; n < N; ++n) o[n] += add[m * lda + n];
  }
  split_k_runs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

#endif  // ELMO_X86

}  // namespace

// out (M, N) = x (M, K) · w (+ add (M, N)), w given as pack_panels(w). out and add: row-major rows (any row stride).
void elmo_cpu::small_mm(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& add, const at::Tensor& out) {
  TORCH_CHECK(elmo_cpu::has_avx512(),
              "elmo_fast._cpu: small_mm needs AVX-512 (small_mm_available() is false on this CPU)");
  check_f32(x, "x", 2);
  check_f32(out, "out", 2);
  const int64_t M = x.size(0), K = x.size(1);
  check_f32(panels, "panels", 3);
  const int64_t W = panels.size(2);
  TORCH_CHECK(panels.is_contiguous() && panels.size(1) == K && (W == 16 || W == 32) &&
                  panels.size(0) == (N + W - 1) / W,
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
    TORCH_CHECK(add_p != out.data_ptr<float>(), "elmo_fast._cpu: small_mm: out must not be add (it holds partial sums)");
  }
  if (M == 0 || N == 0) return;
  // x transposed (K x M): the M values a k multiplies on one line (x's own rows, a power-of-two stride apart at
  // these widths, would share a few L1 sets)
  // (not zero-filled: every element is written; split over threads only from 64K elements on). The buffer is the
  // calling thread's, kept and grown across calls: a fresh 1 MiB (K = 16384, M = 16) came from mmap and page-faulted
  // on every call, ~60 us of a 1.3 ms product.
  thread_local std::vector<float> xt_buffer;
  if (xt_buffer.size() < static_cast<size_t>(K * M)) xt_buffer.resize(static_cast<size_t>(K * M));
  float* const xt = xt_buffer.data();
  const float* xp = x.data_ptr<float>();
  const int64_t sm = x.stride(0), sk = x.stride(1);
#ifdef ELMO_X86
  if (sk == 1 && W == 16 &&
      small_mm_split_k(xp, sm, M, K, panels.data_ptr<float>(), N, out.data_ptr<float>(), out.stride(0), add_p, lda, xt))
    return;
  if (sk == 1) {  // a row-major x: 16 x 16 blocks transposed in registers, k split over threads in blocks of 16
    at::parallel_for(0, (K + 15) / 16, (int64_t{1} << 16) / (16 * M) + 1, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += 16)
        transpose_rows(xp, sm, std::min<int64_t>(16, M - m0), M, m0, begin * 16, std::min(K, end * 16), K, xt);
    });
  } else
#endif
  at::parallel_for(0, K, (int64_t{1} << 16) / M + 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      for (int64_t m = 0; m < M; ++m) xt[k * M + m] = xp[m * sm + k * sk];
  });
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
#ifdef ELMO_X86
  if (W == 16)
    small_mm_packed<1, 16>(xt, M, panels.data_ptr<float>(), K, N, op, ldo, add_p, lda);
  else if (M <= 16)  // two blocks of 8 rows rather than 14 + 2
    small_mm_packed<2, 8>(xt, M, panels.data_ptr<float>(), K, N, op, ldo, add_p, lda);
  else
    small_mm_packed<2, 14>(xt, M, panels.data_ptr<float>(), K, N, op, ldo, add_p, lda);
#endif
}

void add_small_gemm(pybind11::module_& m) {
  m.def("small_mm_available", &elmo_cpu::has_avx512, "whether small_mm runs on this CPU (AVX-512)");
  m.def("pack_panels", &pack_panels, "a (K, N) weight packed for small_mm in panels of 16 or 32 columns",
        pybind11::arg("w"), pybind11::arg("width") = 16);
  m.def("small_mm_split_k_runs", [] { return split_k_runs.load(); }, "how many small_mm calls split K (tests)");
  m.def("small_mm", &elmo_cpu::small_mm, "out = x . w (+ add) for few rows, w as pack_panels(w)", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("add"), pybind11::arg("out"));
}
