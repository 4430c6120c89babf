"""biLM pretraining (spec §6.4-§6.7): the bilm-tf training graph, Adagrad with sparse softmax rows, stateful TBPTT,
atomic checkpoints with exact resume, held-out perplexity, and DDP-style data parallelism.

Design notes
------------
* **Towers.** As in bilm-tf's multi-GPU training every tower has its own rows, data stream (its own subset of the
  shards when there are enough, else all shards with its own seed), negative sampler and LSTM state. A run has
  ``world_size x cfg.towers`` towers; one process can hold several (``--towers``), so 1 process x 2 towers and
  2 processes x 1 tower compute the same thing. Dropout masks are drawn from a seed derived from (seed, step,
  tower), so they do not depend on how the towers are laid out over processes either. A process's towers run one
  after the other, or (``fuse_towers``, the GPU default) in one model pass over all their rows, each tower still
  with its own masks (``ops.dropout.row_groups``), sample sets, loss and states: the same step but for the order
  of floating-point sums, with larger GEMMs and a third of the encoder's and LSTMs' launches for 3 towers (each
  dropout site and the softmax still run per tower), and every tower's activations in memory at once.
* **Loss and gradients.** Per tower ``0.5 (fwd + bwd)`` of the mean sampled-softmax loss (the two directions draw
  their own sample sets and share ``softmax_W``/``softmax_b``); gradients are taken of ``loss x unroll_steps`` and
  averaged over towers.
* **Sparse softmax.** ``SampledSoftmaxLoss(sparse=True)`` gives sparse COO gradients for the rows a tower touches
  (targets of both directions + both sample sets): no (V, P) dense gradient is ever materialised. The samples are
  drawn by the trainer with one generator per tower and passed in. Towers' row gradients are concatenated and
  deduplicated by summing, as TF does for IndexedSlices. Across processes we **all-gather the touched rows**
  (ids + gradient rows, padded to the largest count), then deduplicate, rather than densify-and-allreduce: each
  rank receives world x (at most 2·B·T + 2·S) softmax rows instead of all V rows (a word-input model's embedding:
  2·B·T more, its own table or the tied softmax's). For the original model (B 128, T 20,
  S 8192, V 793k) on 3 GPUs that is <= 64k rows against 793k, about 12x less traffic, and no (V, P) buffer.
* **Clipping and update.** Global-norm clipping over all dense gradients and the deduplicated row gradients, then
  Adagrad as TF1 applies it (``acc += g²; w -= lr·g/√acc``, accumulator initialised to 1.0, no epsilon); for the
  softmax only the touched rows' weights and accumulators change, which is exactly what dense Adagrad would do
  for them (the other rows' gradient is 0). On the CPU (fp32, with ``elmo_fast._cpu``) the row sums and the row
  update are one pass each with no temporaries (csrc/cpu/sparse_rows.cpp), the same arithmetic as the torch ops
  (whose ``sqrt_`` may differ by an ulp: MKL's vsSqrt; the compiled update rounds it correctly, as torch's fused
  dense Adagrad does).
* **State carry.** The final (h, c) of every layer/direction/tower is detached and fed into the next batch.
* **Determinism.** With ``deterministic`` a step and an evaluation run in ``elmo_fast.determinism``'s mode (no
  atomics, torch's deterministic algorithms), so GPU runs and resumes are bit-identical too (README).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .._signals import check_signals
from ..chars import Vocabulary
from ..cpu.ext import cpu_ext_for, denormals_flushed
from ..cpu.memory import keep_freed_memory
from ..cpu.gemm import gemm_timings, restore_gemm_timings
from ..cpu.packed import pack_timings, restore_pack_timings
from ..determinism import deterministic
from ..models.bilm import BiLM
from ..options import ElmoOptions
from ..modules.sampled_softmax import SampledSoftmaxLoss
from ..ops.dropout import RowGroups, rng_state, row_groups
from ..ops.dropout import dropout as hashed_dropout
from ..ops.softmax import log_uniform_sample
from ..ops.lstmp import trusted_lengths
from ..util import parse_device
from .configs import ConfigError, TrainConfig, fuses_towers
from .data import BackgroundLoader, BidirectionalStream, ProcessLoader

CHECKPOINT_VERSION = 1


# ----------------------------------------------------------------------------------------------- distributed
@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str = "auto") -> DistInfo:
    """Initialise torch.distributed from torchrun's environment (NCCL on GPU, gloo on CPU); no-op otherwise."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return DistInfo(rank, world, local_rank, False)
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if not use_cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return DistInfo(rank, world, local_rank, True)


