"""bench/common.py: where benchmark rows go (never the committed results by default), the rounds variable, and
the best-of-N timing loop the CPU benchmarks share."""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402


@pytest.fixture
def bench_env(monkeypatch):
    for name in ("ELMO_FAST_BENCH_DIR", "ELMO_FAST_BENCH_RECORD", "ELMO_FAST_BENCH_ROUNDS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_rows_go_to_scratch_unless_recording_is_asked_for(bench_env, tmp_path):
    assert common.results_dir() == common.SCRATCH
    assert common.ROOT / "bench" / "results" not in common.SCRATCH.parents
    bench_env.setenv("ELMO_FAST_BENCH_RECORD", "1")
    assert common.results_dir() == common.RESULTS
    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    assert common.results_dir() == tmp_path
    path = common.append_rows("x", [{"a": 1}])
    assert path == tmp_path / "x.csv" and path.read_text().splitlines()[0].startswith("a,date,device")
    bench_env.delenv("ELMO_FAST_BENCH_DIR")
    bench_env.setenv("ELMO_FAST_BENCH_RECORD", "yes")
    with pytest.raises(ValueError, match="ELMO_FAST_BENCH_RECORD='yes': expected 1"):
        common.results_dir()


def test_rounds_come_from_the_one_variable(bench_env):
    assert common.env_rounds(3) == 3
    bench_env.setenv("ELMO_FAST_BENCH_ROUNDS", "7")
    assert common.env_rounds(3) == 7
    bench_env.setenv("ELMO_FAST_BENCH_ROUNDS", "0")
    with pytest.raises(ValueError, match="ELMO_FAST_BENCH_ROUNDS='0': expected a positive integer"):
        common.env_rounds(3)


def test_best_times_takes_the_best_round_of_interleaved_calls(monkeypatch):
    order, clock = [], iter(range(0, 1000, 1))
    monkeypatch.setattr(common.time, "perf_counter", lambda: float(next(clock)))
    best = common.best_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=2, warmup=1,
                             calls=3)
    assert order == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 2  # warm-up, then the providers in turn each round
    assert best == {"a": 1 / 3, "b": 1 / 3}  # one clock tick per round of 3 calls


def test_variants_are_env_switches_timed_as_extra_providers(monkeypatch):
    assert common.parse_variants(None) == []
    assert common.parse_variants(["ELMO_FAST_CPU_TRAIN_PACK=0", "ELMO_FAST_CPU_EXT="]) == [
        ("ELMO_FAST_CPU_TRAIN_PACK", "0"), ("ELMO_FAST_CPU_EXT", "")]
    for bad in ("ELMO_FAST_CPU_TRAIN_PACK", "OMP_NUM_THREADS=1"):
        with pytest.raises(ValueError, match="expected NAME=VALUE with an ELMO_FAST_\\* variable"):
            common.parse_variants([bad])
    monkeypatch.setenv("ELMO_FAST_X", "outer")
    seen = []
    fn = common.with_env(lambda a: seen.append((a, os.environ["ELMO_FAST_X"])), "ELMO_FAST_X", "inner")
    fn(1)
    assert seen == [(1, "inner")] and os.environ["ELMO_FAST_X"] == "outer"


