"""``elmo-fast train`` and ``elmo-fast dump-weights``.

``add_subcommands(subparsers)`` registers both on an argparse subparsers object (the main ``elmo-fast`` CLI calls
it); ``python -m elmo_fast.training.cli train ...`` works on its own too. Multi-process:
``torchrun --nproc_per_node N -m elmo_fast.training.cli train ...`` (or ``torchrun ... $(which elmo-fast) train``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import typing
import warnings

from .._backend import BACKENDS
from ..util import check_backend, check_input_file, check_output_dir, check_output_file, same_file
from .configs import PRESETS, ConfigError, TrainConfig, check_memory, load_config, original_towers, small
from .data import DataError, build_vocab, check_corpus, count_tokens, load_training_vocab, resolve_shards, write_vocab

# the ops a training step runs (each must be available on the device for the chosen backend)
TRAIN_OPS = ("char_cnn", "highway", "lstmp", "sampled_softmax", "full_softmax")

# fields that may change on --resume (run control); the rest must match the checkpoint
RESUMABLE = {"max_steps", "time_budget", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batch_size",
             "eval_unroll_steps", "eval_max_batches", "log_every", "queue_size", "data_worker", "fuse_towers",
             "sleep_per_step",
             "n_epochs", "n_train_tokens", "device", "backend", "num_threads", "bf16", "deterministic", "check_memory",
             "check_vocab_order", "vocab_check_lines"}
# and on --init-from (bilm-tf's restart.py: a new run from a checkpoint's weights), also these: the data side
RESTARTABLE = RESUMABLE | {"batch_size", "towers", "seed"}


def _field_type(f: dataclasses.Field):
    hints = typing.get_type_hints(TrainConfig)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if args:
        t = args[0]
    return t


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "configuration", "every field of the configuration; a flag given here overrides --config. The defaults shown "
        "are the 'small' preset's (the default --config); another preset or JSON file brings its own")
    defaults = small()
    choices = {"backend": BACKENDS, "activation": ("relu", "tanh")}
    for f in dataclasses.fields(TrainConfig):
        t = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = json.dumps(default) if isinstance(default, list) else ("null" if default is None else default)
        if t is bool:
            shown = flag if default else "--no-" + flag[2:]
        hlp = f"{f.metadata['help']} (default: {shown})"
        if t is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=hlp)
        elif t is list:
            g.add_argument(flag, dest=f.name, type=_json_list, default=argparse.SUPPRESS, metavar="JSON", help=hlp)
        else:
            g.add_argument(flag, dest=f.name, type=_nullable(t), default=argparse.SUPPRESS, help=hlp,
                           choices=choices.get(f.name), metavar=None if f.name in choices else t.__name__.upper())


def _json_list(s: str) -> list:
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        v = None
    if not isinstance(v, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[[1,32],[2,32]]', got {s!r}")
    return v


def _nullable(t):
    def conv(s: str):
        if s.lower() in ("none", "null"):
            return None
        return t(s)

    conv.__name__ = t.__name__
    return conv


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-prefix", "--corpus", dest="corpus", default=None, metavar="GLOB",
                   help="glob of training shards, one tokenized sentence a line (default: the embedded corpus, "
                   "written to SAVE_DIR/corpus)")
    p.add_argument("--heldout", default=None, metavar="GLOB", help="glob of held-out shards for perplexity "
                   "(default: none; with the embedded corpus, its held-out split)")
    p.add_argument("--vocab", default=None, help="vocabulary file: <S>, </S>, <UNK>, then words by descending "
                   "frequency (default: built from the corpus and written to SAVE_DIR/vocab.txt)")
    p.add_argument("--save-dir", required=True, help="directory for checkpoints, options.json, vocab.txt, "
                   "train_log.jsonl (created if missing; required)")
    p.add_argument("--config", default=None, help=f"a preset ({', '.join(sorted(PRESETS))}) or a JSON file of "
                   "configuration fields (default: small)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint in --save-dir, or from the given checkpoint file "
                   "(default: start a new run)")
    p.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                   help="start a new run from a checkpoint's weights and Adagrad accumulators (a checkpoint file, or "
                   "a save dir: its latest), as bilm-tf's restart.py does to fine-tune on another corpus: the model "
                   "comes from the checkpoint, its vocabulary from --vocab or the checkpoint's run; the data, batch "
                   "size, epochs (n_train_tokens counted afresh) and run control from this command; steps, data "
                   "positions and LSTM states start from zero (default: fresh weights)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on a terminal)")
    p.add_argument("--quiet", action="store_true", help="do not echo the JSON log lines to stdout (default: echo)")
    _add_config_args(p)


def add_dump_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-dir", required=True, help="the training directory (required)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: the latest in --save-dir)")
    p.add_argument("--outfile", "--weight-file", dest="outfile", required=True,
                   help="hdf5 weights to write, in the published layout (required; its folder must exist)")
    p.add_argument("--options-file", default=None, help="inference options.json to write (default: options.json "
                   "next to --outfile)")


def add_subcommands(subparsers) -> None:
    tp = subparsers.add_parser("train", help="pretrain a biLM from a corpus (bilm-tf semantics)",
                               description="Pretrain a biLM (character CNN, or word inputs with --no-char-inputs); "
                               "one process, or many under torchrun.")
    add_train_arguments(tp)
    tp.set_defaults(func=cmd_train)
    dp = subparsers.add_parser("dump-weights", help="write a trained biLM as options.json + hdf5 (published layout)")
    add_dump_arguments(dp)
    dp.set_defaults(func=cmd_dump_weights)
    ep = subparsers.add_parser("evaluate", help="held-out perplexity of a training checkpoint (bilm-tf's run_test.py)",
                               description="Full-softmax perplexity of a checkpoint on test shards, as bilm-tf's "
                               "bin/run_test.py computes it: test-mode data, no dropout, the state carried across "
                               "batches, exp(mean batch loss), the last incomplete batch dropped.")
    add_evaluate_arguments(ep)
    ep.set_defaults(func=cmd_evaluate)


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-dir", required=True, help="the training directory (required)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: the latest in --save-dir)")
    p.add_argument("--test-prefix", "--heldout", dest="test_prefix", required=True, metavar="GLOB",
                   help="glob of the test shards, one tokenized sentence a line (required)")
    p.add_argument("--vocab", default=None, help="the run's vocabulary (default: vocab.txt of the checkpoint's run)")
    p.add_argument("--batch-size", type=int, default=256, help="rows of a batch (default: 256, as bilm-tf)")
    p.add_argument("--unroll-steps", type=int, default=1, help="tokens per row of a batch (default: 1, as bilm-tf)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (default: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="kernel backend (default: the checkpoint's configuration's)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast on a GPU (default: fp32, as bilm-tf's "
                   "test())")


# ------------------------------------------------------------------------------------------------- train
def _overrides(args) -> dict:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def read_checkpoint(path: str) -> dict:
    """A training checkpoint, or ConfigError naming the file when it is truncated, foreign or from another version."""
    from .trainer import CHECKPOINT_VERSION, load_checkpoint

    try:
        ck = load_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - torch.load fails in many ways on a truncated or foreign file
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {reason}); it is truncated or "
                          "not a checkpoint written by `elmo-fast train`") from None
    needed = {"version", "config", "options", "model", "step", "towers"}
    if not isinstance(ck, dict) or not needed <= ck.keys():
        raise ConfigError(f"{path} is not a checkpoint written by `elmo-fast train` (expected a dict with the keys "
                          f"{sorted(needed)})")
    if ck["version"] != CHECKPOINT_VERSION:
        raise ConfigError(f"checkpoint {path} has version {ck['version']!r}; this elmo_fast reads version "
                          f"{CHECKPOINT_VERSION}")
    return ck


def prepare(args, dinfo):
    """Check every argument, then resolve config, corpus, vocabulary and checkpoint, and only then write the run's
    files into the save dir. Returns (cfg, vocab, train_files, heldout_files, ckpt, init): the checkpoint to resume,
    or the one whose weights start a new run (--init-from)."""
    from .trainer import latest_checkpoint, resolve_device

    save_dir = args.save_dir
    check_output_dir(save_dir, "--save-dir", ConfigError)
    over = _overrides(args)
    ckpt = init = None
    init_from = getattr(args, "init_from", None)
    if args.resume and init_from:
        raise ConfigError("--resume continues the run in --save-dir, --init-from starts a new one from a checkpoint's "
                          "weights: give one of them")
    previous = None if args.resume else latest_checkpoint(save_dir)
    if previous is not None:
        raise ConfigError(f"--save-dir {save_dir} already holds checkpoints (latest: {previous}); "
                          "continue that run with --resume, start from its weights in another --save-dir with "
                          "--init-from, or choose an empty --save-dir")
    if args.resume:
        where = save_dir if args.resume == "latest" else args.resume
        path, ckpt = _checkpoint_for("--resume", where, over, RESUMABLE, "differ from the checkpoint's configuration; "
                                     "only run-control options may change", dinfo)
        cfg = TrainConfig.from_dict({**ckpt["config"], **over})
        run_file = os.path.join(save_dir, "run.json")
        if not os.path.isfile(run_file):
            raise ConfigError(f"--resume: {run_file} is missing; resume in the --save-dir of the interrupted run")
        with open(run_file, encoding="utf-8") as fh:
            run = json.load(fh)
        corpus, heldout, vocab_path = run["corpus"], run["heldout"], os.path.join(save_dir, "vocab.txt")
    elif init_from:
        if args.config is not None:
            raise ConfigError("--init-from takes the model's configuration from the checkpoint: leave out --config "
                              "and give the fields to change as flags")
        if args.corpus is None:
            raise ConfigError("--init-from needs the corpus to train on (--train-prefix), as bilm-tf's restart.py "
                              "does")
        path, init = _checkpoint_for("--init-from", init_from, over, RESTARTABLE, "would change the model the "
                                     "checkpoint holds; only the data side and run control may change", dinfo)
        # the new corpus's tokens are counted unless given; the old run's step limits and this machine's settings
        # do not carry over (bilm-tf's options hold none of them)
        fresh = TrainConfig()
        machine = {k: getattr(fresh, k) for k in ("device", "backend", "num_threads", "sleep_per_step", "data_worker",
                                                  "fuse_towers", "queue_size", "check_memory")}
        cfg = TrainConfig.from_dict({**init["config"], "n_train_tokens": None, "max_steps": None, "time_budget": None,
                                     **machine, **over})
        corpus, heldout = args.corpus, args.heldout
        vocab_path = args.vocab or _run_vocab(path)
        if args.vocab is None and not os.path.isfile(vocab_path):
            raise ConfigError(f"--init-from: {vocab_path} (the checkpoint's run vocabulary) is missing; give the "
                              "vocabulary the checkpoint was trained with as --vocab")
    else:
        cfg = load_config(args.config or "small")
        if args.config == "original" and "towers" not in over and dinfo.world_size > 1:
            towers, warning = original_towers(dinfo.world_size)
            over = {**over, "towers": towers}
            if warning and dinfo.is_main:
                warnings.warn(warning, stacklevel=1)
        cfg = TrainConfig.from_dict({**cfg.to_dict(), **over})
        corpus, heldout, vocab_path = args.corpus, args.heldout, args.vocab
    cfg.validate()
    device = resolve_device(cfg.device, dinfo)
    check_backend(cfg.backend, device, TRAIN_OPS, error=ConfigError)
    if vocab_path is not None:
        check_input_file(vocab_path, "--vocab", DataError)
    if corpus is None:  # every argument is checked: now the embedded corpus may be written
        from .corpus import default_corpus

        d = os.path.join(save_dir, "corpus")
        if dinfo.is_main:
            default_corpus(d)
        _barrier(dinfo)
        corpus = os.path.join(d, "train-*.txt")
        if heldout is None:
            heldout = os.path.join(d, "heldout-*.txt")
    train_files = resolve_shards(corpus, "training corpus")
    check_corpus(train_files, "training corpus")
    heldout_files = None
    if heldout:
        heldout_files = resolve_shards(heldout, "held-out corpus")
        check_corpus(heldout_files, "held-out corpus")

    words = None
    if ckpt is not None:
        vocab = load_training_vocab(vocab_path)
        _check_vocab(vocab, ckpt, vocab_path, "--resume")
    elif init is not None:  # the checkpoint's vocabulary: its order was checked against its own corpus
        vocab = load_training_vocab(vocab_path)
        _check_vocab(vocab, init, vocab_path, "--init-from")
        if cfg.n_train_tokens is None:
            cfg.n_train_tokens = count_tokens(train_files)[2]
    elif vocab_path is None:
        counts, n_sent, n_tok, _ = count_tokens(train_files)
        words = build_vocab(counts, cfg.vocab_min_count, cfg.vocab_max_size)
        from ..chars import Vocabulary

        vocab = Vocabulary(words=words)
        if cfg.n_train_tokens is None:
            cfg.n_train_tokens = n_tok
    else:
        counts, n_sent, n_tok, complete = count_tokens(train_files, cfg.vocab_check_lines)
        vocab = load_training_vocab(vocab_path, counts if cfg.check_vocab_order else None)
        if cfg.n_train_tokens is None:
            if complete:
                cfg.n_train_tokens = n_tok
            else:  # estimate from the bytes read so far
                size = sum(os.path.getsize(f) for f in train_files)
                read = sum(len(" ".join(s)) + 1 for s in _first_lines(train_files, n_sent))
                cfg.n_train_tokens = int(n_tok * size / max(read, 1))
    if cfg.check_memory:
        check_memory(cfg, len(vocab), device, warn=dinfo.is_main)
    if dinfo.is_main and ckpt is None:
        os.makedirs(save_dir, exist_ok=True)
        if words is not None:
            write_vocab(words, os.path.join(save_dir, "vocab.txt"))
        elif os.path.abspath(vocab_path) != os.path.abspath(os.path.join(save_dir, "vocab.txt")):
            shutil.copyfile(vocab_path, os.path.join(save_dir, "vocab.txt"))
        with open(os.path.join(save_dir, "run.json"), "w", encoding="utf-8") as fh:
            json.dump({"corpus": os.path.abspath(corpus), "heldout": heldout and os.path.abspath(heldout),
                       "world_size": dinfo.world_size, **({"init_from": os.path.abspath(path)} if init else {})},
                      fh, indent=2)
        with open(os.path.join(save_dir, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(cfg.to_dict(), fh, indent=2)
        with open(os.path.join(save_dir, "options.json"), "w", encoding="utf-8") as fh:
            json.dump(cfg.options(len(vocab)), fh, indent=2)
    _barrier(dinfo)
    return cfg, vocab, train_files, heldout_files, ckpt, init


def _checkpoint_for(flag: str, where: str, over: dict | None = None, allowed: set = frozenset(), refusal: str = "",
                    dinfo=None) -> tuple[str, dict]:
    """(path, checkpoint) of ``where`` (a checkpoint file, a save dir's latest, or its checkpoints folder's) for
    ``flag``, refusing flags (``over``: field -> value, none by default) that set a field outside ``allowed`` to
    another value than the checkpoint's configuration, with ``refusal`` saying why. Under torchrun rank 0 picks the
    file for every rank (a run still writing checkpoints must not start the ranks from different steps)."""
    from .trainer import latest_checkpoint

    if os.path.isdir(where) and os.path.basename(os.path.normpath(where)) == "checkpoints":
        where = os.path.dirname(os.path.normpath(where))
    path = latest_checkpoint(where)
    if dinfo is not None and dinfo.enabled:
        import torch.distributed as dist

        box = [path]
        dist.broadcast_object_list(box, 0)
        path = box[0]
    if path is None:
        shown = where if os.path.isfile(where) or where.endswith(".pt") else os.path.join(where, "checkpoints")
        raise ConfigError(f"{flag}: no checkpoint in {shown}")
    ck = read_checkpoint(path)
    bad = {k: v for k, v in (over or {}).items() if k not in allowed and ck["config"].get(k) != v}
    if bad:
        raise ConfigError(f"{flag}: {sorted(bad)} {refusal} ({sorted(allowed)})")
    return path, ck


def _run_vocab(checkpoint_path: str) -> str:
    """The vocabulary file of the run that wrote ``checkpoint_path`` (SAVE_DIR/checkpoints/ckpt-*.pt)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path))), "vocab.txt")


