"""Input validation of the training configuration (``TrainConfig.validate``) and of the batch packers' sizes.

Every value here used to pass: NaN slips through ``<= 0`` checks (a NaN learning rate or clip trains NaNs and saves
NaN checkpoints), a negative global-norm clip scales the gradients by a negative factor, an infinite initial
accumulator freezes the weights, ``max_steps`` -1 or ``time_budget`` -5 run 0 steps and save, ``eval_max_batches`` 0
skips the evaluation, ``num_threads`` -3 is a raw RuntimeError, and a negative ``cell_clip`` or ``n_highway`` was
refused only after the run's files were written. bilm-tf's ``iter_batches(0, n)`` in test mode yielded empty
batches forever. All on CPU."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

from elmo_fast import BidirectionalLMDataset, LMDataset
from elmo_fast.chars import Vocabulary
from elmo_fast.training import data as D
from elmo_fast.training.cli import main as cli_main
from elmo_fast.training.configs import PRESETS, ConfigError, TrainConfig, tiny

NAN, INF = float("nan"), float("inf")


def _refused(cfg: TrainConfig, name: str, value) -> None:
    with pytest.raises(ConfigError, match=rf"\b{name}\b.*got {re.escape(repr(value))}"):
        dataclasses.replace(cfg, **{name: value}).validate()


# field -> (values that validate, values refused with a ConfigError naming the field and the value)
BOUNDS = {
    "learning_rate": ([1e-6, 0.2, 5], [NAN, INF, -INF, 0.0, -0.1, "0.2"]),
    "initial_accumulator_value": ([0.1, 1.0, 3], [INF, NAN, 0.0, -1.0]),
    "all_clip_norm_val": ([1e-3, 10.0, 1e6], [NAN, INF, 0.0, -1.0]),
    "cell_clip": ([None, 0.0, 3, 50.0], [NAN, INF, -1.0]),
    "proj_clip": ([None, 0.0, 3, 50.0], [NAN, INF, -0.5]),
    "dropout": ([0.0, 0.5], [NAN, 1.0, "0.1", None]),
    "max_steps": ([None, 1, 10**9], [-1, 0, 1.5]),
    "time_budget": ([None, 0.5, 3600], [-5.0, 0.0, NAN, INF]),
    "eval_max_batches": ([None, 1, 30], [0, -2]),
    "eval_every": ([None, 0, 7], [-5]),  # 0 is read as null by the training loop (only at the end)
    "num_threads": ([None, 0, 1, 4], [-3, -1]),  # 0: torch's default, as null (the CLI sets threads only if truthy)
    "n_highway": ([0, 1, 3], [-1]),
    "sleep_per_step": ([0.0, 0.25], [-1.0, NAN, INF]),
    "n_train_tokens": ([None, 1, 10**10], [-1]),
    "vocab_min_count": ([1, 5], [0, -1]),
    "vocab_max_size": ([None, 3, 1000], [2, 0, -1]),
    "vocab_check_lines": ([1, 10], [0, -10]),
    "seed": ([0, -1, 2**63, 2**64 - 1], [2**64, -(2**63) - 1, 1.5]),
    "filters": ([[[1, 4]], [[1, 4], [3, 8]]], [[[2, "a"]], [[1.5, 4]], [[True, 4]], [[1, 4], [2]]]),
    "bf16": ([True, False], ["no", 1]),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_each_field_refuses_what_cannot_train_and_keeps_what_can(name):
    good, bad = BOUNDS[name]
    cfg = tiny()
    for value in good:
        dataclasses.replace(cfg, **{name: value}).validate()
    for value in bad:
        _refused(cfg, name, value)


def test_n_train_tokens_0_needs_max_steps():
    """0 tokens cannot count the steps (the training loop reads it as unknown): refused up front unless the steps
    are given."""
    cfg = tiny()
    with pytest.raises(ConfigError, match=r"n_train_tokens is 0.*--max-steps"):
        dataclasses.replace(cfg, n_train_tokens=0).validate()
    dataclasses.replace(cfg, n_train_tokens=0, max_steps=3).validate()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_validates_and_refuses_a_nan_learning_rate(preset):
    cfg = PRESETS[preset]()
    assert cfg.validate() is cfg
    for name in ("learning_rate", "cell_clip", "proj_clip", "all_clip_norm_val", "initial_accumulator_value"):
        _refused(cfg, name, NAN)


def test_the_configs_the_tests_build_validate():
    """The bilm-tf training fixture's configuration (tests/test_golden_fixtures.py) and its variants, the default
    TrainConfig, and the trainer tests' tiny overrides still validate; a NaN among them does not."""
    golden = {"char_embed_dim": 4, "filters": [[1, 8], [2, 8], [3, 16], [4, 32], [5, 64]], "n_highway": 1,
              "activation": "tanh", "max_characters_per_token": 10, "lstm_dim": 16, "projection_dim": 8,
              "n_layers": 2, "cell_clip": None, "proj_clip": None, "use_skip_connections": False, "dropout": 0.1,
              "batch_size": 2, "unroll_steps": 10, "n_negative_samples_batch": 16, "n_epochs": 50,
              "n_train_tokens": 134, "all_clip_norm_val": 1.0, "eval_batch_size": 1, "eval_unroll_steps": 1,
              "num_threads": 1, "checkpoint_every": 1000, "backend": "cpu"}
    for changes in ({}, {"char_inputs": False, "bidirectional": False},
                    {"char_inputs": False, "share_embedding_softmax": True},
                    {"char_inputs": False, "use_skip_connections": True}):
        TrainConfig.from_dict({**golden, **changes}).validate()
    TrainConfig().validate()
    over = {"backend": "reference", "n_train_tokens": 300, "n_negative_samples_batch": 8, "max_steps": 6,
            "sleep_per_step": 0.1, "eval_every": None, "learning_rate": 0.05, "initial_accumulator_value": 0.3,
            "all_clip_norm_val": 1e-3, "dropout": 0.0}
    cfg = dataclasses.replace(tiny(), **over)
    cfg.validate()
    _refused(cfg, "all_clip_norm_val", NAN)


