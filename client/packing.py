"""Attention over packed rows (`format: text`): keep each document to itself.

A packed row holds several documents (segments); `position_ids` restarts at 0 at every
segment start, including the start of every row and of the padding run, and `document_ids`
numbers the row's segments 0, 1, 2, ... (-1 on padding). Either gives the model what it needs:

    from stoker.client.packing import block_causal_mask, cu_seqlens

    cu = cu_seqlens(batch["position_ids"])             # FlashAttention varlen (flattened batch)
    mask = block_causal_mask(batch["document_ids"])    # SDPA: attn_mask=mask[:, None]

Both run on the tensors' device: call them after the batch is on the GPU. Needs torch.
"""

from __future__ import annotations

import torch

__all__ = ["block_causal_mask", "cu_seqlens"]


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative segment lengths of the batch flattened to one sequence, int32
    [segments + 1]: 0, the start of every later segment (where position_ids == 0), B * T.
    This is `cu_seqlens_q`/`cu_seqlens_k` of flash_attn_varlen_func; the longest segment,
    its `max_seqlen`, is `int(cu.diff().max())`. The first position always starts one."""
    flat = position_ids.reshape(-1)
    starts = flat == 0
    if flat.numel():
        starts[0] = True
    idx = torch.nonzero(starts).flatten()
    end = torch.tensor([flat.numel()], dtype=idx.dtype, device=idx.device)
    return torch.cat([idx, end]).to(torch.int32)


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T], True where query t may attend to key s: s <= t in the same segment.
    Padding (-1) is one segment too, so no query is left with nothing to attend to (an
    all-False row would make softmax NaN); its outputs carry no loss (labels -100)."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq_len], got {list(document_ids.shape)}")
    t = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return same & causal
