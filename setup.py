"""Build script: a pure-Python install by default; the optional CUDA extension ``elmo_fast._C``.

ELMO_FAST_BUILD_CUDA=1 builds the extension (opt-in: it has never run on a GPU, see BACKEND_STATUS in
elmo_fast/_backend.py; a failed build is an error); unset or any other value installs pure Python. Honours
TORCH_CUDA_ARCH_LIST (default "9.0a": the persistent kernels need sm_90a and refuse other targets at compile
time) and MAX_JOBS; uses ninja. Without a GPU, `make cuda-compile-check` (csrc/compile_check.sh) compiles every
source; for development `python csrc/jit_build.py` builds the same sources with
torch.utils.cpp_extension.load. The sources are listed once, in csrc/sources.txt (CMake reads it too).

ELMO_FAST_BUILD_CPU: the optional CPU extension ``elmo_fast._cpu`` (csrc/cpu/: the cpu backend's fused LSTMP gate
math, the sparse softmax rows' sum and update, the AVX-512 products of few rows; C++ only, no nvcc). "1" requires
it, "0" skips it, unset = build it when torch and a C++ compiler are present, and go on without it (the cpu backend
then runs the same math as torch ops) if the build fails.
Under pip's build isolation torch cannot be imported, so it is skipped with a warning (pip shows it with -v):
install torch first and use ``pip install --no-build-isolation``.
"""
import os
import shutil
import sys

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


def _want_cpu() -> bool:
    flag = os.environ.get("ELMO_FAST_BUILD_CPU", "").strip()
    if flag == "0":
        return False
    try:
        import torch.utils.cpp_extension  # noqa: F401
        has_torch = True
    except Exception:  # noqa: BLE001
        has_torch = False
    has_cxx = shutil.which(os.environ.get("CXX", "c++")) is not None or shutil.which("g++") is not None
    if flag == "1" and not (has_torch and has_cxx):
        raise RuntimeError("ELMO_FAST_BUILD_CPU=1 but elmo_fast._cpu cannot be built here: "
                           f"torch importable={has_torch}, C++ compiler found={has_cxx}")
    if not has_torch:
        _warn("torch cannot be imported by this build (pip builds in an isolated environment without torch unless "
              "told not to), so the optional CPU extension elmo_fast._cpu is skipped and the cpu backend runs its "
              "gate math as torch ops. To build it: install torch first, then `pip install --no-build-isolation .` "
              "(or `-e .`). ELMO_FAST_BUILD_CPU=1 makes this an error, ELMO_FAST_BUILD_CPU=0 skips it quietly.")
    elif not has_cxx:
        _warn("no C++ compiler found ($CXX, c++ or g++), so the optional CPU extension elmo_fast._cpu is skipped and "
              "the cpu backend runs its gate math as torch ops. ELMO_FAST_BUILD_CPU=0 skips it quietly.")
    return has_torch and has_cxx


def _warn(message: str) -> None:
    """A warning that the install goes on without something (pip shows build output with -v, or on failure)."""
    print(f"WARNING: elmo_fast: {message}", file=sys.stderr, flush=True)


def _torch_define() -> str:
    """The torch this build is against, recorded in the module (csrc/include/elmo_fast/built_with.h)."""
    import torch

    return f"-DELMO_FAST_BUILT_WITH_TORCH={torch.__version__}"


ext_modules, cmdclass = [], {}
if _want_cpu():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules.append(CppExtension(name="elmo_fast._cpu",
                                    sources=["csrc/cpu/lstmp_cell.cpp", "csrc/cpu/sparse_rows.cpp",
                                             "csrc/cpu/small_gemm.cpp", "csrc/cpu/fpenv.cpp",
                                             "csrc/cpu/char_cnn.cpp", "csrc/cpu/lstmp_loop.cpp",
                                             "csrc/cpu/dropout.cpp"],
                                    # -g0: Python's CFLAGS carry -g (twice the compile time); -fopenmp: at::parallel_for
                                    extra_compile_args=["-O3", "-g0", "-std=c++17", "-fopenmp", _torch_define()],
                                    extra_link_args=["-fopenmp"]))
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
if _want_cuda():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    ext_modules.append(
        CUDAExtension(
            name="elmo_fast._C",
            sources=_sources(),
            include_dirs=[os.path.join(HERE, "csrc", "include")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17", _torch_define()],
                                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]},
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

if ext_modules:
    _base = cmdclass["build_ext"]

    class _BuildExt(_base):
        """The CPU extension is optional unless ELMO_FAST_BUILD_CPU=1: a failed build leaves the pure-torch path."""

        failed: set = set()

        def build_extension(self, ext):
            if ext.name != "elmo_fast._cpu" or os.environ.get("ELMO_FAST_BUILD_CPU", "").strip() == "1":
                return super().build_extension(ext)
            try:
                return super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                self.failed.add(ext.name)
                print(f"elmo_fast: the optional CPU extension elmo_fast._cpu did not build ({exc}); the cpu backend "
                      "runs its gate math as torch ops instead")

        def build_extensions(self):
            super().build_extensions()
            self.extensions = [e for e in self.extensions if e.name not in self.failed]  # nothing to install

    cmdclass["build_ext"] = _BuildExt

setup(ext_modules=ext_modules, cmdclass=cmdclass)
