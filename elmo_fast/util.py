"""Sentence-boundary helpers with AllenNLP's contracts (``allennlp.nn.util``), strict text input, and the path
checks every command runs before it does any work."""
from __future__ import annotations

import operator
import os
import re
import stat
import sys

import torch


def _configuration_error_class(base: type) -> type:
    """(base, ValueError) as ``elmo_fast.util.ConfigurationError``, the name pickle finds it by."""
    cls = globals().get("ConfigurationError")
    if cls is None or cls.__bases__[0] is not base:
        cls = type("ConfigurationError", (base, ValueError), {"__module__": __name__})
        globals()["ConfigurationError"] = cls
    return cls


def __getattr__(name: str):
    # an unpickled error: the class made on first use (allennlp was loaded where it was raised)
    if name == "ConfigurationError":
        try:
            from allennlp.common.checks import ConfigurationError as base
        except ImportError:  # no allennlp: no such attribute (hasattr and getattr(..., default) must not raise)
            raise AttributeError(f"module {__name__!r} has no attribute {name!r} (allennlp is not installed)") from None
        return _configuration_error_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configuration_error(message: str) -> ValueError:
    """The error for a wrong argument where AllenNLP raises its ``ConfigurationError``: a ``ValueError``, and also
    an ``allennlp.common.checks.ConfigurationError`` once allennlp is loaded, so that ``except ConfigurationError``
    in code ported from AllenNLP still catches it (allennlp is never imported here for it)."""
    base = getattr(sys.modules.get("allennlp.common.checks"), "ConfigurationError", None)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        return ValueError(message)
    try:
        err = _configuration_error_class(base)(message)  # AllenNLP's keeps it in .message, and str() gives it
    except TypeError:
        return ValueError(message)
    return err if str(err) == message else ValueError(message)