def _check_vocab(vocab, ck: dict, vocab_path: str, flag: str) -> None:
    """``vocab`` must be the checkpoint's: as many words (its softmax rows), and the same words in the same order where
    the checkpoint records them (``vocab_sha256``; older checkpoints hold only the count)."""
    from .trainer import vocab_digest

    if len(vocab) != ck["vocab_size"]:
        raise ConfigError(f"{flag}: {vocab_path} has {len(vocab)} entries but the checkpoint's softmax has "
                          f"{ck['vocab_size']} rows; give the vocabulary it was trained with as --vocab")
    if ck.get("vocab_sha256") not in (None, vocab_digest(vocab)):
        raise ConfigError(f"{flag}: {vocab_path} is not the vocabulary the checkpoint was trained with (same size, "
                          "other words or order: its rows would be read as other words); give that one as --vocab")


def _first_lines(files, n):
    from .data import read_shard

    k = 0
    for f in files:
        for s in read_shard(f):
            if k >= n:
                return
            yield s
            k += 1


def _barrier(dinfo):
    if dinfo.enabled:
        import torch.distributed as dist

        dist.barrier()


def run_train(args) -> dict:
    import torch

    from .trainer import JsonLog, Trainer, resolve_device, setup_distributed, train_loop

    dinfo = setup_distributed(getattr(args, "device", "auto"))
    try:
        cfg, vocab, train_files, heldout_files, ckpt, init = prepare(args, dinfo)
        device = resolve_device(cfg.device, dinfo)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        log = JsonLog(os.path.join(args.save_dir, "train_log.jsonl"), dinfo.is_main, echo=not args.quiet)
        log({"event": "start", "world_size": dinfo.world_size, "towers": cfg.towers, "device": str(device),
             "vocab_size": len(vocab), "train_shards": len(train_files),
             "heldout_shards": len(heldout_files or []), "resumed_from_step": ckpt["step"] if ckpt else 0,
             **({"initialised_from_step": init["step"]} if init else {}),
             "n_train_tokens": cfg.n_train_tokens, "threads": torch.get_num_threads()})
        trainer = Trainer(cfg, vocab, train_files, heldout_files, args.save_dir, dinfo, device, ckpt, log, init=init)
        return train_loop(trainer, log, progress=not args.no_progress)
    finally:
        if dinfo.initialised_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def cmd_train(args) -> int:
    run_train(args)
    return 0


