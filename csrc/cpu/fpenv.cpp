// elmo_fast._cpu: denormal flushing (FTZ and DAZ) on the calling thread and every thread of its OpenMP team.
//
// The sampled softmax's probabilities of far-off samples fall below fp32's smallest normal number (exp(x) for
// x < -87.3) once the logits spread widely. x86 cores take a microcode assist for each denormal operand or result:
// a (320, 8193) softmax a quarter denormal made its backward GEMMs 20x slower on the Xeon here. TensorFlow, whose
// outputs elmo_fast reproduces, runs its CPU ops with denormals flushed to zero; torch.set_flush_denormal does that
// for the calling thread only, and the GEMMs run on the OpenMP team. A flushed value differs from the denormal by
// less than 1.2e-38.
#include <torch/csrc/utils/pybind.h>

#include "common.h"

#include <omp.h>

#include <cstdint>
#include <vector>

namespace {

#ifdef ELMO_X86
constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR: flush to zero (bit 15), denormals are zero (bit 6)
#endif

bool flushed_here() {
#ifdef ELMO_X86
  return (_mm_getcsr() & kFtzDaz) == kFtzDaz;
#else
  return false;
#endif
}

void set_here(bool on) {
#ifdef ELMO_X86
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFtzDaz) : (csr & ~kFtzDaz));
#else
  (void)on;
#endif
}

// Sets (on) or clears FTZ and DAZ on each thread of this thread's OpenMP team (thread 0 is this thread; the team
// is the one its parallel regions, at::parallel_for, MKL and oneDNN, run on). Returns each team thread's state
// before, by thread number, for restore_denormals. Off x86 nothing changes and every state reads false.
std::vector<uint8_t> flush_denormals(bool on) {
  std::vector<uint8_t> before(static_cast<size_t>(omp_get_max_threads()), 0);
#pragma omp parallel
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    if (t < before.size()) before[t] = flushed_here();
    set_here(on);
  }
  return before;
}

// Puts back the states flush_denormals returned, thread by thread (a thread the team has gained since takes this
// thread's).
void restore_denormals(const std::vector<uint8_t>& before) {
  TORCH_CHECK(!before.empty(), "elmo_fast._cpu: restore_denormals: no states (expected flush_denormals' result)");
#pragma omp parallel
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    set_here(before[t < before.size() ? t : 0] != 0);
  }
}

}  // namespace

void add_fpenv(pybind11::module_& m) {
  m.def("flush_denormals", &flush_denormals,
        "set (True) or clear FTZ and DAZ on this thread's OpenMP team (this thread included); returns each team "
        "thread's state before, for restore_denormals",
        pybind11::arg("on"));
  m.def("restore_denormals", &restore_denormals, "put back the states flush_denormals returned",
        pybind11::arg("before"));
  m.def("denormals_flushed", &flushed_here, "whether FTZ and DAZ are set on this thread");
}
