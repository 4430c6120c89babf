"""elmo_fast.cpu.gemm: MKL or oneDNN per GEMM shape, measured once per process (issue 13)."""
import zlib

import pytest
import torch

from elmo_fast.cpu import gemm, packed

needs_onednn = pytest.mark.skipif(not packed.onednn_enabled(), reason="torch without oneDNN")


@pytest.fixture
def fresh(monkeypatch):
    """No measurements from other tests, auto mode, oneDNN on."""
    monkeypatch.setattr(gemm, "_TIMES", {})
    monkeypatch.delenv("ELMO_FAST_CPU_GEMM", raising=False)
    return monkeypatch


def _operands(M, K, N, a_t, b_t, gen):
    a = torch.randn(K, M, generator=gen).t() if a_t else torch.randn(M, K, generator=gen)
    b = torch.randn(N, K, generator=gen).t() if b_t else torch.randn(K, N, generator=gen)
    return a, b


@needs_onednn
@pytest.mark.parametrize("mode", ["mkl", "onednn"])
@pytest.mark.parametrize("a_t, b_t", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("into", [None, "strided"])
def test_gemm_matches_the_fp64_product(fresh, mode, a_t, b_t, with_bias, into):
    """Either library, any operand layout, with or without a bias, into a new tensor or a strided ``out`` (filled
    with NaN first): the fp64 product to fp32 rounding."""
    fresh.setenv("ELMO_FAST_CPU_GEMM", mode)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mode, a_t, b_t, with_bias, into)).encode()))
    M, K, N = 37, 70, 129  # no dimension a multiple of a vector width
    a, b = _operands(M, K, N, a_t, b_t, gen)
    bias = torch.randn(N, generator=gen) if with_bias else None
    want = a.double() @ b.double() + (bias.double() if with_bias else 0.0)
    assert gemm.uses_onednn(a, b, bias) == (mode == "onednn")
    if into is None:
        got = gemm.gemm(a, b, bias)
    else:
        buf = torch.full((M, N + 3), float("nan"))
        out = buf[:, 2 : 2 + N]
        got = gemm.gemm(a, b, bias, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert buf[:, :2].isnan().all() and buf[:, 2 + N :].isnan().all()  # nothing outside out written
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


@needs_onednn
def test_auto_measures_once_per_shape_class_and_keeps_the_faster(fresh):
    """auto: the first product of a shape class (each dimension rounded up to a power of two, layouts, bias,
    threads) times both libraries; later ones reuse the measurement (an inner dimension that follows the data, as
    the highway's weight gradients' count of distinct tokens, measures once per class, not every step); the
    faster library wins."""
    fresh.setattr(gemm, "MIN_FLOP", 0)
    calls = []

    def fake_best(fn, reps):  # MKL timed first, then oneDNN: oneDNN 2x faster
        calls.append(reps)
        return 1.0 if len(calls) % 2 else 0.5

    fresh.setattr(packed, "best_seconds", fake_best)
    a5, a7, a9, b = torch.randn(5, 16), torch.randn(7, 16), torch.randn(9, 16), torch.randn(16, 32)
    assert gemm.uses_onednn(a5, b) and len(calls) == 2
    assert gemm.uses_onednn(a7, b) and len(calls) == 2  # 5 and 7 rows: one class (8)
    assert gemm.uses_onednn(a9, b) and len(calls) == 4  # 9 rows: the next class
    assert gemm.uses_onednn(a5, b, torch.randn(32)) and len(calls) == 6  # a bias: another class
    for k in (17, 23, 32):  # K = 17..32: one class; N = 33 and 64 too
        assert gemm.uses_onednn(torch.randn(4, k), torch.randn(k, 33 if k < 32 else 64)) and len(calls) == 8
    key = gemm._key(a5, b, None)
    gemm._TIMES[key] = (0.5, 1.0)  # MKL faster
    assert not gemm.uses_onednn(a5, b)
    torch.testing.assert_close(gemm.gemm(a5, b), a5 @ b)


@needs_onednn
def test_what_never_measures_and_what_fixes_the_choice(fresh):
    from elmo_fast.determinism import deterministic

    def no_timing(fn, reps):
        raise AssertionError("measured")

    fresh.setattr(packed, "best_seconds", no_timing)
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    assert not gemm.uses_onednn(a, b)  # auto: below MIN_FLOP, MKL without a measurement
    fresh.setattr(gemm, "MIN_FLOP", 0)
    gemm._TIMES[gemm._key(a, b, None)] = (1.0, 0.5)  # oneDNN measured faster ...
    assert gemm.uses_onednn(a, b)
    with deterministic():
        assert not gemm.uses_onednn(a, b)  # ... but deterministic mode never lets a timing choose
    fresh.setenv("ELMO_FAST_CPU_GEMM", "mkl")
    assert not gemm.uses_onednn(a, b)
    fresh.setenv("ELMO_FAST_CPU_GEMM", "onednn")
    assert gemm.uses_onednn(a, b)
    # what oneDNN cannot run stays on MKL whatever the mode: other dtypes, empty dimensions, a 2-D bias
    assert not gemm.uses_onednn(a.double(), b.double())
    assert not gemm.uses_onednn(torch.randn(4, 0), torch.randn(0, 16))
    assert not gemm.uses_onednn(a, b, torch.randn(4, 16))
    torch.testing.assert_close(gemm.gemm(torch.randn(4, 0), torch.randn(0, 16)), torch.zeros(4, 16))
    fresh.setattr(packed, "_ONEDNN_OK", False)  # ELMO_FAST_CPU_ONEDNN=0, or a failed pack
    assert not gemm.uses_onednn(a, b)
    fresh.setenv("ELMO_FAST_CPU_GEMM", "fast")
    fresh.setattr(packed, "_ONEDNN_OK", True)
    with pytest.raises(ValueError, match=r"ELMO_FAST_CPU_GEMM='fast': expected one of auto, mkl, onednn"):
        gemm.uses_onednn(a, b)


def test_timings_round_trip(fresh):
    gemm._TIMES[(512, 512, 16384, True, False, True, 2)] = (0.05, 0.04)
    rows = gemm.gemm_timings()
    assert rows == [[512, 512, 16384, True, False, True, 2, 0.05, 0.04]]
    gemm._TIMES.clear()
    gemm.restore_gemm_timings(rows)
    assert gemm._TIMES == {(512, 512, 16384, True, False, True, 2): (0.05, 0.04)}
    gemm.restore_gemm_timings(None)  # a checkpoint from before these timings
    gemm._TIMES.clear()  # a checkpoint from before K and N were rounded: its rows land on the rounded classes
    gemm.restore_gemm_timings([[512, 418, 2048, False, True, False, 2, 0.01, 0.02]])
    assert gemm._TIMES == {(512, 512, 2048, False, True, False, 2): (0.01, 0.02)}
    with pytest.raises(ValueError, match="a gemm timing row of 8 fields, expected 9"):
        gemm.restore_gemm_timings([rows[0][:8]])


@needs_onednn
@pytest.mark.parametrize("mode", ["mkl", "onednn"])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("c_t", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
def test_gemm_add_matches_the_fp64_sum(fresh, mode, b_t, c_t, reuse):
    """``c + a · b`` on either library, with a transposed weight or addend: the fp64 sum to fp32 rounding. ``c`` is
    left as it was, except that MKL sums into it in place when ``reuse`` says it is scratch."""
    fresh.setenv("ELMO_FAST_CPU_GEMM", mode)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mode, b_t, c_t, reuse)).encode()))
    M, K, N = 37, 70, 129
    a, b = _operands(M, K, N, False, b_t, gen)
    c = torch.randn(N, M, generator=gen).t() if c_t else torch.randn(M, N, generator=gen)
    before = c.clone()
    want = c.double() + a.double() @ b.double()
    got = gemm.gemm_add(c, a, b, reuse=reuse)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)
    if reuse and mode == "mkl":
        assert got.data_ptr() == c.data_ptr()
    else:
        assert got.data_ptr() != c.data_ptr() and torch.equal(c, before)