# ------------------------------------------------------------------------------------------------- evaluate
def evaluate_checkpoint(save_dir: str, test_prefix: str, checkpoint: str | None = None, vocab: str | None = None,
                        batch_size: int = 256, unroll_steps: int = 1, max_batches: int | None = None,
                        device: str = "auto", backend: str | None = None, bf16: bool = False) -> dict:
    """bilm-tf's ``run_test.py``: the held-out perplexity of a checkpoint (``Trainer.evaluate``, spec §6.7) on the
    shards of ``test_prefix``. Returns the evaluation record (with the checkpoint's path)."""
    from .trainer import DistInfo, Trainer, resolve_device

    if batch_size < 1 or unroll_steps < 1 or (max_batches is not None and max_batches < 1):
        raise ConfigError(f"--batch-size, --unroll-steps and --max-batches must be positive, got {batch_size}, "
                          f"{unroll_steps}, {max_batches}")
    path, ck = _checkpoint_for("evaluate", checkpoint or save_dir)
    shards = resolve_shards(test_prefix, "test corpus")
    check_corpus(shards, "test corpus")
    vocab_path = vocab or _run_vocab(path)
    check_input_file(vocab_path, "--vocab", DataError)
    words = load_training_vocab(vocab_path)
    _check_vocab(words, ck, vocab_path, "evaluate")
    cfg = TrainConfig.from_dict({**ck["config"], "device": device, "bf16": bf16,
                                 **({"backend": backend} if backend else {})})
    dev = resolve_device(cfg.device, DistInfo())
    check_backend(cfg.backend, dev, TRAIN_OPS, error=ConfigError)
    trainer = Trainer(cfg, words, None, shards, save_dir, device=dev, init=ck)  # no training data: no towers
    res = trainer.evaluate(shards, batch_size, unroll_steps, max_batches)
    if not res["heldout_batches"]:
        raise DataError(f"test corpus {test_prefix}: not one full batch of {batch_size} rows x {unroll_steps} tokens "
                        "(the last incomplete batch is dropped, as bilm-tf does); lower --batch-size")
    return {"event": "evaluate", "checkpoint": path, "step": ck["step"], **res}


