"""``elmo-fast``: the command line.

  elmo-fast embed --options O --weights W --input sentences.txt --output out.hdf5 [--layers all|top|average]
  elmo-fast dump-token-embeddings --vocab V --options O --weights W --output out.hdf5
  elmo-fast train ... / elmo-fast dump-weights ...   (pretraining; see `elmo-fast train --help`)
"""
from __future__ import annotations

import argparse
import json
import sys

import h5py
import numpy as np
import torch

from .weights import atomic_h5


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _read_sentences(path: str) -> list[list[str]]:
    from .util import read_utf8

    text = read_utf8(path, "input file", CLIError)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    sentences = []
    for i, line in enumerate(lines):
        toks = line.split()
        if not toks:
            raise CLIError(f"{path}: line {i + 1} is empty; every line must hold one tokenized sentence")
        sentences.append(toks)
    if not sentences:
        raise CLIError(f"{path}: no sentences (the file is empty)")
    return sentences


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return dev


def cmd_embed(args) -> int:
    from tqdm import tqdm

    from .chars import batch_to_ids
    from .models.elmo import ElmoBiLM
    from .util import remove_sentence_boundaries

    sentences = _read_sentences(args.input)
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    dev = _device(args.device)
    model = ElmoBiLM(args.options, args.weights, backend=args.backend, cuda_graph=dev.type == "cuda").to(dev).eval()
    keys: dict[str, str] = {}
    with atomic_h5(args.output) as out, torch.no_grad():
        for start in tqdm(range(0, len(sentences), args.batch_size), desc="embed", unit="batch",
                          disable=args.quiet or not sys.stderr.isatty()):
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
                key = text if args.use_sentence_keys else str(idx)
                if args.use_sentence_keys and key in out:
                    raise CLIError(f"{args.input}: line {idx + 1} repeats an earlier sentence; "
                                   "--use-sentence-keys needs distinct sentences")
                out.create_dataset(key, data=vec.astype(np.float32))
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

    try:
        n = dump_token_embeddings(args.vocab, args.options, args.weights, args.output, batch_size=args.batch_size,
                                  device=_device(args.device), backend=args.backend)
    except OSError as exc:
        raise CLIError(f"cannot read vocabulary {args.vocab}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CLIError(f"vocabulary {args.vocab} is not UTF-8 text") from None
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if not args.quiet:
        print(f"wrote {n} token embeddings to {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elmo-fast", description="A fast and faithful ELMo engine.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--options", required=True, help="options.json of the biLM")
        sp.add_argument("--weights", required=True, help="hdf5 weight file in the published layout")
        sp.add_argument("--output", required=True, help="hdf5 file to write")
        sp.add_argument("--batch-size", type=int, default=64)
        sp.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
        sp.add_argument("--backend", default=None, choices=["auto", "reference", "triton", "cuda"],
                        help="kernel backend (default: $ELMO_FAST_BACKEND, else auto)")
        sp.add_argument("--quiet", action="store_true")

    e = sub.add_parser("embed", help="contextual embeddings of a file of sentences (one tokenized sentence a line)")
    e.add_argument("--input", required=True, help="UTF-8 text, one whitespace-tokenized sentence per line")
    common(e)
    e.add_argument("--layers", choices=["all", "top", "average"], default="all",
                   help="all: (3, n, 2P) per sentence; top: the last layer; average: the mean of the layers")
    e.add_argument("--use-sentence-keys", action="store_true", help="name datasets by the sentence text")
    e.add_argument("--forget-sentences", action="store_true",
                   help="reset the LSTM state after every batch (no sentence_to_index map is written)")
    e.set_defaults(func=cmd_embed)

    d = sub.add_parser("dump-token-embeddings", help="context-independent token-layer vectors of a vocabulary")
    d.add_argument("--vocab", required=True, help="one token a line")
    common(d)
    d.set_defaults(func=cmd_dump_token_embeddings, batch_size=4096)

    try:
        from .training.cli import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from .options import OptionsError
    from .weights import WeightFileError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, OptionsError, WeightFileError, FileNotFoundError) as exc:
        print(f"elmo-fast {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
