// Persistent cooperative LSTMP kernels (forward and backward through time), sm_90a.
// API, shapes and aliasing: csrc/include/elmo_fast/lstmp.h.
//
// Tiling (H=4096, P=512, bf16 on an H100 with 132 SMs): HC = 32 cells per block, 128 blocks, one per SM.
// Shared memory per block (rows padded by 16 bytes against bank conflicts):
//   W_rec columns of the block   P x (4HC+8)  bf16 = 139,264 B
//   W_proj rows of the block     HC x (P+8)   bf16 =  33,280 B
//   h / dL/dh' tile               MT x (P+8)   bf16 =  33,280 B   (MT = 32 rows)
//   scratch (z fp32 + m, or dm fp32 + dz, or the phase-2 reduction)  19,456 B
//   total 225,280 B of the 232,448 B a block may opt into.
// Forward step: phase 1, per 32-row tile with a live row: z = h·W_rec[:, own] (tensor cores, fp32 acc),
// gates, cell (fp32, kept in global per block: only its owner touches it), m, partial = m·W_proj[own, :]
// into the block's fp32 slice of `partial`; grid sync; phase 2: 8 warps of each block sum the partials of
// 32 outputs over the blocks, clip, mask, write y and h; grid sync. Backward: phase 1, dm = dh'·W_proj[own]^T,
// pointwise gate gradients, partial dh = dz[:, own]·W_rec[:, own]^T; grid sync; phase 2 sums, adds dy of
// the next step and applies the projection-clip mask; grid sync.
#include "elmo_fast/lstmp.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <mma.h>

#include <cstdio>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "elmo_fast persistent LSTMP kernels target sm_90a (H100/H200): build with -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace cg = cooperative_groups;

namespace elmo_fast {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kAccPad = 4;  // fp32 row padding (wmma float ldm must be a multiple of 4)

// ---------------------------------------------------------------------------------------------------
// Shared-memory layout, identical on host and device.
struct Layout {
  int ld_wrec, ld_wproj, ld_h;  // element strides of the dtype tiles
  int ld_z, ld_m;               // forward scratch: z (fp32), m (dtype)
  int ld_dm, ld_dz;             // backward scratch: dm (fp32), dz (dtype)
  size_t off_wrec, off_wproj, off_h, off_scratch;
  size_t off_m, off_dz;         // inside the scratch
  size_t total;
};

__host__ __device__ inline size_t align128(size_t v) { return (v + 127) & ~static_cast<size_t>(127); }

__host__ __device__ inline Layout make_layout(int P, int HC, int MT, int esize) {
  Layout L{};
  const int pad = 16 / esize;  // 16 bytes
  const int G = 4 * HC;
  L.ld_wrec = G + pad;
  L.ld_wproj = P + pad;
  L.ld_h = P + pad;
  L.ld_z = G + kAccPad;
  L.ld_m = HC + pad;
  L.ld_dm = HC + kAccPad;
  L.ld_dz = G + pad;
  L.off_wrec = 0;
  L.off_wproj = align128(L.off_wrec + static_cast<size_t>(P) * L.ld_wrec * esize);
  L.off_h = align128(L.off_wproj + static_cast<size_t>(HC) * L.ld_wproj * esize);
  L.off_scratch = align128(L.off_h + static_cast<size_t>(MT) * L.ld_h * esize);
  // forward scratch: z then m
  L.off_m = align128(static_cast<size_t>(MT) * L.ld_z * 4);
  const size_t fwd = align128(L.off_m + static_cast<size_t>(MT) * L.ld_m * esize);
  // backward scratch: dm then dz
  L.off_dz = align128(static_cast<size_t>(MT) * L.ld_dm * 4);
  const size_t bwd = align128(L.off_dz + static_cast<size_t>(MT) * L.ld_dz * esize);
  const size_t red = align128(static_cast<size_t>(kWarps) * 32 * 4);
  size_t scratch = fwd > bwd ? fwd : bwd;
  scratch = scratch > red ? scratch : red;
  L.total = L.off_scratch + scratch;
  return L;
}

// ---------------------------------------------------------------------------------------------------
// Element helpers.
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float clip_f(float v, float c) { return fminf(fmaxf(v, -c), c); }

// Copy `rows` x `cols` elements (cols * sizeof(T) a multiple of 16, both pointers 16-byte aligned,
// strides in elements keep that alignment) with 16-byte accesses; rows in [rows, rows_pad) are zeroed.
template <typename T>
__device__ __forceinline__ void copy_tile(T* dst, int ld_dst, const T* src, int ld_src, int rows, int rows_pad,
                                          int cols) {
  constexpr int kVec = 16 / sizeof(T);
  const int vpr = cols / kVec;
  for (int idx = threadIdx.x; idx < rows_pad * vpr; idx += blockDim.x) {
    const int r = idx / vpr, v = idx - r * vpr;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows) val = *reinterpret_cast<const uint4*>(src + static_cast<size_t>(r) * ld_src + v * kVec);
    *reinterpret_cast<uint4*>(dst + static_cast<size_t>(r) * ld_dst + v * kVec) = val;
  }
}