def test_cpu_lstmp_bench_times_a_variant_in_the_same_rounds():
    import bench_cpu_lstmp

    rows = bench_cpu_lstmp.run(B=2, T=2, rounds=1, variants=[("ELMO_FAST_CPU_TRAIN_PACK", "0")])
    got = {(r["provider"], r["mode"]) for r in rows}
    assert {("cpu", "fwd+bwd"), ("cpu[ELMO_FAST_CPU_TRAIN_PACK=0]", "fwd"),
            ("cpu[ELMO_FAST_CPU_TRAIN_PACK=0]", "fwd+bwd"), ("nn.LSTM", "fwd+bwd"), ("mm", "gemm")} <= got
    assert all(r["speedup_vs_nn_lstm"] for r in rows if r["mode"] != "gemm")
    # the percentages: of torch.mm's rate, and of the faster of the two libraries' 2048^3 products
    from elmo_fast.cpu.packed import onednn_enabled

    gemms = {r["provider"]: r["gflops"] for r in rows if r["mode"] == "gemm"}
    assert set(gemms) == ({"mm", "mm-onednn"} if onednn_enabled() else {"mm"})
    slack = 0.06 + 10 / min(gemms.values())  # the rows' rates are rounded to 0.1 GFLOP/s, their shares to 0.1%
    for r in rows:
        assert r["pct_of_mm"] == pytest.approx(100 * r["gflops"] / gemms["mm"], rel=2e-3, abs=slack)
        assert r["pct_of_best_gemm"] == pytest.approx(100 * r["gflops"] / max(gemms.values()), rel=2e-3, abs=slack)


def test_cpu_plot_draws_one_device_and_leaves_variants_out(monkeypatch, tmp_path):
    """bench_cpu_plot.py picks, per provider and batch, the last row of one device: a figure never mixes machines,
    and providers timed with an ELMO_FAST_* switch are left out unless asked for."""
    import bench_cpu_plot

    def row(provider, B, tps, device):
        return {"provider": provider, "B": str(B), "tokens_per_s": str(tps), "device": device}

    rows = [row("elmo_fast", 16, 100, "cpu: Xeon"), row("elmo_fast", 16, 50, "cpu: AMD EPYC"),
            row("elmo_fast", 8, 40, "cpu: AMD EPYC"), row("elmo_fast", 16, 60, "cpu: AMD EPYC"),
            row("elmo_fast[ELMO_FAST_X=0]", 16, 55, "cpu: AMD EPYC"), row("allennlp", 16, 20, "cpu: Xeon")]
    got = bench_cpu_plot.latest(rows, "B", "EPYC")
    assert sorted(got) == ["elmo_fast"]
    assert {b: r["tokens_per_s"] for b, r in got["elmo_fast"].items()} == {16: "60", 8: "40"}
    assert "elmo_fast[ELMO_FAST_X=0]" in bench_cpu_plot.latest(rows, "B", "EPYC", variants=True)
    assert sorted(bench_cpu_plot.latest(rows, "B", "Xeon")) == ["allennlp", "elmo_fast"]
    # what the figure names: the device, torch, commits, dates and commands of the rows it draws
    drawn = [dict(r, torch="2.13", commit=c, date=d, command="python x") for r, c, d in
             zip(got["elmo_fast"].values(), ["c2", "c1"], ["2026-11-25T06:00Z", "2026-11-25T03:00Z"])]
    assert bench_cpu_plot.provenance(drawn) == {"device": "cpu: AMD EPYC", "torch": "2.13", "commit": "c1, c2",
                                                "date": "2026-11-25T03:00Z to 2026-11-25T06:00Z",
                                                "command": "python x"}
    # a device with no rows is an error that names the devices there are
    monkeypatch.setattr(bench_cpu_plot, "rows_of", lambda name: rows)
    with pytest.raises(SystemExit, match="no rows for a device matching 'Graviton'.*EPYC"):
        bench_cpu_plot.main(["--device", "Graviton"])


def test_op_profile_counts_per_call(capsys):
    """common.op_profile: an op's self time and calls are per call of the profiled function, grouped by shapes,
    sorted by self time; print_op_profile prints every row."""
    import torch

    a, b, c = torch.randn(64, 64), torch.randn(64, 64), torch.randn(8, 64)

    def step():
        torch.mm(a, b)
        torch.mm(a, b)
        torch.mm(c, b)

    rows = common.op_profile(step, steps=3, top=50)
    mm = {r["shapes"]: r for r in rows if r["op"] == "aten::mm"}
    assert mm["[[64, 64], [64, 64]]"]["calls"] == 2 and mm["[[8, 64], [64, 64]]"]["calls"] == 1
    assert [r["self_ms"] for r in rows] == sorted((r["self_ms"] for r in rows), reverse=True)
    assert abs(sum(r["share"] for r in common.op_profile(step, steps=1, top=1000)) - 1) < 1e-6
    assert len(common.op_profile(step, steps=1, top=1)) == 1
    common.print_op_profile("t", rows)
    out = capsys.readouterr().out
    assert "aten::mm  [[8, 64], [64, 64]]" in out and out.count("aten::mm") == 2


