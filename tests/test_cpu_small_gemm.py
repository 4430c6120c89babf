"""elmo_fast._cpu's small_mm (csrc/cpu/small_gemm.cpp): x (M, K) · w (K, N) (+ add) with w packed in panels of 16
columns, against an fp64 product, at shapes that cross every row block (16/8/4/2/1), panel tail and k block (256);
and how elmo_fast.cpu.packed chooses it (ELMO_FAST_CPU_PANELS, the probe)."""
import pytest
import torch

from conftest import poison_allocations
from elmo_fast.cpu import lstmp_cpu, packed
from elmo_fast.cpu.ext import cpu_ext
from elmo_fast.cpu.packed import PackedLinear
from test_cpu_backend import _chain, _run_lstmp

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None or not ext.small_mm_available(),
                                reason="elmo_fast._cpu's small_mm needs the extension built and an AVX-512 CPU")


def _check(M, K, N, seed, add=True, x_t=False, w_t=False, out_pad=0, width=16, x_pad=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, M, generator=g).t() if x_t else torch.randn(M, K + x_pad, generator=g)[:, x_pad:]
    w = torch.randn(N, K, generator=g).t() if w_t else torch.randn(K, N, generator=g)
    a = torch.randn(M, N + 3, generator=g)[:, 1 : N + 1] if add else None  # a row stride of N + 3
    buf = torch.full((M, N + out_pad), float("nan"))
    out = buf[:, :N]
    ext.small_mm(x, ext.pack_panels(w, width), N, a, out)
    want = x.double() @ w.double() + (a.double() if add else 0)
    bound = 1e-6 * (x.double().abs() @ w.double().abs() + (a.double().abs() if add else 0)) + 1e-30
    assert torch.isfinite(out).all(), "an element was not written"
    assert ((out.double() - want).abs() <= 8 * bound).all(), float(((out.double() - want).abs() / bound).max())
    if out_pad:
        assert torch.isnan(buf[:, N:]).all(), "small_mm wrote past column N"


@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 14, 15, 16, 17, 29, 31, 32, 33, 47])
def test_every_row_block(M, width):
    _check(M, 300, 37, seed=M, out_pad=5, width=width)


@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("K", [0, 1, 7, 255, 256, 257, 600])
@pytest.mark.parametrize("N", [1, 15, 16, 17, 31, 32, 33, 100])
def test_every_panel_tail_and_k_block(K, N, width):
    _check(6, K, N, seed=K * 1000 + N, width=width)


