"""Forward-mode derivative (jvp) of scaled dot-product attention, in torch operators.

With P = softmax(S), S = scale * Q K^T + mask (the first term soft-capped where asked: its tangent
times the cap's derivative), O = P V, a tangent (dQ, dK, dV, dMask) moves them by
    dS = scale * (dQ K^T + Q dK^T) + dMask
    dP = P * (dS - rowsum(P * dS))
    dO = dP V + P dV.
The fused kernels compute no such thing (forward mode is rare in training: Hessian-vector
products, jacfwd of small functions), so this forms P explicitly (_explicit.py), O(L * S) memory
per head, and runs under vmap as any torch code does (jacfwd).
"""

from __future__ import annotations

import math

from ._explicit import grouped, heads_of, probabilities, raw_scores, wide_dtype
from ._softcap import slope


def sdpa_jvp(query, key, value, attn_mask, tangents, dropout_p, is_causal, scale, enable_gqa, bottom_right,
             window=(-1, -1), alibi_slopes=None, sinks=None, d_sinks=None, softcap: float = 0.0):
    """The output's tangent for the inputs' `tangents` (dQ, dK, dV, dMask; None for none) and the
    sinks' (d_sinks): a sink's tangent moves every weight of its rows by -P P_sink d_sink. With
    soft-capping, q.k's tangent passes through the cap's derivative (the mask's does not)."""
    if dropout_p > 0:
        raise RuntimeError("mha.scaled_dot_product_attention: forward-mode AD (jvp, jacfwd, forward_ad) with "
                           "dropout_p > 0 is not supported (the dropout mask is drawn inside the kernel)")
    wide = wide_dtype(query)
    dq, dk, dv, dmask = tangents
    heads = heads_of(query)
    q = query.to(wide)
    k = grouped(key, heads, enable_gqa).to(wide)
    v = grouped(value, heads, enable_gqa).to(wide)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    p = probabilities(query, key, attn_mask, is_causal, scale, enable_gqa, bottom_right, window, alibi_slopes, sinks,
                      softcap)

    d_scores = None
    if dq is not None:
        d_scores = dq.to(wide) @ k.transpose(-1, -2) * scale
    if dk is not None:
        term = q @ grouped(dk, heads, enable_gqa).to(wide).transpose(-1, -2) * scale
        d_scores = term if d_scores is None else d_scores + term
    if d_scores is not None and softcap > 0:
        d_scores = d_scores * slope(raw_scores(query, key, scale, enable_gqa), softcap)
    if dmask is not None and attn_mask is not None and attn_mask.is_floating_point():
        d_scores = dmask.to(wide) if d_scores is None else d_scores + dmask.to(wide)
    d_out = None
    if d_scores is not None:
        pd = p * d_scores
        d_out = (pd - p * pd.sum(-1, keepdim=True)) @ v
    if dv is not None:
        term = p @ grouped(dv, heads, enable_gqa).to(wide)
        d_out = term if d_out is None else d_out + term
    if d_sinks is not None:
        sink_share = 1 - p.sum(-1, keepdim=True)  # [..., Hq, L, 1]
        rows = d_sinks.to(wide).reshape(-1, 1, 1) if p.dim() >= 3 else d_sinks.to(wide).reshape(1, 1)
        term = -(p @ v) * sink_share * rows
        d_out = term if d_out is None else d_out + term
    if d_out is None:
        return None
    return d_out.to(query.dtype)