def test_cpu_products_bench_runs_every_product(bench_env, tmp_path):
    """bench_cpu_products.py --small: every provider of every product timed, with its rates; rows go to scratch."""
    import bench_cpu_products

    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    rows = bench_cpu_products.run(batches=(2,), rounds=1, small=True)
    names = {r["provider"] for r in rows}
    assert {"mm", "read", "dW fresh", "dW out="} <= names
    for p, _, _, _ in bench_cpu_products.PRODUCTS:
        assert {f"{p} packed", f"{p} packed-cold", f"{p} mm"} <= names
    if bench_cpu_products.packed.onednn_enabled():
        for w, *_ in bench_cpu_products.WIDE:
            assert {f"{w} mkl", f"{w} onednn"} <= names
    # every rate computed (at --small sizes on a busy machine one may round to 0.0: present is what counts)
    assert all(r["ms"] > 0 for r in rows) and all(r["gflops"] != "" for r in rows if r["provider"] != "read")
    per_step = {p for p, *_ in bench_cpu_products.PRODUCTS}
    assert all(r["weight_gbps"] != "" for r in rows if r["provider"].split(" ")[0] in per_step)
    bench_cpu_products.report(rows)
    assert (tmp_path / "cpu_products.csv").read_text().count("\n") == len(rows) + 1


def test_cpu_embedding_sweep_times_each_variant_beside_the_engines(bench_env, tmp_path):
    """bench_cpu_embedding's sweep at the tiny model's size: a --variant adds the fp32 engine run with that switch,
    timed in the same rounds."""
    import bench_cpu_embedding
    from elmo_fast.testing import TINY_OPTIONS

    bench_env.setattr(bench_cpu_embedding, "ORIGINAL_OPTIONS", TINY_OPTIONS)
    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    seen = []
    real = bench_cpu_embedding.ElmoBiLM.__call__

    def spy(self, *a, **k):
        seen.append(os.environ.get("ELMO_FAST_CPU_GEMM"))
        return real(self, *a, **k)

    bench_env.setattr(bench_cpu_embedding.ElmoBiLM, "__call__", spy)
    rows = bench_cpu_embedding.sweep([2], rounds=1, variants=[("ELMO_FAST_CPU_GEMM", "mkl")])
    names = {r["provider"] for r in rows}
    assert {"elmo_fast", "elmo_fast[ELMO_FAST_CPU_GEMM=mkl]"} <= names
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "mkl" in seen and None in seen  # the variant's calls ran with the switch, the engine's without
    assert "ELMO_FAST_CPU_GEMM" not in os.environ


def test_cpu_embedding_check_names_the_side_off_the_fp64_reference(tmp_path, capsys):
    """When the engines disagree, the bench's check prints each one's distance to an fp64 reference run: outputs
    moved off that reference by known amounts read back as those amounts, each beside its engine's name."""
    import bench_cpu_embedding
    from elmo_fast.testing import TINY_OPTIONS, write_random_model

    opt, wts = write_random_model(str(tmp_path), TINY_OPTIONS, seed=0)
    ids = bench_cpu_embedding.batch_to_ids([["a", "small", "test"], ["another", "one"]])
    with common.torch.no_grad():
        ref = bench_cpu_embedding.ElmoBiLM(opt, wts, backend="reference").double().eval()
        truth = ref(ids)["activations"]
    ours, theirs = [t.float() + 2e-5 for t in truth], [t.float() - 3e-4 for t in truth]
    bench_cpu_embedding._which_side(opt, wts, ids, ours, theirs)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "fp64 reference" in ln]
    assert len(lines) == 2 and "elmo_fast" in lines[0] and "allennlp" in lines[1]
    for line, moved in zip(lines, (2e-5, 3e-4)):
        got = [float(v) for v in line.split(": ")[1].split(", ")]
        assert all(abs(g - moved) < 0.1 * moved for g in got), (line, moved)