@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
@pytest.mark.parametrize("N", [16, 45, 64])
@pytest.mark.parametrize("K", [37, 70000])  # 70000: panels of more than 4 MiB, written with streaming stores
def test_pack_panels_layout(layout, N, width, K):
    """Every source layout (row-major: copied runs; column-major: gathered; other strides) gives the same panels:
    column n of w at panel n // width, lane n % width, zeros past N."""
    base = torch.randn(K, N) if layout == "row-major" else torch.randn(N, K).t()
    w = base if layout != "strided" else torch.randn(K, 2 * N)[:, ::2]
    P = -(-N // width)
    want = torch.nn.functional.pad(w, (0, P * width - N)).reshape(K, P, width).permute(1, 0, 2)
    assert torch.equal(ext.pack_panels(w, width), want)


def test_strided_operands_and_no_add():
    """x column-major (the scalar transpose), x's rows wider than K (the blocked transpose reads row by row, masked
    past K), w transposed, no add."""
    _check(20, 130, 70, seed=1, add=False, x_t=True, w_t=True)
    _check(37, 45, 20, seed=4, x_pad=5, out_pad=2)
    _check(16, 4096, 16, seed=5, x_pad=3)
    _check(9, 513, 33, seed=2, x_t=True, out_pad=3)
    _check(30, 513, 45, seed=3, x_t=True, w_t=True, out_pad=3, width=32)


def test_the_transpose_split_over_threads():
    """At 16 rows the transpose of x splits k over the threads from 4,112 on (257 blocks of 16): K = 16384 (the
    step's dz·W_recᵀ) and a tail (16,390), on 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(16, 16384, 32, seed=6, x_pad=3)
        _check(16, 16390, 20, seed=7)
    finally:
        torch.set_num_threads(threads)


def test_the_sum_runs_in_k_blocks():
    """Blocked accumulation keeps the error near a blocked GEMM's: at K = 16384 within 4x of torch.mm's worst."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 16384, generator=g), torch.randn(16384, 40, generator=g)
    out = torch.empty(4, 40)
    ext.small_mm(x, ext.pack_panels(w), 40, None, out)
    want = x.double() @ w.double()
    assert (out.double() - want).abs().max() <= 4 * ((x @ w).double() - want).abs().max() + 1e-4


def test_bad_inputs_are_named():
    w = torch.randn(8, 20)
    panels = ext.pack_panels(w)
    with pytest.raises(RuntimeError, match="panels must be pack_panels of a \\(8, 40\\) weight"):
        ext.small_mm(torch.randn(2, 8), panels, 40, None, torch.empty(2, 40))
    with pytest.raises(RuntimeError, match="panels must be pack_panels of a \\(9, 20\\) weight"):
        ext.small_mm(torch.randn(2, 9), panels, 20, None, torch.empty(2, 20))
    with pytest.raises(RuntimeError, match="out must be \\(2, 20\\)"):
        ext.small_mm(torch.randn(2, 8), panels, 20, None, torch.empty(3, 20))
    with pytest.raises(RuntimeError, match="x must be a 2-d CPU float32 tensor"):
        ext.small_mm(torch.randn(2, 8, dtype=torch.float64), panels, 20, None, torch.empty(2, 20))
    with pytest.raises(RuntimeError, match="add must be \\(2, 20\\) with unit column stride"):
        ext.small_mm(torch.randn(2, 8), panels, 20, torch.randn(20, 2).t(), torch.empty(2, 20))
    out = torch.empty(2, 20)
    with pytest.raises(RuntimeError, match="out must not be add"):
        ext.small_mm(torch.randn(2, 8), panels, 20, out, out)
    with pytest.raises(RuntimeError, match="width must be 16 or 32, got 8"):
        ext.pack_panels(w, 8)


def test_packed_linear_chooses_panels_by_the_rule(monkeypatch):
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    short, long_k = torch.randn(64, 48), torch.randn(2048, 48)
    assert PackedLinear(short, 16).packed.t.shape[2] == 16  # few rows, short K: panels of 16 columns ...
    assert PackedLinear(short, 17).packed.t.shape[2] == 32  # ... or 32 for 17-32 rows
    if torch.backends.mkldnn.is_available():
        assert not isinstance(PackedLinear(short, 33).packed, packed._Panels)  # more rows than 32: oneDNN
        assert not isinstance(PackedLinear(long_k, 17).packed, packed._Panels)  # K > 1024 and 17-32 rows: oneDNN
    assert PackedLinear(long_k, 16).packed.t.shape[2] == 16  # at most 16 rows: panels at any K
    assert not isinstance(PackedLinear(short, 16, torch.bfloat16).packed, packed._Panels)  # fp32 only
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "1")
    assert isinstance(PackedLinear(long_k, 100).packed, packed._Panels)
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "0")
    assert not isinstance(PackedLinear(short, 16).packed, packed._Panels)
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "sometimes")
    with pytest.raises(ValueError, match="ELMO_FAST_CPU_PANELS='sometimes': expected one of auto, 0, 1"):
        PackedLinear(short, 16)


