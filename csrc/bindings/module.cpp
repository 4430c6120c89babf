// The single registration of every compiled op into elmo_fast._C. Importing elmo_fast never imports this
// module; elmo_fast._backend loads it lazily when a CUDA backend is selected.
#include <pybind11/pybind11.h>

#include "../include/elmo_fast/built_with.h"

namespace elmo_fast_bind {
void register_lstmp(pybind11::module_& m);
}  // namespace elmo_fast_bind

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "elmo_fast compiled CUDA kernels (persistent LSTMP); see csrc/include/elmo_fast/*.h";
  elmo_fast_bind::register_lstmp(m);
  elmo_fast::record_torch_version(m);
}