def resolve_device(pref: str, dinfo: DistInfo) -> torch.device:
    """The training device: ``pref`` checked by ``util.parse_device`` ("auto": cuda where there is a GPU, else cpu);
    a bare "cuda" becomes this process's GPU (its local rank under torchrun)."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    dev = parse_device(pref, "device", ConfigError)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", dinfo.local_rank if dinfo.enabled else torch.cuda.current_device())
    return dev


def _mix_seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


# ----------------------------------------------------------------------------------------------- the trainer
class TowerStream:
    """A tower's batches: the arrays as tensors, and on a GPU (``ahead``) pinned, with the tower's two sample
    sets (forward, backward) drawn in the data thread from its CPU generator, so the step uploads everything
    with ``non_blocking`` and never waits on the host. On the CPU the step draws the samples itself from the same
    generator (the same ids): sampler ops in the data thread would start a second OpenMP team that competes with
    the step's for the cores (measured: the small config's step 87 -> 160 ms on 2 cores). The state is the
    stream's, plus the sampler's when it draws ahead, so a resumed run draws what an uninterrupted one would."""

    KEYS = ("tokens_characters", "tokens_characters_reverse", "next_token_id", "next_token_id_reverse")
    WORD_KEYS = ("token_ids", "token_ids_reverse", "next_token_id", "next_token_id_reverse")

    def __init__(self, stream: BidirectionalStream, sampler: torch.Generator | None, num_samples: int,
                 vocab_size: int, ahead: bool, pin: bool | None = None, keys: tuple[str, ...] = KEYS):
        self.stream, self.sampler, self.ahead, self.keys = stream, sampler, ahead, keys
        self.pin = ahead if pin is None else pin  # False in a loader process: the trainer's process pins
        self.num_samples, self.vocab_size = num_samples, vocab_size

    def draw(self) -> tuple[torch.Tensor, list[int]]:
        """Two sample sets (forward, backward): ids (2, S) on the CPU, num_tries of each."""
        draws = [log_uniform_sample(self.num_samples, self.vocab_size, generator=self.sampler) for _ in range(2)]
        return torch.stack([ids for ids, _ in draws]), [tries for _, tries in draws]

    def next_batch(self) -> dict:
        if self.keys == self.KEYS:  # char inputs: the distinct tokens of both directions, found here (run_model)
            b, rows, inverse = self.stream.next_batch_and_tokens(chars=False)
            # ... instead of the batch's char ids (KEYS[:2], not made): ~1/6 of the bytes to pickle, unpickle, pin
            # and upload a step (rows (U, L) int16: ids < 262; inverse int32; bench_data.py's payload rows)
            b = {**b, "char_rows": rows.astype(np.int16), "char_inverse": inverse.astype(np.int32)}
        else:
            b = self.stream.next_batch()
        out = {k: torch.from_numpy(b[k]) for k in (*self.keys, "char_rows", "char_inverse") if k in b}
        if self.ahead and self.sampler is not None:
            out["sampled_ids"], out["num_tries"] = self.draw()
        return self.pinned(out) if self.pin else out

    @staticmethod
    def pinned(batch: dict) -> dict:
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def get_state(self) -> dict:
        return {"data": self.stream.get_state(),
                "sampler": self.sampler.get_state() if self.ahead and self.sampler is not None else None}

    def set_state(self, st: dict) -> None:
        self.stream.set_state(st["data"])
        if self.ahead and self.sampler is not None:
            self.sampler.set_state(st["sampler"])


class Tower:
    def __init__(self, gid: int, loader: BackgroundLoader, stream: TowerStream, h: torch.Tensor, c: torch.Tensor):
        self.gid = gid
        self.loader = loader
        self.stream = stream
        self.h = h
        self.c = c

    def state(self) -> dict:
        """The data position after the last consumed batch and the sampler state after its draws."""
        st = dict(self.loader.position)
        if not self.stream.ahead and self.stream.sampler is not None:
            st["sampler"] = self.stream.sampler.get_state()
        return st


def _fused_chars(per: list, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The towers' distinct tokens (each tower's ``Trainer.char_tensors``, or None) for their rows side by side
    (``_fused_step``: every tower's forward inputs, then every tower's backward ones), each tower's ``tokens``
    (B·T) a direction: the rows one after the other, each inverse shifted past the towers' rows before it. A token in
    two towers is encoded twice (the same result). None where a tower's batch has none."""
    if any(p is None for p in per):
        return None
    shift = [0]
    for rows, _ in per[:-1]:
        shift.append(shift[-1] + rows.shape[0])
    fwd = [inv[:n] + s for (_, inv), n, s in zip(per, tokens, shift)]
    bwd = [inv[n:] + s for (_, inv), n, s in zip(per, tokens, shift)]
    return torch.cat([rows for rows, _ in per]), torch.cat(fwd + bwd)


def tower_shards(shards: list[str], gid: int, n_towers: int) -> list[str]:
    """Tower ``gid`` reads shards gid, gid + n, ... when there are at least n shards, else all of them."""
    return shards[gid::n_towers] if len(shards) >= n_towers else list(shards)


PHASES = ("data", "forward", "backward", "optimizer")
PHASE_PREFIX = "elmo_fast.step."  # a phase's range is named PHASE_PREFIX + its name


def _phase(name: str):
    """A named range of the training step (``elmo_fast.step.<name>``, one of ``PHASES``) for torch.profiler: a
    profile, and its trace, then show where a step's host and device time go by phase (bench_train --profile).
    Outside a profiler it costs two dispatcher calls (enter, exit). On a GPU the backward's kernels are launched
    from autograd's device thread, outside the main thread's range: a profile counts them apart."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


def _in_mode(method):
    """Run a Trainer method in deterministic mode when the configuration asks for it, and on the CPU with denormals
    flushed to zero, as TensorFlow runs its CPU ops (``cpu.ext.denormals_flushed``); the previous modes after."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with contextlib.ExitStack() as modes:
            if self.cfg.deterministic:
                modes.enter_context(deterministic())
            if self.device.type == "cpu":
                modes.enter_context(denormals_flushed())
            return method(self, *args, **kwargs)
    return wrapped