# ------------------------------------------------------------------------------------------------ the CLI
def _corpus(tmp_path) -> str:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text("the cat sat on the mat .\na dog sat .\n" * 20, encoding="utf-8")
    return str(d / "train.txt")


@pytest.mark.parametrize("flag, value, field", [
    ("--learning-rate", "nan", "learning_rate"),
    ("--cell-clip", "-1", "cell_clip"),
    ("--all-clip-norm-val", "-1", "all_clip_norm_val"),
    ("--initial-accumulator-value", "inf", "initial_accumulator_value"),
    ("--max-steps", "-1", "max_steps"),
    ("--time-budget", "-5", "time_budget"),
    ("--eval-max-batches", "0", "eval_max_batches"),
    ("--num-threads", "-3", "num_threads"),
    ("--n-highway", "-1", "n_highway"),
])
def test_cli_refuses_in_one_line_before_writing_anything(tmp_path, capsys, flag, value, field):
    """rc 2, one error line naming the field and the value, and no save dir (the corpus lies outside it); before the
    fix these trained (rc 0) and saved a checkpoint, or failed after the run's files were written."""
    save = tmp_path / "run"
    rc = cli_main(["train", "--save-dir", str(save), "--config", "tiny", "--corpus", _corpus(tmp_path),
                   "--heldout", str(tmp_path / "corpus" / "train.txt"), "--backend", "reference", "--device", "cpu",
                   "--max-steps", "1", "--n-negative-samples-batch", "8", "--no-progress", "--quiet", flag, value])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not os.path.exists(save), sorted(os.listdir(save))
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and re.search(rf"error: {field}\b.*, got {value}", lines[0]), err


# ------------------------------------------------------------------------------------------------ batch sizes
BAD_SIZES = [(0, 2, "batch_size"), (2, 0, "num_steps"), (1, -1, "num_steps"), (-1, 1, "batch_size")]


@pytest.fixture()
def shards(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("the cat sat\na dog\n\nhi\nx y z w\n", encoding="utf-8")
    counts, _, _, _ = D.count_tokens([str(f)])
    return [str(f)], Vocabulary(words=D.build_vocab(counts))


@pytest.mark.parametrize("dataset", [LMDataset, BidirectionalLMDataset])
@pytest.mark.parametrize("batch_size, num_steps, field", BAD_SIZES)
def test_iter_batches_refuses_non_positive_sizes_at_once(shards, dataset, batch_size, num_steps, field):
    """Test-mode data ends, so iteration must end: 0 rows or 0 steps made empty batches forever (islice bounds a
    regression to 5 of them), a negative size a raw numpy error."""
    files, vocab = shards
    ds = dataset(files[0], vocab, test=True)
    value = batch_size if field == "batch_size" else num_steps
    with pytest.raises(ValueError, match=rf"{field}\b.* must be an integer >= 1, got {value}"):
        ds.iter_batches(batch_size, num_steps)  # at the call, before any batch is asked for
    assert len(list(ds.iter_batches(2, 3))) >= 1  # the sizes that work still do


@pytest.mark.parametrize("batch_size, unroll_steps, field", BAD_SIZES)
def test_streams_refuse_non_positive_sizes(shards, batch_size, unroll_steps, field):
    """The trainer's (and its evaluation's) packers are the same streams."""
    files, vocab = shards
    field = "unroll_steps" if field == "num_steps" else field
    for make in (lambda: D.LMStream(files, vocab, batch_size, unroll_steps, 50, test=True),
                 lambda: D.BidirectionalStream(files, vocab, batch_size, unroll_steps, 50, test=True)):
        with pytest.raises(ValueError, match=rf"{field}\b.* must be an integer >= 1, got"):
            stream = make()
            for _ in range(5):
                stream.next_batch()


def test_message_values_are_the_given_ones():
    """NaN is reported as nan (not as a failed comparison elsewhere)."""
    with pytest.raises(ConfigError, match=r"^learning_rate must be a finite number > 0, got nan$"):
        dataclasses.replace(tiny(), learning_rate=NAN).validate()


def test_integer_fields_take_numpy_integers_as_plain_ints():
    """A size computed with numpy (np.int64) is an integer: accepted, stored as an int so that the config still
    goes to JSON (checkpoints and logs write it); a float or a bool is not."""
    import json

    import numpy as np

    cfg = dataclasses.replace(TrainConfig(), batch_size=np.int64(8), eval_batch_size=np.int32(2)).validate()
    assert type(cfg.batch_size) is int and type(cfg.eval_batch_size) is int
    json.dumps(cfg.to_dict())
    for bad in (8.0, True):
        with pytest.raises(ConfigError, match=r"batch_size must be an integer >= 1, got"):
            dataclasses.replace(TrainConfig(), batch_size=bad).validate()