def test_report_rows_prints_each_row_then_appends_them(bench_env, tmp_path, capsys):
    rows = [{"a": 1, "b": 2.5}, {"a": 3, "b": 4.0}]
    path = common.report_rows("t", rows, lambda r: f"row a={r['a']}", ["a", "b"], tmp_path / "t.csv")
    out = capsys.readouterr().out.splitlines()
    assert out == ["row a=1", "row a=3", f"appended to {path}"]
    assert path.read_text().splitlines()[0] == "a,b" and len(path.read_text().splitlines()) == 3


def test_appending_rows_with_new_columns_keeps_every_value_under_its_column(bench_env, tmp_path):
    import csv

    path = tmp_path / "t.csv"
    common.append_rows("t", [{"a": 1, "b": 2}], ["a", "b"], path)
    common.append_rows("t", [{"a": 3, "c": 4}], ["a", "c"], path)  # a column added since, one dropped
    common.append_rows("t", [{"a": 5, "b": 6, "c": 7}], ["a", "b", "c"], path)
    with open(path, newline="") as fh:
        got = [(r["a"], r["b"], r["c"]) for r in csv.DictReader(fh)]
    assert path.read_text().splitlines()[0] == "a,b,c"
    assert got == [("1", "2", ""), ("3", "", "4"), ("5", "6", "7")]
    # no new column (fewer, or another order): the file is appended to, its old bytes left as they are
    path.write_text('a,b,c\n1,"2",\n')
    common.append_rows("t", [{"c": 9, "a": 8}], ["c", "a"], path)
    assert path.read_text() == 'a,b,c\n1,"2",\n8,,9\n'


def test_peak_memory_off_cuda_is_nan_without_a_call():
    import math

    if common.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    calls = []
    assert math.isnan(common.peak_memory_mib(lambda: calls.append(1))) and calls == []


def test_bench_data_smoke(tmp_path, monkeypatch):
    """bench_data.py --small: every measure of both data workers, and the receiver's count; rows go to scratch."""
    import bench_data

    monkeypatch.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    rows = bench_data.run(small=True)
    steps = {r["worker"] for r in rows if r["measure"] == "step"}
    assert steps == {"none", "thread", "process"}
    assert all(r["ms"] > 0 for r in rows if "ms" in r)
    received = [r for r in rows if r["measure"] == "received"]
    assert [r["round"] for r in received] == ["asleep", "busy"] and all(r["batches"] > 0 for r in received)
    payload = {r["worker"]: r for r in rows if r["measure"] == "payload"}
    assert payload.keys() == {"tokens", "char ids"} and payload["tokens"]["bytes"] < payload["char ids"]["bytes"]
    bench_data.report(rows)
    assert (tmp_path / "data.csv").exists()


def test_with_pdl_sets_the_variable_and_keeps_the_k_loop_variant_apart(monkeypatch):
    """``common.with_pdl``: ELMO_FAST_LSTMP_PDL=1 only around each call; ``k_loop``: PDL_TUNED empty during the call
    and whole again after it, even when the call raises; a call whose variant differs from the last one's empties the
    loop-graph pool first (the graphs are keyed by the setting, not the tiles), and a repeat of it does not."""
    KL = pytest.importorskip("elmo_fast.kernels.lstmp")
    monkeypatch.delenv(KL.PDL_ENV, raising=False)
    monkeypatch.setattr(common, "_PDL_LAST", {})
    cleared = []
    monkeypatch.setattr(KL.graphs.POOL, "clear", lambda: cleared.append(1))
    full = dict(KL.PDL_TUNED)
    seen = []

    def probe(fail=False):
        seen.append((os.environ.get(KL.PDL_ENV), dict(KL.PDL_TUNED)))
        if fail:
            raise RuntimeError("boom")

    common.with_pdl(probe)()
    common.with_pdl(probe, k_loop=True)()
    common.with_pdl(probe, k_loop=True)()
    with pytest.raises(RuntimeError, match="boom"):
        common.with_pdl(probe, k_loop=True)(fail=True)
    common.with_pdl(probe)()
    assert seen == [("1", full), ("1", {}), ("1", {}), ("1", {}), ("1", full)]
    assert KL.PDL_TUNED == full and KL.PDL_ENV not in os.environ
    assert len(cleared) == 2  # into the k_loop variant, and out of it


