"""Data-parallel training: 2 processes over gloo (torchrun) equal 1 process with 2 towers on the same global batch."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from elmo_fast.training.trainer import latest_checkpoint, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(tmp_path):
    rng = random.Random(3)
    words = ["the", "a", "cat", "dog", "sees", "eats", "big", "small", "fish", "bird", ".", "today", "old", "red"]
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(4):
        lines = [" ".join(rng.choices(words, k=rng.randint(2, 9))) for _ in range(80)]
        (d / f"train-{i}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(d / "train-*.txt")


def _args(save_dir, corpus, towers, extra=()):
    return ["train", "--save-dir", str(save_dir), "--config", "tiny", "--corpus", corpus, "--backend", "reference",
            "--max-steps", "6", "--log-every", "1", "--checkpoint-every", "100", "--n-negative-samples-batch", "8",
            "--towers", str(towers), "--no-progress", "--quiet", "--device", "cpu", *extra]


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _succeeded(run: subprocess.CompletedProcess) -> None:
    """Fail with the run's whole error output: an assert's message is cut in the middle by pytest, where a
    torchrun rank's exception sits (one failure under `make test` left only its first and last lines)."""
    if run.returncode != 0:
        pytest.fail(f"exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-12000:]}",
                    pytrace=False)


def _losses(save_dir):
    recs = [json.loads(x) for x in open(os.path.join(save_dir, "train_log.jsonl"), encoding="utf-8")]
    return [r["loss"] for r in recs if r["event"] == "train"]


@pytest.mark.parametrize("extra", [(), ("--no-char-inputs",)], ids=["chars", "words"])
def test_two_gloo_processes_equal_one_process_with_two_towers(tmp_path, extra):
    """Also for a word-input model, whose embedding's row gradients are gathered across processes like the
    softmax's (its own cap of rows)."""
    corpus = _corpus(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = subprocess.run([sys.executable, "-m", "elmo_fast.training.cli", *_args(one, corpus, 2, extra)], env=_env(),
                        capture_output=True, text=True, timeout=300)
    _succeeded(r1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "elmo_fast.training.cli",
           *_args(two, corpus, 1, extra)]
    r2 = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    _succeeded(r2)

    l1, l2 = _losses(one), _losses(two)
    assert len(l1) == len(l2) == 6
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-6)
    # the loss moved (so the equality is not trivial) and the weights agree
    assert l1[0] != l1[-1]
    a = load_checkpoint(latest_checkpoint(str(one)))
    b = load_checkpoint(latest_checkpoint(str(two)))
    assert a["world_size"] == 1 and b["world_size"] == 2
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    for k in ("softmax_W", "softmax_b", "acc_W", "acc_b", *(("acc_emb",) if extra else ())):
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # each tower kept its own stream state; the tower states line up one to one
    assert [t["gid"] for t in a["towers"]] == [t["gid"] for t in b["towers"]] == [0, 1]
    for ta, tb in zip(a["towers"], b["towers"]):
        torch.testing.assert_close(tb["h"], ta["h"], rtol=1e-5, atol=1e-6)
        assert ta["data"]["fwd"]["offset"] == tb["data"]["fwd"]["offset"]
