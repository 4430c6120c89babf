"""The published hdf5 weight layout (spec §2.3, §3.3, §7.1): read with shape checks, write back bit-exactly."""
from __future__ import annotations

import contextlib
import json
import os
import re

import h5py
import numpy as np

from .options import ElmoOptions, OptionsError


class WeightFileError(ValueError):
    """A weight file lacks a dataset or holds one of the wrong shape for its options."""


def lstm_prefix(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def expected_shapes(opts: ElmoOptions, include_optional: bool = True) -> dict[str, tuple[int, ...]]:
    """Dataset name -> shape that ``opts`` requires (plus the optional ones a loader accepts)."""
    shapes: dict[str, tuple[int, ...]] = {}
    P, H = opts.lstm.projection_dim, opts.lstm.dim
    c = opts.char_cnn
    if c is not None:
        F = c.n_filters
        shapes["char_embed"] = (261, c.embedding_dim)
        for i, (w, n) in enumerate(c.filters):
            shapes[f"CNN/W_cnn_{i}"] = (1, w, c.embedding_dim, n)
            shapes[f"CNN/b_cnn_{i}"] = (n,)
        for k in range(c.n_highway):
            shapes[f"CNN_high_{k}/W_carry"] = (F, F)
            shapes[f"CNN_high_{k}/b_carry"] = (F,)
            shapes[f"CNN_high_{k}/W_transform"] = (F, F)
            shapes[f"CNN_high_{k}/b_transform"] = (F,)
        if opts.has_cnn_projection or include_optional:
            shapes["CNN_proj/W_proj"] = (F, P)
            shapes["CNN_proj/b_proj"] = (P,)
    for d in range(2):
        for layer in range(opts.lstm.n_layers):
            pre = lstm_prefix(d, layer)
            shapes[f"{pre}/W_0"] = (2 * P, 4 * H)
            shapes[f"{pre}/B"] = (4 * H,)
            if opts.lstm.has_projection or include_optional:
                shapes[f"{pre}/W_P_0"] = (H, P)
    return shapes


def _optional(opts: ElmoOptions, name: str) -> bool:
    if name.startswith("CNN_proj/"):
        return not opts.has_cnn_projection
    if name.endswith("/W_P_0"):
        return not opts.lstm.has_projection
    return False


_CNN = re.compile(r"CNN/[Wb]_cnn_(\d+)")
_HIGHWAY = re.compile(r"CNN_high_(\d+)/")
_CELL = re.compile(r"RNN_(\d+)/RNN/MultiRNNCell/Cell(\d+)/")


def _upto(prefix: str, n: int) -> str:
    return f"{prefix}0 only" if n == 1 else f"{prefix}0 .. {prefix}{n - 1}"


def _unaccounted_reason(opts: ElmoOptions, name: str) -> str | None:
    """Why dataset ``name`` of a weight file is a part of the model that ``opts`` leaves out, or None.

    Only the families of the published layout count (the CNN filters and highway layers, the CNN projection of a
    word-input model and the LSTM layers and directions); other datasets (bilm-tf's ``softmax/W``, a word-input
    model's ``embedding``, ...) are left alone, as the loaders do."""
    c = opts.char_cnn
    if c is None:
        if name == "char_embed" or name.startswith(("CNN/", "CNN_proj/")) or _HIGHWAY.match(name):
            return "the options have no char_cnn (a word-input biLM), so no character CNN"
    else:
        m = _CNN.fullmatch(name)
        if m and int(m[1]) >= len(c.filters):
            n = len(c.filters)
            return (f"char_cnn.filters has {n} entr{'y' if n == 1 else 'ies'}: {_upto('CNN/W_cnn_', n)} and "
                    f"{_upto('CNN/b_cnn_', n)}")
        m = _HIGHWAY.match(name)
        if m and int(m[1]) >= c.n_highway:
            n = c.n_highway
            return f"char_cnn.n_highway is {n}: " + ("no highway layers" if n == 0 else _upto("CNN_high_", n))
    m = _CELL.match(name)
    if m and int(m[1]) >= 2:
        return "a biLM has two directions: RNN_0 and RNN_1 only"
    if m and int(m[2]) >= opts.lstm.n_layers:
        return f"lstm.n_layers is {opts.lstm.n_layers}: MultiRNNCell/{_upto('Cell', opts.lstm.n_layers)}"
    return None


def _residual_flag(path, value) -> bool:
    """The root attribute ``RESIDUAL_ATTR`` as a bool: h5py reads a written bool as numpy.bool_; 0/1 is accepted."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise WeightFileError(f"{path}: the root attribute '{RESIDUAL_ATTR}' is {value!r} ({type(value).__name__}), "
                          "expected a boolean (true/false, or 0/1) saying whether the model has residual connections")


def _check_float(path, name: str, ds: h5py.Dataset) -> None:
    """Weights are floating point (float32; float16/float64 are converted): refuse integers, booleans, strings..."""
    if ds.dtype.kind != "f":
        found = f"{ds.dtype} (strings)" if h5py.check_string_dtype(ds.dtype) is not None else str(ds.dtype)
        raise WeightFileError(f"{path}: dataset '{name}' has dtype {found}, expected floating point (float32)")


def _check_accounted(path, fh: h5py.File, opts: ElmoOptions) -> None:
    """Refuse datasets of the layout's families that the options leave out (more filters, highway layers or LSTM
    layers than the options say): reading only what the options name would run a smaller model silently."""
    names: list[str] = []
    fh.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    extra: dict[str, list[str]] = {}
    for name in sorted(names):
        reason = _unaccounted_reason(opts, name)
        if reason is not None:
            extra.setdefault(reason, []).append(name)
    if extra:
        parts = []
        for reason, found in extra.items():
            shown = ", ".join(f"'{n}'" for n in found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
            parts.append(f"{shown} ({reason})")
        raise WeightFileError(f"{path} holds datasets the options do not account for: {'; '.join(parts)}; use the "
                              "options file written with these weights")


def read_weights(path: str | os.PathLike, opts: ElmoOptions) -> dict[str, np.ndarray]:
    """Read every dataset ``opts`` needs, as float32 arrays in file layout; raise naming any mismatch."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"weight file not found: {path}")
    out: dict[str, np.ndarray] = {}
    try:
        fh = h5py.File(path, "r")
    except OSError as exc:
        raise WeightFileError(f"{path} is not a readable hdf5 file: {exc}") from None
    with fh:
        residual = fh.attrs.get(RESIDUAL_ATTR)
        if residual is not None:
            residual = _residual_flag(path, residual)
        if residual is not None and residual != opts.lstm.use_skip_connections:
            raise WeightFileError(
                f"{path} holds a model {'with' if residual else 'without'} residual connections but the options say "
                f"lstm.use_skip_connections={str(opts.lstm.use_skip_connections).lower()}; use the options file "
                "written with these weights")
        _check_accounted(path, fh, opts)
        if opts.char_cnn is None:  # a word-input biLM: its (vocabulary, P) token table
            ds = fh.get("embedding")
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 2 or ds.shape[1] != opts.lstm.projection_dim:
                found = "is missing" if ds is None else f"has shape {getattr(ds, 'shape', None)}"
                raise WeightFileError(f"{path}: the options have no char_cnn (a word-input biLM), so the file needs "
                                      f"an 'embedding' dataset of shape (vocabulary, {opts.lstm.projection_dim}); "
                                      f"it {found}")
            _check_float(path, "embedding", ds)
            out["embedding"] = ds[...].astype(np.float32)
        for name, shape in expected_shapes(opts).items():
            if name not in fh:
                if _optional(opts, name):
                    continue
                raise WeightFileError(f"{path}: dataset '{name}' is missing (expected shape {shape} from the options)")
            ds = fh[name]
            if not isinstance(ds, h5py.Dataset):
                raise WeightFileError(f"{path}: '{name}' is a group, expected a dataset of shape {shape}")
            if tuple(ds.shape) != shape:
                raise WeightFileError(
                    f"{path}: dataset '{name}' has shape {tuple(ds.shape)}, expected {shape} from the options"
                )
            _check_float(path, name, ds)
            arr = ds[...]
            if arr.dtype != np.float32:
                arr = arr.astype(np.float32)
            out[name] = arr
    return out


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike):
    """Temporary names for ``paths`` (same folders), renamed into place together only when the block succeeds.

    A reader never sees a half-written file; on any exception (including the one the CLI raises for SIGINT or
    SIGTERM) every temporary file is removed and the targets keep their old content, or stay absent. The renames
    come last, after everything was written, so files that belong together are replaced together."""
    targets = [os.fspath(p) for p in paths]
    tmps = [f"{p}.tmp-{os.getpid()}" for p in targets]
    try:
        yield tmps
        for tmp, target in zip(tmps, targets):
            os.replace(tmp, target)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)