def test_narrowing_arguments_are_checked_before_anything_runs(capsys):
    """The lease's narrowed benchmarks (gpu_check LEASE): a typo in a provider, dtype, part or batch is an error that
    names what the flag takes, before any GPU work; what is given narrows each part."""
    import bench_bilm
    import bench_lstmp
    import bench_train

    assert common.comma_list("--x", None, ("a", "b")) is None
    assert common.comma_list("--x", "b,a", ("a", "b")) == ("b", "a")
    for bad in ("", "a,c", ",", "a,a"):
        with pytest.raises(ValueError, match="--x .*expected a comma-separated list of a, b"):
            common.comma_list("--x", bad, ("a", "b"))
    for main, argv, what in (
            (bench_lstmp.parse_args, ["--providers", "triton,tritn"], "--providers 'triton,tritn': expected"),
            (bench_lstmp.parse_args, ["--batches", "384,x"], "--batches '384,x': expected"),
            (bench_lstmp.parse_args, ["--batches", "0"], "positive integers"),
            (bench_lstmp.parse_args, ["--dtypes", "fp16"], "of bf16, fp32"),
            (bench_lstmp.parse_args, ["--parts", "sweep,tile"], "--parts 'sweep,tile'"),
            (bench_bilm.main, ["--providers", "auto+grph"], "--providers 'auto+grph'"),
            (bench_bilm.main, ["--cases", "speed"], "of throughput, latency"),
            (bench_train.main, ["--providers", "elmo_fast,elmo_fst"], "--providers 'elmo_fast,elmo_fst'"),
            (bench_train.main, ["--trace", "t.json.gz"], "give --profile N too"),
            (bench_lstmp.parse_args, ["--parts", "kernels", "--providers", "triton"], "add sweep to --parts")):
        with pytest.raises(SystemExit):
            main(argv)
        assert what in capsys.readouterr().err, (argv, what)
    a = bench_lstmp.parse_args(["--parts", "sweep,kernels", "--batches", "384,1", "--dtypes", "bf16",
                                "--providers", "triton,cudnn"])
    kw = bench_lstmp._narrowed(a)
    assert kw["sweep"] == {"dtypes": (torch.bfloat16,), "providers": ("triton", "cudnn"),
                           "shapes": [(384, 20), (1, 20)]}
    assert kw["kernels"] == {"dtypes": (torch.bfloat16,), "batches": (384, 1)}
    assert bench_lstmp._narrowed(bench_lstmp.parse_args([]))["sweep"] == {}  # each part's own defaults


def test_training_step_profile_names_its_phases_and_writes_the_trace(tmp_path, capsys):
    """bench_train --profile (the lease's bench-train-lease): the step's named ranges (data, forward, backward,
    optimizer) in the printed profile with their host time, kept out of the kernel and op tables, and with --trace
    the profiled steps' gzipped Chrome trace holding those ranges."""
    import gzip
    import json

    import bench_train
    from elmo_fast.training import configs
    from elmo_fast.training.trainer import PHASE_PREFIX, PHASES

    cfg = configs.tiny()
    cfg.backend = "reference"
    trace = tmp_path / "out" / "train_trace.json.gz"
    bench_train.run(steps=1, vocab_size=200, batch=4, cfg=cfg, n_tokens=5000, warmup=1, rounds=1, device="cpu",
                    providers=("elmo_fast",), profile=2, trace=str(trace))
    out = capsys.readouterr().out
    table = [line for line in out[out.index("phases (ms"):out.index("host ops by self time")].splitlines()[1:]
             if line.strip() and "kernels in no range" not in line]
    assert [line.split()[0] for line in table] == list(PHASES)
    assert all(float(line.split()[1]) > 0 and float(line.split()[4]) == 1.0 for line in table)  # once a step
    assert PHASE_PREFIX not in out[out.index("host ops by self time"):]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {PHASE_PREFIX + p for p in PHASES} <= names


