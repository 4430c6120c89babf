"""csrc/ compiles for sm_90a with warnings as errors (no GPU needed): runs csrc/compile_check.sh."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="needs nvcc (CUDA toolkit)")
def test_csrc_compiles_for_sm90a(tmp_path):
    env = dict(os.environ, ELMO_FAST_CC_OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "csrc", "compile_check.sh")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"compile_check.sh failed:\n{proc.stdout}\n{proc.stderr}"
    assert "all sources compile" in proc.stdout
    # No register spills in the persistent kernels (a spill would put state in local memory every step).
    for line in proc.stdout.splitlines():
        if "spill" in line:
            assert "0 bytes spill stores, 0 bytes spill loads" in line, line


def test_sources_list_matches_csrc():
    with open(os.path.join(ROOT, "csrc", "sources.txt")) as fh:
        listed = {ln.strip() for ln in fh if ln.strip() and not ln.startswith("#")}
    found = set()
    for sub in ("kernels", "bindings"):
        for name in os.listdir(os.path.join(ROOT, "csrc", sub)):
            if name.endswith((".cu", ".cpp")):
                found.add(f"{sub}/{name}")
    assert listed == found, f"csrc/sources.txt {sorted(listed)} != files {sorted(found)}"
