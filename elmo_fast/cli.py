"""``elmo-fast``: the command line.

  elmo-fast embed --options O --weights W --input sentences.txt --output out.hdf5 [--layers all|top|average]
  elmo-fast dump-token-embeddings --vocab V --options O --weights W --output out.hdf5
  elmo-fast train ... / elmo-fast dump-weights ...   (pretraining; see `elmo-fast train --help`)

Every command checks all its arguments and paths before it does any work or writes anything. A user error is
one line on stderr and exit code 2; SIGINT / SIGTERM remove the temporary files, print one line and exit with
130 / 143. Outputs are written under temporary names and renamed into place at the end.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import warnings

import h5py
import numpy as np
import torch

from . import __version__, _signals
from ._backend import BACKENDS
from .util import (check_backend, check_input_file, check_output_file, check_output_not_input, parse_device,
                   read_utf8, text_lines)
from .weights import atomic_h5

MODEL_OPS = ("char_cnn", "highway", "lstmp")  # the ops a biLM forward runs


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2), like every other error of the command line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _read_sentences(path: str, sentence_keys: bool) -> list[list[str]]:
    lines = text_lines(read_utf8(path, "input file", CLIError))
    sentences = []
    seen: dict[str, int] = {}
    for i, line in enumerate(lines):
        toks = line.split()
        if not toks:
            raise CLIError(f"{path}: line {i + 1} is empty; every line must hold one tokenized sentence")
        if sentence_keys:
            key = " ".join(toks)
            if key in seen:
                raise CLIError(f"{path}: line {i + 1} repeats line {seen[key] + 1}; --use-sentence-keys needs "
                               "distinct sentences")
            if "/" in key or key == ".":
                raise CLIError(f"{path}: line {i + 1} ({key!r}) cannot name an hdf5 dataset ('/' separates groups, "
                               "'.' is the file itself); omit --use-sentence-keys to key by line number")
            seen[key] = i
        sentences.append(toks)
    if not sentences:
        raise CLIError(f"{path}: no sentences (the file is empty)")
    return sentences


def _check_model_args(args, *inputs: tuple[str, str]) -> torch.device:
    """The model files, the device and the backend of embed / dump-token-embeddings, and that --output names none of
    the files read (``inputs``: (flag, path) pairs besides --options and --weights); returns the device."""
    check_input_file(args.options, "--options", CLIError)
    check_input_file(args.weights, "--weights", CLIError)
    check_output_file(args.output, "--output", CLIError)
    check_output_not_input(args.output, (*inputs, ("--options", args.options), ("--weights", args.weights)),
                           "--output", CLIError)
    if args.device is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = parse_device(args.device, "--device", CLIError)
    check_backend(args.backend, dev, MODEL_OPS, error=CLIError)
    return dev


def cmd_embed(args) -> int:
    from tqdm import tqdm

    from .chars import batch_to_ids
    from .models.elmo import ElmoBiLM
    from .util import remove_sentence_boundaries

    check_input_file(args.input, "--input", CLIError)
    dev = _check_model_args(args, ("--input", args.input))
    sentences = _read_sentences(args.input, args.use_sentence_keys)
    model = ElmoBiLM(args.options, args.weights, backend=args.backend, cuda_graph=dev.type == "cuda").to(dev).eval()
    keys: dict[str, str] = {}
    with atomic_h5(args.output) as out, torch.no_grad():
        for start in tqdm(range(0, len(sentences), args.batch_size), desc="embed", unit="batch",
                          disable=args.quiet or not sys.stderr.isatty()):
            _signals.check_signals()  # a signal whose exception a finalizer swallowed stops us here
            batch = sentences[start : start + args.batch_size]
            res = model(batch_to_ids(batch).to(dev))
            layers = torch.stack(res["activations"], 1)  # (B, 3, T+2, D)
            B, n_layers, T2, D = layers.shape
            flat, mask = remove_sentence_boundaries(layers.permute(0, 2, 1, 3).reshape(B, T2, -1), res["mask"])
            emb = flat.reshape(B, T2 - 2, n_layers, D).permute(0, 2, 1, 3)
            for k, sent in enumerate(batch):
                idx = start + k
                vec = emb[k, :, : len(sent)].float().cpu().numpy()
                if args.layers == "top":
                    vec = vec[-1]
                elif args.layers == "average":
                    vec = vec.mean(0)
                text = " ".join(sent)
                out.create_dataset(text if args.use_sentence_keys else str(idx), data=vec.astype(np.float32))
                keys.setdefault(text, str(idx))
            if args.forget_sentences:
                model.reset_states()
        if not args.use_sentence_keys and not args.forget_sentences:
            dt = h5py.string_dtype(encoding="utf-8")
            ds = out.create_dataset("sentence_to_index", (1,), dtype=dt)
            ds[0] = json.dumps(keys)
    if not args.quiet:
        print(f"wrote {len(sentences)} sentence embeddings to {args.output}")
    return 0


def cmd_dump_token_embeddings(args) -> int:
    from .compat import dump_token_embeddings

    check_input_file(args.vocab, "--vocab", CLIError)
    dev = _check_model_args(args, ("--vocab", args.vocab))
    try:
        n = dump_token_embeddings(args.vocab, args.options, args.weights, args.output, batch_size=args.batch_size,
                                  device=dev, backend=args.backend)
    except ValueError as exc:  # an empty or non-UTF-8 vocabulary
        raise CLIError(str(exc)) from None
    if not args.quiet:
        print(f"wrote {n} token embeddings to {args.output}")
    return 0


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="elmo-fast", description="A fast and faithful ELMo engine.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, batch_size: int):
        sp.add_argument("--options", required=True, help="options.json of the biLM (required)")
        sp.add_argument("--weights", required=True, help="hdf5 weight file in the published layout (required)")
        sp.add_argument("--output", required=True, help="hdf5 file to write (required; its folder must exist; "
                        "written under a temporary name and renamed into place at the end)")
        sp.add_argument("--batch-size", type=_positive_int, default=batch_size,
                        help=f"sentences or tokens per batch (default: {batch_size})")
        sp.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
        sp.add_argument("--backend", default=None, choices=list(BACKENDS),
                        help="kernel backend (default: $ELMO_FAST_BACKEND, else auto)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar and no summary line (default: off)")

    e = sub.add_parser("embed", help="contextual embeddings of a file of sentences (one tokenized sentence a line)",
                       description="Contextual embeddings of a file of sentences, in bilm-tf/AllenNLP's dump "
                       "format. The model is stateful: sentences run in file order in batches of --batch-size, "
                       "and each batch starts from the LSTM state the previous one left, so the vectors depend on "
                       "--batch-size and on the preceding lines (see --forget-sentences).")
    e.add_argument("--input", required=True, help="UTF-8 text, one whitespace-tokenized sentence a line (required)")
    common(e, 64)
    e.add_argument("--layers", choices=["all", "top", "average"], default="all",
                   help="all: (3, n, 2P) per sentence; top: the last layer; average: the mean of the layers "
                   "(default: all)")
    e.add_argument("--use-sentence-keys", action="store_true",
                   help="name the datasets by the sentence text instead of the line index (default: off)")
    e.add_argument("--forget-sentences", action="store_true",
                   help="reset the LSTM state after every batch, so that a batch does not depend on the ones "
                   "before it; no sentence_to_index map is written (default: off)")
    e.set_defaults(func=cmd_embed)

    d = sub.add_parser("dump-token-embeddings", help="context-independent token-layer vectors of a vocabulary",
                       description="The token layer (character CNN) of every vocabulary line, in file order: "
                       "the dataset 'embedding' (n_vocab, P), bilm-tf's format.")
    d.add_argument("--vocab", required=True, help="vocabulary file, one token a line (required)")
    common(d, 4096)
    d.set_defaults(func=cmd_dump_token_embeddings)

    try:
        from .training.cli import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return p


def _warn_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"elmo-fast: warning: {message}", file=sys.stderr)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command: user errors one line with exit code 2, signals 128 + signum."""
    from ._backend import BackendUnavailableError
    from .options import OptionsError
    from .training.configs import ConfigError
    from .training.data import DataError
    from .weights import WeightFileError

    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a usage error (2, one line already printed), or --help / --version (0)
        return exc.code if isinstance(exc.code, int) else 0
    handlers, unraisable = {}, sys.unraisablehook
    if threading.current_thread() is threading.main_thread():
        _signals.PENDING.clear()
        handlers = {s: signal.signal(s, _signals.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        sys.unraisablehook = _signals.quiet_unraisable(unraisable)
    show = warnings.showwarning
    warnings.showwarning = _warn_one_line
    try:
        return int(args.func(args) or 0)
    except (CLIError, OptionsError, WeightFileError, ConfigError, DataError, BackendUnavailableError,
            OSError) as exc:
        print(f"elmo-fast {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except _signals.Signalled as sig:
        name = signal.Signals(sig.signum).name
        print(f"elmo-fast {args.command}: interrupted by {name}; temporary files removed", file=sys.stderr)
        return 128 + sig.signum
    finally:
        warnings.showwarning = show
        for s, h in handlers.items():
            signal.signal(s, h)
        if handlers:
            sys.unraisablehook = unraisable
            _signals.PENDING.clear()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