def test_packed_linear_panels_compute_the_product(monkeypatch):
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    g = torch.Generator().manual_seed(4)
    w, x, a = torch.randn(300, 70, generator=g), torch.randn(24, 300, generator=g), torch.randn(24, 70, generator=g)
    lin = PackedLinear(w, 16)  # built for 16 rows, called with 24 and 5
    assert isinstance(lin.packed, packed._Panels)
    poison_allocations(monkeypatch)  # the products' outputs start as NaN
    torch.testing.assert_close(lin(x, add=a), torch.addmm(a, x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x[:5]), x[:5] @ w, rtol=1e-5, atol=1e-5)


def test_a_failed_probe_turns_the_panels_off(monkeypatch):
    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_VERIFIED", set())
    monkeypatch.setattr(packed, "_PANELS_OK", True)
    real = ext.small_mm

    class Wrong:  # the extension, with a product that comes back wrong
        def __getattr__(self, name):
            return getattr(ext, name)

        def small_mm(self, x, panels, n, add, out):
            real(x, panels, n, add, out)
            out.add_(1.0)

    monkeypatch.setattr("elmo_fast.cpu.ext.cpu_ext", lambda: Wrong())
    w = torch.randn(40, 30)
    lin = PackedLinear(w, 8)
    assert not isinstance(lin.packed, packed._Panels) and not packed._PANELS_OK
    x = torch.randn(8, 40)
    torch.testing.assert_close(lin(x), x @ w)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_lstmp_chain_through_panels_matches_the_reference(monkeypatch, dtype):
    """Every per-step product on panels (forced: the test weights are small), forward and every gradient."""
    from elmo_fast.reference import lstmp_reference

    monkeypatch.setattr(packed, "_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed, "_PANELS_OK", True)
    monkeypatch.setenv("ELMO_FAST_CPU_PANELS", "1")
    monkeypatch.setenv("ELMO_FAST_CPU_TRAIN_PACK", "1")
    built = []
    real = packed._Panels.__init__

    def spy(self, w, rows):
        built.append(tuple(w.shape))
        real(self, w, rows)

    monkeypatch.setattr(packed._Panels, "__init__", spy)
    kw = dict(cell_clip=0.9, proj_clip=0.6, reverse=True, residual=True, forget_bias=1.0)
    lengths = [6, 2, 5, 0]
    args = _chain(4, 6, 8, 16, 8, True, dtype, seed=5)
    up = [torch.randn(4, 6, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype), torch.randn(4, 16, dtype=dtype)]
    got = _run_lstmp(lstmp_cpu, args, lengths, up, **kw)
    want = _run_lstmp(lstmp_reference, args, lengths, up, **kw)
    assert len(built) >= 4  # forward w_rec, w_proj and backward's transposes
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("M, K, N", [(16, 16384, 512), (5, 2305, 37), (1, 6001, 16), (13, 8192, 100), (3, 3000, 512)])
@pytest.mark.parametrize("add", [True, False])
def test_split_k_for_few_panels_and_a_long_k(threads, M, K, N, add):
    """Few panels and a long K: the k blocks split over the threads, each summing into its own partial sums (tails
    in K and N, uneven splits with 3 threads, with and without add)."""
    before, runs = torch.get_num_threads(), ext.small_mm_split_k_runs()
    torch.set_num_threads(threads)
    try:
        _check(M, K, N, seed=K + N + M, add=add, out_pad=3)
    finally:
        torch.set_num_threads(before)
    nt = min(threads, -(-K // 256))
    assert ext.small_mm_split_k_runs() - runs == int(K >= 4 * 256 * nt), "the split was (not) taken"


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_streamed_pack_over_two_threads(layout):
    """64 panels of 1100 x 16 (4.5 MiB, streamed) split over two threads: each thread's part fenced before the join."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        K, N = 1100, 1024
        w = torch.randn(K, N) if layout == "row-major" else torch.randn(N, K).t()
        want = w.reshape(K, N // 16, 16).permute(1, 0, 2)
        assert torch.equal(ext.pack_panels(w, 16), want)
    finally:
        torch.set_num_threads(before)
