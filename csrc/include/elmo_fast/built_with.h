// The torch a compiled elmo_fast module is built against, as its attribute ``torch_version``: elmo_fast's loader
// (elmo_fast._backend.torch_build_mismatch) refuses the module under any other torch, since such a module imports
// and then crashes in its first call. The build passes the version unquoted
// (-DELMO_FAST_BUILT_WITH_TORCH=2.13.0+cpu: torch.utils.cpp_extension.load's shell strips quotes, setup.py's does
// not) and it is stringized here. Without the define no attribute is set, and the loader refuses the module.
#pragma once

#include <pybind11/pybind11.h>

#define ELMO_FAST_STR_(x) #x
#define ELMO_FAST_STR(x) ELMO_FAST_STR_(x)

namespace elmo_fast {
inline void record_torch_version(pybind11::module_& m) {
#ifdef ELMO_FAST_BUILT_WITH_TORCH
  m.attr("torch_version") = ELMO_FAST_STR(ELMO_FAST_BUILT_WITH_TORCH);
#else
  (void)m;
#endif
}
}  // namespace elmo_fast
