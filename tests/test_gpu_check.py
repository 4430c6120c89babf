"""bench/gpu_check.py: the smoke mode (every step on the CPU from a fresh clone of HEAD, the package not
installed beforehand) passes, and the step runner keeps a killed step from taking the others with it."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_smoke_runs_every_step_from_a_fresh_clone(tmp_path):
    import subprocess

    out = tmp_path / "out"
    every = [s.name for s in gpu_check.STEPS]  # the lease's narrowed steps too, which a plain run leaves out
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(out),
                           "--budget", "1500", *every], capture_output=True, text=True, timeout=1800)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + (out / "log.txt").read_text()[-4000:]
    for step in gpu_check.STEPS:
        assert f"{step.name:20s} ok" in summary, summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench_rows.jsonl", "log.txt", "summary.txt"]  # the device machine returns at most 8
    rows = [json.loads(line) for line in (out / "bench_rows.jsonl").read_text().splitlines()]
    assert {r["bench"] for r in rows} >= {"launches", "bilm"}
    log = (out / "log.txt").read_text()
    assert "/clone/elmo_fast/__init__.py" in log  # the installed clone, not this working tree


def test_a_killed_step_loses_only_itself(tmp_path):
    out = gpu_check.Output(tmp_path)
    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    status, secs = gpu_check.run_step([slow], None, tmp_path, 1.5, out.log)
    assert status == "TIMEOUT" and secs < 20
    status, _ = gpu_check.run_step([[sys.executable, "-c", "print('next step')"]], None, tmp_path, 30, out.log)
    assert status == "ok"
    status, _ = gpu_check.run_step([[sys.executable, "-c", "raise SystemExit(3)"]], None, tmp_path, 30, out.log)
    assert status == "FAILED rc=3"
    log = (tmp_path / "log.txt").read_text()
    assert "started" in log and "killed after" in log and "next step" in log


def test_unknown_step_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["no-such-step"])
    assert "unknown step(s) ['no-such-step']" in capsys.readouterr().err


def test_step_caps(tmp_path, capsys):
    assert gpu_check.parse_step("bench-lstmp") == ("bench-lstmp", None)
    assert gpu_check.parse_step("bench-lstmp:90") == ("bench-lstmp", 90.0)
    for bad in ("bench-lstmp:", "bench-lstmp:soon", "bench-lstmp:-5"):
        with pytest.raises(SystemExit):
            gpu_check.main([bad, "--out", str(tmp_path)])
        assert "expected NAME:SECONDS" in capsys.readouterr().err
    # a cap below 60 s still starts the step, and the step is killed at the cap, not at its own limit
    gpu_check.STEPS += (gpu_check.Step("sleepy", 600, "test", (), ((sys.executable, "-c", "import time; "
                                                                    "time.sleep(30)"),), ()),)
    gpu_check.BY_NAME["sleepy"] = gpu_check.STEPS[-1]
    try:
        rc = gpu_check.main(["sleepy:2", "--smoke", "--no-install", "--out", str(tmp_path / "o")])
    finally:
        gpu_check.STEPS = gpu_check.STEPS[:-1]
        del gpu_check.BY_NAME["sleepy"]
    summary = (tmp_path / "o" / "summary.txt").read_text()
    assert rc == 1 and "sleepy               TIMEOUT" in summary, summary


def test_the_lease_plan_fits_the_device_budget():
    """Each call's capped steps fit its budget with the runner's margin (so every step starts with its whole cap),
    each call fits one command, and the calls with the machine's start, the transfers and the idle gap between them
    fit a session's device time."""
    lease = gpu_check.LEASE
    must = [call for call in lease if not call.optional]
    assert lease[: len(must)] == tuple(must)  # the optional calls come last
    total = gpu_check.START_SECONDS + (len(must) - 1) * gpu_check.GAP_SECONDS
    for call in lease:
        caps = [gpu_check.parse_step(s) for s in call.steps]
        assert all(cap is not None and cap <= gpu_check.BY_NAME[name].timeout for name, cap in caps), call.steps
        assert sum(cap + gpu_check.STEP_MARGIN for _, cap in caps) <= call.budget - gpu_check.CALL_SLACK, call
        assert call.budget + gpu_check.TRANSFER_SECONDS <= gpu_check.COMMAND_SECONDS
        total += 0 if call.optional else call.budget + gpu_check.TRANSFER_SECONDS
    assert total <= gpu_check.DEVICE_SECONDS, total
    names = [gpu_check.parse_step(s)[0] for call in lease for s in call.steps]
    repeated = {n for n in names if names.count(n) > 1}
    assert repeated <= {"install", "env"}, repeated  # a step measured once a lease
    assert "install" in names[: names.index("selfcheck")]
    # the lease's narrowed benchmarks run in the lease only: a plain gpu-check runs the full ones
    assert {n for n in names if gpu_check.BY_NAME[n].lease} == {s.name for s in gpu_check.STEPS if s.lease}


