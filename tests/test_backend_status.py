"""Backends honest about what has been verified: the status table, auto never picking an unverified CUDA
extension, the once-per-device Triton self-check, and the opt-in CUDA build."""
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from conftest import requires_triton, triton_device
from elmo_fast import _backend
from elmo_fast.ops import _selfcheck

ROOT = Path(__file__).resolve().parents[1]


def test_readme_shows_the_status_table():
    assert _backend.status_table() in (ROOT / "README.md").read_text(encoding="utf-8")


def test_auto_never_picks_an_unverified_cuda_extension(monkeypatch):
    fake_ext = types.SimpleNamespace(lstmp=object())
    monkeypatch.setattr(_backend, "cuda_ext_import_error", lambda: None)
    monkeypatch.setattr(_backend, "cuda_ext", lambda: fake_ext)
    monkeypatch.setattr(_backend, "triton_import_error", lambda: None)
    monkeypatch.setattr(_backend, "triton_self_check", lambda op, dev: True)
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    gpu = torch.device("cuda")
    assert not _backend.verified_on_gpu("cuda")
    assert _backend.select_backend("auto", gpu, "lstmp") == "triton"
    verified = _backend.BackendStatus("cuda", "cuda", "verified on NVIDIA H100 at abc1234", "make gpu-check")
    rows = tuple(r for r in _backend.BACKEND_STATUS if r.backend != "cuda") + (verified,)
    monkeypatch.setattr(_backend, "BACKEND_STATUS", rows)
    assert _backend.select_backend("auto", gpu, "lstmp") == "cuda"
    assert _backend.select_backend("auto", gpu, "highway") == "triton"  # the extension has no highway
    monkeypatch.setattr(_backend, "triton_self_check", lambda op, dev: False)
    assert _backend.select_backend("auto", gpu, "highway") == "reference"


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("op", sorted(_selfcheck.OPS))
def test_self_check_passes_for_every_op(op):
    dev = torch.device(triton_device())  # where the Triton kernels run here
    assert _selfcheck.run_self_check(op, dev) is None


@pytest.mark.triton
@requires_triton
def test_a_failing_self_check_warns_once_and_falls_back(monkeypatch):
    import elmo_fast.kernels.highway as hk

    real = hk.highway_fwd
    monkeypatch.setattr(hk, "highway_fwd", lambda *a: real(*a) * 1.01)  # a kernel gone wrong by 1%
    monkeypatch.setattr(_backend, "_SELF_CHECKED", {})
    dev = torch.device(triton_device())
    with pytest.warns(RuntimeWarning, match=r"Triton kernel of highway failed its self-check.*relative error"):
        assert _backend.triton_self_check("highway", dev) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.triton_self_check("highway", dev) is False  # cached: no second warning, no rerun
    monkeypatch.setattr(hk, "highway_fwd", lambda *a: 1 / 0)
    monkeypatch.setattr(_backend, "_SELF_CHECKED", {})
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        assert _backend.triton_self_check("highway", dev) is False


def test_cuda_extension_build_is_opt_in(tmp_path):
    code = ("import sys, setuptools; setuptools.setup = lambda **k: print('EXT', "
            "sum(e.name == 'elmo_fast._C' for e in k['ext_modules'])); "
            "sys.argv = ['setup.py']; exec(open('setup.py').read(), {'__file__': 'setup.py', '__name__': 'x'})")
    env = {k: v for k, v in os.environ.items() if k != "ELMO_FAST_BUILD_CUDA"}
    for flag, want in ((None, "EXT 0"), ("0", "EXT 0"), ("auto", "EXT 0")):
        if flag is not None:
            env["ELMO_FAST_BUILD_CUDA"] = flag
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert want in out.stdout, out.stderr
    env["ELMO_FAST_BUILD_CUDA"] = "1"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if torch.version.cuda is None:  # a CPU torch: the forced build says why it cannot be done
        assert "ELMO_FAST_BUILD_CUDA=1 but the CUDA extension cannot be built here" in out.stderr


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("on", True), (" yes ", True), ("0", False),
                                             ("false", False), ("Off", False), ("no", False), ("", "default")])
def test_on_off_switches_read_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", value)
    for default in (True, False):
        assert _backend.env_flag("ELMO_FAST_CPU_EXT", default) is (default if expected == "default" else expected)


def test_on_off_switches_refuse_other_values_by_name(monkeypatch):
    """ELMO_FAST_CPU_EXT=false used to leave the extension on (only "0" counted), and any other value was read as
    the default: now every spelling of on/off works and anything else is refused, naming the variable."""
    from elmo_fast.cpu import ext as ext_module
    from elmo_fast.cpu.ext import cpu_ext

    monkeypatch.setattr(ext_module, "_load", lambda: "built")  # as if the extension were built, everywhere
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", "true")
    assert cpu_ext() == "built"
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", "false")
    assert cpu_ext() is None
    monkeypatch.setenv("ELMO_FAST_CPU_EXT", "bogus")
    with pytest.raises(ValueError, match=r"ELMO_FAST_CPU_EXT='bogus': expected 1 or 0 \(also true/false"):
        cpu_ext()


@pytest.mark.parametrize("value, on", [("1", True), ("Yes", True), ("y", True), ("true", True), ("0", False),
                                       ("false", False), ("off", False), ("bogus", False), ("", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, on):
    """Triton's getenv_bool takes 1/true/on/yes/y (any case) as on and anything else as off; elmo_fast read any
    value but "" and "0" as on, so TRITON_INTERPRET=false picked the interpreter that Triton then did not run."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _backend.triton_interpret() is on


def test_onednn_switch_is_read_when_used(monkeypatch):
    """ELMO_FAST_CPU_ONEDNN was read at import: a bad value made `import elmo_fast` fail. Now it is read where the
    packed path is chosen, and a bad value is refused there by name."""
    from elmo_fast.cpu import packed

    monkeypatch.setenv("ELMO_FAST_CPU_ONEDNN", "0")
    assert not packed.onednn_enabled()
    monkeypatch.setenv("ELMO_FAST_CPU_ONEDNN", "bogus")
    with pytest.raises(ValueError, match="ELMO_FAST_CPU_ONEDNN='bogus'"):
        packed.onednn_enabled()
