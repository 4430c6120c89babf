// elmo_fast._cpu: denormal flushing (FTZ and DAZ) on the calling thread and every thread of its OpenMP team.
//
// The sampled softmax's probabilities of far-off samples fall below fp32's smallest normal number (exp(x) for
// x < -87.3) once the logits spread widely. x86 cores take a microcode assist for each denormal operand or result:
// a (320, 8193) softmax a quarter denormal made its backward GEMMs 20x slower on the Xeon here. TensorFlow, whose
// outputs elmo_fast reproduces, runs its CPU ops with denormals flushed to zero; torch.set_flush_denormal does that
// for the calling thread only, and the GEMMs run on the OpenMP team. A flushed value differs from the denormal by
// less than 1.2e-38.
#include <torch/csrc/utils/pybind.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ELMO_X86 1
#endif

namespace {

#ifdef ELMO_X86
constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR: flush to zero (bit 15), denormals are zero (bit 6)

void apply(bool on) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFtzDaz) : (csr & ~kFtzDaz));
}
#endif

// Sets or clears FTZ and DAZ on this thread and on each thread of the OpenMP team its parallel regions (at::parallel_for,
// MKL, oneDNN) run on; returns whether this thread had both set before. False and nothing done off x86.
bool flush_denormals(bool on) {
#ifdef ELMO_X86
  const bool before = (_mm_getcsr() & kFtzDaz) == kFtzDaz;
  apply(on);
#pragma omp parallel
  apply(on);
  return before;
#else
  (void)on;
  return false;
#endif
}

bool denormals_flushed() {
#ifdef ELMO_X86
  return (_mm_getcsr() & kFtzDaz) == kFtzDaz;
#else
  return false;
#endif
}

}  // namespace

void add_fpenv(pybind11::module_& m) {
  m.def("flush_denormals", &flush_denormals,
        "set (True) or clear FTZ and DAZ on this thread and its OpenMP team; returns this thread's state before",
        pybind11::arg("on"));
  m.def("denormals_flushed", &denormals_flushed, "whether FTZ and DAZ are set on this thread");
}
