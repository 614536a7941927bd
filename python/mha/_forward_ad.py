"""Forward-mode derivative (jvp) of scaled dot-product attention, in torch operators.

With P = softmax(S), S = scale * Q K^T + mask, O = P V, a tangent (dQ, dK, dV, dMask) moves them by
    dS = scale * (dQ K^T + Q dK^T) + dMask
    dP = P * (dS - rowsum(P * dS))
    dO = dP V + P dV.
The fused kernels compute no such thing (forward mode is rare in training: Hessian-vector
products, jacfwd of small functions), so this forms P explicitly, O(L * S) memory per head, in
float32 (float64 for float64 inputs), and runs under vmap as any torch code does (jacfwd).
"""

from __future__ import annotations

import math

import torch


def _grouped(x, heads: int, enable_gqa: bool):
    """Key/value heads repeated to the query's count (GQA), as the kernel reads them in place."""
    if x is None or not enable_gqa or x.dim() < 3 or x.shape[-3] == heads:
        return x
    return x.repeat_interleave(heads // x.shape[-3], dim=-3)


def sdpa_jvp(query, key, value, attn_mask, tangents, dropout_p, is_causal, scale, enable_gqa, bottom_right):
    """The output's tangent for the inputs' `tangents` (dQ, dK, dV, dMask; None for none)."""
    if dropout_p > 0:
        raise RuntimeError("mha.scaled_dot_product_attention: forward-mode AD (jvp, jacfwd, forward_ad) with "
                           "dropout_p > 0 is not supported (the dropout mask is drawn inside the kernel)")
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    dq, dk, dv, dmask = tangents
    heads = query.shape[-3] if query.dim() >= 3 else 1
    q = query.to(wide)
    k = _grouped(key, heads, enable_gqa).to(wide)
    v = _grouped(value, heads, enable_gqa).to(wide)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(wide))
    if is_causal:
        L, S = scores.shape[-2:]
        hidden = torch.ones(L, S, dtype=torch.bool).triu(1 + (S - L if bottom_right else 0))
        scores = scores.masked_fill(hidden, -math.inf)
    # (a row with every key masked is zeros, as the kernel's output there)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)

    d_scores = None
    if dq is not None:
        d_scores = dq.to(wide) @ k.transpose(-1, -2) * scale
    if dk is not None:
        term = q @ _grouped(dk, heads, enable_gqa).to(wide).transpose(-1, -2) * scale
        d_scores = term if d_scores is None else d_scores + term
    if dmask is not None and attn_mask is not None and attn_mask.is_floating_point():
        d_scores = dmask.to(wide) if d_scores is None else d_scores + dmask.to(wide)
    d_out = None
    if d_scores is not None:
        pd = p * d_scores
        d_out = (pd - p * pd.sum(-1, keepdim=True)) @ v
    if dv is not None:
        term = p @ _grouped(dv, heads, enable_gqa).to(wide)
        d_out = term if d_out is None else d_out + term
    if d_out is None:
        return None
    return d_out.to(query.dtype)