def test_device_profile_keeps_annotations_out_of_the_kernels(monkeypatch, capsys):
    """On a GPU a phase range has a CPU entry (its host time, its kernels' device time) and a GPU-side annotation of
    the same name (its device span); neither, nor any other annotation, is a kernel (a fake profile: no GPU here)."""
    from types import SimpleNamespace as E

    import torch.profiler

    from elmo_fast.training.trainer import PHASE_PREFIX as pre

    events = [E(key=pre + "forward", device_type="DeviceType.CPU", cpu_time_total=8000, device_time_total=6000,
                count=2, is_user_annotation=True),
              E(key=pre + "forward", device_type="DeviceType.CUDA", cpu_time_total=0, device_time_total=7000,
                count=2, is_user_annotation=True),
              E(key="other range", device_type="DeviceType.CUDA", self_device_time_total=9000, count=2,
                is_user_annotation=True),
              E(key="gemm_kernel", device_type="DeviceType.CUDA", self_device_time_total=10000, count=4,
                is_user_annotation=False),
              E(key="aten::mm", device_type="DeviceType.CPU", self_cpu_time_total=1000, count=4,
                is_user_annotation=False)]

    class Fake:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Fake)
    prof = common.device_profile(lambda: None, steps=2)
    assert prof["kernels"] == [("gemm_kernel", 5.0, 2.0)] and prof["kernel_ms"] == 5.0
    assert prof["host_ops"] == [("aten::mm", 0.5, 2.0)]
    assert prof["phases"] == [("forward", 4.0, 3.0, 3.5, 1.0)]
    common.print_device_profile("fake", prof)  # the kernels in no range (the backward's, on a GPU) on their own line
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "kernels in no range" in ln)
    assert float(line.split()[-1]) == 2.0


def test_train_bench_keeps_each_providers_row_as_it_is_measured(bench_env, tmp_path, monkeypatch, capsys):
    """bench_train: each provider's row is printed and appended to the CSV as soon as its block ends (a step killed
    at its cap keeps them); where common.keep_going allows it a provider that raises is kept as an error row (with
    the shape) and the next one runs; on the CPU (the smoke test) the error propagates."""
    import csv
    import functools

    import bench_train
    from elmo_fast.training import configs

    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    cfg = configs.tiny()
    results = []
    emit = functools.partial(bench_train._emit, results, 4, cfg, 200, 2, torch.device("cpu"), True)
    with emit("a"):
        results.append(dict(provider="a", ms_per_step=10.0, round_ms="10.0", compiles_timed=0, peak_mem_mib=1.0,
                            data_wait=0.0))
    rows = list(csv.DictReader(open(tmp_path / "train.csv")))
    assert [(r["provider"], float(r["tokens_per_s"])) for r in rows] == [("a", 4 * cfg.unroll_steps / 0.01)]
    with pytest.raises(RuntimeError, match="on the cpu"):
        with emit("b"):
            raise RuntimeError("on the cpu")
    monkeypatch.setattr(common, "keep_going", functools.partial(common.keep_going, force=True))  # as on a GPU
    with emit("c"):
        raise RuntimeError("boom")
    assert results[-1]["provider"] == "c" and results[-1]["error"] == "RuntimeError: boom"
    assert results[-1]["shape"] == results[0]["shape"] and "tokens_per_s" not in results[-1]
    assert "c: FAILED (RuntimeError: boom)" in capsys.readouterr().out
    assert [r["provider"] for r in csv.DictReader(open(tmp_path / "train.csv"))] == ["a", "c"]
    bench_train._report(results)  # the speedups skip the error row (no parts here: nothing printed)


