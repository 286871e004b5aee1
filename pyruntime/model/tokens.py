"""Token-id arguments of a forward pass, checked once for every executor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyruntime.errors import UsageError


def token_ids(tokens: Sequence[int] | torch.Tensor, n_vocab: int) -> torch.Tensor:
    """tokens as a flat int64 tensor [n], n >= 1, every id in [0, n_vocab) (else UsageError)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise UsageError("forward() needs at least one token")
    if int(ids.min()) < 0 or int(ids.max()) >= n_vocab:
        raise UsageError(f"token id out of range [0, {n_vocab})")
    return ids


def single_token(tokens: Sequence[int] | torch.Tensor, n_vocab: int) -> int | None:
    """The token id when `tokens` holds exactly one (in [0, n_vocab), else UsageError as
    token_ids), else None: the decode fast paths' check, without building a tensor."""
    if isinstance(tokens, torch.Tensor):
        token = int(tokens.reshape(-1)[0]) if tokens.numel() == 1 else None
    elif len(tokens) == 1 and not isinstance(tokens[0], torch.Tensor | Sequence):
        token = int(tokens[0])
    else:
        return None
    if token is not None and not 0 <= token < n_vocab:
        raise UsageError(f"token id out of range [0, {n_vocab})")
    return token