// C[M x N] (fp32, row-major, ldc; shared or global) = A[M x K] (row-major, lda) * Bop, where
// Bop[k][n] = kBT ? Bm[n * ldb + k] : Bm[k * ldb + n]. M, N, K are multiples of 16.
// bf16: tensor cores through WMMA 16x16x16 with fp32 accumulation; fp32: exact SIMT FMAs.
template <typename T, bool kBT>
__device__ __forceinline__ void block_gemm(const T* A, int lda, const T* Bm, int ldb, float* C, int ldc, int M,
                                           int N, int K) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    using namespace nvcuda;
    using BLayout = typename std::conditional<kBT, wmma::col_major, wmma::row_major>::type;
    const int warp = threadIdx.x >> 5;
    const int tiles_n = N >> 4;
    const int tiles = (M >> 4) * tiles_n;
    for (int tile = warp; tile < tiles; tile += kWarps) {
      const int tm = tile / tiles_n, tn = tile - tm * tiles_n;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb;
      const T* a_row = A + static_cast<size_t>(tm) * 16 * lda;
      for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(fa, a_row + k, lda);
        const T* bp = kBT ? Bm + static_cast<size_t>(tn) * 16 * ldb + k : Bm + static_cast<size_t>(k) * ldb + tn * 16;
        wmma::load_matrix_sync(fb, bp, ldb);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(C + static_cast<size_t>(tm) * 16 * ldc + tn * 16, acc, ldc, wmma::mem_row_major);
    }
  } else {
    for (int idx = threadIdx.x; idx < M * N; idx += blockDim.x) {
      const int m = idx / N, n = idx - m * N;
      const T* a_row = A + static_cast<size_t>(m) * lda;
      float s = 0.f;
      for (int k = 0; k < K; ++k) {
        const T b = kBT ? Bm[static_cast<size_t>(n) * ldb + k] : Bm[static_cast<size_t>(k) * ldb + n];
        s = fmaf(to_f<T>(a_row[k]), to_f<T>(b), s);
      }
      C[static_cast<size_t>(m) * ldc + n] = s;
    }
  }
}

// Stage the block's weights: W_rec columns [g*H + cell0, g*H + cell0 + HC) for g = 0..3 as a P x 4HC tile
// (gate-major columns), and W_proj rows [cell0, cell0 + HC).
template <typename T>
__device__ __forceinline__ void stage_weights(T* sWrec, T* sWp, const Layout& L, const T* w_rec, const T* w_proj,
                                              int H, int P, int HC, int cell0) {
  for (int g = 0; g < 4; ++g)
    copy_tile<T>(sWrec + g * HC, L.ld_wrec, w_rec + static_cast<size_t>(g) * H + cell0, 4 * H, P, P, HC);
  copy_tile<T>(sWp, L.ld_wproj, w_proj + static_cast<size_t>(cell0) * P, P, HC, HC, P);
}