def cmd_evaluate(args) -> int:
    print(json.dumps(evaluate_checkpoint(args.save_dir, args.test_prefix, args.checkpoint, args.vocab,
                                         args.batch_size, args.unroll_steps, args.max_batches, args.device,
                                         args.backend, args.bf16)))
    return 0


# ------------------------------------------------------------------------------------------------- dump
def default_options_file(outfile: str) -> str:
    """Where ``dump-weights`` writes the options when --options-file is not given: options.json beside --outfile."""
    return os.path.join(os.path.dirname(os.path.abspath(outfile)), "options.json")


# what a training run keeps in its save dir: these files, and everything under these folders
RUN_FILES = ("vocab.txt", "run.json", "config.json", "options.json", "train_log.jsonl")
RUN_FOLDERS = ("checkpoints", "corpus")


def _run_file(path: str, run_dirs: list[str]) -> str | None:
    """Which file of a training run (in one of ``run_dirs``) writing ``path`` would replace, in words, else None."""
    real = os.path.realpath(path)
    for d in run_dirs:
        for name in RUN_FILES:
            if same_file(path, os.path.join(d, name)):
                return f"the training run's file {os.path.join(d, name)}, which the output would replace"
        for name in RUN_FOLDERS:
            folder = os.path.realpath(os.path.join(d, name))
            if os.path.commonpath([real, folder]) == folder:
                return f"inside the training run's folder {os.path.join(d, name)}"
    return None


