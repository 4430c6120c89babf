"""The bf16 (autocast) half of the once-per-device Triton self-check (elmo_fast/ops/_selfcheck.py), on the CPU
under the interpreter (on a GPU when there is one): every op within the accuracy budget, and broken bf16 variants
caught while fp32 passes."""
import warnings

import pytest
import torch
from conftest import requires_triton, triton_device

from elmo_fast import _backend
from elmo_fast.ops import _selfcheck

pytestmark = [pytest.mark.triton, requires_triton]
DEV = torch.device(triton_device())


@pytest.mark.parametrize("op", sorted(_selfcheck.CHECKS))
def test_bf16_variant_within_budget(op):
    assert _selfcheck.bf16_excess(op, DEV) <= 1.0


def test_a_broken_bf16_forward_is_caught(monkeypatch):
    """The highway's bf16 kernel 5% off (its fp32 variant intact): the check names bf16, auto falls back."""
    import elmo_fast.kernels.highway as hk

    real = hk.highway_fwd
    monkeypatch.setattr(hk, "highway_fwd", lambda x, *a: real(x, *a) * (1.05 if x.dtype == torch.bfloat16 else 1))
    assert _selfcheck.op_error("highway", DEV) <= _selfcheck.TOL
    assert _selfcheck.run_self_check("highway", DEV).startswith("bf16 (autocast): error")
    monkeypatch.setattr(_backend, "_SELF_CHECKED", {})
    with pytest.warns(RuntimeWarning, match=r"Triton kernel of highway failed its self-check.*bf16 \(autocast\)"):
        assert _backend.triton_self_check("highway", DEV) is False


def test_a_broken_bf16_gradient_is_caught(monkeypatch):
    """The char CNN's bf16 backward with its weight gradient 10% off (fp32 intact): caught."""
    import elmo_fast.kernels.char_cnn as kc

    real = kc.char_cnn_bwd

    def broken(ids, char_embed, *args):
        gemb, gw, gb = real(ids, char_embed, *args)
        return gemb, (gw * 1.1 if char_embed.dtype == torch.bfloat16 and gw is not None else gw), gb

    monkeypatch.setattr(kc, "char_cnn_bwd", broken)
    assert _selfcheck.op_error("char_cnn", DEV) <= _selfcheck.TOL
    assert _selfcheck.bf16_excess("char_cnn", DEV) > 1.0


def test_the_check_leaves_no_autocast_and_no_grad_mode_behind():
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _selfcheck.run_self_check("highway", DEV) is None
        assert not torch.is_grad_enabled() and not torch.is_autocast_enabled(DEV.type)