class Trainer:
    def __init__(self, cfg: TrainConfig, vocab: Vocabulary, train_shards: list[str] | None,
                 heldout_shards: list[str] | None, save_dir: str, dinfo: DistInfo | None = None,
                 device: torch.device | None = None, checkpoint: dict | None = None, log=None,
                 init: dict | None = None):
        self.cfg = cfg.validate()
        self.vocab = vocab
        self.V = len(vocab)
        if cfg.sample_softmax and cfg.n_negative_samples_batch > self.V:
            raise ConfigError(f"n_negative_samples_batch ({cfg.n_negative_samples_batch}) exceeds the vocabulary "
                              f"size ({self.V}); lower it (--n-negative-samples-batch)")
        self.train_shards = train_shards
        self.heldout_shards = heldout_shards
        self.save_dir = save_dir
        self.dinfo = dinfo or DistInfo()
        self.device = device or torch.device("cpu")
        self._log = log or (lambda rec: None)
        if self.device.type == "cpu":
            keep_freed_memory()  # large per-step buffers come back from the heap, not as fresh pages
        self.n_towers_total = self.dinfo.world_size * cfg.towers
        self.options = cfg.options(self.V)
        opts = ElmoOptions.from_dict(self.options)
        torch.manual_seed(cfg.seed)
        self.model = BiLM(opts, backend=cfg.backend, stateful=False,
                          n_tokens_vocab=None if cfg.char_inputs else self.V).to(self.device)
        self.embedding = self.model.word_embedding  # a word-input model's (V, P) table, else None
        self.batch_keys = TowerStream.KEYS if cfg.char_inputs else TowerStream.WORD_KEYS
        P = cfg.projection_dim
        self.P = P
        self.softmax = SampledSoftmaxLoss(self.V, P, min(cfg.n_negative_samples_batch, self.V), sparse=True, seed=0,
                                          sample_softmax=cfg.sample_softmax, backend=cfg.backend,
                                          share_embedding=self.embedding if cfg.share_embedding_softmax else None
                                          ).to(self.device)
        self.softmax_W = self.softmax.softmax_W
        self.softmax_b = self.softmax.softmax_b
        # updated by rows (sparse gradients): the word embedding, like the softmax tables; a forward-only LM leaves
        # the backward stack out
        skip = {id(self.embedding)}
        if not cfg.bidirectional:
            skip |= {id(p) for p in self.model.backward_lstm.parameters()}
        self.dense_params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in skip]
        self.acc_dense = [torch.full_like(p, cfg.initial_accumulator_value) for p in self.dense_params]
        self.acc_W = torch.full_like(self.softmax_W, cfg.initial_accumulator_value)
        self.acc_b = torch.full_like(self.softmax_b, cfg.initial_accumulator_value)
        self.acc_emb = None
        self.row_params = [(self.softmax_W, self.acc_W), (self.softmax_b, self.acc_b)]
        if self.embedding is not None and not cfg.share_embedding_softmax:
            self.acc_emb = torch.full_like(self.embedding, cfg.initial_accumulator_value)
            self.row_params.append((self.embedding, self.acc_emb))
        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.data_wait_s = 0.0  # time train_step spent waiting for the data worker's batches (this process)
        self.autocast = (self.device.type == "cuda" and cfg.bf16)
        tower_states = {}
        if checkpoint is not None:
            self._load_state(checkpoint)
            tower_states = {t["gid"]: t for t in checkpoint["towers"]}
            if len(checkpoint["towers"]) != self.n_towers_total:
                raise ConfigError(f"the checkpoint has {len(checkpoint['towers'])} towers but this run has "
                                  f"{self.n_towers_total} (world size {self.dinfo.world_size} x --towers "
                                  f"{cfg.towers}); resume with the same layout")
        elif init is not None:  # a new run from a checkpoint's weights and accumulators (bilm-tf's restart.py)
            self._load_weights(init)
        elif self.dinfo.enabled:
            self._broadcast_params()
        self.towers: list[Tower] = []
        L, H, B = cfg.n_layers, cfg.lstm_dim, cfg.batch_size
        for j in range(cfg.towers if train_shards is not None else 0):  # none: an evaluation-only trainer
            gid = self.dinfo.rank * cfg.towers + j
            stream = BidirectionalStream(tower_shards(train_shards, gid, self.n_towers_total), vocab, B,
                                         cfg.unroll_steps, cfg.max_characters_per_token, test=False,
                                         seed=f"{cfg.seed}/tower{gid}")
            st = tower_states.get(gid)
            gen = None
            if cfg.sample_softmax:
                gen = torch.Generator()
                gen.manual_seed(_mix_seed(cfg.seed, 7919, gid))
            h = torch.zeros(2, L, B, P, device=self.device)
            c = torch.zeros(2, L, B, H, device=self.device)
            gpu = self.device.type == "cuda"
            in_process = cfg.data_worker == "process" or (cfg.data_worker == "auto" and gpu)
            ready = TowerStream(stream, gen, self.softmax.num_samples, self.V, ahead=gpu, pin=gpu and not in_process,
                                keys=self.batch_keys)
            if st is not None:
                h, c = st["h"].to(self.device), st["c"].to(self.device)
                if gen is not None:
                    gen.set_state(st["sampler"])
            state = {"data": st["data"], "sampler": st["sampler"]} if st is not None else None
            if in_process:
                loader = ProcessLoader(ready, cfg.queue_size, state, prepare=TowerStream.pinned if gpu else None)
            else:
                loader = BackgroundLoader(ready, cfg.queue_size, state)
            self.towers.append(Tower(gid, loader, ready, h, c))
        self.fused = fuses_towers(cfg, self.device.type == "cuda")

    # ------------------------------------------------------------------ forward
    def run_batch(self, batch: dict, h0: torch.Tensor, c0: torch.Tensor, training: bool):
        """Token encoder + both LSTM stacks on a packed batch. Returns (top_fwd (B,T,P), top_bwd (B,T,P), h_n, c_n,
        targets_fwd (B,T), targets_bwd (B,T), outputs) where the backward tensors are in reversed-stream order."""
        return self.run_model(*self.batch_tensors(batch), h0, c0, training, chars=self.char_tensors(batch))

    def batch_tensors(self, batch: dict) -> tuple[torch.Tensor | None, ...]:
        """The batch's arrays on the device: (inputs fwd, inputs bwd, targets fwd, targets bwd (B, T)); the inputs
        are char ids (B, T, L), or word ids (B, T) for a word-input model, or None in a batch of ``TowerStream``'s
        that brings its distinct tokens instead (``char_tensors``)."""
        return tuple(torch.as_tensor(batch[k]).to(self.device, non_blocking=True) if k in batch else None
                     for k in self.batch_keys)

    def char_tensors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's distinct tokens found by its data stream (``TowerStream``: rows (U, L), inverse (2·B·T,) over
        the forward inputs then the backward ones) on the device, or None (a batch from elsewhere: the token encoder
        deduplicates on the device)."""
        if "char_rows" not in batch:
            return None
        rows, inverse = (torch.as_tensor(batch[k]).to(self.device, non_blocking=True)
                         for k in ("char_rows", "char_inverse"))
        return rows, inverse

    def run_model(self, cf: torch.Tensor | None, cb: torch.Tensor | None, tf: torch.Tensor, tb: torch.Tensor,
                  h0: torch.Tensor, c0: torch.Tensor, training: bool,
                  chars: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``run_batch`` on the batch's tensors (``batch_tensors``; ``chars``: ``char_tensors``' for both
        directions, which a char batch's inputs ``cf``/``cb`` may then leave None)."""
        dev = self.device
        B, T = tf.shape
        bi = self.cfg.bidirectional
        n = 2 * B if bi else B  # rows through the token encoder
        if chars is not None:  # (a forward-only model: the inverse's first B·T; the reverse tokens' rows idle)
            emb = self.model.token_encoder.encode_tokens(chars[0].long(), chars[1][: n * T], (n, T))
        elif cf is None:
            raise ValueError("run_model: a char batch without its char ids (tokens_characters) needs its distinct "
                             "tokens (chars=Trainer.char_tensors(batch))")
        else:  # char ids (evaluation's batches: the token encoder deduplicates), or word ids (a word-input model:
            # row gradients, as TF's embedding_lookup gives (IndexedSlices))
            x = (torch.cat([cf, cb], 0) if bi else cf).long()
            emb = self.model.token_encoder(x) if self.embedding is None else F.embedding(x, self.embedding, sparse=True)
        ef, eb = emb[:B], (emb[B:] if bi else None)
        lengths = torch.full((B,), T, dtype=torch.long, device=dev)
        p = self.cfg.dropout if training else 0.0
        # The backward LM runs left to right over the reversed stream; the reverse-direction stack scans right to
        # left, so it is given the time-flipped stream (all rows are full, so a flip is the reverse_sequence).
        # The states stay fp32 under autocast (the ops keep the cell state in its own dtype); every row is full,
        # so the lengths need no range check (no host sync).
        with trusted_lengths():
            fwd, bwd, h_n, c_n = self.model.run_lstms(ef, lengths, h0, c0, dropout=p, bidirectional=bi,
                                                      token_embedding_bwd=eb.flip(1) if bi else None)
        top_f, top_b = fwd[-1], (bwd[-1].flip(1) if bi else None)
        if training and p > 0:
            top_f = hashed_dropout(top_f, p, backend=self.cfg.backend)
            top_b = hashed_dropout(top_b, p, backend=self.cfg.backend) if bi else None
        return top_f, top_b, h_n, c_n, tf, tb, {"emb_fwd": ef, "emb_bwd": eb, "fwd": fwd,
                                               "bwd": [o.flip(1) for o in bwd]}

    def model_loss(self, cf: torch.Tensor | None, cb: torch.Tensor | None, tf: torch.Tensor, tb: torch.Tensor,
                   h0: torch.Tensor, c0: torch.Tensor, samples: tuple[torch.Tensor, list[int]] | None = None,
                   chars: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The model step of training, forward and loss of one tower batch: (loss, h_n, c_n). The batch's tensors
        (``batch_tensors``), the LSTM states, with the sampled softmax the two sample sets (ids (2, S) on the
        device, num_tries of each), and the batch's distinct tokens where its stream found them (``char_tensors``;
        then its char ids ``cf``/``cb`` are None: ``TowerStream`` ships the distinct tokens instead). No host work:
        this is the function to hand to ``torch.compile`` (the step of towers one after the other; ``_fused_step``
        swaps generator states, which a compiled graph cannot)."""
        top_f, top_b, h_n, c_n, tf, tb, _ = self.run_model(cf, cb, tf, tb, h0, c0, training=True, chars=chars)
        return self._head_loss(top_f, top_b, tf, tb, samples), h_n, c_n

    def _head_loss(self, top_f, top_b, tf, tb, samples):
        """One tower's loss from its top layers (B, T, P) and targets (B, T): bilm-tf's mean of the two directions'
        sampled-softmax losses (each direction with its own sample set), or the forward LM's alone."""
        return self._head_losses([(top_f, top_b, tf, tb, samples)])[0]

    def _head_losses(self, heads):
        """``_head_loss`` of each tower's ``(top_f, top_b, tf, tb, samples)``. With the sampled softmax and both
        directions every tower's two directions go to one softmax call (``SampledSoftmaxLoss.forward_groups``: on the
        triton backend one launch of each kernel for all the towers, on the cpu backend one operator a tower)."""
        sm = self.softmax
        if self.cfg.bidirectional and self.cfg.sample_softmax:
            groups = []
            for top_f, top_b, tf, tb, (ids, tries) in heads:
                groups += [(top_f, tf, (ids[0], tries[0])), (top_b, tb, (ids[1], tries[1]))]
            losses = sm.forward_groups(groups)
            return [0.5 * (lf.float() + lb.float()) for lf, lb in zip(losses[::2], losses[1::2])]
        return [self._head_loss_each(*h) for h in heads]

    def _head_loss_each(self, top_f, top_b, tf, tb, samples):
        """``_head_loss`` one direction at a time (the full softmax, or the forward LM alone)."""
        sm = self.softmax
        losses = []
        for d, (top, targets) in enumerate(((top_f, tf), (top_b, tb))[: 1 + self.cfg.bidirectional]):
            h = top.reshape(-1, self.P)  # under autocast the softmax runs its bf16 variant, fp32 accumulation
            if samples is not None:
                ids, tries = samples
                losses.append(sm(h, targets.reshape(-1), samples=(ids[d], tries[d])).float())
            else:
                losses.append(sm(h, targets.reshape(-1)).float())
        # bilm-tf: the mean of the two directions' losses, or the forward LM's alone
        return 0.5 * (losses[0] + losses[1]) if len(losses) == 2 else losses[0]

    def _samples(self, tw: Tower, batch: dict):
        """The tower's two sample sets for this batch (drawn ahead with the batch on a GPU), ids on the device."""
        if not self.cfg.sample_softmax:
            return None
        ids, tries = (batch["sampled_ids"], batch["num_tries"]) if tw.stream.ahead else tw.stream.draw()
        return ids.to(self.device, non_blocking=True), tries

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _tower_step(self, tw: Tower, batch: dict, scale: float):
        cfg = self.cfg
        torch.manual_seed(_mix_seed(cfg.seed, self.step, tw.gid))  # dropout masks: same for any tower layout
        with _phase("forward"):
            inputs = self.batch_tensors(batch)
            samples = self._samples(tw, batch)
            chars = self.char_tensors(batch)
            self.softmax.train()
            with self._autocast():
                loss, h_n, c_n = self.model_loss(*inputs, tw.h, tw.c, samples, chars)
        with _phase("backward"):
            (loss * (cfg.unroll_steps * scale)).backward()
        tw.h, tw.c = h_n.detach().float(), c_n.detach().float()
        return loss.detach()

    def _fused_step(self, batches: list[dict], scale: float) -> list[torch.Tensor]:
        """The towers' step in one model pass (``fuse_towers``): their rows side by side through the token encoder
        and the LSTMs, each tower's dropout masks drawn from its own seed (``ops.dropout.row_groups``: the masks
        the tower gets alone), each tower's loss from its own rows and sample sets, one backward of the weighted
        sum, each tower's final states split back. The same step as ``_tower_step`` tower after tower, but for
        the order of floating-point sums; activations of all towers are kept at once."""
        cfg, towers = self.cfg, self.towers
        states = []
        for tw in towers:  # each tower's generators as its own step would seed them
            torch.manual_seed(_mix_seed(cfg.seed, self.step, tw.gid))
            states.append(rng_state(self.device))
        with _phase("forward"):
            per = [self.batch_tensors(b) for b in batches]
            cf, cb, tf, tb = (None if per[0][i] is None else torch.cat([p[i] for p in per], 0) for i in range(4))
            samples = [self._samples(tw, b) for tw, b in zip(towers, batches)]
            B = [p[2].shape[0] for p in per]
            chars = _fused_chars([self.char_tensors(b) for b in batches], [b * tf.shape[1] for b in B])
            h0, c0 = torch.cat([tw.h for tw in towers], 2), torch.cat([tw.c for tw in towers], 2)
            self.softmax.train()
            groups = RowGroups(B, states, self.device)
            with self._autocast(), row_groups(groups):
                top_f, top_b, h_n, c_n, tf, tb, _ = self.run_model(cf, cb, tf, tb, h0, c0, training=True,
                                                                   chars=chars)
                parts = [t.split(B, 0) if t is not None else [None] * len(B) for t in (top_f, top_b, tf, tb)]
                losses = self._head_losses([(*(p[g] for p in parts), samples[g]) for g in range(len(towers))])
        # the generators are left where the last tower's own step leaves them: its group draws last at each site
        with _phase("backward"):
            (torch.stack(losses).sum() * (cfg.unroll_steps * scale)).backward()
        for tw, h, c in zip(towers, h_n.detach().split(B, 2), c_n.detach().split(B, 2)):
            tw.h, tw.c = h.float().contiguous(), c.float().contiguous()
        return [loss.detach() for loss in losses]

    @_in_mode
    def train_step(self) -> torch.Tensor:
        """One optimisation step over all towers. Returns the mean (over towers) sampled loss, as a tensor.

        No host synchronisation: every shape is fixed by the configuration (the softmax rows are summed by
        ``sum_rows``), the clip factor stays a tensor, and the loss is returned as a tensor."""
        self.model.train()
        for p in [*self.dense_params, *(t for t, _ in self.row_params)]:
            p.grad = None
        scale = 1.0 / self.n_towers_total
        if self.fused:
            t0 = time.perf_counter()
            with _phase("data"):
                batches = [next(tw.loader) for tw in self.towers]
            self.data_wait_s += time.perf_counter() - t0
            losses = self._fused_step(batches, scale)
        else:
            losses = []
            for tw in self.towers:
                t0 = time.perf_counter()
                with _phase("data"):
                    batch = next(tw.loader)
                self.data_wait_s += time.perf_counter() - t0
                losses.append(self._tower_step(tw, batch, scale))
        with _phase("optimizer"):
            return self._update(losses)

    def _update(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's end: the towers' mean loss, the gradients gathered (row gradients summed by row), clipped by
        their global norm, and Adagrad on the dense parameters and on the touched rows of the row tables."""
        cfg = self.cfg
        loss = torch.stack(losses).sum() / self.n_towers_total
        dense, accs = list(self.dense_params), list(self.acc_dense)
        tables, rows, vals = [], [], []  # the tables with row gradients: softmax W and b, a word embedding
        for p, acc in self.row_params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                v = g._values()
                tables.append((p, acc))
                rows.append(g._indices()[0])
                vals.append(v.reshape(v.shape[0], -1))
            else:  # full softmax: dense gradients, updated with the other dense parameters
                dense.append(p)
                accs.append(acc)
        if self.dinfo.enabled:
            loss = self._allreduce(dense, loss)
            gathered = [self._gather_rows(r, v, self._row_cap(p)) for (p, _), r, v in zip(tables, rows, vals)]
            rows, vals = [r for r, _ in gathered], [v for _, v in gathered]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
        summed = [sum_rows(r, v) for r, v in zip(rows, vals)]
        rows, vals = [r for r, _ in summed], [v for _, v in summed]
        norm = global_norm([*grads, *vals])
        clip, lr = cfg.all_clip_norm_val, cfg.learning_rate
        inv_factor = torch.clamp(norm, min=clip) / clip  # gradients are divided by it: global-norm clipping
        with torch.no_grad():
            adagrad_dense(dense, grads, accs, lr, inv_factor)
            for (p, acc), r, v in zip(tables, rows, vals):
                adagrad_rows(p.view(p.shape[0], -1), acc.view(p.shape[0], -1), r, v, lr, inv_factor)
        self.step += 1
        self.tokens_seen += cfg.batch_size * cfg.unroll_steps * self.n_towers_total
        self.last_grad_norm = norm.detach()
        return loss

    def _allreduce(self, params, loss):
        """Sum the dense gradients and the loss over processes (one flat all-reduce)."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).to(grads[0].dtype)])
        dist.all_reduce(flat)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(g).clone()
            off += n
        return flat[off]

    def _row_cap(self, table) -> int:
        """The most gradient rows a process's towers give ``table``: a softmax table's targets and samples of both
        directions, plus the inputs where the word embedding is that table; a word embedding of its own, the
        inputs of both directions. Fixed by the configuration, so processes exchange no sizes."""
        cfg = self.cfg
        BT = cfg.batch_size * cfg.unroll_steps
        if table is self.embedding and not cfg.share_embedding_softmax:
            return cfg.towers * 2 * BT
        return cfg.towers * 2 * (BT + self.softmax.num_samples + (BT if table is self.embedding else 0))

    def _gather_rows(self, rows, vals, cap: int):
        """All-gather every process's row gradients of one table (ids, values), padded to ``cap`` rows
        (``_row_cap``); padding rows are (id 0, zeros), which the row update ignores."""
        import torch.distributed as dist

        if rows.numel() > cap:
            raise RuntimeError(f"{rows.numel()} gradient rows of a table, more than the {cap} a process can touch")
        rows = F.pad(rows, (0, cap - rows.numel()))
        vals = F.pad(vals, (0, 0, 0, cap - vals.shape[0]))
        out_r = [torch.empty_like(rows) for _ in range(self.dinfo.world_size)]
        out_v = [torch.empty_like(vals) for _ in range(self.dinfo.world_size)]
        dist.all_gather(out_r, rows)
        dist.all_gather(out_v, vals)
        return torch.cat(out_r), torch.cat(out_v)

    def _broadcast_params(self):
        import torch.distributed as dist

        with torch.no_grad():
            for t in [*self.dense_params, *(p.data for p, _ in self.row_params)]:
                dist.broadcast(t, 0)

    # ------------------------------------------------------------------ held-out perplexity
    @_in_mode
    @torch.no_grad()
    def evaluate(self, shards: list[str] | None = None, batch_size: int | None = None, unroll_steps: int | None = None,
                 max_batches: int | None = -1) -> dict:
        """Full-softmax perplexity (spec §6.7): no dropout, state carried, test-mode data; exp(mean batch loss)
        where a batch loss is the mean of the forward and backward mean cross-entropies."""
        cfg = self.cfg
        shards = shards if shards is not None else self.heldout_shards
        if not shards:
            return {"heldout_perplexity": None, "heldout_batches": 0}
        B = batch_size or cfg.eval_batch_size
        T = unroll_steps or cfg.eval_unroll_steps
        max_batches = cfg.eval_max_batches if max_batches == -1 else max_batches
        was_training = self.model.training
        self.model.eval()
        stream = BidirectionalStream(shards, self.vocab, B, T, cfg.max_characters_per_token, test=True)
        L = cfg.n_layers
        h = torch.zeros(2, L, B, self.P, device=self.device)
        c = torch.zeros(2, L, B, cfg.lstm_dim, device=self.device)
        losses = []
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        for i, batch in enumerate(stream):
            if max_batches is not None and i >= max_batches:
                break
            with ctx:
                top_f, top_b, h, c, tf, tb, _ = self.run_batch(batch, h, c, training=False)
            h, c = h.float(), c.float()
            self.softmax.eval()
            lf = float(self.softmax(top_f.reshape(-1, self.P).float(), tf.reshape(-1)))
            if top_b is None:  # the forward LM alone
                losses.append(lf)
                continue
            lb = float(self.softmax(top_b.reshape(-1, self.P).float(), tb.reshape(-1)))
            losses.append(0.5 * (lf + lb))
        self.model.train(was_training)
        if not losses:
            return {"heldout_perplexity": None, "heldout_batches": 0}
        m = float(np.mean(losses))
        return {"heldout_loss": m, "heldout_perplexity": math.exp(m), "heldout_batches": len(losses),
                "heldout_tokens": len(losses) * B * T}

    # ------------------------------------------------------------------ checkpoints
    def _load_state(self, ck: dict) -> None:
        self._load_weights(ck)
        self.step = ck["step"]
        self.tokens_seen = ck["tokens_seen"]
        self.train_seconds = ck.get("train_seconds", 0.0)
        torch.set_rng_state(ck["torch_rng"])
        random.setstate(ck["py_random"])
        restore_pack_timings(ck.get("cpu_pack_timings"))
        restore_gemm_timings(ck.get("cpu_gemm_timings"))

    def _load_weights(self, ck: dict) -> None:
        """The weights and the Adagrad accumulators of a checkpoint (what --init-from takes; _load_state adds the
        run's position)."""
        if ck.get("version") != CHECKPOINT_VERSION:
            raise ConfigError(f"unsupported checkpoint version {ck.get('version')}")
        self.model.load_state_dict(ck["model"])
        with torch.no_grad():
            self.softmax_W.copy_(ck["softmax_W"])
            self.softmax_b.copy_(ck["softmax_b"])
        for acc, a in zip(self.acc_dense, ck["acc_dense"]):
            acc.copy_(a)
        self.acc_W.copy_(ck["acc_W"])
        self.acc_b.copy_(ck["acc_b"])
        if self.acc_emb is not None:
            self.acc_emb.copy_(ck["acc_emb"])

    def tower_states(self) -> list[dict]:
        local = [{"gid": tw.gid, **tw.state(), "h": tw.h.detach().cpu(), "c": tw.c.detach().cpu()}
                 for tw in self.towers]
        if not self.dinfo.enabled:
            return local
        import torch.distributed as dist

        out: list = [None] * self.dinfo.world_size
        dist.all_gather_object(out, local)
        return sorted([t for part in out for t in part], key=lambda t: t["gid"])

    def state_dict(self) -> dict:
        return {
            "version": CHECKPOINT_VERSION,
            "config": self.cfg.to_dict(),
            "options": self.options,
            "vocab_size": self.V,
            "vocab_sha256": vocab_digest(self.vocab),
            "world_size": self.dinfo.world_size,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "softmax_W": self.softmax_W.detach().cpu(),
            "softmax_b": self.softmax_b.detach().cpu(),
            "acc_dense": [a.cpu() for a in self.acc_dense],
            "acc_W": self.acc_W.cpu(),
            "acc_b": self.acc_b.cpu(),
            "acc_emb": None if self.acc_emb is None else self.acc_emb.cpu(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": self.train_seconds,
            "towers": self.tower_states(),
            "torch_rng": torch.get_rng_state(),
            "py_random": random.getstate(),
            # the cpu backend's timed choices (packing: elmo_fast.cpu.packed.pack_pays; MKL or oneDNN per GEMM
            # shape: elmo_fast.cpu.gemm.uses_onednn): restored on resume so a resumed run makes the choices, and so
            # the summation orders, of the interrupted one
            "cpu_pack_timings": pack_timings(),
            "cpu_gemm_timings": gemm_timings(),
        }

    def check_finite_params(self) -> None:
        """Raise RuntimeError naming the step and the first parameter that holds NaN or inf (a diverged run): one
        fused max-abs over all parameters and one host read, so it runs where a checkpoint is written, not every
        step. Every rank holds the same parameters, so every rank raises alike."""
        named = {id(p): (n, p) for n, p in self.model.named_parameters()}
        named.setdefault(id(self.softmax_W), ("softmax_W", self.softmax_W))
        named.setdefault(id(self.softmax_b), ("softmax_b", self.softmax_b))
        names, params = zip(*((n, p.detach()) for n, p in named.values() if p.numel()))
        peaks = torch.stack(torch._foreach_norm(list(params), float("inf"))).tolist()  # NaN and inf propagate
        bad = [n for n, v in zip(names, peaks) if not math.isfinite(v)]
        if bad:
            raise RuntimeError(
                f"step {self.step}: the parameters hold NaN or inf values (in {', '.join(bad[:4])}"
                f"{', ...' if len(bad) > 4 else ''}): the training diverged. No checkpoint was written and the "
                f"existing checkpoints in {os.path.join(self.save_dir, 'checkpoints')} were kept; resume from the "
                "last one (e.g. with a lower learning rate)")

    def save_checkpoint(self) -> str | None:
        """Every rank must call this (tower states are gathered); rank 0 writes. Atomic: temp file + os.replace.
        Parameters that are no longer finite raise (``check_finite_params``) before anything is written or removed,
        so a diverged run never rotates the good checkpoints out."""
        self.check_finite_params()
        st = self.state_dict()
        if not self.dinfo.is_main:
            return None
        d = os.path.join(self.save_dir, "checkpoints")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"ckpt-{self.step:09d}.pt")
        atomic_torch_save(st, path)
        ckpts = list_checkpoints(self.save_dir)
        for old in ckpts[: -self.cfg.keep_checkpoints]:
            with contextlib.suppress(OSError):
                os.remove(old)
        return path

    def close(self) -> None:
        for tw in self.towers:
            tw.loader.close()


def vocab_digest(vocab: Vocabulary) -> str:
    """A checkpoint's record of its vocabulary, words in order: a run started from it (--init-from) or evaluating
    it must read the rows of its softmax and embedding as the same words, not just as many."""
    import hashlib

    return hashlib.sha256("\n".join(vocab.words).encode("utf-8")).hexdigest()


def sum_rows(ids: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of ``vals`` (M, k) that share an id in ``ids`` (M,), in fixed shapes (no host sync).

    Returns (ids', sums), both of M rows: every distinct id once with the sum of its rows, then (id 0, zeros)
    rows that an ``index_add_`` row update leaves without effect (what TF does to IndexedSlices: duplicates
    summed once)."""
    sid, perm = torch.sort(ids)
    ext = cpu_ext_for(vals)
    if ext is not None:  # the same sums in one pass (csrc/cpu/sparse_rows.cpp), bit-identical
        out = torch.empty_like(ids), torch.empty_like(vals)
        ext.sum_rows(sid, perm, vals, *out)
        return out
    first = torch.ones_like(sid, dtype=torch.bool)
    first[1:] = sid[1:] != sid[:-1]
    seg = torch.cumsum(first, 0) - 1  # segment (distinct id) of every sorted row
    sums = torch.zeros_like(vals).index_add_(0, seg, vals.index_select(0, perm))
    return torch.zeros_like(ids).scatter_(0, seg, sid), sums


_NORM_ROW = 4096  # global_norm's first-level run on the CPU


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together (0-dim, their dtype): what clipping divides by.

    On the CPU torch's fp32 norm sums a whole tensor in a few long runs, and at the original sizes that loses
    precision: 6.5e-4 low on a (1024, 16384) normal tensor (relative to fp64, torch 2.13 and 2.11 alike), so the
    clipped step would be off by as much. With ``elmo_fast._cpu``, each fp32 tensor that is contiguous (or a
    transposed contiguous one) has its squares summed in double, one pass, and the root is taken once: the fp64
    norm, rounded to the dtype (1.5-2.2 ms a 64 MiB gradient on 2 Xeon cores, warm; the rows below took 3.1).
    Without it (or for the other tensors), each tensor is cut into rows of 4,096 elements whose norms are exact to
    a few ulps, and the norm of those norms is taken: within ~1e-7 of the fp64 value (18 against torch's 34 ms for
    the 374 MB of dense gradients of the original model on 2 Xeon cores). A GPU's norm sums in trees: one foreach
    launch there."""
    if not tensors:
        raise ValueError("global_norm: no tensors")
    if tensors[0].device.type != "cpu":
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    flats = [t.t() if t.dim() == 2 and not t.is_contiguous() else t for t in tensors]  # a view where either is
    squares, parts = 0.0, []  # the extension's sums (double), the other tensors' row norms
    for t in flats:
        ext = cpu_ext_for(t)
        if ext is not None and hasattr(ext, "sum_squares"):
            squares += ext.sum_squares(t)  # every square and sum in double (csrc/cpu/sparse_rows.cpp), one pass
            continue
        flat = t.reshape(-1)
        n = flat.numel() // _NORM_ROW * _NORM_ROW
        if n:
            parts.append(torch.linalg.vector_norm(flat[:n].view(-1, _NORM_ROW), dim=1))
        if n < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[n:]).reshape(1))
    if not parts:  # the fp64 norm, rounded once
        return torch.tensor(math.sqrt(squares), dtype=tensors[0].dtype)
    rest = torch.linalg.vector_norm(torch.cat(parts)).double()
    return torch.sqrt(rest * rest + squares).to(tensors[0].dtype)


_FUSED_ADAGRAD: dict[str, bool] = {}  # device type -> whether torch's fused Adagrad ran there (absent: not tried)
_ADAGRAD_STEPS: dict = {}  # (device, count) -> the fused kernel's step counters (unused: no lr decay)


def adagrad_dense(params, grads, accs, lr: float, inv_factor: torch.Tensor) -> None:
    """TF1 Adagrad on whole tensors with the clipped gradient g / inv_factor: ``acc += g²; p -= lr·g/√acc`` (no
    epsilon). One fused pass over all the tensors where torch has the kernel (``torch._fused_adagrad_`` with eps 0
    and the clipping factor as its grad scale: the CPU's; CUDA's where the torch build has it, pytorch#159008,
    not yet seen on the GPU image's torch 2.11): it reads each parameter,
    gradient and accumulator once and writes two, where the foreach ops below make 11 passes (1.1 ms of a
    384-row step on the H200, 2026-11-27). Where the kernel is missing or refuses the tensors on a device, the
    foreach ops, with one warning (and the gradients rescaled in place)."""
    if not params:
        return
    dev = params[0].device
    if hasattr(torch, "_fused_adagrad_") and _FUSED_ADAGRAD.get(dev.type, True):
        key = (dev, len(params))
        if key not in _ADAGRAD_STEPS:
            _ADAGRAD_STEPS[key] = [torch.zeros((), device=dev) for _ in params]
        try:
            torch._fused_adagrad_(params, grads, accs, _ADAGRAD_STEPS[key], lr=lr, lr_decay=0.0, weight_decay=0.0,
                                  eps=0.0, maximize=False, grad_scale=inv_factor.float(), found_inf=None)
        except (NotImplementedError, RuntimeError, TypeError) as exc:  # refused before it writes anything
            if dev.type == "cpu" and not isinstance(exc, NotImplementedError):
                raise
            _FUSED_ADAGRAD[dev.type] = False
            warnings.warn(f"torch's fused Adagrad does not run here ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); the optimizer takes torch's foreach ops instead "
                          f"(the same update in more passes)", RuntimeWarning, stacklevel=2)
        else:
            _FUSED_ADAGRAD[dev.type] = True
            torch.autograd.graph.increment_version(params)  # the fused kernel does not bump the version counters
            return
    torch._foreach_div_(grads, inv_factor)
    torch._foreach_addcmul_(accs, grads, grads)
    torch._foreach_addcdiv_(params, grads, torch._foreach_sqrt(accs), value=-lr)


def adagrad_rows(p: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, lr: float,
                 inv_factor: torch.Tensor) -> None:
    """The same update for the rows ``rows`` of ``p``/``acc`` (V, k), gradient rows ``g`` (M, k) from ``sum_rows``:
    only the touched rows change, exactly as dense Adagrad would change them (the others' gradient is 0)."""
    ext = cpu_ext_for(g, p, acc)
    if ext is not None and ext.adagrad_rows(p, acc, rows, g, lr, inv_factor):
        return  # in place, one pass, bit-identical (csrc/cpu/sparse_rows.cpp; False: ids repeat, nothing changed)
    g = g / inv_factor
    g2 = g * g
    new_acc = acc.index_select(0, rows) + g2
    acc.index_add_(0, rows, g2)
    p.index_add_(0, rows, g.div_(new_acc.sqrt_()).mul_(-lr))


def atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        with contextlib.suppress(OSError):
            dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def list_checkpoints(save_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(save_dir, "checkpoints", "ckpt-*.pt")))