def _check_dump_targets(save_dir: str, checkpoint: str, outfile: str, options_file: str, options_given: bool):
    """Neither output of ``dump-weights`` is the checkpoint dumped nor a file of its run or of --save-dir's."""
    run_dirs = [save_dir] if os.path.isdir(save_dir) else []
    folder = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(folder) == "checkpoints":  # SAVE_DIR/checkpoints/ckpt-*.pt: its run
        run_dirs.append(os.path.dirname(folder))
    for flag, target in (("--outfile", outfile), ("--options-file", options_file)):
        if same_file(target, checkpoint):
            raise ConfigError(f"{flag} {target} is the checkpoint being dumped; write the output to another file")
        run_file = _run_file(target, run_dirs)
        if run_file is not None and flag == "--options-file" and not options_given:
            raise ConfigError(f"--outfile {outfile} is in the save dir, so the default --options-file {target} "
                              "(options.json beside --outfile) would replace the run's own options.json; pass "
                              "--options-file elsewhere or put --outfile outside the save dir")
        if run_file is not None:
            raise ConfigError(f"{flag} {target} is {run_file}; give a path outside the run's files "
                              f"({', '.join(RUN_FILES)}, {'/, '.join(RUN_FOLDERS)}/)")


def dump_weights(save_dir: str, outfile: str, options_file: str | None = None, checkpoint: str | None = None) -> str:
    """Latest (or given) checkpoint -> hdf5 in the published layout + inference options.json (n_characters 262),
    by ``BiLM.save_weights``: both files are written together or not at all, and never over the checkpoint or a
    file of its run. Returns the checkpoint's path."""
    from ..models.bilm import BiLM
    from ..options import ElmoOptions
    from .trainer import latest_checkpoint

    options_given = bool(options_file)
    options_file = options_file or default_options_file(outfile)
    check_output_file(outfile, "--outfile", ConfigError)
    check_output_file(options_file, "--options-file", ConfigError)
    if same_file(outfile, options_file):
        raise ConfigError(f"--outfile and --options-file both name {outfile}; give two different files")
    path = latest_checkpoint(checkpoint or save_dir)
    if path is None:
        raise ConfigError(f"no checkpoint in {os.path.join(save_dir, 'checkpoints')}")
    _check_dump_targets(save_dir, path, outfile, options_file, options_given)
    ck = read_checkpoint(path)
    if not ck["options"].get("bidirectional", True):
        raise ConfigError(f"{path} holds a forward-only LM (bidirectional false): the published layout and its "
                          "loaders (bilm-tf, AllenNLP) hold both directions, so there is nothing to dump it to; "
                          "train with --bidirectional for a dumpable biLM")
    opts = ElmoOptions.from_dict(ck["options"])
    model = BiLM(opts, backend="reference", stateful=False,
                 n_tokens_vocab=ck["vocab_size"] if opts.char_cnn is None else None)
    model.load_state_dict(ck["model"])
    model.save_weights(outfile, options_file)
    return path


def cmd_dump_weights(args) -> int:
    path = dump_weights(args.save_dir, args.outfile, args.options_file, args.checkpoint)
    options_file = args.options_file or default_options_file(args.outfile)
    print(json.dumps({"event": "dumped", "checkpoint": path, "weights": args.outfile, "options": options_file}))
    return 0


def main(argv=None) -> int:
    from ..cli import ArgumentParser, run

    parser = ArgumentParser(prog="elmo-fast", description="elmo_fast biLM training")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
