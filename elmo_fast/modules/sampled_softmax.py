"""The bilm-tf softmax layer as a module: sampled softmax in training, exact full softmax in eval."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import ops
from ..ops import _precision as prec
from .._backend import check_backend_name


class SampledSoftmaxLoss(nn.Module):
    """``softmax/W`` (V, P) and ``softmax/b`` (V,) with TF's sampled softmax loss (spec §6.4, §6.5).

    * ``train()`` mode: every call draws a fresh set of ``num_samples`` unique log-uniform ids (TF sampler,
      shared by the N positions of the call) and returns TF's sampled softmax loss (mean over N by default,
      as bilm-tf does per direction). Call it once per direction to get bilm-tf's two sample sets.
    * ``eval()`` mode, or ``sample_softmax=False``: the exact full-softmax NLL over all V words (held-out
      perplexity, spec §6.7).

    Args:
        num_words: V. The sampler assumes ids sorted by descending frequency (spec §6.2).
        embedding_dim: P, the width of the LSTM output fed to the softmax.
        num_samples: S (bilm-tf: 8192).
        sparse: gradients of ``softmax_W`` / ``softmax_b`` in the sampled loss are sparse COO tensors holding only
            the target and sample rows (use a sparse-aware optimizer, e.g. ``torch.optim.Adagrad``). The
            full softmax (eval) always gives dense gradients.
        seed: seed of the module's own sampler generator (``None``: drawn from torch's default generator once).
        share_embedding: a (V, P) ``nn.Parameter`` (or an ``nn.Embedding``) to use as ``softmax_W``
            (bilm-tf ``share_embedding_softmax``, word-input models only).
        remove_accidental_hits, reduction, backend: passed to the ops.

    The sampler state is the generator state; it is saved in ``state_dict`` (``_extra_state``), with the last
    sample set, so a resumed run draws the same samples. ``last_samples`` is ``(ids, num_tries)`` of the last
    training call.
    """

    def __init__(self, num_words: int, embedding_dim: int, num_samples: int = 8192, *, sparse: bool = False,
                 seed: int | None = None, share_embedding: nn.Parameter | nn.Embedding | None = None,
                 remove_accidental_hits: bool = True, reduction: str = "mean", sample_softmax: bool = True,
                 backend: str | None = "auto"):
        super().__init__()
        if not 0 < num_samples <= num_words:
            raise ValueError(f"num_samples must be in [1, num_words={num_words}], got {num_samples}")
        self.num_words = num_words
        self.embedding_dim = embedding_dim
        self.num_samples = num_samples
        self.sparse = sparse
        self.remove_accidental_hits = remove_accidental_hits
        self.reduction = reduction
        self.sample_softmax = sample_softmax
        self.backend = check_backend_name(backend)
        if isinstance(share_embedding, nn.Embedding):
            share_embedding = share_embedding.weight
        if share_embedding is not None:
            if tuple(share_embedding.shape) != (num_words, embedding_dim):
                raise ValueError(
                    f"share_embedding must be ({num_words}, {embedding_dim}), got {tuple(share_embedding.shape)}"
                )
            self.softmax_W = share_embedding
            self.tied = True
        else:
            self.softmax_W = nn.Parameter(torch.empty(num_words, embedding_dim))
            self.tied = False
        self.softmax_b = nn.Parameter(torch.zeros(num_words))
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = int(seed)
        self._generator: torch.Generator | None = None
        self._pending_state: tuple[str, torch.Tensor] | None = None
        self.last_samples: tuple[torch.Tensor, int] | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """bilm-tf init: W ~ Normal(0, 1/√P) (left alone when tied to an embedding), b = 0."""
        if not self.tied:
            self.softmax_W.normal_(0.0, 1.0 / math.sqrt(self.embedding_dim))
        self.softmax_b.zero_()

    # ---- sampler -------------------------------------------------------------------------------------
    def generator(self, device: torch.device | None = None) -> torch.Generator:
        """The sampler's generator on ``device`` (default: the parameters' device). Created lazily from
        ``seed``, or from a state loaded with ``load_state_dict``; re-created if the module changes device type."""
        device = torch.device(device) if device is not None else self.softmax_W.device
        g = self._generator
        if g is None or g.device.type != device.type:
            g = torch.Generator(device=device)
            if self._pending_state is not None and self._pending_state[0] == device.type:
                g.set_state(self._pending_state[1])
            else:
                g.manual_seed(self.seed)
            self._pending_state = None
            self._generator = g
        return g

    def sample(self) -> tuple[torch.Tensor, int]:
        """Draw a fresh sample set (ids (S,) on the parameters' device, num_tries) and remember it."""
        device = self.softmax_W.device
        ids, tries = ops.log_uniform_sample(self.num_samples, self.num_words, generator=self.generator(device),
                                            device=device)
        self.last_samples = (ids, tries)
        return ids, tries

    # ---- loss ----------------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, targets: torch.Tensor,
                samples: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """hidden (N, P) (any leading dims are flattened), targets (N,) → loss (scalar, or (N,) for 'none').

        The loss is computed in the parameters' dtype (``hidden`` is cast to it when they differ).

        ``samples``: an explicit ``(ids, num_tries)`` to use instead of drawing (training mode only).
        """
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        W = self.softmax_W
        b = self.softmax_b
        if _cast_to_table(hidden, W):
            # cast the (N, P) activations, never the (V, P) table (a full copy per call at V = 793k)
            hidden = hidden.to(W.dtype)
        if self.training and self.sample_softmax:
            if samples is None:
                samples = self.sample()
            else:
                self.last_samples = samples
            ids, tries = samples
            return ops.sampled_softmax_loss(hidden, targets, W, b, ids, tries,
                                            remove_accidental_hits=self.remove_accidental_hits,
                                            reduction=self.reduction, backend=self.backend,
                                            sparse_grad=self.sparse)
        return ops.full_softmax_nll(hidden, targets, W, b, self.reduction, backend=self.backend)

    def forward_pair(self, hidden_f: torch.Tensor, targets_f: torch.Tensor, samples_f: tuple[torch.Tensor, int],
                     hidden_b: torch.Tensor, targets_b: torch.Tensor, samples_b: tuple[torch.Tensor, int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two directions' sampled losses with their explicit sample sets (training mode, sampled softmax):
        ``(self(hidden_f, targets_f, samples_f), self(hidden_b, targets_b, samples_b))``, the same values and
        gradients, as :meth:`forward_groups` of the two."""
        return self.forward_groups([(hidden_f, targets_f, samples_f), (hidden_b, targets_b, samples_b)])

    def forward_groups(self, groups) -> tuple[torch.Tensor, ...]:
        """Sampled losses of several groups over this table, each ``(hidden, targets, (ids, num_tries))`` with its
        explicit sample set (training mode, sampled softmax): ``self(hidden, targets, samples)`` of each, the same
        values and gradients, through ``ops.sampled_softmax_loss_groups`` (on the triton backend one launch of each
        kernel for all the groups; on the cpu backend each pair as one operator). ``last_samples`` is the last
        group's."""
        if not (self.training and self.sample_softmax):
            raise RuntimeError("forward_pair / forward_groups are the sampled softmax of training: call train(), "
                               "with sample_softmax")
        W, b = self.softmax_W, self.softmax_b
        items = []
        for hidden, targets, (ids, tries) in groups:
            h = hidden.reshape(-1, hidden.shape[-1])
            items.append((h.to(W.dtype) if _cast_to_table(h, W) else h, targets.reshape(-1), ids, tries))
        losses = ops.sampled_softmax_loss_groups(items, W, b, remove_accidental_hits=self.remove_accidental_hits,
                                                 reduction=self.reduction, backend=self.backend,
                                                 sparse_grad=self.sparse)
        self.last_samples = groups[-1][2]
        return losses

    # ---- checkpointing -------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        state: dict = {"seed": self.seed}
        if self._generator is not None:
            state["generator_device_type"] = self._generator.device.type
            state["generator_state"] = self._generator.get_state().clone()
        elif self._pending_state is not None:
            state["generator_device_type"], state["generator_state"] = self._pending_state
        if self.last_samples is not None:
            state["last_sampled_ids"] = self.last_samples[0].detach().cpu()
            state["last_num_tries"] = int(self.last_samples[1])
        return state

    def set_extra_state(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self._generator = None
        self._pending_state = None
        if "generator_state" in state:
            self._pending_state = (state["generator_device_type"], state["generator_state"].cpu())
        if "last_sampled_ids" in state:
            self.last_samples = (state["last_sampled_ids"].to(self.softmax_W.device), int(state["last_num_tries"]))

    def extra_repr(self) -> str:
        return (f"num_words={self.num_words}, embedding_dim={self.embedding_dim}, num_samples={self.num_samples}, "
                f"sparse={self.sparse}, tied={self.tied}, backend={self.backend!r}")


def _cast_to_table(hidden: torch.Tensor, W: torch.Tensor) -> bool:
    """Whether the loss casts ``hidden`` to the table's dtype: where they differ, but not under autocast, where the
    op casts both to the autocast dtype (bf16 top layers would go to fp32 and back: two copies, the same values)."""
    return hidden.dtype != W.dtype and prec.compute_dtype(hidden) is None
