"""Training configurations: the published original (spec §6.1), a small one (CPU demo) and a tiny one (tests).

Every field is also a command-line option (``--batch-size``, ``--lstm-dim``, ...; see ``cli.py``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import typing
import warnings
from dataclasses import dataclass, field

from ..util import check_int


class ConfigError(ValueError):
    """A training configuration is invalid or does not fit the machine."""


def _field(default, help: str):
    """A configuration field and its one line of ``elmo-fast train --help`` (the CLI adds the default)."""
    if isinstance(default, list):
        return field(default_factory=lambda: [list(x) for x in default], metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # ---- model (char CNN + LSTMP); written to options.json
    char_inputs: bool = _field(True, "a character-CNN token encoder; --no-char-inputs trains a word-input biLM "
                               "(a vocabulary x projection_dim embedding, bilm-tf's options without char_cnn)")
    bidirectional: bool = _field(True, "forward and backward LMs; --no-bidirectional trains the forward LM alone "
                                 "(bilm-tf's bidirectional false: its dump has no published layout)")
    share_embedding_softmax: bool = _field(False, "the softmax weights are the word embedding (word inputs only, "
                                           "as in bilm-tf)")
    char_embed_dim: int = _field(16, "character embedding size (char_cnn.embedding.dim)")
    filters: list = _field([[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
                           "CNN filters, a JSON list of [width, count]")
    n_highway: int = _field(2, "highway layers after the CNN")
    activation: str = _field("relu", "CNN activation")
    max_characters_per_token: int = _field(50, "character ids per token (50 for AllenNLP's batch_to_ids; bilm-tf's "
                                           "Batcher takes any)")
    lstm_dim: int = _field(4096, "LSTM cell size (lstm.dim)")
    projection_dim: int = _field(512, "LSTM projection size, also the token-layer size")
    n_layers: int = _field(2, "LSTM layers per direction")
    cell_clip: float | None = _field(3.0, "clip of the LSTM cell state (null: none)")
    proj_clip: float | None = _field(3.0, "clip of the projected LSTM output (null: none)")
    use_skip_connections: bool = _field(True, "residual connections between LSTM layers")
    # ---- optimisation (bilm-tf names where they exist)
    dropout: float = _field(0.1, "dropout on every LSTM layer's input and on the top output")
    batch_size: int = _field(128, "rows per tower and step (per process under torchrun, per virtual tower in one "
                             "process)")
    unroll_steps: int = _field(20, "tokens per row and step (the truncated-BPTT window)")
    n_negative_samples_batch: int = _field(8192, "sampled-softmax negatives per step and direction")
    sample_softmax: bool = _field(True, "sampled softmax; --no-sample-softmax trains with the full softmax")
    learning_rate: float = _field(0.2, "Adagrad learning rate")
    initial_accumulator_value: float = _field(1.0, "Adagrad's initial accumulator")
    all_clip_norm_val: float = _field(10.0, "global gradient-norm clip")
    n_epochs: int = _field(10, "epochs (steps = n_epochs x n_train_tokens / (batch_size x unroll_steps x towers))")
    n_train_tokens: int | None = _field(None, "tokens in one epoch (null: counted from the corpus, estimated from its "
                                        "first vocab_check_lines lines for a large one with a given --vocab)")
    towers: int = _field(1, "data-parallel towers in one process, each with its own rows, data shard and sampler")
    fuse_towers: str = _field("auto", "a process's towers in one model pass (their rows side by side; each keeps its "
                              "samples, dropout masks and states): 'on', 'off' (one after the other, one tower's "
                              "activations in memory at a time) or 'auto' (on a GPU)")
    # ---- run control
    seed: int = _field(0, "random seed")
    max_steps: int | None = _field(None, "stop after this many steps (null: from n_epochs)")
    time_budget: float | None = _field(None, "seconds of training, then checkpoint, evaluate and stop (null: no "
                                       "limit)")
    checkpoint_every: int = _field(1250, "steps between checkpoints")
    keep_checkpoints: int = _field(2, "checkpoints kept on disk")
    eval_every: int | None = _field(None, "steps between held-out evaluations (null: only at the end)")
    eval_batch_size: int = _field(256, "rows of a held-out batch")
    eval_unroll_steps: int = _field(1, "tokens per row of a held-out batch")
    eval_max_batches: int | None = _field(None, "held-out batches per evaluation (null: all)")
    log_every: int = _field(10, "steps between log lines")
    device: str = _field("auto", "auto, cpu, cuda or cuda:N")
    backend: str = _field("auto", "kernel backend")
    bf16: bool = _field(True, "bfloat16 autocast on a GPU (ignored on the CPU)")
    deterministic: bool = _field(False, "deterministic mode: bit-identical runs on a GPU too (ordered sums instead "
                                 "of atomics; slower)")
    queue_size: int = _field(8, "batches the loader reads ahead")
    data_worker: str = _field("auto", "where batches are made: 'thread', 'process' (no interpreter lock shared with "
                              "the step) or 'auto' (a process on a GPU, a thread on the CPU)")
    num_threads: int | None = _field(None, "torch intra-op threads (null: torch's default; 1 is best for tiny "
                                     "models)")
    vocab_min_count: int = _field(1, "fewest occurrences of a word in a vocabulary built from the corpus")
    vocab_max_size: int | None = _field(None, "most entries of a vocabulary built from the corpus (null: no limit)")
    vocab_check_lines: int = _field(1_000_000, "corpus lines counted to check the order of a given --vocab")
    check_vocab_order: bool = _field(True, "check that a given --vocab is sorted by corpus frequency")
    check_memory: bool = _field(True, "refuse a configuration that does not fit in memory")
    sleep_per_step: float = _field(0.0, "seconds to sleep after every step (a testing aid: a run slow enough to be "
                                   "killed mid-way)")

    def validate(self) -> "TrainConfig":
        def integer(name, low, nullable=False, note=""):
            v = getattr(self, name)
            if not (nullable and v is None):  # stored as a plain int (a numpy integer would not go to JSON)
                setattr(self, name, check_int(v, name, low, (" or null" if nullable else "") + note, error=ConfigError))

        def number(name, low, strict, nullable=False, note=""):
            """A finite real number above ``low`` (``strict``) or at least ``low``: NaN and infinities fail every
            comparison that matters here (a NaN learning rate trains NaNs), so they are refused by name."""
            v = getattr(self, name)
            if nullable and v is None:
                return
            ok = (not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
                  and (v > low if strict else v >= low))
            if not ok:
                raise ConfigError(f"{name} must be a finite number {'>' if strict else '>='} {low}"
                                  f"{' or null' if nullable else ''}{note}, got {v!r}")

        for n in ("char_embed_dim", "lstm_dim", "projection_dim", "n_layers", "batch_size", "unroll_steps",
                  "n_negative_samples_batch", "n_epochs", "towers", "checkpoint_every", "keep_checkpoints",
                  "eval_batch_size", "eval_unroll_steps", "log_every", "queue_size", "max_characters_per_token"):
            integer(n, 1)
        for n in ("char_inputs", "bidirectional", "share_embedding_softmax", "use_skip_connections", "sample_softmax",
                  "bf16", "deterministic", "check_vocab_order", "check_memory"):
            if not isinstance(getattr(self, n), bool):
                raise ConfigError(f"{n} must be true or false, got {getattr(self, n)!r}")
        integer("n_highway", 0)
        integer("max_steps", 1, nullable=True, note=" (null: from n_epochs)")
        integer("n_train_tokens", 0, nullable=True)
        if self.n_train_tokens == 0 and self.max_steps is None:
            raise ConfigError("n_train_tokens is 0, so the steps cannot be counted from it; pass --n-train-tokens "
                              "or --max-steps")
        integer("eval_every", 0, nullable=True, note=" (0 or null: only at the end)")
        integer("eval_max_batches", 1, nullable=True, note=" (null: all)")
        integer("num_threads", 0, nullable=True, note=" (0 or null: torch's default)")
        integer("vocab_min_count", 1, note=" (every word of the corpus occurs at least once: 1 keeps them all)")
        integer("vocab_max_size", 3, nullable=True, note=" (the vocabulary always holds <S>, </S> and <UNK>)")
        integer("vocab_check_lines", 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < 1 << 64:
            raise ConfigError(f"seed must be an integer in [-2**63, 2**64) (torch's seed range), got {self.seed!r}")
        number("learning_rate", 0, strict=True)
        number("initial_accumulator_value", 0, strict=True)
        number("all_clip_norm_val", 0, strict=True)
        for n in ("cell_clip", "proj_clip"):
            number(n, 0, strict=False, nullable=True, note=" (null: no clip)")
        number("time_budget", 0, strict=True, nullable=True, note=" (null: no limit)")
        number("sleep_per_step", 0, strict=False)
        if self.data_worker not in ("auto", "thread", "process"):
            raise ConfigError(f"data_worker must be auto, thread or process, got {self.data_worker!r}")
        if self.fuse_towers not in ("auto", "on", "off"):
            raise ConfigError(f"fuse_towers must be auto, on or off, got {self.fuse_towers!r}")
        if self.activation not in ("relu", "tanh"):
            raise ConfigError(f"activation must be relu or tanh, got {self.activation!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0.0 <= d < 1.0:  # NaN fails the range too
            raise ConfigError(f"dropout must be in [0, 1), got {d!r}")
        self.dropout = float(d)  # a plain float (a numpy one would not go to JSON)
        if self.projection_dim > self.lstm_dim:
            raise ConfigError(f"projection_dim ({self.projection_dim}) exceeds lstm_dim ({self.lstm_dim})")
        if (not isinstance(self.filters, (list, tuple)) or not self.filters
                or any(not isinstance(f, (list, tuple)) or len(f) != 2
                       or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in f)
                       for f in self.filters)):
            raise ConfigError(f"filters must be a non-empty list of [width, count] (positive integers), got "
                              f"{self.filters!r}")
        if max(f[0] for f in self.filters) > self.max_characters_per_token:
            raise ConfigError("a filter is wider than max_characters_per_token")
        if self.share_embedding_softmax and self.char_inputs:
            raise ConfigError("share_embedding_softmax needs a word-input model (--no-char-inputs): sharing the "
                              "softmax and the embedding requires word inputs (bilm-tf raises the same)")
        if self.max_characters_per_token < 3:
            raise ConfigError(f"max_characters_per_token must be at least 3 (begin-of-word, a character, end-of-word), "
                              f"got {self.max_characters_per_token}")
        from .._backend import BACKENDS

        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not a backend; expected one of {', '.join(BACKENDS)}")
        if self.device != "auto":
            from ..util import parse_device

            parse_device(self.device, "device", ConfigError)
        return self

    def options(self, n_tokens_vocab: int) -> dict:
        """The bilm-tf training options dict (``n_characters`` 261; the dump writes 262)."""
        chars = {"char_cnn": {"activation": self.activation, "embedding": {"dim": self.char_embed_dim},
                              "filters": [list(map(int, f)) for f in self.filters], "max_characters_per_token":
                                  self.max_characters_per_token, "n_characters": 261, "n_highway": self.n_highway}}
        return {
            "bidirectional": self.bidirectional,
            **(chars if self.char_inputs else {}),
            **({"share_embedding_softmax": True} if self.share_embedding_softmax else {}),
            "dropout": self.dropout,
            "lstm": {"cell_clip": self.cell_clip, "dim": self.lstm_dim, "n_layers": self.n_layers,
                     "proj_clip": self.proj_clip, "projection_dim": self.projection_dim,
                     "use_skip_connections": self.use_skip_connections},
            "all_clip_norm_val": self.all_clip_norm_val,
            "n_epochs": self.n_epochs,
            "n_train_tokens": self.n_train_tokens,
            "batch_size": self.batch_size,
            "n_tokens_vocab": n_tokens_vocab,
            "unroll_steps": self.unroll_steps,
            "n_negative_samples_batch": self.n_negative_samples_batch,
            "sample_softmax": self.sample_softmax,
            "learning_rate": self.learning_rate,
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(d) - set(hints))
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}")
        for key, value in d.items():
            allowed = typing.get_args(hints[key]) or (hints[key],)
            if not any(_is_a(value, t) for t in allowed):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise ConfigError(f"config key {key!r} must be {names}, got {value!r}")
        return cls(**d)


def _is_a(value, t) -> bool:
    if t is type(None):
        return value is None
    if isinstance(value, bool):
        return t is bool
    return isinstance(value, t) or (t is float and isinstance(value, int))


ORIGINAL_TOWERS = 3


def original() -> TrainConfig:
    """bilm-tf ``bin/train_elmo.py`` (spec §6.1): 2x4096_512_2048cnn_2xhighway; 3 GPUs x 128 rows, so 3 towers of
    128 rows (384 rows a step, 1,000,840 steps). One process runs them in one pass on a GPU (``fuse_towers``), one
    after the other on the CPU; under torchrun the CLI spreads the 3 over the processes (``original_towers``)."""
    return TrainConfig(n_train_tokens=768648884, towers=ORIGINAL_TOWERS)


def original_towers(world_size: int) -> tuple[int, str | None]:
    """(towers per process, a warning or None) for bilm-tf's 3 towers over ``world_size`` processes: 3, 1 per
    process at 3, and where 3 does not divide, one per process with a warning that the step is not bilm-tf's."""
    if ORIGINAL_TOWERS % world_size == 0:
        return ORIGINAL_TOWERS // world_size, None
    return 1, (f"--config original is bilm-tf's {ORIGINAL_TOWERS} towers of 128 rows (384 rows a step); {world_size} "
               f"processes cannot share them, so this run trains {world_size} towers ({world_size * 128} rows a "
               "step, a different number of steps). Run 1 or 3 processes for bilm-tf's recipe, or set --towers")


