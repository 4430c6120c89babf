"""Development build of ``elmo_fast._C`` with ``torch.utils.cpp_extension.load`` (ninja, cached).

Never run by importing elmo_fast; run it by hand on a machine with nvcc and a CUDA build of torch:

    python csrc/jit_build.py                # build (or reuse) into build/jit, copy _C*.so next to elmo_fast/
    python csrc/jit_build.py --no-install   # build only; prints the path of the module
    python csrc/jit_build.py --verbose      # show the ninja/nvcc command lines

Sources come from csrc/sources.txt, the same list setup.py and CMakeLists.txt read. Honours
TORCH_CUDA_ARCH_LIST (default "9.0a": the kernels use sm_90a) and MAX_JOBS. The production build is
``ELMO_FAST_BUILD_CUDA=1 pip install --no-build-isolation -e .``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sources() -> list[str]:
    with open(os.path.join(HERE, "sources.txt")) as fh:
        return [os.path.join(HERE, ln.strip()) for ln in fh if ln.strip() and not ln.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "jit"))
    ap.add_argument("--no-install", action="store_true", help="do not copy the module into elmo_fast/")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from torch.utils.cpp_extension import load

    if torch.version.cuda is None:
        print("jit_build: this torch is a CPU build; a CUDA build of torch is needed", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.makedirs(args.build_dir, exist_ok=True)
    mod = load(
        name="_C",
        sources=sources(),
        extra_include_paths=[os.path.join(HERE, "include")],
        extra_cflags=["-O3", "-std=c++17", f"-DELMO_FAST_BUILT_WITH_TORCH={torch.__version__}"],  # built_with.h
        extra_cuda_cflags=["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"],
        build_directory=args.build_dir,
        verbose=args.verbose,
    )
    print(f"jit_build: built {mod.__file__}")
    if not args.no_install:
        dst = os.path.join(ROOT, "elmo_fast", os.path.basename(mod.__file__))
        shutil.copy2(mod.__file__, dst)
        print(f"jit_build: copied to {dst} (import elmo_fast._C now finds it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
