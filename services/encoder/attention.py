"""Attention for the vision and audio towers over every item a tower call holds, one SDPA call a layer, with
nothing read back from the device.

Under SDPA transformers' towers split the packed items by `lengths.tolist()` in every layer, a device wait each;
given an implementation named "flash" they hand every layer cu_seqlens and the longest length instead. Equal
items are a batch as they lie; otherwise each is laid into a padded row, the padding masked out of the keys."""

import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "omni_flash_varlen"  # "flash" makes the towers pass cu_seqlens and the longest length

_layouts = threading.local()  # the last call's layout: every layer of a tower call passes the same cu_seqlens


def _layout(cu: torch.Tensor, tokens: int, longest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(item, place within it) of each packed token [tokens], and each item's valid keys [items, longest]."""
    cached = getattr(_layouts, "last", None)
    if cached is not None and cached[0] is cu:
        return cached[1]
    bounds = cu.long()
    lengths = bounds[1:] - bounds[:-1]
    item = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=tokens)
    place = torch.arange(tokens, device=cu.device) - bounds[item]
    valid = torch.arange(longest, device=cu.device)[None, :] < lengths[:, None]
    _layouts.last = (cu, (item, place, valid))  # holding cu keeps its identity from another tensor
    return item, place, valid


def forget_layout() -> None:
    """Drops the kept layout: a graph being captured must compute its own, not read tensors that may go."""
    _layouts.last = None


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                     max_length_q=None, is_causal=False, **kwargs):
    """query, key, value [1, heads, tokens, head_dim] packed items -> ([1, tokens, heads, head_dim], None)."""
    if cu_seq_lens_q is None or max_length_q is None or is_causal:
        raise ValueError(f"{NAME} attends within packed items, both ways: it needs cu_seqlens and the longest length")
    _, heads, tokens, dim = query.shape
    items, longest = cu_seq_lens_q.shape[0] - 1, int(max_length_q)
    if items * longest == tokens:  # every item is the longest: a batch [items, heads, longest, dim] as it lies
        q, k, v = (t[0].reshape(heads, items, longest, dim).transpose(0, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        return out.transpose(1, 2).reshape(1, tokens, heads, dim), None
    item, place, valid = _layout(cu_seq_lens_q, tokens, longest)

    def rows(t: torch.Tensor) -> torch.Tensor:  # [1, heads, tokens, dim] -> [items, heads, longest, dim], zero padded
        padded = t.new_zeros(items, longest, heads, dim)
        padded[item, place] = t[0].transpose(0, 1)
        return padded.transpose(1, 2)

    out = F.scaled_dot_product_attention(rows(query), rows(key), rows(value), attn_mask=valid[:, None, None, :],
                                         scale=scaling)
    return out.transpose(1, 2)[item, place][None], None


AttentionInterface.register(NAME, varlen_attention)


def use_varlen_attention(tower: torch.nn.Module) -> torch.nn.Module:
    tower.config._attn_implementation = NAME
    return tower