def small() -> TrainConfig:
    """A CPU-sized biLM for the demo: 2x256_64 LSTMP, 256-filter CNN, 1 highway."""
    return TrainConfig(char_embed_dim=16, filters=[[1, 16], [2, 16], [3, 32], [4, 64], [5, 128]], n_highway=1,
                       lstm_dim=256, projection_dim=64, batch_size=32, unroll_steps=20, n_negative_samples_batch=512,
                       n_epochs=1, checkpoint_every=200, eval_every=100, eval_batch_size=64, eval_unroll_steps=20,
                       eval_max_batches=30, log_every=10)


def tiny() -> TrainConfig:
    """Test-sized (bilm-tf's own training tests use LSTM 16/8)."""
    return TrainConfig(char_embed_dim=4, filters=[[1, 4], [2, 8], [3, 16], [4, 32]], n_highway=1, lstm_dim=32,
                       projection_dim=16, batch_size=4, unroll_steps=8, n_negative_samples_batch=24, n_epochs=1,
                       checkpoint_every=50, eval_every=None, eval_batch_size=8, eval_unroll_steps=8, log_every=5,
                       queue_size=4)


PRESETS = {"original": original, "small": small, "tiny": tiny}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown config {name!r}; choose one of {sorted(PRESETS)} or a JSON file")
    return PRESETS[name]()


