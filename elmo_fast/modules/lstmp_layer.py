"""``LSTMP``: a drop-in ``torch.nn.LSTM`` (with or without ``proj_size``) that runs on elmo_fast's LSTMP chain.

Same constructor, forward, state and parameters as ``nn.LSTM``, so a model swaps one for the other and a
``state_dict`` moves between the two both ways; plus ELMo's extras as keywords: cell and projection clipping
(TF semantics: a clip is applied whenever it is not None), a forget-gate bias added at run time, and residual
connections between layers (spec §3.4).

Two layouts, one implementation of the math. The parameters keep nn.LSTM's layout (``weight_ih_l0`` (4H, D),
``weight_hh_l0`` (4H, P), ``bias_ih_l0`` + ``bias_hh_l0`` (4H,), ``weight_hr_l0`` (P, H), gate blocks i|f|g|o);
every chain runs through ``elmo_fast.ops.lstmp``, which takes the TF layout (w_in (D, 4H), w_rec (P, 4H), one
bias (4H,), w_proj (H, P), gate blocks i|j|f|o with j = g). The conversion is made once per version of the
parameters, not per call: the converted copies are cached in the module until an in-place update (an optimizer
step) bumps a parameter's version counter, and they reach autograd through a small Function whose backward maps
their gradients back to the parameters (``_ConvertedWeight``, the pattern of ``ops._precision.cast_weight``).
Under ``torch.autocast`` the cached copies are made directly in the autocast dtype (one copy, one cache), which
the op's own cast then leaves alone. While torch.compile / torch.export trace, the conversion is plain
differentiable code in the graph.

Differences from nn.LSTM that a user can see: none in the results beyond float rounding (fp64 agrees to 1e-12,
fp32 to 1e-5, tests/test_lstmp_layer.py); ``flatten_parameters`` is a no-op (there is no cuDNN weight buffer).
"""
from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .. import ops
from .._stamp import stamp, unchanged
from .._backend import check_backend_name
from ..cpu.packed import PackedWeightCache
from ..ops import _precision as prec
from ..ops._library import backend_for, tracing
from ..ops.lstmp import trusted_lengths

_EXTRAS = ("cell_clip", "proj_clip", "forget_bias", "residual")


def _swap_gates(t: torch.Tensor) -> torch.Tensor:
    """Gate blocks along dim 0 from i|f|g|o to i|j|f|o (j = g) or back: blocks 1 and 2 swapped."""
    H = t.shape[0] // 4
    return torch.cat([t[:H], t[2 * H : 3 * H], t[H : 2 * H], t[3 * H :]])


# nn.LSTM layout -> TF layout, and the map of a TF-layout gradient back to the nn.LSTM-layout parameters. The
# weight conversions return transposed views (the gate swap is the one copy); ``LSTMP._converted_copy`` makes
# them contiguous except for the cpu backend, which takes column-major weights as they are and returns their
# gradients in the same layout (so the map back is a plain block copy, no transposing copy either way).
def _w_to_tf(w: torch.Tensor) -> torch.Tensor:  # (4H, K) -> (K, 4H)
    return _swap_gates(w).t()


def _w_grad(g: torch.Tensor) -> tuple[torch.Tensor]:
    return (_swap_gates(g.t()),)


def _bias_to_tf(b_ih: torch.Tensor, b_hh: torch.Tensor) -> torch.Tensor:
    return _swap_gates(b_ih + b_hh)


def _bias_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = _swap_gates(g)
    return g, g


def _proj_to_tf(w_hr: torch.Tensor) -> torch.Tensor:  # (P, H) -> (H, P)
    return w_hr.t()


def _proj_grad(g: torch.Tensor) -> tuple[torch.Tensor]:
    return (g.t(),)


_CONVERSIONS = {"w_in": (_w_to_tf, _w_grad), "w_rec": (_w_to_tf, _w_grad), "bias": (_bias_to_tf, _bias_grad),
                "w_proj": (_proj_to_tf, _proj_grad)}