def test_gemm_add_refuses_an_addend_of_another_shape(fresh):
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    for c in (torch.randn(16), torch.randn(4, 16).double()):  # torch.addmm would broadcast the first
        with pytest.raises(ValueError, match=r"gemm_add: c of .* expected \(4, 16\) torch.float32 \(no broadcast\)"):
            gemm.gemm_add(c, a, b)


@needs_onednn
@pytest.mark.parametrize("mode", ["mkl", "onednn"])
def test_gemm_add_takes_a_broadcast_addend_and_the_left_operand_as_addend(fresh, mode):
    """A stride-0 (expanded) addend, and ``a`` itself as the addend (a square product): still the fp64 sum, and
    neither input changed (without ``reuse``)."""
    fresh.setenv("ELMO_FAST_CPU_GEMM", mode)
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(33, 33, generator=gen), torch.randn(33, 33, generator=gen)
    row = torch.randn(1, 33, generator=gen).expand(33, 33)
    for c in (row, a):
        before_a, before_c = a.clone(), c.clone()
        got = gemm.gemm_add(c, a, b)
        torch.testing.assert_close(got.double(), before_c.double() + before_a.double() @ b.double(), rtol=1e-5,
                                   atol=1e-4)
        assert torch.equal(a, before_a) and torch.equal(c, before_c)


@needs_onednn
@pytest.mark.parametrize("mode", ["mkl", "onednn"])
def test_gemm_takes_a_strided_or_broadcast_bias(fresh, mode):
    """A bias that is a strided view (oneDNN reads it as contiguous: it is made so) or of length 1 (broadcast, as
    torch.addmm takes it: it stays on MKL): the fp64 sum either way."""
    fresh.setenv("ELMO_FAST_CPU_GEMM", mode)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 8, generator=gen), torch.randn(8, 24, generator=gen)
    for bias in (torch.randn(48, generator=gen)[::2], torch.randn(1, generator=gen)):
        got = gemm.gemm(a, b, bias)
        torch.testing.assert_close(got.double(), a.double() @ b.double() + bias.double(), rtol=1e-5, atol=1e-5)
    assert not gemm.uses_onednn(a, b, torch.randn(1))