def load_config(name_or_path: str) -> TrainConfig:
    if name_or_path in PRESETS:
        return preset(name_or_path)
    if os.path.isfile(name_or_path):
        from ..util import read_utf8

        try:
            d = json.loads(read_utf8(name_or_path, "config file", ConfigError))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {name_or_path} is not valid JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"config file {name_or_path} holds a JSON {type(d).__name__}; expected an object of "
                              "configuration fields, e.g. {\"lstm_dim\": 512}")
        return TrainConfig.from_dict(d)
    raise ConfigError(f"unknown config {name_or_path!r}; choose one of {sorted(PRESETS)} or a JSON file")


# ------------------------------------------------------------------------------------------- memory estimate
def count_parameters(cfg: TrainConfig, vocab_size: int) -> dict[str, int]:
    d, F_, P, H, L = cfg.char_embed_dim, sum(f[1] for f in cfg.filters), cfg.projection_dim, cfg.lstm_dim, cfg.n_layers
    cnn = 261 * d + sum(w * d * n + n for w, n in cfg.filters) + cfg.n_highway * 2 * (F_ * F_ + F_)
    if F_ != P:
        cnn += F_ * P + P
    if not cfg.char_inputs:  # the word embedding (dense accounting: an upper bound)
        cnn = 0 if cfg.share_embedding_softmax else vocab_size * P
    lstm = 2 * L * (2 * P * 4 * H + 4 * H + (H * P if P < H else 0))
    softmax = vocab_size * P + vocab_size
    return {"cnn": cnn, "lstm": lstm, "softmax": softmax, "total": cnn + lstm + softmax}