def test_a_lease_call_runs_its_steps_in_its_order_under_its_budget(tmp_path, monkeypatch):
    quick = (sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('ran')", "{out}/ran.txt")
    fake = tuple(gpu_check.Step(n, 600, "test", (), (quick,), ()) for n in ("alpha", "mid", "zeta"))
    monkeypatch.setattr(gpu_check, "STEPS", gpu_check.STEPS + fake)
    monkeypatch.setattr(gpu_check, "BY_NAME", {**gpu_check.BY_NAME, **{s.name: s for s in fake}})
    monkeypatch.setattr(gpu_check, "LEASE", (gpu_check.Call(40, ("zeta:10", "alpha:10", "mid:10"), "test"),))
    rc = gpu_check.main(["--lease", "1", "--smoke", "--no-install", "--out", str(tmp_path / "o")])
    summary = (tmp_path / "o" / "summary.txt").read_text()
    assert rc == 0, summary
    assert "gpu_check --smoke zeta alpha mid  (budget 40 s" in summary  # the plan's order, not STEPS'
    assert [line.split()[0] for line in summary.splitlines()[1:]] == ["zeta", "alpha", "mid"]
    assert (tmp_path / "o" / "ran.txt").read_text() == "ran" * 3  # "{out}" in a command is the output folder
    # an explicit --budget wins, and a step without room for its cap and the margin is not started
    rc = gpu_check.main(["--lease", "1", "--smoke", "--no-install", "--budget", "14", "--out", str(tmp_path / "p")])
    summary = (tmp_path / "p" / "summary.txt").read_text()
    assert rc == 0 and "(budget 14 s" in summary and summary.count("NOT STARTED") == 3, summary


def test_lease_takes_no_steps_beside_it(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--lease", "1", "selfcheck"])
    assert "name no steps beside it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--lease", str(len(gpu_check.LEASE) + 1)])
    assert "invalid choice" in capsys.readouterr().err


def test_test_gpu_runs_the_decisive_checks_first():
    """The test-gpu step's ELMO_FAST_TESTS_FIRST puts the opt-ins' checks first in collection (so first to the
    xdist workers); every named file holds gpu tests; the rest keep their order."""
    import importlib.util
    import subprocess

    # tests/conftest.py by its path: a session that collects bench/ too has another module named conftest
    spec = importlib.util.spec_from_file_location("tests_conftest_ordering", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    tests_first = conftest.tests_first

    first = gpu_check.STEP_ENV["test-gpu"]["ELMO_FAST_TESTS_FIRST"]
    env = dict(__import__("os").environ, ELMO_FAST_TESTS_FIRST=first)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", "-m",
                           "gpu and not cuda_ext", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    files = [i.split("::")[0].split("/")[-1] for i in ids]
    words = first.split(",")
    assert set(words) <= set(files)
    assert files[: sum(f in words for f in files)] == sorted((f for f in files if f in words), key=words.index)

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item(n) for n in ("a.py::x", "b.py::y", "c.py::z", "a.py::w")]
    assert [i.nodeid for i in tests_first(items, "c.py,a.py")] == ["c.py::z", "a.py::x", "a.py::w", "b.py::y"]
    assert tests_first(items, "") == items


def test_test_steps_write_each_failure_as_it_comes(tmp_path):
    """The test steps' ELMO_FAST_FAILURE_LOG ("{out}" is $OUT): tests/conftest.py appends each failure's node id,
    phase and message (a long one cut to its start and end) to it, once under pytest-xdist (the controller)."""
    import os
    import subprocess

    for name in ("test-triton", "test-gpu", "test-cuda-ext"):
        assert gpu_check.STEP_ENV[name]["ELMO_FAST_FAILURE_LOG"] == "{out}/failures.txt"
    ours = str(ROOT / "tests" / "conftest.py")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('elmo_tests_conftest', {ours!r})\n"
        "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
        "pytest_configure, pytest_runtest_logreport = m.pytest_configure, m.pytest_runtest_logreport\n")
    (tmp_path / "test_x.py").write_text("def test_ok():\n    pass\n\n\ndef test_long():\n"
                                        "    assert 'a' * 20000 == 'b', 'START' + 'x' * 20000 + 'END'\n")
    log = tmp_path / "failures.txt"
    env = dict(os.environ, ELMO_FAST_FAILURE_LOG=str(log))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "test_x.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = log.read_text()
    assert text.count("==== ") == 1 and "==== test_x.py::test_long (call)" in text and "test_ok" not in text
    assert "START" in text and "END" in text and "characters ...]" in text and len(text) < 10_000
