"""Sentence-boundary helpers with AllenNLP's contracts (``allennlp.nn.util``), and strict text input."""
from __future__ import annotations

import torch


def read_utf8(path, what: str = "input file", error: type[Exception] = ValueError) -> str:
    """The whole file as text; an unreadable or non-UTF-8 file raises ``error`` naming the file, line and byte."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{what} {path}: line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                    f"{exc.start}); the file must be UTF-8 text, e.g. convert it with `iconv -f latin1 -t utf-8`"
                    ) from None


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
