"""Build script: a pure-Python install by default; the optional CUDA extension ``elmo_fast._C``.

ELMO_FAST_BUILD_CUDA=1 builds the extension (opt-in: it has never run on a GPU, see BACKEND_STATUS in
elmo_fast/_backend.py; a failed build is an error); unset or any other value installs pure Python. Honours
TORCH_CUDA_ARCH_LIST (default "9.0a": the persistent kernels need sm_90a and refuse other targets at compile time) and MAX_JOBS;
uses ninja. Without a GPU, `make cuda-compile-check` (csrc/compile_check.sh) compiles every source; for development
`python csrc/jit_build.py` builds the same sources with torch.utils.cpp_extension.load. The sources are listed once, in csrc/sources.txt (CMake reads it too).
"""
import os
import shutil

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources():
    path = os.path.join(HERE, "csrc", "sources.txt")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [os.path.join("csrc", ln.strip()) for ln in fh if ln.strip() and not ln.startswith("#")]


def _want_cuda() -> bool:
    if os.environ.get("ELMO_FAST_BUILD_CUDA", "").strip() != "1":
        return False
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import CUDA_HOME
        has_torch_cuda = torch.version.cuda is not None
    except Exception:  # noqa: BLE001
        has_torch_cuda, CUDA_HOME = False, None
    has_nvcc = CUDA_HOME is not None or shutil.which("nvcc") is not None
    if not (has_torch_cuda and has_nvcc and _sources()):
        raise RuntimeError(
            "ELMO_FAST_BUILD_CUDA=1 but the CUDA extension cannot be built here: "
            f"torch CUDA build={has_torch_cuda}, nvcc found={has_nvcc}, sources={bool(_sources())}. Install a CUDA "
            "build of torch and the CUDA toolkit, or unset ELMO_FAST_BUILD_CUDA."
        )
    return True


ext_modules, cmdclass = [], {}
if _want_cuda():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    ext_modules.append(
        CUDAExtension(
            name="elmo_fast._C",
            sources=_sources(),
            include_dirs=[os.path.join(HERE, "csrc", "include")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]},
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
