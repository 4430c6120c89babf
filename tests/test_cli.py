"""`elmo-fast embed` and `dump-token-embeddings` end to end, in the original dump formats."""
import argparse
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import elmo_fast
from elmo_fast.cli import main


def _run(*args):
    return main([str(a) for a in args])


def test_embed_all_top_average(tiny_model, tmp_path):
    o, w = tiny_model
    inp = tmp_path / "s.txt"
    sents = [["The", "cat", "sat", "."], ["Hello", "world"], ["naïve", "café"]]
    inp.write_text("\n".join(" ".join(s) for s in sents) + "\n", encoding="utf-8")
    out = tmp_path / "all.hdf5"
    assert _run("embed", "--options", o, "--weights", w, "--input", inp, "--output", out, "--batch-size", 2,
                "--quiet") == 0
    bilm = elmo_fast.ElmoBiLM(o, w)
    expected = []
    for start in (0, 2):  # same batches, same order: the stateful model gives the same numbers
        res = bilm(elmo_fast.batch_to_ids(sents[start:start + 2]))
        for k in range(len(sents[start:start + 2])):
            n = len(sents[start + k])
            expected.append(torch.stack([a[k, 1:n + 1] for a in res["activations"]]).numpy())
    with h5py.File(out) as fh:
        assert sorted(fh.keys()) == ["0", "1", "2", "sentence_to_index"]
        for i in range(3):
            assert fh[str(i)].shape == (3, len(sents[i]), 32) and fh[str(i)].dtype == np.float32
            np.testing.assert_allclose(fh[str(i)][...], expected[i], atol=1e-6)
        mapping = json.loads(fh["sentence_to_index"][0])
        assert mapping == {"The cat sat .": "0", "Hello world": "1", "naïve café": "2"}
    for mode, fn in (("top", lambda a: a[-1]), ("average", lambda a: a.mean(0))):
        out2 = tmp_path / f"{mode}.hdf5"
        assert _run("embed", "--options", o, "--weights", w, "--input", inp, "--output", out2, "--batch-size", 2,
                    "--layers", mode, "--quiet") == 0
        with h5py.File(out2) as fh:
            for i in range(3):
                np.testing.assert_allclose(fh[str(i)][...], fn(expected[i]), atol=1e-6)


def test_embed_sentence_keys(tiny_model, tmp_path):
    o, w = tiny_model
    inp = tmp_path / "s.txt"
    inp.write_text("a b\nc\n")
    out = tmp_path / "k.hdf5"
    assert _run("embed", "--options", o, "--weights", w, "--input", inp, "--output", out, "--use-sentence-keys",
                "--quiet") == 0
    with h5py.File(out) as fh:
        assert sorted(fh.keys()) == ["a b", "c"]
    inp.write_text("a b\na b\n")
    assert _run("embed", "--options", o, "--weights", w, "--input", inp, "--output", out, "--use-sentence-keys",
                "--quiet") == 2


@pytest.mark.parametrize("content, msg", [
    (b"a b\n\nc\n", "line 2 is empty"),
    (b"", "empty"),
    (b"ok\n\xff\xfe bad\n", "line 2 is not valid UTF-8"),
])
def test_embed_bad_input(tiny_model, tmp_path, capsys, content, msg):
    o, w = tiny_model
    inp = tmp_path / "s.txt"
    inp.write_bytes(content)
    out = tmp_path / "o.hdf5"
    assert _run("embed", "--options", o, "--weights", w, "--input", inp, "--output", out) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_embed_unreadable_input(tiny_model, tmp_path, capsys):
    o, w = tiny_model
    assert _run("embed", "--options", o, "--weights", w, "--input", tmp_path / "missing.txt", "--output",
                tmp_path / "o.hdf5") == 2
    assert "--input" in capsys.readouterr().err


def test_dump_token_embeddings(tiny_model, tmp_path):
    o, w = tiny_model
    vocab = tmp_path / "vocab.txt"
    words = ["<S>", "</S>", "<UNK>", "the", "cat", "x" * 70]
    vocab.write_text("\n".join(words) + "\n")
    out = tmp_path / "tok.hdf5"
    assert _run("dump-token-embeddings", "--vocab", vocab, "--options", o, "--weights", w, "--output", out,
                "--quiet") == 0
    bilm = elmo_fast.BiLM.from_files(o, w)
    with h5py.File(out) as fh:
        emb = fh["embedding"][...]
    assert emb.shape == (6, 16)
    ids = elmo_fast.Batcher().batch_sentences([["the", "cat"]])
    tok = bilm(ids)["token_embedding"][0].detach().numpy()
    np.testing.assert_allclose(emb[0], tok[0], atol=1e-6)  # <S> equals the boundary embedding
    np.testing.assert_allclose(emb[3:5], tok[1:3], atol=1e-6)
    np.testing.assert_allclose(emb[1], tok[3], atol=1e-6)


def test_dump_token_embeddings_keeps_blank_vocab_lines(tiny_model, tmp_path):
    """bilm-tf keeps a blank vocabulary line as the word "": 3 lines give 3 rows, later rows do not shift."""
    o, w = tiny_model
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("the\n\ncat\n")
    out = tmp_path / "tok.hdf5"
    assert _run("dump-token-embeddings", "--vocab", vocab, "--options", o, "--weights", w, "--output", out,
                "--quiet") == 0
    enc = elmo_fast.BiLM.from_files(o, w).token_encoder
    with h5py.File(out) as fh:
        emb = fh["embedding"][...]
    ids = torch.tensor([elmo_fast.word_to_char_ids(t) for t in ("the", "", "cat")])
    np.testing.assert_allclose(emb, enc(ids).detach().numpy(), atol=1e-6)


def test_help_has_a_default_for_every_flag():
    from elmo_fast.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"embed", "dump-token-embeddings", "train", "dump-weights", "evaluate"}
    n = 0
    for name, sp in sub.choices.items():
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            n += 1
            assert action.help and ("default" in action.help or "required" in action.help), (name, action.dest)
    assert n > 60  # the 43 configuration fields of `train` among them


def test_version():
    res = subprocess.run([sys.executable, "-m", "elmo_fast.cli", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith(f"elmo-fast {elmo_fast.__version__}")


def test_console_script_help():
    res = subprocess.run([sys.executable, "-m", "elmo_fast.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "embed" in res.stdout and "dump-token-embeddings" in res.stdout