def read_utf8(path, what: str = "input file", error: type[Exception] = ValueError) -> str:
    """The whole file as text, without a leading UTF-8 byte-order mark (which editors on Windows write, and which
    would otherwise become characters of the first word); an unreadable or non-UTF-8 file raises ``error`` naming
    the file, line and byte."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{what} {path}: line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                    f"{exc.start}); the file must be UTF-8 text, e.g. convert it with `iconv -f latin1 -t utf-8`"
                    ) from None
    return text[1:] if text.startswith("\ufeff") else text


def text_lines(text: str) -> list[str]:
    r"""The lines of ``text`` as Python's text-mode ``readlines`` (bilm-tf's reader) sees them, without their
    ends: only \n, \r\n and \r end a line. (``str.splitlines`` would also split at \v, \f, \x1c-\x1e, \x85,
    \u2028 and \u2029, which bilm-tf's ``str.split`` treats as spaces inside a line.)"""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def check_int(value, what: str, minimum: int, note: str = "", error: type[Exception] = ValueError) -> int:
    """``value`` as an int when it is an integer (an int or anything int-like, e.g. a numpy integer; not a float,
    str or bool) of at least ``minimum``; else ``error``: "{what} must be an integer >= {minimum}{note}, got ..."."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise error(f"{what} must be an integer >= {minimum}{note}, got {value!r}")
    return number


def parse_device(name: str, what: str = "--device", error: type[Exception] = ValueError) -> torch.device:
    """A device string that can run here (cpu, cuda, cuda:N with a GPU present); else ``error`` saying why."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise error(f"{what} {name!r} is not a device; expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise error(f"{what} {name}: no CUDA device is available here; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise error(f"{what} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_backend(name: str | None, device: torch.device, ops: tuple[str, ...], what: str = "--backend",
                  error: type[Exception] = ValueError) -> None:
    """The backend ``name`` can run every op in ``ops`` on ``device``; else ``error`` in command-line words."""
    from ._backend import BackendUnavailableError, select_backend

    try:
        for op in ops:
            select_backend(name, device, op)
    except (BackendUnavailableError, ValueError) as exc:
        prefix = f"{what} {name}: " if name else ""
        raise error(prefix + re.sub(r"backend='(\w+)'", r"--backend \1", str(exc))) from None


def check_input_file(path, what: str, error: type[Exception] = ValueError) -> None:
    """``path`` names a readable regular file; else ``error`` naming ``what`` (e.g. "--vocab"), the path and why."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise error(f"{what} {path}: no such file")
    if os.path.isdir(path):
        raise error(f"{what} {path}: is a directory; expected a file")
    if not os.access(path, os.R_OK):
        raise error(f"{what} {path}: not readable (permission denied)")


def check_output_file(path, what: str, error: type[Exception] = ValueError) -> None:
    """``path`` can be written: not a directory nor any other existing non-regular file (a device, a fifo, a socket:
    the rename into place would replace it), and its folder exists and is writable. Nothing is created."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{what} {path}: is a directory; expected a file name, e.g. {os.path.join(path, 'out.hdf5')}")
    if os.path.exists(path) and not os.path.isfile(path):  # the rename into place would replace it by a file
        kind = _file_kind(os.stat(path).st_mode)
        raise error(f"{what} {path}: is {kind}, not a regular file, and the output (renamed into place at the end) "
                    "would replace it; give the name of a regular file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise error(f"{what} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise error(f"{what} {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise error(f"{what} {path}: the file exists and is not writable")


def _file_kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a fifo (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def same_file(a, b) -> bool:
    """``a`` and ``b`` name one file: ``os.path.samefile`` when both exist (symlinks, hard links), else their
    normalised real paths are equal."""
    a, b = os.fspath(a), os.fspath(b)
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def check_output_not_input(output, inputs, what: str = "--output", error: type[Exception] = ValueError) -> None:
    """``output`` names none of the files read: ``inputs`` are (name, path) pairs (e.g. ("--vocab", path)); else
    ``error`` saying which one the output would replace."""
    for name, path in inputs:
        if path is not None and same_file(output, path):
            raise error(f"{what} {output} is the {name} file {path}: the output would replace it; give another "
                        f"{what}")


def check_output_dir(path, what: str, error: type[Exception] = ValueError) -> None:
    """``path`` is a directory, or can be created as one (its nearest existing ancestor is a writable folder)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise error(f"{what} {path}: the directory is not writable")
        return
    if os.path.exists(path):
        raise error(f"{what} {path}: is a file; expected a directory (existing or to be created)")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise error(f"{what} {path}: {parent} is a file, so the directory cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{what} {path}: cannot create it, {parent} is not writable")


def _lengths(mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (batch, timesteps), got shape {tuple(mask.shape)}")
    return mask.long().sum(dim=1)


def add_sentence_boundary_token_ids(tensor: torch.Tensor, mask: torch.Tensor, sentence_begin_token,
                                    sentence_end_token):
    """Put ``sentence_begin_token`` at position 0 and ``sentence_end_token`` right after each row's last
    valid position. tensor (B, T) or (B, T, D); returns (tensor (B, T+2[, D]), mask (B, T+2) bool)."""
    if tensor.dim() not in (2, 3):
        raise ValueError(f"tensor must be (batch, timesteps) or (batch, timesteps, dim), got {tuple(tensor.shape)}")
    B, T = tensor.shape[:2]
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(tensor.shape[:2])}")
    lengths = _lengths(mask).to(tensor.device)
    begin = torch.as_tensor(sentence_begin_token, dtype=tensor.dtype, device=tensor.device)
    end = torch.as_tensor(sentence_end_token, dtype=tensor.dtype, device=tensor.device)
    pos = torch.arange(T + 2, device=tensor.device).unsqueeze(0)  # (1, T+2)
    src = (pos - 1).clamp(0, max(T - 1, 0)).expand(B, T + 2)
    inside = (pos >= 1) & (pos <= lengths.unsqueeze(1))
    is_begin = pos == 0
    is_end = pos == (lengths + 1).unsqueeze(1)
    if tensor.dim() == 2:
        gathered = tensor.gather(1, src) if T else tensor.new_zeros(B, T + 2)
        out = torch.where(inside, gathered, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
        out = torch.where(is_begin, begin, out)
        out = torch.where(is_end, end, out)
    else:
        D = tensor.shape[2]
        if T:
            gathered = tensor.gather(1, src.unsqueeze(-1).expand(B, T + 2, D))
        else:
            gathered = tensor.new_zeros(B, 2, D)
        out = gathered * inside.unsqueeze(-1).to(tensor.dtype) if tensor.is_floating_point() else \
            torch.where(inside.unsqueeze(-1), gathered, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
        out = torch.where(is_begin.unsqueeze(-1), begin.expand(D), out)
        out = torch.where(is_end.unsqueeze(-1), end.expand(D), out)
    new_mask = pos < (lengths + 2).unsqueeze(1)
    return out, new_mask


def remove_sentence_boundaries(tensor: torch.Tensor, mask: torch.Tensor):
    """Drop each row's first and last valid positions: (B, T, D) -> (B, T-2, D) plus the new bool mask.
    Rows with 2 or fewer valid positions become all zeros with an all-False mask."""
    if tensor.dim() != 3:
        raise ValueError(f"tensor must be (batch, timesteps, dim), got shape {tuple(tensor.shape)}")
    B, T, D = tensor.shape
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {(B, T)}")
    if T < 2:
        raise ValueError(f"a tensor with sentence boundaries has at least 2 timesteps, got {T}")
    lengths = _lengths(mask).to(tensor.device)
    new_len = (lengths - 2).clamp(min=0)
    pos = torch.arange(T - 2, device=tensor.device).unsqueeze(0)
    new_mask = pos < new_len.unsqueeze(1)
    out = tensor[:, 1 : T - 1] * new_mask.unsqueeze(-1).to(tensor.dtype)
    return out, new_mask