@contextlib.contextmanager
def atomic_h5(path: str | os.PathLike):
    """An hdf5 file opened for writing under a temporary name (see ``atomic_paths``)."""
    with atomic_paths(path) as (tmp,), h5py.File(tmp, "w") as fh:
        yield fh


# The published files do not record whether the model has residual connections (the shapes are the same either
# way). Files written by elmo_fast record it in this root attribute, and reading them checks it.
RESIDUAL_ATTR = "elmo_fast.use_skip_connections"


def write_arrays(fh: h5py.File, arrays: dict[str, np.ndarray], opts: ElmoOptions | None = None) -> None:
    """Float32 datasets in the published layout into an open file; with ``opts``, also the residual flag."""
    for name in sorted(arrays):
        fh.create_dataset(name, data=np.asarray(arrays[name], dtype=np.float32))
    if opts is not None:
        fh.attrs[RESIDUAL_ATTR] = bool(opts.lstm.use_skip_connections)


def write_weights(path: str | os.PathLike, arrays: dict[str, np.ndarray], opts: ElmoOptions | None = None,
                  options_file: str | os.PathLike | None = None) -> None:
    """Write float32 datasets in the published layout (see ``write_arrays``) and, with ``options_file``, the
    inference options.json of ``opts`` (``n_characters`` 262, spec §7.1) that loads them back. The files are
    written together or not at all (``atomic_paths``)."""
    if options_file is not None and opts is None:
        raise ValueError("write_weights: an options_file needs the options (opts) to write")
    targets = (path,) if options_file is None else (path, options_file)
    if len({os.path.abspath(os.fspath(t)) for t in targets}) < len(targets):
        raise ValueError(f"write_weights: the weights and the options file both name {os.fspath(path)}")
    with atomic_paths(*targets) as tmps:
        with h5py.File(tmps[0], "w") as fh:
            write_arrays(fh, arrays, opts)
        if options_file is not None:
            with open(tmps[1], "w", encoding="utf-8") as fh:
                json.dump(opts.to_inference_dict(), fh, indent=2)


__all__ = ["read_weights", "write_weights", "write_arrays", "atomic_h5", "atomic_paths", "expected_shapes",
           "lstm_prefix", "WeightFileError", "OptionsError"]