class _ConvertedWeight(torch.autograd.Function):
    """Returns the cached TF-layout copy; backward maps its gradient to the nn.LSTM-layout parameters, each in its
    own dtype."""

    @staticmethod
    def forward(ctx, copy, grad_map, *masters):
        ctx.grad_map = grad_map
        ctx.dtypes = [m.dtype for m in masters]
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.grad_map(grad)
        return None, None, *(g.to(dt) for g, dt in zip(grads, ctx.dtypes))


class LSTMP(nn.Module):
    """``torch.nn.LSTM`` on elmo_fast's LSTMP chain (see the module docstring).

    Args (nn.LSTM's): input_size, hidden_size (H, the cell size), num_layers, bias, batch_first, dropout (between
        layers, not after the last), bidirectional (forward and reverse chains per layer; the next layer reads
        their concatenation), proj_size (P; 0: no projection, the output is the cell output, width H), device,
        dtype.
    Keyword-only extras (the defaults give nn.LSTM's function):
        cell_clip, proj_clip: clip the cell state / the projected output to [-clip, clip] when not None (the
            projection clip needs proj_size > 0).
        forget_bias: added to the forget gate's pre-activation at run time (TF's LSTMCell: 1.0; nn.LSTM: 0.0).
        residual: layers >= 1 output their LSTM output plus their input (the widths match for every such layer);
            the recurrent state stays the pure LSTM output.
        backend: "auto" | "reference" | "cpu" | "triton" | "cuda" (else ``ELMO_FAST_BACKEND``, else auto).

    forward(input, hx=None) takes and returns what nn.LSTM does: input (T, N, D) / (N, T, D) with
    ``batch_first`` / (T, D) unbatched, or a PackedSequence (sorted or not); hx = (h0, c0) of shapes
    (num_layers * num_directions, N, P or H) and (num_layers * num_directions, N, H) (no N when unbatched);
    returns (output, (h_n, c_n)), output a PackedSequence when the input is one.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None, *, cell_clip: float | None = None, proj_clip: float | None = None,
                 forget_bias: float = 0.0, residual: bool = False, backend: str | None = "auto"):
        super().__init__()
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers),
                        ("proj_size", proj_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"LSTMP: {name} must be an int, got {type(v).__name__}")
        for name, v in (("bias", bias), ("batch_first", batch_first), ("bidirectional", bidirectional),
                        ("residual", residual)):
            if not isinstance(v, bool):
                raise TypeError(f"LSTMP: {name} must be a bool, got {type(v).__name__}")
        if input_size <= 0 or hidden_size <= 0 or num_layers <= 0:
            raise ValueError(f"LSTMP: input_size, hidden_size and num_layers must be > 0, got {input_size}, "
                             f"{hidden_size}, {num_layers}")
        if not 0 <= proj_size < hidden_size:
            raise ValueError(f"LSTMP: proj_size must lie in [0, hidden_size={hidden_size}), got {proj_size}")
        if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
            raise ValueError(f"LSTMP: dropout must be a probability in [0, 1], got {dropout!r}")
        if proj_clip is not None and proj_size == 0:
            raise ValueError("LSTMP: proj_clip clips the projection, which needs proj_size > 0")
        for name, v in (("cell_clip", cell_clip), ("proj_clip", proj_clip)):
            if v is not None and (not isinstance(v, numbers.Real) or not v >= 0):  # NaN too: all-NaN outputs
                raise ValueError(f"LSTMP: {name} must be None or a number >= 0, got {v!r}")
        if not isinstance(forget_bias, numbers.Real) or not math.isfinite(forget_bias):
            raise ValueError(f"LSTMP: forget_bias must be a finite number, got {forget_bias!r}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"LSTMP: dropout acts between layers, so dropout={dropout} does nothing with "
                          "num_layers=1 (as nn.LSTM)", stacklevel=2)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, proj_size
        self.cell_clip = None if cell_clip is None else float(cell_clip)
        self.proj_clip = None if proj_clip is None else float(proj_clip)
        self.forget_bias, self.residual = float(forget_bias), residual
        self.backend = check_backend_name(backend)
        factory = dict(device=device, dtype=dtype)
        dirs = 2 if bidirectional else 1
        P = proj_size or hidden_size
        G = 4 * hidden_size
        self._chains: list[dict[str, str]] = []  # per (layer, direction): TF role -> parameter name(s)
        for layer in range(num_layers):
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                d_in = input_size if layer == 0 else P * dirs
                self.register_parameter(f"weight_ih{sfx}", nn.Parameter(torch.empty(G, d_in, **factory)))
                self.register_parameter(f"weight_hh{sfx}", nn.Parameter(torch.empty(G, P, **factory)))
                names = {"w_in": (f"weight_ih{sfx}",), "w_rec": (f"weight_hh{sfx}",)}
                if bias:
                    self.register_parameter(f"bias_ih{sfx}", nn.Parameter(torch.empty(G, **factory)))
                    self.register_parameter(f"bias_hh{sfx}", nn.Parameter(torch.empty(G, **factory)))
                    names["bias"] = (f"bias_ih{sfx}", f"bias_hh{sfx}")
                if proj_size:
                    self.register_parameter(f"weight_hr{sfx}", nn.Parameter(torch.empty(proj_size, hidden_size,
                                                                                        **factory)))
                    names["w_proj"] = (f"weight_hr{sfx}",)
                self._chains.append(names)
        self._converted: dict = {}  # (chain, role, dtype) -> (stamp, TF-layout copy)
        # cpu backend: packed weights kept across calls, one cache for all chains (keyed by each weight's storage,
        # so a weight that chains share is packed once)
        self._cpu_cache = PackedWeightCache()
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------- nn.LSTM API
    def reset_parameters(self) -> None:
        """nn.LSTM's initialisation: every parameter uniform in ±1/√hidden_size."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for w in self.parameters():
            nn.init.uniform_(w, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """No-op (nn.LSTM compacts its cuDNN weight buffer here; this module has none)."""

    def _apply(self, fn, *args, **kwargs):
        self._converted.clear()  # .to() / .float() / ... give the parameters new storage
        self._cpu_cache.clear()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        defaults = dict(num_layers=1, bias=True, batch_first=False, dropout=0.0, bidirectional=False, proj_size=0,
                        cell_clip=None, proj_clip=None, forget_bias=0.0, residual=False, backend="auto")
        for k, v in defaults.items():
            if getattr(self, k) != v:
                s += f", {k}={getattr(self, k)!r}"
        return s

    def __getstate__(self):  # pickling / deepcopy: the cached copies are rebuilt on the next call
        state = self.__dict__.copy()
        state["_converted"] = {}
        return state

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM, **extras) -> "LSTMP":
        """An LSTMP with ``lstm``'s configuration, parameters (copied), device, dtype and training mode;
        ``extras``: the keyword-only arguments (clips, forget_bias, residual, backend)."""
        if not isinstance(lstm, nn.LSTM):
            raise TypeError(f"LSTMP.from_lstm needs a torch.nn.LSTM, got {type(lstm).__name__}")
        w = lstm.weight_ih_l0
        m = cls(lstm.input_size, lstm.hidden_size, lstm.num_layers, lstm.bias, lstm.batch_first, lstm.dropout,
                lstm.bidirectional, lstm.proj_size, device=w.device, dtype=w.dtype, **extras)
        m.load_state_dict(lstm.state_dict())
        return m.train(lstm.training)

    def to_lstm(self) -> nn.LSTM:
        """The nn.LSTM with this module's configuration and parameters (copied). Raises ValueError when the ELMo
        extras are in use: nn.LSTM computes no clipping, forget bias or residual."""
        used = ([k for k in ("cell_clip", "proj_clip") if getattr(self, k) is not None]  # a clip of 0 is a clip
                + ["forget_bias"] * (self.forget_bias != 0) + ["residual"] * bool(self.residual))
        if used:
            raise ValueError(f"LSTMP.to_lstm: nn.LSTM has no {', '.join(used)}; this module uses them, so its "
                             "function cannot be carried over")
        w = self.weight_ih_l0
        lstm = nn.LSTM(self.input_size, self.hidden_size, self.num_layers, self.bias, self.batch_first, self.dropout,
                       self.bidirectional, self.proj_size, device=w.device, dtype=w.dtype)
        lstm.load_state_dict(self.state_dict())
        return lstm.train(self.training)

    # ---------------------------------------------------------------------------------------------- forward
    def forward(self, input, hx: tuple[torch.Tensor, torch.Tensor] | None = None):
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = _unpack(input)  # original batch order, lengths on the CPU
            unbatched = False
        else:
            if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
                raise ValueError(f"LSTMP: input must be a 2-D (unbatched) or 3-D tensor or a PackedSequence, got "
                                 f"{_describe(input)}")
            unbatched = input.dim() == 2
            x = input.unsqueeze(0) if unbatched else (input if self.batch_first else input.transpose(0, 1))
            lengths = None
        if x.shape[-1] != self.input_size:
            raise ValueError(f"LSTMP: input.size(-1) must be input_size={self.input_size}, got {x.shape[-1]}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"LSTMP: input must be a floating-point tensor (the weights' dtype), got {x.dtype}")
        B, T = x.shape[0], x.shape[1]
        lengths = (torch.full((B,), T, dtype=torch.long, device=x.device) if lengths is None
                   else lengths.to(x.device))
        h0, c0 = self._initial_state(hx, x, unbatched)
        be = backend_for(self.backend, x.device, "lstmp")  # once per call, for the layout and for the op
        # the op gets the resolved name, except 'cuda': asked for by 'auto', it falls back per call where its kernel
        # cannot run, which an explicit 'cuda' refuses
        op_backend = self.backend if be == "cuda" else be
        dirs = 2 if self.bidirectional else 1
        h_n, c_n = [], []
        inp = x
        with trusted_lengths():  # lengths from the PackedSequence or the full length: in range by construction
            for layer in range(self.num_layers):
                if layer > 0 and self.dropout > 0 and self.training:
                    # the mask drawn over the time-major tensor, as nn.LSTM draws it: the same masks as nn.LSTM's
                    # own CPU kernels for the same seed
                    inp = F.dropout(inp.transpose(0, 1).contiguous(), self.dropout, training=True).transpose(0, 1)
                outs = []
                for d in range(dirs):
                    k = layer * dirs + d
                    y, h, c = ops.lstmp(inp, *self._tf_weights(k, inp, col_major=be == "cpu"), h0[k], c0[k],
                                        lengths, cell_clip=self.cell_clip, proj_clip=self.proj_clip,
                                        forget_bias=self.forget_bias, reverse=d == 1, backend=op_backend,
                                        cpu_weight_cache=self._cpu_cache)
                    outs.append(y)
                    h_n.append(h)
                    c_n.append(c)
                out = torch.cat(outs, -1) if dirs == 2 else outs[0]
                inp = out + inp if self.residual and layer > 0 else out
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed:
            return _repack(inp, input), (h_n, c_n)
        if unbatched:
            return inp[0], (h_n[:, 0], c_n[:, 0])
        return (inp if self.batch_first else inp.transpose(0, 1)), (h_n, c_n)

    def _initial_state(self, hx, x: torch.Tensor, unbatched: bool):
        dirs = 2 if self.bidirectional else 1
        B = x.shape[0]
        want = [(self.num_layers * dirs, B, self.proj_size or self.hidden_size),
                (self.num_layers * dirs, B, self.hidden_size)]
        if hx is None:
            dtype = prec.state_dtype(x.dtype)
            return tuple(torch.zeros(s, dtype=dtype, device=x.device) for s in want)
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise ValueError(f"LSTMP: hx must be a tuple (h0, c0), got {_describe(hx)}")
        state = [s.unsqueeze(1) if unbatched and isinstance(s, torch.Tensor) else s for s in hx]
        for name, s, shape in zip(("h0", "c0"), state, want):
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != shape:
                shown = shape[:1] + shape[2:] if unbatched else shape
                raise ValueError(f"LSTMP: {name} must have shape {shown}, got {_describe(s)}")
            if s.device != x.device:
                raise ValueError(f"LSTMP: {name} is on {s.device} but the input is on {x.device}")
        return state

    # ------------------------------------------------------------------------------------ layout conversion
    def _tf_weights(self, k: int, x: torch.Tensor, col_major: bool) -> tuple:
        """(w_in, w_rec, bias, w_proj) of chain k in the TF layout, the weight matrices in the dtype the op will
        compute in (the autocast dtype, else the parameters'); bias stays in the parameters' dtype, and is zeros
        without ``bias`` (w_proj None without a projection). ``col_major`` (the cpu backend, which computes with
        column-major weights, nn.LSTM's layout read transposed, at full speed): the transposed views."""
        names = self._chains[k]
        low = prec.compute_dtype(x)
        out = []
        for role in ("w_in", "w_rec", "bias", "w_proj"):
            if role not in names:
                out.append(None)
                continue
            masters = [getattr(self, n) for n in names[role]]
            out.append(self._converted_copy(k, role, masters, None if role == "bias" else low, col_major))
        if out[2] is None:
            out[2] = out[0].new_zeros(4 * self.hidden_size, dtype=self.weight_ih_l0.dtype)
        return tuple(out)

    def _converted_copy(self, k: int, role: str, masters: list, dtype: torch.dtype | None,
                        col_major: bool = False) -> torch.Tensor:
        """The TF-layout weight of ``role`` for chain k, in ``dtype``: contiguous, or with ``col_major`` the
        transposed view the conversion gives (a view of the parameter itself where no gate swap or cast is
        needed)."""
        to_tf, grad_map = _CONVERSIONS[role]

        def convert(*ms):
            w = to_tf(*ms)
            w = w if dtype is None else w.to(dtype)
            return w if col_major else w.contiguous()

        if tracing(*masters):  # in the graph: plain differentiable code
            return convert(*masters)
        key = (k, role, dtype, col_major)
        hit = self._converted.get(key)
        if hit is None or not all(unchanged(s, m) for s, m in zip(hit[0], masters)):  # elmo_fast._stamp's rule
            with torch.no_grad():
                hit = (tuple(stamp(m) for m in masters), convert(*(m.detach() for m in masters)))
            self._converted[key] = hit
        if torch.is_grad_enabled() and any(m.requires_grad for m in masters):
            return _ConvertedWeight.apply(hit[1], grad_map, *masters)
        return hit[1]


def _describe(v) -> str:
    return f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


@torch.compiler.disable
def _unpack(input: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """pad_packed_sequence, outside any torch.compile graph: its lengths are data-dependent sizes (a graph break
    in torch 2.13), and torch 2.11's dynamo fails on it outright ('data is not allocated yet' from a fake tensor)."""
    return pad_packed_sequence(input, batch_first=True)


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """``out`` (B, T, ·), batch in the original order, packed exactly as ``like`` is (its batch sizes and order):
    packed row j holds (batch entry b_j, step t_j), step-major, the entries of a step in ``like``'s sorted order.
    Every size is known from ``like`` (no data-dependent shape, so torch.compile keeps it in its graph)."""
    B, T = out.shape[0], out.shape[1]
    dev = out.device
    sizes = like.batch_sizes.to(dev)
    N = like.data.shape[0]
    t = torch.repeat_interleave(torch.arange(T, device=dev), sizes, output_size=N)
    b = torch.arange(N, device=dev) - (torch.cumsum(sizes, 0) - sizes).index_select(0, t)
    if like.sorted_indices is not None:
        b = like.sorted_indices.index_select(0, b)
    data = out.reshape(B * T, -1).index_select(0, b * T + t)
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)