def test_keep_going_stops_where_the_device_no_longer_answers(monkeypatch):
    """common.keep_going: the error text where the run may go on (CUDA answering a sync); the first error raised
    again where a sync fails (a broken context would fail every later provider) and on the CPU."""
    exc = RuntimeError("an illegal launch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert common.keep_going(exc, "cuda") == "RuntimeError: an illegal launch"

    def broken(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with pytest.raises(RuntimeError, match="an illegal launch"):
        common.keep_going(exc, "cuda")
    with pytest.raises(RuntimeError, match="an illegal launch"):
        common.keep_going(exc, "cpu")
    assert common.keep_going(exc, "cpu", force=True) == "RuntimeError: an illegal launch"


def test_bilm_bench_keeps_going_past_a_failing_provider(bench_env, tmp_path, monkeypatch):
    """bench_bilm on a GPU (keep_going): a provider that raises becomes an error row, the others are timed, and
    every row is in the CSV; without keep_going (the CPU smoke run) the error propagates."""
    import csv

    import bench_bilm
    from elmo_fast.testing import TINY_OPTIONS

    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))
    real = bench_bilm._providers

    def providers(*a, **k):
        provs = real(*a, **k)

        def broken(ids):
            raise RuntimeError("no such launch option")

        return {"elmo_fast-broken": broken, **provs}

    monkeypatch.setattr(bench_bilm, "_providers", providers)
    rows = bench_bilm.run_gpu(TINY_OPTIONS, "cpu", providers=("library",), dtypes=("fp32",), cases=("latency",),
                              keep_going=True)
    assert [(r["provider"], "error" in r) for r in rows] == [("elmo_fast-broken", True), ("library", False)]
    assert rows[0]["error"] == "RuntimeError: no such launch option" and rows[1]["ms_p50"] > 0
    assert [r["provider"] for r in csv.DictReader(open(tmp_path / "bilm.csv"))] == ["elmo_fast-broken", "library"]
    with pytest.raises(RuntimeError, match="no such launch option"):
        bench_bilm.run_gpu(TINY_OPTIONS, "cpu", providers=("library",), dtypes=("fp32",), cases=("latency",))
    # a provider asked for by name that cannot even be built here (the CUDA extension's) is an error row too
    monkeypatch.setattr(bench_bilm, "_providers", real)
    rows = bench_bilm.run_gpu(TINY_OPTIONS, "cpu", providers=("cuda", "library"), dtypes=("fp32",),
                              cases=("latency",), keep_going=True)
    assert [(r["provider"], "error" in r) for r in rows] == [("elmo_fast-cuda", True), ("library", False)]


def test_train_bench_writes_the_timed_row_before_the_profile(bench_env, tmp_path, monkeypatch):
    """The elmo_fast row is in the CSV before its profile runs: a profile that fails (or a step killed at its cap
    during the profile) keeps the timed row."""
    import csv

    import bench_train
    from elmo_fast.training import configs

    bench_env.setenv("ELMO_FAST_BENCH_DIR", str(tmp_path))

    def failing(*a, **k):
        raise RuntimeError("the profiler failed")

    monkeypatch.setattr(common, "device_profile", failing)
    cfg = configs.tiny()
    cfg.backend = "reference"
    with pytest.raises(RuntimeError, match="the profiler failed"):  # on the CPU it propagates
        bench_train.run(steps=1, vocab_size=200, batch=4, cfg=cfg, n_tokens=5000, warmup=1, rounds=1, device="cpu",
                        providers=("elmo_fast",), profile=1)
    rows = list(csv.DictReader(open(tmp_path / "train.csv")))
    assert [r["provider"] for r in rows] == ["elmo_fast"] and float(rows[0]["tokens_per_s"]) > 0