def latest_checkpoint(save_dir_or_file: str) -> str | None:
    if os.path.isfile(save_dir_or_file):
        return save_dir_or_file
    ck = list_checkpoints(save_dir_or_file)
    return ck[-1] if ck else None


def load_checkpoint(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------------------------- the loop
class JsonLog:
    def __init__(self, path: str | None, enabled: bool, echo: bool = True):
        self.path = path
        self.enabled = enabled
        self.echo = echo
        self.bar = None

    def __call__(self, rec: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(rec, sort_keys=False)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        if self.echo:
            if self.bar is not None:
                from tqdm import tqdm

                tqdm.write(line)
            else:
                print(line, flush=True)


def total_steps(cfg: TrainConfig, n_towers_total: int) -> int:
    if cfg.max_steps is not None:
        return int(cfg.max_steps)
    if not cfg.n_train_tokens:
        raise ConfigError("n_train_tokens is unknown; pass --n-train-tokens or --max-steps")
    per_epoch = int(cfg.n_train_tokens / (cfg.batch_size * cfg.unroll_steps * n_towers_total))
    return max(1, per_epoch * cfg.n_epochs)


def train_loop(trainer: Trainer, log: JsonLog, progress: bool = True) -> dict:
    cfg = trainer.cfg
    dinfo = trainer.dinfo
    n_steps = total_steps(cfg, trainer.n_towers_total)
    bar = None
    if progress and dinfo.is_main and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=n_steps, initial=trainer.step, unit="step", dynamic_ncols=True)
        log.bar = bar
    t_start = time.perf_counter()
    t_mark, tok_mark, step_mark, wait_mark = t_start, trainer.tokens_seen, trainer.step, trainer.data_wait_s
    loss_acc, n_acc = None, 0
    last_eval = None
    stopped_by = "steps"
    try:
        while trainer.step < n_steps:
            if cfg.time_budget is not None:
                stop = torch.tensor([float(time.perf_counter() - t_start >= cfg.time_budget)])
                if dinfo.enabled:
                    import torch.distributed as dist

                    stop = stop.to(trainer.device)
                    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if float(stop) > 0:
                    stopped_by = "time_budget"
                    break
            check_signals()  # a SIGINT / SIGTERM whose exception a finalizer swallowed stops the run here
            t0 = time.perf_counter()
            loss = trainer.train_step()
            loss_acc = loss if loss_acc is None else loss_acc + loss
            n_acc += 1
            if cfg.sleep_per_step:
                time.sleep(cfg.sleep_per_step)
            trainer.train_seconds += time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
            if trainer.step % cfg.log_every == 0 or trainer.step == n_steps:
                now = time.perf_counter()
                mean_loss = float(loss_acc) / n_acc
                rec = {"event": "train", "step": trainer.step, "loss": mean_loss,
                       "train_perplexity": math.exp(min(mean_loss, 700.0)),
                       "tokens_per_s": (trainer.tokens_seen - tok_mark) / max(now - t_mark, 1e-9),
                       "steps_per_s": (trainer.step - step_mark) / max(now - t_mark, 1e-9),
                       "grad_norm": float(trainer.last_grad_norm), "tokens": trainer.tokens_seen,
                       # the share of the time since the last record spent waiting for batches: near 0 unless the
                       # data worker is the bottleneck
                       "data_wait": round((trainer.data_wait_s - wait_mark) / max(now - t_mark, 1e-9), 3),
                       "elapsed_s": round(now - t_start, 3)}
                log(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                t_mark, tok_mark, step_mark, wait_mark = now, trainer.tokens_seen, trainer.step, trainer.data_wait_s
                loss_acc, n_acc = None, 0
            if trainer.step % cfg.checkpoint_every == 0 and trainer.step < n_steps:
                trainer.save_checkpoint()
            if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < n_steps:
                last_eval = _eval_and_log(trainer, log)
        path = trainer.save_checkpoint()
        last_eval = _eval_and_log(trainer, log)
    finally:
        if bar is not None:
            bar.close()
            log.bar = None
        trainer.close()
    summary = {"event": "done", "step": trainer.step, "tokens": trainer.tokens_seen, "stopped_by": stopped_by,
               "elapsed_s": round(time.perf_counter() - t_start, 3), "checkpoint": path}
    if last_eval:
        summary.update({k: v for k, v in last_eval.items() if k != "event"})
    log(summary)
    return summary


def _eval_and_log(trainer: Trainer, log: JsonLog) -> dict | None:
    if not trainer.heldout_shards:
        return None
    res = None
    if trainer.dinfo.is_main:
        t0 = time.perf_counter()
        res = trainer.evaluate()
        res = {"event": "eval", "step": trainer.step, **res, "eval_s": round(time.perf_counter() - t0, 3)}
        log(res)
    if trainer.dinfo.enabled:
        import torch.distributed as dist

        dist.barrier()
    return res