def fuses_towers(cfg: TrainConfig, cuda: bool) -> bool:
    """Whether a process runs its towers in one model pass (``fuse_towers``; 'auto': on a GPU). One tower: no."""
    return cfg.towers > 1 and (cfg.fuse_towers == "on" or (cfg.fuse_towers == "auto" and cuda))


def estimate_memory(cfg: TrainConfig, vocab_size: int, cuda: bool) -> dict[str, int]:
    """Bytes: parameters + gradients + Adagrad accumulators + activations kept for backward (rough upper bound)."""
    p = count_parameters(cfg, vocab_size)
    dense = p["cnn"] + p["lstm"]
    params = 4 * (p["total"] * 2 + dense)  # weights + accumulators (fp32) + dense grads
    act_bytes = 2 if (cuda and cfg.bf16) else 4
    # towers one after the other free their activations (one tower's rows at a time); fused, all are kept at once
    B, T, P, H, L = cfg.batch_size, cfg.unroll_steps, cfg.projection_dim, cfg.lstm_dim, cfg.n_layers
    B *= cfg.towers if fuses_towers(cfg, cuda) else 1
    F_ = sum(f[1] for f in cfg.filters)
    n_tok = 2 * B * T  # both directions
    per_tok_lstm = L * (4 * H * 3 + H * 3 + P * 4)  # gates, c, tanh(c), m, h, dropout outputs (the cuda backend's
    # F.dropout also keeps masks; the hashed dropout regenerates them), residual
    per_tok_cnn = cfg.max_characters_per_token * (cfg.char_embed_dim + 2 * F_) + F_ * (2 + 4 * cfg.n_highway) + P
    S = cfg.n_negative_samples_batch if cfg.sample_softmax else vocab_size
    softmax_act = 2 * B * T * S * 3 + 2 * (S + 2 * B * T) * P * 2
    acts = act_bytes * n_tok * (per_tok_lstm + per_tok_cnn) + 4 * softmax_act
    return {"parameters": params, "activations": acts, "total": params + acts}


