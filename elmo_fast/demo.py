"""``make demo``: pretrain a small biLM on the embedded corpus for a few minutes on CPU, dump it, load it with
``elmo_fast.Elmo`` and show contextual vectors.

    python -m elmo_fast.demo [--time-budget SECONDS] [--save-dir DIR] [--threads N]

Steps: (1) build the default corpus (docstrings of a fixed list of stdlib modules; nothing downloaded);
(2) train the ``small`` config (tokens/s and training loss logged, held-out perplexity with the full softmax
every ``--eval-every`` steps); (3) ``dump-weights`` to options.json + hdf5 in the published layout;
(4) load them with ``elmo_fast.Elmo`` and print cosine similarities of one word in different sentences.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

SENTENCES = [
    # "set": a noun in [0] and [2], a verb in [1] and [3]
    ("set", "Return a new set of the keys ."),
    ("set", "This method will set the value of the attribute ."),
    ("set", "This returns a set containing all the elements ."),
    ("set", "Call this to set the name of the thread ."),
    # "open": a verb in [4] and [6], an adjective in [5] and [7]
    ("open", "Use this function to open the file for reading ."),
    ("open", "Return true if the file is open ."),
    ("open", "The client will open a new connection to the server ."),
    ("open", "Raise an error if the socket is not open ."),
]


class _DemoLog:
    """Human-readable progress plus the JSON lines in SAVE_DIR/train_log.jsonl."""

    def __init__(self, path):
        self.path = path
        self.bar = None
        self.evals = []
        self.tok_s = []

    def __call__(self, rec):
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        ev = rec.get("event")
        if ev == "start":
            print(f"  vocabulary {rec['vocab_size']} words, {rec['n_train_tokens']} training tokens, device "
                  f"{rec['device']}, {rec['threads']} torch thread(s)", flush=True)
        elif ev == "train":
            self.tok_s.append(rec["tokens_per_s"])
            print(f"  step {rec['step']:5d}  loss {rec['loss']:.3f}  (sampled) train ppl {rec['train_perplexity']:9.1f}"
                  f"  {rec['tokens_per_s']:7.0f} tokens/s  {rec['elapsed_s']:6.0f}s", flush=True)
        elif ev == "eval" and rec.get("heldout_perplexity") is not None:
            self.evals.append((rec["step"], rec["heldout_perplexity"]))
            print(f"  >>> held-out perplexity (full softmax) at step {rec['step']}: {rec['heldout_perplexity']:.1f}",
                  flush=True)


def _cos(a, b):
    import torch

    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elmo_fast.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-budget", type=float, default=float(os.environ.get("ELMO_FAST_DEMO_SECONDS", 200)),
                    help="seconds of training (default 200, or $ELMO_FAST_DEMO_SECONDS)")
    ap.add_argument("--save-dir", default=None, help="output directory (default: a fresh temporary directory)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's, one per core: on a 2-vCPU Xeon, 2026-11-26, 2 "
                         "threads trained 1.36-1.42x the tokens of 1 in the same time, the data thread keeping up "
                         "(the log's data_wait 0.001); 1 suits a machine busy with other work, where OpenMP threads "
                         "wait for each other)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--config", default="small")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)

    import torch

    from . import Elmo, ElmoBiLM, batch_to_ids
    from .training.cli import dump_weights, prepare
    from .training.configs import check_memory
    from .training.trainer import DistInfo, Trainer, latest_checkpoint, resolve_device, train_loop

    save_dir = args.save_dir or tempfile.mkdtemp(prefix="elmo_fast_demo_")
    if latest_checkpoint(save_dir) is not None:
        print(f"python -m elmo_fast.demo: --save-dir {save_dir} holds a previous run; choose an empty one",
              file=sys.stderr)
        return 2
    os.makedirs(save_dir, exist_ok=True)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    print(f"elmo_fast demo: pretraining a small biLM for {args.time_budget:.0f}s on CPU; output in {save_dir}")
    print("[1/4] building the embedded corpus (stdlib docstrings, offline)...", flush=True)
    t0 = time.perf_counter()
    targs = argparse.Namespace(save_dir=save_dir, config=args.config, resume=None, corpus=None, heldout=None,
                               vocab=None, time_budget=args.time_budget, n_epochs=10_000, eval_every=args.eval_every,
                               eval_batch_size=16, eval_unroll_steps=20, eval_max_batches=None, log_every=25,
                               checkpoint_every=100_000, backend=args.backend, device="cpu",
                               num_threads=None if args.threads is None else max(1, args.threads))
    dinfo = DistInfo()
    cfg, vocab, train_files, heldout_files, *_ = prepare(targs, dinfo)
    with open(os.path.join(save_dir, "corpus", "corpus.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    print(f"  {meta['train_sentences']} training sentences ({meta['train_tokens']} tokens), "
          f"{meta['heldout_sentences']} held-out ({meta['heldout_tokens']} tokens), {time.perf_counter() - t0:.1f}s")
    device = resolve_device("cpu", dinfo)
    check_memory(cfg, len(vocab), device)
    print(f"[2/4] training: char-CNN {sum(f[1] for f in cfg.filters)} filters, 2x LSTMP {cfg.lstm_dim}->"
          f"{cfg.projection_dim}, batch {cfg.batch_size}x{cfg.unroll_steps}, {cfg.n_negative_samples_batch} "
          "negative samples", flush=True)
    log = _DemoLog(os.path.join(save_dir, "train_log.jsonl"))
    log({"event": "start", "vocab_size": len(vocab), "n_train_tokens": cfg.n_train_tokens, "device": str(device),
         "threads": torch.get_num_threads()})
    trainer = Trainer(cfg, vocab, train_files, heldout_files, save_dir, dinfo, device, None, log)
    first = trainer.evaluate()
    log({"event": "eval", "step": 0, **first})
    summary = train_loop(trainer, log, progress=False)
    steady = log.tok_s[1:] or log.tok_s
    tok_s = sum(steady) / max(len(steady), 1)
    print(f"  trained {summary['step']} steps, {summary['tokens']} tokens in {summary['elapsed_s']:.0f}s: "
          f"{tok_s:.0f} tokens/s (per direction; {torch.get_num_threads()} thread(s))")
    if log.evals:
        print("  held-out perplexity: " + " -> ".join(f"{p:.1f} (step {s})" for s, p in log.evals))

    print("[3/4] dumping weights (published hdf5 layout + options.json)...", flush=True)
    out = os.path.join(save_dir, "elmo")
    os.makedirs(out, exist_ok=True)
    dump_weights(save_dir, os.path.join(out, "weights.hdf5"))
    opt_file, w_file = os.path.join(out, "options.json"), os.path.join(out, "weights.hdf5")
    print(f"  {w_file} ({os.path.getsize(w_file) / 1e6:.1f} MB)")

    print("[4/4] loading with elmo_fast.Elmo and comparing contextual vectors", flush=True)
    elmo = Elmo(opt_file, w_file, num_output_representations=1, dropout=0.0, backend=args.backend)
    bilm = ElmoBiLM(opt_file, w_file, backend=args.backend, stateful=False)
    elmo.eval()
    toks = [s.split() for _, s in SENTENCES]
    ids = batch_to_ids(toks)
    with torch.no_grad():
        reps = elmo(ids)["elmo_representations"][0]
        top = bilm(ids)["activations"][2][:, 1:-1]  # top LSTM layer, boundaries removed
    vec_mix, vec_top = [], []
    for k, (w, _) in enumerate(SENTENCES):
        pos = [t.lower() for t in toks[k]].index(w)
        vec_mix.append(reps[k, pos])
        vec_top.append(top[k, pos])
    for word, idx in (("set", [0, 1, 2, 3]), ("open", [4, 5, 6, 7])):
        print(f"  '{word}' in:")
        for i in idx:
            print(f"    [{i}] {SENTENCES[i][1]}")
        print("    cosine similarity   ELMo mix   top layer")
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                i, j = idx[a], idx[b]
                mix, tp = _cos(vec_mix[i], vec_mix[j]), _cos(vec_top[i], vec_top[j])
                print(f"      [{i}] vs [{j}]        {mix:7.3f}   {tp:7.3f}")
        same = [(idx[0], idx[2]), (idx[1], idx[3])]
        diff = [(idx[0], idx[1]), (idx[0], idx[3]), (idx[2], idx[1]), (idx[2], idx[3])]
        ms = sum(_cos(vec_top[i], vec_top[j]) for i, j in same) / len(same)
        md = sum(_cos(vec_top[i], vec_top[j]) for i, j in diff) / len(diff)
        print(f"    top layer: same usage {ms:.3f} vs different usage {md:.3f} "
              f"({'similar contexts are closer' if ms > md else 'not separated yet: train longer'})")
    print("  (the token layer alone gives cosine 1.000 for every pair: the differences come from context)")
    print(f"done in {time.perf_counter() - t0:.0f}s; weights: {w_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
