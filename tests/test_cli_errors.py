"""Every bad invocation of issue 15's table: exit code 2 (130 / 143 for signals), one line on stderr naming the
argument, no traceback, and nothing left behind (no output, no temporary file, no half-made save dir)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import types

import pytest
import torch

from elmo_fast.cli import main
from elmo_fast.testing import TINY_OPTIONS, random_arrays, write_random_model
from elmo_fast.weights import write_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Model files, a sentence file, a vocabulary, a corpus and a real training checkpoint (step 0)."""
    from elmo_fast.chars import Vocabulary
    from elmo_fast.training.configs import tiny
    from elmo_fast.training.data import build_vocab, count_tokens
    from elmo_fast.training.trainer import Trainer

    root = tmp_path_factory.mktemp("inputs")
    opts, weights = write_random_model(root / "model")
    (root / "sentences.txt").write_text("The cat sat .\nHello world\n", encoding="utf-8")
    (root / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nthe\ncat\n", encoding="utf-8")
    corpus = root / "corpus.txt"
    corpus.write_text("the cat sat on the mat .\na dog barked .\n" * 20, encoding="utf-8")
    counts, *_ = count_tokens([str(corpus)])
    cfg = tiny()
    cfg.backend, cfg.n_negative_samples_batch, cfg.n_train_tokens = "reference", 8, 100
    trainer = Trainer(cfg, Vocabulary(words=build_vocab(counts)), [str(corpus)], None, str(root / "run"))
    try:
        trainer.save_checkpoint()
    finally:
        trainer.close()
    res_opts = dict(TINY_OPTIONS, lstm=dict(TINY_OPTIONS["lstm"], use_skip_connections=False))
    (root / "plain_options.json").write_text(json.dumps(res_opts), encoding="utf-8")
    from elmo_fast.options import ElmoOptions

    write_weights(root / "residual_weights.hdf5", random_arrays(TINY_OPTIONS, 1), ElmoOptions.from_dict(TINY_OPTIONS))
    return {"opts": opts, "weights": weights, "sent": str(root / "sentences.txt"), "vocab": str(root / "vocab.txt"),
            "corpus": str(corpus), "run": str(root / "run"), "plain_opts": str(root / "plain_options.json"),
            "res_weights": str(root / "residual_weights.hdf5")}


def _embed(w, out, *extra):
    return ["embed", "--options", w["opts"], "--weights", w["weights"], "--input", w["sent"], "--output", out,
            "--quiet", *extra]


def _tokens(w, out, *extra):
    return ["dump-token-embeddings", "--vocab", w["vocab"], "--options", w["opts"], "--weights", w["weights"],
            "--output", out, "--quiet", *extra]


def _train(w, save_dir, *extra):
    return ["train", "--save-dir", save_dir, "--config", "tiny", "--corpus", w["corpus"], "--max-steps", "1",
            "--backend", "reference", "--n-negative-samples-batch", "8", "--no-progress", "--quiet", *extra]


def _bad_checkpoint(tmp, content: bytes | None):
    d = tmp / "bad_run" / "checkpoints"
    d.mkdir(parents=True)
    if content is None:
        torch.save({"weights": torch.zeros(3)}, d / "ckpt-000000001.pt")
    else:
        (d / "ckpt-000000001.pt").write_bytes(content)
    (tmp / "bad_run" / "run.json").write_text('{"corpus": "x", "heldout": null}')
    return str(tmp / "bad_run")


def _truncated(w, tmp):
    data = open(os.path.join(w["run"], "checkpoints", "ckpt-000000000.pt"), "rb").read()
    return _bad_checkpoint(tmp, data[: len(data) // 2])


# (name, argv builder (work, tmp) -> argv, expected exit code, a fragment of the one-line message)
CASES = [
    ("embed output is a directory", lambda w, t: _embed(w, t), 2, "--output"),
    ("embed output folder missing", lambda w, t: _embed(w, t / "nodir" / "o.hdf5"), 2, "does not exist"),
    ("dump-weights outfile is a directory",
     lambda w, t: ["dump-weights", "--save-dir", w["run"], "--outfile", str(t)], 2, "--outfile"),
    ("dump-weights options folder missing",
     lambda w, t: ["dump-weights", "--save-dir", w["run"], "--outfile", str(t / "w.hdf5"), "--options-file",
                   str(t / "nodir" / "options.json")], 2, "--options-file"),
    ("dump-token-embeddings output is a directory", lambda w, t: _tokens(w, t), 2, "--output"),
    ("dump-token-embeddings output folder missing", lambda w, t: _tokens(w, t / "nodir" / "o.hdf5"), 2,
     "does not exist"),
    ("train save dir is a file", lambda w, t: _train(w, w["sent"]), 2, "--save-dir"),
    ("dump-weights truncated checkpoint",
     lambda w, t: ["dump-weights", "--save-dir", _truncated(w, t), "--outfile", str(t / "w.hdf5")], 2,
     "cannot be read"),
    ("dump-weights foreign checkpoint",
     lambda w, t: ["dump-weights", "--save-dir", _bad_checkpoint(t, None), "--outfile", str(t / "w.hdf5")], 2,
     "not a checkpoint written by"),
    ("resume from a truncated checkpoint", lambda w, t: _train(w, _truncated(w, t), "--resume"), 2,
     "cannot be read"),
    ("resume from a text file", lambda w, t: _train(w, _bad_checkpoint(t, b"not a checkpoint\n"), "--resume"), 2,
     "cannot be read"),
    ("embed --device gpu", lambda w, t: _embed(w, t / "o.hdf5", "--device", "gpu"), 2, "--device 'gpu'"),
    ("train --device gpu", lambda w, t: _train(w, t / "run", "--device", "gpu"), 2, "'gpu' is not a device"),
    ("train --backend bogus", lambda w, t: _train(w, t / "run", "--backend", "bogus"), 2, "--backend"),
    ("embed --backend triton on the CPU", lambda w, t: _embed(w, t / "o.hdf5", "--device", "cpu", "--backend",
                                                              "triton"), 2, "--backend reference"),
    ("train --backend triton on the CPU", lambda w, t: _train(w, t / "run", "--device", "cpu", "--backend", "triton"),
     2, "--backend reference"),
    ("train --device cuda without a GPU", lambda w, t: _train(w, t / "run", "--device", "cuda"), 2, "cuda"),
    ("embed --device cuda without a GPU", lambda w, t: _embed(w, t / "o.hdf5", "--device", "cuda"), 2, "no CUDA"),
    ("train malformed JSON config", lambda w, t: _write_config(t, "{not json") + [], 2, "not valid JSON"),
    ("train JSON list config", lambda w, t: _write_config(t, "[1, 2]"), 2, "expected an object"),
    ("train config value of the wrong type", lambda w, t: _write_config(t, '{"dropout": "high"}'), 2, "'dropout'"),
    ("dump-token-embeddings --batch-size 0", lambda w, t: _tokens(w, t / "o.hdf5", "--batch-size", "0"), 2,
     "--batch-size"),
    ("dump-token-embeddings --batch-size -1", lambda w, t: _tokens(w, t / "o.hdf5", "--batch-size", "-1"), 2,
     "--batch-size"),
    ("embed --use-sentence-keys with the sentence '.'",
     lambda w, t: _embed(w, t / "o.hdf5", "--use-sentence-keys") if _sentences(w, t, ".\n") else None, 2,
     "cannot name an hdf5 dataset"),
    ("embed --use-sentence-keys with a '/' in a sentence",
     lambda w, t: _embed(w, t / "o.hdf5", "--use-sentence-keys") if _sentences(w, t, "a / b\n") else None, 2,
     "cannot name an hdf5 dataset"),
    ("residual weights with non-residual options",
     lambda w, t: _embed(dict(w, opts=w["plain_opts"], weights=w["res_weights"]), t / "o.hdf5"), 2,
     "residual connections"),
    ("embed missing weights", lambda w, t: _embed(dict(w, weights=str(t / "none.hdf5")), t / "o.hdf5"), 2,
     "--weights"),
    ("dump-token-embeddings vocabulary is a directory", lambda w, t: _tokens(dict(w, vocab=str(t)), t / "o.hdf5"), 2,
     "--vocab"),
]


def _write_config(tmp, text):
    cfg = tmp.parent / f"config-{abs(hash(text))}.json"
    cfg.write_text(text)
    return ["train", "--save-dir", str(tmp / "run"), "--config", str(cfg), "--corpus", str(cfg)]


def _sentences(w, tmp, text):
    path = tmp.parent / f"sentences-{abs(hash(text))}.txt"
    path.write_text(text)
    w["sent"] = str(path)
    return True


def _snapshot(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root)
                  for f in files + [x + "/" for x in dirs])


@pytest.mark.parametrize("name, argv, code, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_invocation(work, tmp_path, capsys, monkeypatch, name, argv, code, fragment):
    if ("cuda" in name or "triton" in name) and torch.cuda.is_available():
        pytest.skip("the case needs a machine without a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [str(a) for a in argv(dict(work), out_dir)]
    before = _snapshot(tmp_path)
    work_before = _snapshot(work["run"])
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]
    assert _snapshot(tmp_path) == before  # no output, no temporary file, no save dir
    assert _snapshot(work["run"]) == work_before


def test_dump_weights_writes_both_files_or_neither(work, tmp_path, monkeypatch, capsys):
    out = tmp_path / "w.hdf5"
    opt = tmp_path / "options.json"

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", fail)  # the options file fails after the weights were written
    assert main(["dump-weights", "--save-dir", work["run"], "--outfile", str(out), "--options-file", str(opt)]) == 2
    assert "No space left" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert main(["dump-weights", "--save-dir", work["run"], "--outfile", str(out), "--options-file", str(opt)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["options.json", "w.hdf5"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed exception, reported
def test_a_signal_swallowed_by_a_finalizer_still_stops_embed(work, tmp_path, monkeypatch, capsys):
    """Python swallows an exception raised inside a finalizer ("Exception ignored in ..."): a SIGINT whose handler
    runs there is recorded, and the embed loop raises it again before its next batch (elmo_fast._signals)."""
    from elmo_fast.models import elmo as elmo_mod

    inp = tmp_path / "many.txt"
    inp.write_text("the cat sat .\n" * 50)
    out = tmp_path / "out.hdf5"

    class SignalInFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode: still in here
            for _ in range(1000):
                pass

    calls = []
    real = elmo_mod.ElmoBiLM.forward

    def forward(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            SignalInFinalizer()  # made and collected at once: its finalizer swallows the handler's exception
        return real(self, *a, **k)

    monkeypatch.setattr(elmo_mod.ElmoBiLM, "forward", forward)
    argv = ["embed", "--options", work["opts"], "--weights", work["weights"], "--input", str(inp), "--output",
            str(out), "--batch-size", "1", "--backend", "reference", "--quiet"]
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN under nohup / a background job
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's printer, not pytest's collector
    hook = sys.unraisablehook
    assert main(argv) == 130
    assert len(calls) == 3  # stopped before the 4th batch, not after the 50th
    # the one-line message only: no "Exception ignored in ..." traceback of the swallowed signal before it
    assert capsys.readouterr().err.strip().splitlines() == ["elmo-fast embed: interrupted by SIGINT; temporary "
                                                            "files removed"]
    assert os.listdir(tmp_path) == ["many.txt"]
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before the call is back
    assert sys.unraisablehook is hook


def test_the_unraisable_hook_passes_on_everything_but_a_signal():
    from elmo_fast import _signals

    seen = []
    hook = _signals.quiet_unraisable(seen.append)
    for exc in (_signals.Signalled(signal.SIGTERM), ValueError("x")):
        hook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None, err_msg=None, object=None))
    assert [type(u.exc_value) for u in seen] == [ValueError]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_embed_cleans_up(work, tmp_path, sig, code):
    inp = tmp_path / "many.txt"
    inp.write_text("the cat sat on the mat .\n" * 20000)
    out = tmp_path / "out.hdf5"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-m", "elmo_fast.cli", "embed", "--options", work["opts"], "--weights",
                          work["weights"], "--input", str(inp), "--output", str(out), "--batch-size", "1",
                          "--device", "cpu", "--backend", "reference", "--quiet"], env=env,
                         stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not any(f.startswith("out.hdf5.tmp-") for f in os.listdir(tmp_path)) and time.time() - t0 < 120:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert err.strip().splitlines() == [f"elmo-fast embed: interrupted by {signal.Signals(sig).name}; "
                                        "temporary files removed"]
    assert sorted(os.listdir(tmp_path)) == ["many.txt"]


def test_a_swallowed_signal_stops_training_at_the_next_step(work, tmp_path, monkeypatch, capsys):
    """The training loop raises a recorded SIGTERM again before its next step (elmo_fast._signals), as embed does:
    here the signal's exception is taken to have been swallowed during step 2."""
    from elmo_fast import _signals
    from elmo_fast.training.trainer import Trainer

    steps = []
    real = Trainer.train_step

    def step(self):
        steps.append(1)
        if len(steps) == 2:
            _signals.PENDING.append(signal.SIGTERM)  # what the handler records before its exception is lost
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    argv = _train(work, str(tmp_path / "run"))
    argv[argv.index("--max-steps") + 1] = "50"
    assert main(argv) == 143
    assert len(steps) == 2
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    assert _signals.PENDING == []  # cleared when the command returns


# ------------------------------------------------------------------------------------------------- lost work
def _contents(root):
    """Every path under ``root`` with its kind, and the bytes of the regular files (a fifo is not opened)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for f in files + dirs:
            p = os.path.join(d, f)
            st = os.lstat(p)
            data = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), os.readlink(p) if os.path.islink(p) else data)
    return out


def _refused(capsys, argv, root, fragment):
    """``argv`` exits with 2 and one line holding ``fragment``, and every file under ``root`` is as it was."""
    before = _contents(root)
    rc = main([str(a) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and fragment in lines[0], (rc, lines)
    assert _contents(root) == before


@pytest.fixture
def inputs(tmp_path):
    """Input files of embed and dump-token-embeddings of this test alone (a broken check would destroy them)."""
    opts, weights = write_random_model(tmp_path / "model")
    (tmp_path / "sentences.txt").write_text("The cat sat .\nHello world\n", encoding="utf-8")
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nthe\ncat\n", encoding="utf-8")
    return {"opts": opts, "weights": weights, "sent": str(tmp_path / "sentences.txt"),
            "vocab": str(tmp_path / "vocab.txt")}


OUTPUT_IS_INPUT = [("embed", "sent", "--input"), ("embed", "opts", "--options"), ("embed", "weights", "--weights"),
                   ("dump-token-embeddings", "vocab", "--vocab"), ("dump-token-embeddings", "opts", "--options"),
                   ("dump-token-embeddings", "weights", "--weights")]


@pytest.mark.parametrize("command, key, flag", OUTPUT_IS_INPUT, ids=[f"{c} {f}" for c, _, f in OUTPUT_IS_INPUT])
def test_output_is_never_an_input(inputs, tmp_path, capsys, command, key, flag):
    build = _embed if command == "embed" else _tokens
    _refused(capsys, build(inputs, inputs[key]), tmp_path, f"--output {inputs[key]} is the {flag} file")


@pytest.mark.parametrize("spelling", ["symlink", "hard link", "dotted path"])
def test_output_is_never_an_input_by_another_name(inputs, tmp_path, capsys, spelling):
    out = tmp_path / "out.hdf5"
    if spelling == "symlink":
        out.symlink_to(inputs["sent"])
    elif spelling == "hard link":
        os.link(inputs["sent"], out)
    else:
        out = tmp_path / "model" / ".." / "sentences.txt"
    _refused(capsys, _embed(inputs, out), tmp_path, "is the --input file")


RUN_FILES = ["vocab.txt", "run.json", "config.json", "options.json", "train_log.jsonl"]


@pytest.fixture
def run_copy(work, tmp_path):
    """A copy of the work run (checkpoint step 0) holding every file a run keeps; (save dir, checkpoint)."""
    run = tmp_path / "run"
    shutil.copytree(work["run"], run)
    for name in RUN_FILES + ["corpus/train-1.txt"]:
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(f"the run's {name}\n", encoding="utf-8")
    return str(run), os.path.join(run, "checkpoints", "ckpt-000000000.pt")


def _dump(run, outfile, options_file=None, *extra):
    return ["dump-weights", "--save-dir", run, "--outfile", outfile,
            *(["--options-file", options_file] if options_file else []), *extra]


def _dump_to(run, tmp, flag, target, *extra):
    """dump-weights writing ``flag`` (--outfile or --options-file) to ``target``, the other file into ``tmp``."""
    if flag == "--outfile":
        return _dump(run, target, tmp / "o.json", *extra)
    return _dump(run, tmp / "w.hdf5", target, *extra)


@pytest.mark.parametrize("flag", ["--outfile", "--options-file"])
def test_dump_weights_never_writes_over_the_checkpoint(run_copy, tmp_path, capsys, flag):
    run, ck = run_copy
    _refused(capsys, _dump_to(run, tmp_path, flag, ck), tmp_path, f"{flag} {ck} is the checkpoint being dumped")
    (tmp_path / "link.pt").symlink_to(ck)
    _refused(capsys, _dump_to(run, tmp_path, flag, tmp_path / "link.pt"), tmp_path, "is the checkpoint being dumped")
    shutil.copy(ck, tmp_path / "ck.pt")  # a --checkpoint outside any run
    _refused(capsys, _dump_to(run, tmp_path, flag, tmp_path / "ck.pt", "--checkpoint", tmp_path / "ck.pt"), tmp_path,
             "is the checkpoint being dumped")


@pytest.mark.parametrize("name", RUN_FILES + ["checkpoints/w.hdf5", "corpus/train-1.txt"])
@pytest.mark.parametrize("flag", ["--outfile", "--options-file"])
def test_dump_weights_never_writes_over_a_file_of_the_run(run_copy, tmp_path, capsys, flag, name):
    run, _ = run_copy
    target = os.path.join(run, name)
    fragment = "inside the training run's folder" if "/" in name else f"is the training run's file {target}"
    _refused(capsys, _dump_to(run, tmp_path, flag, target), tmp_path, fragment)


def test_dump_weights_outfile_in_the_save_dir_needs_an_options_file_elsewhere(run_copy, tmp_path, capsys):
    run, _ = run_copy
    out = os.path.join(run, "w.hdf5")
    _refused(capsys, _dump(run, out), tmp_path, "pass --options-file elsewhere or put --outfile outside the save dir")
    before = _contents(run)
    assert main(_dump(run, out, str(tmp_path / "o.json"))) == 0  # what the message suggests works
    assert json.load(open(tmp_path / "o.json"))["char_cnn"]["n_characters"] == 262
    assert _contents(run) == {**before, "w.hdf5": _contents(run)["w.hdf5"]}


def test_an_output_is_never_a_device_or_a_fifo(tmp_path):
    from elmo_fast.util import check_output_file

    with pytest.raises(ValueError, match="--output /dev/null: is a device, not a regular file"):
        check_output_file(os.devnull, "--output")  # only checked here: a command would replace /dev/null (as root)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="is a fifo"):
        check_output_file(tmp_path / "fifo", "--output")


@pytest.mark.parametrize("command", ["embed", "dump-token-embeddings", "dump-weights --outfile",
                                     "dump-weights --options-file"])
def test_a_fifo_output_is_refused(inputs, run_copy, tmp_path, capsys, command):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if command.startswith("dump-weights"):
        argv = _dump_to(run_copy[0], tmp_path, command.split()[1], fifo)
    else:
        argv = (_embed if command == "embed" else _tokens)(inputs, fifo)
    _refused(capsys, argv, tmp_path, f"{fifo}: is a fifo (named pipe), not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
