"""From the repository root, the top-level ``kernels/`` folder shadows PyPI's ``kernels`` package (which
transformers probes for): imported under that name it must import nothing, triton included."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCK_TRITON = "import sys; sys.modules['triton'] = None; "


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], cwd=REPO, capture_output=True, text=True)


def test_top_level_kernels_is_inert_without_triton():
    res = _python("import kernels; print(sorted(n for n in vars(kernels) if not n.startswith('__')))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_elmo_fast_kernels_still_probes_triton():
    res = _python("import elmo_fast.kernels")
    assert res.returncode != 0 and "triton" in res.stderr
    res = _python("import elmo_fast, elmo_fast._backend as b; print(b.triton_import_error() is not None)")
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
