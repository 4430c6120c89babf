// elmo_fast._cpu: what the extension's sources share: argument checks whose errors name the argument, the x86
// test (ELMO_X86: the intrinsics' header is there), and the CPU's instruction set (detected once, in lstmp_cell.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ELMO_X86 1
// The AVX-512 variant of a kernel where the kernels run AVX-512 now (elmo_cpu::use_avx512), else the portable one.
#define ELMO_PICK(avx512, portable) (elmo_cpu::use_avx512() ? (avx512) : (portable))
#else
#define ELMO_PICK(avx512, portable) (portable)
#endif

namespace elmo_cpu {

// t must be a CPU float32 tensor of `dim` dimensions, contiguous where asked.
inline void check_f32(const at::Tensor& t, const char* name, int64_t dim, bool contiguous = false) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim &&
                  (!contiguous || t.is_contiguous()),
              "elmo_fast._cpu: ", name, " must be a ", contiguous ? "contiguous " : "", dim,
              "-d CPU float32 tensor, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// t must be a contiguous (rows, cols) CPU float32 matrix; -1: any size there.
inline void check_matrix(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_f32(t, name, 2, true);
  TORCH_CHECK((rows < 0 || t.size(0) == rows) && (cols < 0 || t.size(1) == cols), "elmo_fast._cpu: ", name,
              " must be (", rows, ", ", cols, "), got ", t.sizes());
}

// The CPU runs AVX-512 (F, DQ, VL, BW): the best instruction set the gate kernels detect (lstmp_cell.cpp).
bool has_avx512();

// The kernels run AVX-512 now: has_avx512() unless a test chose a lesser instruction set (set_isa).
bool use_avx512();

// Kernels that other sources call (csrc/cpu/lstmp_loop.cpp); each is also bound to Python as it is.
void small_mm(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& add,
              const at::Tensor& out);  // small_gemm.cpp
void cell_forward(const at::Tensor& z, const at::Tensor& c_prev, c10::optional<double> cell_clip,
                  const c10::optional<at::Tensor>& g, const c10::optional<at::Tensor>& c_pre, const at::Tensor& c,
                  const c10::optional<at::Tensor>& tc, const at::Tensor& m);  // lstmp_cell.cpp
void cell_backward(const at::Tensor& dm, const at::Tensor& dc, const at::Tensor& g, const at::Tensor& c_pre,
                   const at::Tensor& tc, const at::Tensor& c_prev, c10::optional<double> cell_clip,
                   const at::Tensor& dz, const at::Tensor& dc_prev);  // lstmp_cell.cpp

}  // namespace elmo_cpu