def available_memory(device) -> int | None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(cfg: TrainConfig, vocab_size: int, device, fraction: float = 0.9, warn: bool = True
                 ) -> dict[str, int]:
    """The memory estimate on ``device``, or a ConfigError naming what to lower where it exceeds ``fraction`` of
    the available memory. With ``fuse_towers`` 'auto', where the towers fit one after the other but not fused, it
    sets ``cfg.fuse_towers`` to 'off' (a warning if ``warn``: the CLI's main process) and returns that estimate."""
    import torch

    cuda = torch.device(device).type == "cuda"
    est = estimate_memory(cfg, vocab_size, cuda)
    avail = available_memory(device)
    if avail is None or est["total"] <= fraction * avail:
        return est
    gib = 1 << 30
    fused = fuses_towers(cfg, cuda)
    apart = estimate_memory(dataclasses.replace(cfg, fuse_towers="off"), vocab_size, cuda) if fused else est
    hint = ""
    if fused and apart["total"] <= fraction * avail:
        if cfg.fuse_towers == "auto":
            if warn:
                warnings.warn(f"the {cfg.towers} towers fused in one pass would need about {est['total'] / gib:.1f} "
                              f"GiB on {device}, {avail / gib:.1f} GiB is available: they run one after the other "
                              f"(about {apart['total'] / gib:.1f} GiB; --fuse-towers off)", RuntimeWarning,
                              stacklevel=2)
            cfg.fuse_towers = "off"
            return apart
        hint = f"run the towers one after the other (--fuse-towers off: about {apart['total'] / gib:.1f} GiB), "
    if cfg.fuse_towers == "auto":  # it would fall back to the towers one after the other: the least it can need
        est, fused = apart, False
    raise ConfigError(
        f"the configuration needs about {est['total'] / gib:.1f} GiB on {device} (parameters+optimizer "
        f"{est['parameters'] / gib:.1f} GiB, activations {est['activations'] / gib:.1f} GiB for "
        f"{cfg.batch_size} rows x {cfg.unroll_steps} steps a tower{f' x {cfg.towers} towers fused' if fused else ''}"
        f", vocabulary {vocab_size}) but only {avail / gib:.1f} GiB is available; {hint}lower --batch-size/"
        "--unroll-steps/--n-negative-samples-batch, shrink the model or vocabulary (--vocab-max-size), or pass "
        "--no-check-memory")
