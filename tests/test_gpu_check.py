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
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(out),
                           "--budget", "1500"], capture_output=True, text=True, timeout=1800)
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
