// elmo_fast: persistent LSTMP chain on one GPU, framework-free API (no torch types).
//
// One LSTMP chain (one layer, one direction) with TF LSTMCell semantics, exactly
// elmo_fast/reference/lstmp.py::lstmp_reference (spec §3.2-§3.5):
//
//   z_t  = u_t·W_in + h_{t-1}·W_rec + bias        gate blocks i | j | f | o, each H wide
//   c'_t = σ(f + forget_bias)⊙c_{t-1} + σ(i)⊙tanh(j);   c_t = clip(c'_t, cell_clip)
//   m_t  = σ(o)⊙tanh(c_t);   h'_t = m_t·W_proj;   h_t = clip(h'_t, proj_clip)
//   y_t  = h_t (+ u_t when residual); rows with t >= length output 0 and keep their state;
//   reverse: each row is processed from its last valid step down to 0.
//
// Shape alphabet: B batch rows, T padded steps, H cell size, P projection size (= hidden size);
// G = 4H gate columns. Every matrix is dense row-major (C order) with the strides its shape implies.
// "dtype" below is the element type named by LstmpDtype (float or __nv_bfloat16); cell state, gate
// math and every accumulation are fp32 whatever the dtype.
//
// The input projection x·W_in for all steps is NOT done here: the caller passes it as `gx`
// (one large GEMM before the kernel); likewise the weight gradients are GEMMs the caller runs
// after lstmp_backward from the caches it returns.
//
// Execution: a cooperative (grid-synchronised) persistent kernel, one block per SM. Block b owns the
// cells [b*HC, (b+1)*HC) and keeps, for the whole sequence, its W_rec columns (P x 4HC) and its W_proj
// rows (HC x P) in shared memory. Per step: phase 1 (block-local) gates, cell, m, and a partial
// projection m[:, own cells]·W_proj[own cells, :] into a per-block fp32 slice of `partial`; grid sync;
// phase 2 (all blocks) sums the partials, clips, masks, writes y and h; grid sync. Backward mirrors it.
//
// All pointers are device pointers, 16-byte aligned; no argument may alias another unless stated.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace elmo_fast {

enum class LstmpDtype : int { kFloat32 = 0, kBFloat16 = 1 };

// Launch configuration chosen by lstmp_plan for one (device, dtype, B, H, P).
struct LstmpPlan {
  int num_blocks = 0;       // grid size = H / cells_per_block, all co-resident (cooperative launch)
  int cells_per_block = 0;  // HC, a multiple of 16
  int rows_per_tile = 0;    // MT batch rows per tile (16 or 32); B is processed in ceil(B / MT) tiles
  int threads = 0;          // threads per block
  int padded_batch = 0;     // Bp = ceil(B / MT) * MT, row count of the `partial` workspace
  size_t smem_bytes = 0;    // dynamic shared memory per block
};

// Chooses a plan. Returns 0 and fills *plan on success; otherwise returns non-zero and writes a
// human-readable reason into msg (msg_len bytes, NUL-terminated): device not sm_90 (the kernels are
// built for sm_90a only), no cooperative launch, P or H not multiples of 16, the weights do not fit in
// the shared memory of the co-resident blocks, or a CUDA error. Never launches anything.
int lstmp_plan(LstmpDtype dtype, int device, int B, int H, int P, LstmpPlan* plan, char* msg, size_t msg_len);

// Size in bytes of the `partial` workspace for a plan: num_blocks * padded_batch * P * sizeof(float).
size_t lstmp_partial_bytes(const LstmpPlan& plan, int P);

struct LstmpForwardArgs {
  int B = 0, T = 0, H = 0, P = 0;
  // Inputs (read only).
  const void* gx = nullptr;         // (B, T, G) dtype: x·W_in for every step, WITHOUT the bias.
  const void* x = nullptr;          // (B, T, P) dtype: the layer input, read only when residual != 0.
  const void* w_rec = nullptr;      // (P, G) dtype: W_0[D:], multiplies h_{t-1}.
  const void* bias = nullptr;       // (G,) dtype: B, without the forget bias.
  const void* w_proj = nullptr;     // (H, P) dtype: W_P_0.
  const int32_t* lengths = nullptr; // (B,) valid steps per row, each in [0, T].
  float cell_clip = 0.f, proj_clip = 0.f, forget_bias = 1.f;
  int has_cell_clip = 0, has_proj_clip = 0, reverse = 0, residual = 0;
  // Outputs.
  void* y = nullptr;                // (B, T, P) dtype, fully written (0 at padded positions).
  void* h = nullptr;                // (B, P) dtype, in: h0, out: h_n (updated in place).
  float* c = nullptr;               // (B, H) fp32, in: c0, out: c_n (updated in place).
  float* partial = nullptr;         // workspace, lstmp_partial_bytes(plan, P) bytes, no initialisation.
  // Training caches: all three null (inference) or all three set. The caller zero-fills them; the
  // kernel writes only valid (row, step) positions.
  void* gates = nullptr;            // (B, T, G) dtype: σ(i) | tanh(j) | σ(f + forget_bias) | σ(o).
  float* cpre = nullptr;            // (B, T, H) fp32: the cell before clipping, c'_t.
  float* hpre = nullptr;            // (B, T, P) fp32: the projection before clipping, h'_t.
};

struct LstmpBackwardArgs {
  int B = 0, T = 0, H = 0, P = 0;
  // Inputs (read only): the forward's weights, lengths, flags and caches.
  const void* w_rec = nullptr;      // (P, G) dtype
  const void* w_proj = nullptr;     // (H, P) dtype
  const int32_t* lengths = nullptr; // (B,)
  float cell_clip = 0.f, proj_clip = 0.f;
  int has_cell_clip = 0, has_proj_clip = 0, reverse = 0;
  const void* gates = nullptr;      // (B, T, G) dtype, from lstmp_forward
  const float* cpre = nullptr;      // (B, T, H) fp32, from lstmp_forward
  const float* hpre = nullptr;      // (B, T, P) fp32, from lstmp_forward
  const float* c0 = nullptr;        // (B, H) fp32: the initial cell state
  const void* dy = nullptr;         // (B, T, P) dtype: dL/dy (the residual's share is the caller's)
  // State gradients, updated in place.
  float* dh = nullptr;              // (B, P) fp32, in: dL/dh_n, out: dL/dh0
  float* dc = nullptr;              // (B, H) fp32, in: dL/dc_n, out: dL/dc0
  // Workspaces and outputs.
  void* dh_op = nullptr;            // (B, P) dtype workspace (the step's dL/dh' as a matmul operand)
  float* partial = nullptr;         // workspace, lstmp_partial_bytes(plan, P) bytes
  void* dz = nullptr;               // (B, T, G) dtype out: dL/dz (pre-activation gates); caller zero-fills
  float* dhpre = nullptr;           // (B, T, P) fp32 out: dL/dh'_t; caller zero-fills
};

// Enqueue on `stream`; return the launch status (asynchronous errors surface later, as usual).
cudaError_t lstmp_forward(LstmpDtype dtype, const LstmpPlan& plan, const LstmpForwardArgs& args,
                          cudaStream_t stream);
cudaError_t lstmp_backward(LstmpDtype dtype, const LstmpPlan& plan, const LstmpBackwardArgs& args,
                           cudaStream_t stream);

}  // namespace elmo_fast
