"""Attention over packed rows (`format: text`): keep each document to itself.

A packed row holds several documents (segments); `position_ids` restarts at 0 at every
segment start, including the start of every row and of the padding run, and `document_ids`
numbers the row's segments 0, 1, 2, ... (-1 on padding). Either gives the model what it needs:

    from stoker.client.packing import block_causal_mask, cu_seqlens

    cu = cu_seqlens(batch["position_ids"])             # FlashAttention varlen (flattened batch)
    mask = block_causal_mask(batch["document_ids"])    # SDPA: attn_mask=mask[:, None]

Both run on the tensors' device: call them after the batch is on the GPU. Needs torch.

Padded batches (a list-valued `length_column`, e.g. under `batch_tokens`: every [n, L] field
beside `attention_mask`, real tokens first in each row) pack into one row with
`pack_padded`, which `RemoteLoader(pack=True)` applies to every batch:

    packed = pack_padded(batch)   # input_ids [1, T], position_ids [1, T], cu_seqlens [n + 1]
"""

from __future__ import annotations

import torch

__all__ = ["block_causal_mask", "cu_seqlens", "pack_padded"]


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


def pack_padded(batch: dict[str, torch.Tensor], mask: str = "attention_mask"
                ) -> dict[str, torch.Tensor]:
    """A padded batch as one packed row. Every field whose first two axes are `mask`'s
    [n, L] becomes [1, T, ...]: its real tokens (where mask is non-zero; they come first in
    each row), sample after sample, T = the batch's real tokens. Adds `position_ids` [1, T]
    (0 at each sample's start; kept if the batch has its own), `cu_seqlens` int32 [n + 1]
    (0, then each sample's end: `cu_seqlens(position_ids)` where no sample is empty) and
    `max_seqlen` (int64 [], the longest sample); drops `mask`. Other fields (per sample:
    `sample_index`, labels of shape [n]) stay as they are."""
    if mask not in batch:
        raise KeyError(f"pack_padded: the batch has no {mask!r} (its fields: {sorted(batch)})")
    keep = batch[mask] != 0
    if keep.dim() != 2:
        raise ValueError(f"{mask} must be [batch, length], got {list(keep.shape)}")
    lengths = keep.sum(dim=1)
    out = {}
    for name, value in batch.items():
        if name == mask:
            continue
        if value.dim() >= 2 and value.shape[:2] == keep.shape:
            out[name] = value[keep].unsqueeze(0)
        else:
            out[name] = value
    if "position_ids" not in out:
        positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
        out["position_ids"] = positions[keep].unsqueeze(0)
    zero = torch.zeros(1, dtype=torch.int32, device=keep.device)
    out["cu_seqlens"] = torch.cat([zero, lengths.cumsum(0).to(torch.int32)])
    out["max_seqlen"] = lengths.max() if lengths.numel() else lengths.new_zeros(())
    return out