__device__ __forceinline__ bool row_live(const int32_t* lengths, int row, int t) { return t < __ldg(lengths + row); }

// ---------------------------------------------------------------------------------------------------
// Forward.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) lstmp_fwd_kernel(LstmpForwardArgs a, LstmpPlan plan) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::grid_group grid = cg::this_grid();
  const int B = a.B, Tn = a.T, H = a.H, P = a.P;
  const int HC = plan.cells_per_block, G = 4 * HC, MT = plan.rows_per_tile, Bp = plan.padded_batch;
  const int cell0 = blockIdx.x * HC;
  const Layout L = make_layout(P, HC, MT, sizeof(T));
  T* sWrec = reinterpret_cast<T*>(smem + L.off_wrec);
  T* sWp = reinterpret_cast<T*>(smem + L.off_wproj);
  T* sH = reinterpret_cast<T*>(smem + L.off_h);
  float* sZ = reinterpret_cast<float*>(smem + L.off_scratch);
  T* sM = reinterpret_cast<T*>(smem + L.off_scratch + L.off_m);
  float* sRed = reinterpret_cast<float*>(smem + L.off_scratch);

  const T* gx = static_cast<const T*>(a.gx);
  const T* xin = static_cast<const T*>(a.x);
  const T* bias = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y);
  T* h = static_cast<T*>(a.h);
  T* gates = static_cast<T*>(a.gates);
  const bool train = gates != nullptr;
  const size_t G4 = static_cast<size_t>(4) * H;

  stage_weights<T>(sWrec, sWp, L, static_cast<const T*>(a.w_rec), static_cast<const T*>(a.w_proj), H, P, HC, cell0);
  __syncthreads();

  for (int s = 0; s < Tn; ++s) {
    const int t = a.reverse ? Tn - 1 - s : s;
    // ---- phase 1: block-local gates, cell, m and the partial projection
    for (int r0 = 0; r0 < B; r0 += MT) {
      const int rows = min(MT, B - r0);
      const int live = __syncthreads_or(static_cast<int>(threadIdx.x) < rows && row_live(a.lengths, r0 + threadIdx.x, t));
      if (!live) continue;  // uniform over the block
      copy_tile<T>(sH, L.ld_h, h + static_cast<size_t>(r0) * P, P, rows, MT, P);
      __syncthreads();
      block_gemm<T, false>(sH, L.ld_h, sWrec, L.ld_wrec, sZ, L.ld_z, MT, G, P);
      __syncthreads();
      for (int idx = threadIdx.x; idx < MT * HC; idx += blockDim.x) {
        const int r = idx / HC, k = idx - r * HC;
        const int row = r0 + r, cell = cell0 + k;
        float m = 0.f;
        if (r < rows && row_live(a.lengths, row, t)) {
          const size_t zb = (static_cast<size_t>(row) * Tn + t) * G4 + cell;
          const float* zr = sZ + static_cast<size_t>(r) * L.ld_z + k;
          const float zi = zr[0] + to_f<T>(gx[zb]) + to_f<T>(bias[cell]);
          const float zj = zr[HC] + to_f<T>(gx[zb + H]) + to_f<T>(bias[cell + H]);
          const float zf = zr[2 * HC] + to_f<T>(gx[zb + 2 * H]) + to_f<T>(bias[cell + 2 * H]) + a.forget_bias;
          const float zo = zr[3 * HC] + to_f<T>(gx[zb + 3 * H]) + to_f<T>(bias[cell + 3 * H]);
          const float si = sigmoid_f(zi), tj = tanhf(zj), sf = sigmoid_f(zf), so = sigmoid_f(zo);
          float* cp = a.c + static_cast<size_t>(row) * H + cell;
          const float cpre = sf * (*cp) + si * tj;
          const float c = a.has_cell_clip ? clip_f(cpre, a.cell_clip) : cpre;
          m = so * tanhf(c);
          *cp = c;
          if (train) {
            gates[zb] = from_f<T>(si);
            gates[zb + H] = from_f<T>(tj);
            gates[zb + 2 * H] = from_f<T>(sf);
            gates[zb + 3 * H] = from_f<T>(so);
            a.cpre[(static_cast<size_t>(row) * Tn + t) * H + cell] = cpre;
          }
        }
        sM[static_cast<size_t>(r) * L.ld_m + k] = from_f<T>(m);
      }
      __syncthreads();
      block_gemm<T, false>(sM, L.ld_m, sWp, L.ld_wproj,
                           a.partial + (static_cast<size_t>(blockIdx.x) * Bp + r0) * P, P, MT, P, HC);
      __syncthreads();  // sH / scratch are reused by the next tile
    }
    grid.sync();
    // ---- phase 2: sum the per-block partial projections, clip, mask, write y and h
    {
      const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
      const int total = B * P, chunks = (total + 31) / 32, nb = gridDim.x;
      for (int ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
        const int e = ch * 32 + lane;
        const bool valid = e < total;
        const int r = valid ? e / P : 0, p = e - r * P;
        const bool live = valid && row_live(a.lengths, r, t);
        float acc = 0.f;
        if (live) {
          const float* src = a.partial + static_cast<size_t>(r) * P + p;
#pragma unroll 4
          for (int b = grp; b < nb; b += kWarps) acc += src[static_cast<size_t>(b) * Bp * P];
        }
        sRed[grp * 32 + lane] = acc;
        __syncthreads();
        if (grp == 0 && valid) {
          for (int g = 1; g < kWarps; ++g) acc += sRed[g * 32 + lane];
          const size_t yo = (static_cast<size_t>(r) * Tn + t) * P + p;
          if (live) {
            const float hv = a.has_proj_clip ? clip_f(acc, a.proj_clip) : acc;
            const T ht = from_f<T>(hv);
            h[e] = ht;
            if (train) a.hpre[yo] = acc;
            float out = to_f<T>(ht);
            if (a.residual) out += to_f<T>(xin[yo]);
            y[yo] = from_f<T>(out);
          } else {
            y[yo] = from_f<T>(0.f);
          }
        }
        __syncthreads();
      }
    }
    grid.sync();
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward through time.
//
// Phase 2 of backward step s finishes step t_fin (dh <- sum of the partial dh_{t-1}) for its live rows, then
// prepares step t_prep: dL/dh' = mask(h') * (dh + dy[t_prep]) for the rows live at t_prep.
template <typename T>
__device__ __forceinline__ void bwd_phase2(const LstmpBackwardArgs& a, const LstmpPlan& plan, float* sRed, int t_fin,
                                           int t_prep) {
  const int B = a.B, Tn = a.T, P = a.P, Bp = plan.padded_batch;
  const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
  const int total = B * P, chunks = (total + 31) / 32, nb = gridDim.x;
  const T* dy = static_cast<const T*>(a.dy);
  T* dh_op = static_cast<T*>(a.dh_op);
  for (int ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const int e = ch * 32 + lane;
    const bool valid = e < total;
    const int r = valid ? e / P : 0, p = e - r * P;
    const bool fin = valid && t_fin >= 0 && row_live(a.lengths, r, t_fin);
    float acc = 0.f;
    if (fin) {
      const float* src = a.partial + static_cast<size_t>(r) * P + p;
#pragma unroll 4
      for (int b = grp; b < nb; b += kWarps) acc += src[static_cast<size_t>(b) * Bp * P];
    }
    sRed[grp * 32 + lane] = acc;
    __syncthreads();
    if (grp == 0 && valid) {
      for (int g = 1; g < kWarps; ++g) acc += sRed[g * 32 + lane];
      const float d = fin ? acc : a.dh[e];
      a.dh[e] = d;
      if (t_prep >= 0 && row_live(a.lengths, r, t_prep)) {
        const size_t o = (static_cast<size_t>(r) * Tn + t_prep) * P + p;
        float v = d + to_f<T>(dy[o]);
        if (a.has_proj_clip && fabsf(a.hpre[o]) > a.proj_clip) v = 0.f;
        a.dhpre[o] = v;
        dh_op[e] = from_f<T>(v);
      }
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) lstmp_bwd_kernel(LstmpBackwardArgs a, LstmpPlan plan) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::grid_group grid = cg::this_grid();
  const int B = a.B, Tn = a.T, H = a.H, P = a.P;
  const int HC = plan.cells_per_block, G = 4 * HC, MT = plan.rows_per_tile, Bp = plan.padded_batch;
  const int cell0 = blockIdx.x * HC;
  const Layout L = make_layout(P, HC, MT, sizeof(T));
  T* sWrec = reinterpret_cast<T*>(smem + L.off_wrec);
  T* sWp = reinterpret_cast<T*>(smem + L.off_wproj);
  T* sH = reinterpret_cast<T*>(smem + L.off_h);
  float* sDM = reinterpret_cast<float*>(smem + L.off_scratch);
  T* sDZ = reinterpret_cast<T*>(smem + L.off_scratch + L.off_dz);
  float* sRed = reinterpret_cast<float*>(smem + L.off_scratch);

  const T* gates = static_cast<const T*>(a.gates);
  const T* dh_op = static_cast<const T*>(a.dh_op);
  T* dz = static_cast<T*>(a.dz);
  const size_t G4 = static_cast<size_t>(4) * H;

  stage_weights<T>(sWrec, sWp, L, static_cast<const T*>(a.w_rec), static_cast<const T*>(a.w_proj), H, P, HC, cell0);
  __syncthreads();

  auto t_of = [&](int s) { return a.reverse ? Tn - 1 - s : s; };
  bwd_phase2<T>(a, plan, sRed, -1, t_of(Tn - 1));
  grid.sync();
  for (int s = Tn - 1; s >= 0; --s) {
    const int t = t_of(s);
    // ---- phase 1: dm = dh'·W_proj[own]^T, gate gradients, partial dh_{t-1} = dz[:, own]·W_rec[:, own]^T
    for (int r0 = 0; r0 < B; r0 += MT) {
      const int rows = min(MT, B - r0);
      const int live = __syncthreads_or(static_cast<int>(threadIdx.x) < rows && row_live(a.lengths, r0 + threadIdx.x, t));
      if (!live) continue;
      copy_tile<T>(sH, L.ld_h, dh_op + static_cast<size_t>(r0) * P, P, rows, MT, P);
      __syncthreads();
      block_gemm<T, true>(sH, L.ld_h, sWp, L.ld_wproj, sDM, L.ld_dm, MT, HC, P);
      __syncthreads();
      for (int idx = threadIdx.x; idx < MT * HC; idx += blockDim.x) {
        const int r = idx / HC, k = idx - r * HC;
        const int row = r0 + r, cell = cell0 + k;
        float dzi = 0.f, dzj = 0.f, dzf = 0.f, dzo = 0.f;
        if (r < rows && row_live(a.lengths, row, t)) {
          const size_t gb = (static_cast<size_t>(row) * Tn + t) * G4 + cell;
          const float si = to_f<T>(gates[gb]), tj = to_f<T>(gates[gb + H]);
          const float sf = to_f<T>(gates[gb + 2 * H]), so = to_f<T>(gates[gb + 3 * H]);
          const float cpre = a.cpre[(static_cast<size_t>(row) * Tn + t) * H + cell];
          const float c = a.has_cell_clip ? clip_f(cpre, a.cell_clip) : cpre;
          const float tc = tanhf(c);
          const int tp = a.reverse ? t + 1 : t - 1;
          const bool has_prev = a.reverse ? row_live(a.lengths, row, t + 1) : t > 0;
          float cprev;
          if (has_prev) {
            const float q = a.cpre[(static_cast<size_t>(row) * Tn + tp) * H + cell];
            cprev = a.has_cell_clip ? clip_f(q, a.cell_clip) : q;
          } else {
            cprev = a.c0[static_cast<size_t>(row) * H + cell];
          }
          const float dm = sDM[static_cast<size_t>(r) * L.ld_dm + k];
          float* dcp = a.dc + static_cast<size_t>(row) * H + cell;
          float dc = *dcp + dm * so * (1.f - tc * tc);
          if (a.has_cell_clip && fabsf(cpre) > a.cell_clip) dc = 0.f;
          dzi = dc * tj * si * (1.f - si);
          dzj = dc * si * (1.f - tj * tj);
          dzf = dc * cprev * sf * (1.f - sf);
          dzo = dm * tc * so * (1.f - so);
          *dcp = dc * sf;
          dz[gb] = from_f<T>(dzi);
          dz[gb + H] = from_f<T>(dzj);
          dz[gb + 2 * H] = from_f<T>(dzf);
          dz[gb + 3 * H] = from_f<T>(dzo);
        }
        T* dzr = sDZ + static_cast<size_t>(r) * L.ld_dz + k;
        dzr[0] = from_f<T>(dzi);
        dzr[HC] = from_f<T>(dzj);
        dzr[2 * HC] = from_f<T>(dzf);
        dzr[3 * HC] = from_f<T>(dzo);
      }
      __syncthreads();
      block_gemm<T, true>(sDZ, L.ld_dz, sWrec, L.ld_wrec,
                          a.partial + (static_cast<size_t>(blockIdx.x) * Bp + r0) * P, P, MT, P, G);
      __syncthreads();
    }
    grid.sync();
    bwd_phase2<T>(a, plan, sRed, t, s > 0 ? t_of(s - 1) : -1);
    grid.sync();
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.
void write_msg(char* msg, size_t len, const char* text) {
  if (msg != nullptr && len > 0) std::snprintf(msg, len, "%s", text);
}

template <typename T>
cudaError_t set_smem(size_t bytes) {
  cudaError_t e = cudaFuncSetAttribute(lstmp_fwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(lstmp_bwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// Blocks per SM that can be co-resident for both kernels with `bytes` of dynamic shared memory.
template <typename T>
cudaError_t resident_blocks(size_t bytes, int* out) {
  cudaError_t e = set_smem<T>(bytes);
  if (e != cudaSuccess) return e;
  int f = 0, b = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f, lstmp_fwd_kernel<T>, kThreads, bytes);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, lstmp_bwd_kernel<T>, kThreads, bytes);
  if (e != cudaSuccess) return e;
  *out = f < b ? f : b;
  return cudaSuccess;
}

template <typename T>
int plan_impl(int device, int B, int H, int P, LstmpPlan* plan, char* msg, size_t msg_len) {
  char buf[512];
  int major = 0, minor = 0, sms = 0, smem_optin = 0, coop = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
  if (e != cudaSuccess) {
    std::snprintf(buf, sizeof buf, "cannot query CUDA device %d: %s", device, cudaGetErrorString(e));
    write_msg(msg, msg_len, buf);
    return 1;
  }
  if (major != 9 || minor != 0) {
    std::snprintf(buf, sizeof buf,
                  "the persistent LSTMP kernel is built for sm_90a (H100/H200, compute capability 9.0); device %d "
                  "has compute capability %d.%d. Use backend='triton'.",
                  device, major, minor);
    write_msg(msg, msg_len, buf);
    return 2;
  }
  if (!coop) {
    std::snprintf(buf, sizeof buf, "device %d does not support cooperative launches", device);
    write_msg(msg, msg_len, buf);
    return 3;
  }
  if (B < 0 || H <= 0 || P <= 0 || H % 16 != 0 || P % 16 != 0) {
    std::snprintf(buf, sizeof buf,
                  "the persistent LSTMP kernel needs H and P to be positive multiples of 16, got B=%d H=%d P=%d", B,
                  H, P);
    write_msg(msg, msg_len, buf);
    return 4;
  }
  size_t smallest_need = 0;
  int smallest_blocks = 0;
  for (int HC = 16; HC <= H; HC += 16) {
    if (H % HC != 0) continue;
    const int nb = H / HC;
    bool smem_ok = false;
    for (int MT : {32, 16}) {
      const Layout L = make_layout(P, HC, MT, static_cast<int>(sizeof(T)));
      if (smallest_need == 0 || L.total < smallest_need) {
        smallest_need = L.total;
        smallest_blocks = nb;
      }
      if (L.total > static_cast<size_t>(smem_optin)) continue;
      smem_ok = true;
      int per_sm = 0;
      e = resident_blocks<T>(L.total, &per_sm);
      if (e != cudaSuccess) {
        std::snprintf(buf, sizeof buf, "occupancy query failed: %s", cudaGetErrorString(e));
        write_msg(msg, msg_len, buf);
        return 5;
      }
      if (per_sm * sms < nb) break;  // too many blocks for the device: try more cells per block
      plan->num_blocks = nb;
      plan->cells_per_block = HC;
      plan->rows_per_tile = MT;
      plan->threads = kThreads;
      plan->padded_batch = (B + MT - 1) / MT * MT;
      plan->smem_bytes = L.total;
      return 0;
    }
    if (!smem_ok) break;  // more cells per block need even more shared memory
  }
  const double weights_mib = (static_cast<double>(P) * 4 * H + static_cast<double>(H) * P) * sizeof(T) / 1048576.0;
  std::snprintf(buf, sizeof buf,
                "the recurrent weights of this chain (W_rec %dx%d + W_proj %dx%d = %.1f MiB in %s) do not fit in the "
                "shared memory of device %d (%d SMs, %d bytes per block): the smallest tiling needs %zu bytes per "
                "block with %d blocks. Use backend='triton' (or bf16).",
                P, 4 * H, H, P, weights_mib, sizeof(T) == 2 ? "bf16" : "fp32", device, sms, smem_optin,
                smallest_need, smallest_blocks);
  write_msg(msg, msg_len, buf);
  return 6;
}

template <typename T, typename Args, typename Kernel>
cudaError_t launch(Kernel kernel, const LstmpPlan& plan, const Args& args, cudaStream_t stream) {
  cudaError_t e = set_smem<T>(plan.smem_bytes);
  if (e != cudaSuccess) return e;
  Args a = args;
  LstmpPlan p = plan;
  void* kargs[] = {&a, &p};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(plan.num_blocks), dim3(plan.threads),
                                     kargs, plan.smem_bytes, stream);
}

}  // namespace

int lstmp_plan(LstmpDtype dtype, int device, int B, int H, int P, LstmpPlan* plan, char* msg, size_t msg_len) {
  switch (dtype) {
    case LstmpDtype::kFloat32: return plan_impl<float>(device, B, H, P, plan, msg, msg_len);
    case LstmpDtype::kBFloat16: return plan_impl<__nv_bfloat16>(device, B, H, P, plan, msg, msg_len);
  }
  write_msg(msg, msg_len, "unknown dtype");
  return 7;
}

size_t lstmp_partial_bytes(const LstmpPlan& plan, int P) {
  return static_cast<size_t>(plan.num_blocks) * plan.padded_batch * P * sizeof(float);
}

cudaError_t lstmp_forward(LstmpDtype dtype, const LstmpPlan& plan, const LstmpForwardArgs& args, cudaStream_t stream) {
  if (args.B == 0 || args.T == 0) return cudaSuccess;
  switch (dtype) {
    case LstmpDtype::kFloat32: return launch<float>(lstmp_fwd_kernel<float>, plan, args, stream);
    case LstmpDtype::kBFloat16:
      return launch<__nv_bfloat16>(lstmp_fwd_kernel<__nv_bfloat16>, plan, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t lstmp_backward(LstmpDtype dtype, const LstmpPlan& plan, const LstmpBackwardArgs& args,
                           cudaStream_t stream) {
  if (args.B == 0 || args.T == 0) return cudaSuccess;
  switch (dtype) {
    case LstmpDtype::kFloat32: return launch<float>(lstmp_bwd_kernel<float>, plan, args, stream);
    case LstmpDtype::kBFloat16:
      return launch<__nv_bfloat16>(lstmp_bwd_kernel<__nv_bfloat16>, plan, args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace elmo_fast
