"""Attention probabilities formed explicitly in torch operators, O(L * S) per head.

The fused kernels never form P = softmax(cap(scale * Q K^T) + mask) whole. Where P itself is wanted
with derivatives, this is it, in float32 (float64 for float64 inputs): the forward-mode
derivative (_forward_ad.py), the weights that scaled_dot_product_attention(need_weights=True)
returns when autograd or a torch.func transform must differentiate them, and the backward that
a second derivative differentiates (a gradient penalty: backward(create_graph=True)).
"""

from __future__ import annotations

import math

import torch

from ._softcap import capped, slope
from ._window import band


def grouped(x, heads: int, enable_gqa: bool):
    """Key/value heads repeated to the query's count (GQA), as the kernel reads them in place."""
    if x is None or not enable_gqa or x.dim() < 3 or x.shape[-3] == heads:
        return x
    return x.repeat_interleave(heads // x.shape[-3], dim=-3)


def heads_of(query) -> int:
    return query.shape[-3] if query.dim() >= 3 else 1


def wide_dtype(query):
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def alibi_biases(slopes, L: int, S: int, bottom_right: bool, dtype):
    """ALiBi's biases [..., Hq, L, S] for slopes [..., Hq]: -slope * |i + diagonal - j|, the slope
    and the distance multiplied in `dtype` (as the kernels do: float32, float64 for float64 calls)."""
    i = torch.arange(L, device=slopes.device).unsqueeze(-1) + (S - L if bottom_right else 0)
    distance = (i - torch.arange(S, device=slopes.device)).abs().to(dtype)
    return -(slopes.to(dtype)[..., None, None] * distance)


def raw_scores(query, key, scale, enable_gqa: bool):
    """scale * Q K^T in the wide dtype, grouped key heads repeated."""
    wide = wide_dtype(query)
    k = grouped(key, heads_of(query), enable_gqa).to(wide)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    return query.to(wide) @ k.transpose(-1, -2) * scale


def probabilities(query, key, attn_mask, is_causal: bool, scale, enable_gqa: bool, bottom_right: bool,
                  window=(-1, -1), alibi_slopes=None, sinks=None, softcap: float = 0.0):
    """softmax(cap(scale * Q K^T) + mask) with the kernel's conventions: soft-capping (softcap > 0),
    a bool mask keeps True, a causal
    mask in either alignment, a sliding window (left, right), ALiBi's biases, grouped key heads,
    broadcast batch dimensions; a row whose keys are
    all masked is zeros, and so is its derivative (no NaN from the softmax of -inf alone). Sinks
    [Hq] add exp(sink) to each row's denominator (differentiable in them too)."""
    wide = wide_dtype(query)
    scores = capped(raw_scores(query, key, scale, enable_gqa), softcap)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(wide))
    if alibi_slopes is not None:
        L, S = scores.shape[-2:]
        bias = alibi_biases(alibi_slopes.detach(), L, S, bottom_right,
                            torch.float64 if alibi_slopes.dtype == torch.float64 else torch.float32).to(wide)
        while bias.dim() > scores.dim() and bias.shape[0] == 1:  # (a call without heads: one slope)
            bias = bias[0]
        scores = scores + bias
    if is_causal:
        L, S = scores.shape[-2:]
        hidden = torch.ones(L, S, dtype=torch.bool).triu(1 + (S - L if bottom_right else 0))
        scores = scores.masked_fill(hidden, -math.inf)
    if tuple(window) != (-1, -1):
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(~band(L, S, window, bottom_right, scores.device), -math.inf)
    top = scores.amax(dim=-1, keepdim=True).detach()
    sink = None
    if sinks is not None:  # [Hq] -> [Hq, 1, 1], broadcast over the batch and the rows
        sink = sinks.to(wide).reshape(-1, 1, 1) if scores.dim() >= 3 else sinks.to(wide).reshape(1, 1)
        top = torch.maximum(top, sink.detach())
    top = top.masked_fill(top == -math.inf, 0.0)
    e = torch.exp(scores - top)
    total = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - top)
    return e / total.clamp_min(torch.finfo(wide).tiny)


def dropout_keep(weights, dropout_p: float, dtype):
    """The dropout mask (1 kept, 0 dropped) scaled by 1/(1-p), in `dtype`, from the kernel's
    weights for the call's seed: a kept weight is positive, a dropped one zero."""
    kept = (weights != 0).to(dtype)
    return kept * (1 / (1 - dropout_p)) if dropout_p < 1 else kept * 0


def _summed_to(grad, like, enable_gqa: bool, heads: int):
    """A gradient of the grouped (repeated) or broadcast form of `like`, summed back to its shape."""
    if enable_gqa and like.dim() >= 3 and like.shape[-3] != heads:
        grad = grad.unflatten(-3, (like.shape[-3], heads // like.shape[-3])).sum(-3)
    return grad.sum_to_size(like.shape).to(like.dtype)


def backward(query, key, value, attn_mask, grad_output, wanted, is_causal, scale, enable_gqa, bottom_right,
             window=(-1, -1), alibi_slopes=None, keep=None, sinks=None, softcap: float = 0.0):
    """The gradients of query, key, value and a float mask (None where not `wanted`) for
    `grad_output`, in torch operators that autograd (or a torch.func transform) differentiates
    again. With O = (P * keep) V:
        dV = (P * keep)^T dO,  dP = (dO V^T) * keep,  dS = P * (dP - rowsum(P * dP)),
        dQ = scale dS K,  dK = scale dS^T Q,  dMask = dS (each summed over what it broadcast or
        repeated along); with sinks, dSink = -sum(P_sink * rowsum(P * dP)), P_sink = 1 - rowsum(P)
        (a fifth entry, None without sinks). With soft-capping, q.k's share of dS (dQ, dK) is
        multiplied by the cap's derivative 1 - tanh^2; the mask's is not."""
    wide, heads = wide_dtype(query), heads_of(query)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    p = probabilities(query, key, attn_mask, is_causal, scale, enable_gqa, bottom_right, window, alibi_slopes, sinks,
                      softcap)
    kept = p if keep is None else p * keep
    d_out = grad_output.to(wide)
    d_p = d_out @ grouped(value, heads, enable_gqa).to(wide).transpose(-1, -2)
    if keep is not None:
        d_p = d_p * keep
    delta = (p * d_p).sum(-1, keepdim=True)
    d_s = p * (d_p - delta)
    grads = [None, None, None, None, None]
    if sinks is not None and len(wanted) > 4 and wanted[4]:
        per_row = -((1 - p.sum(-1, keepdim=True)) * delta)[..., 0]  # [..., Hq, L]
        grads[4] = per_row.reshape(-1, sinks.shape[0], per_row.shape[-1]).sum((0, 2)).to(sinks.dtype)
    d_qk = d_s if softcap == 0 else d_s * slope(raw_scores(query, key, scale, enable_gqa), softcap)
    if wanted[0]:
        grads[0] = (d_qk @ grouped(key, heads, enable_gqa).to(wide) * scale).sum_to_size(query.shape).to(query.dtype)
    if wanted[1]:
        grads[1] = _summed_to(d_qk.transpose(-1, -2) @ query.to(wide) * scale, key, enable_gqa, heads)
    if wanted[2]:
        grads[2] = _summed_to(kept.transpose(-1, -2) @ d_out, value, enable_gqa, heads)
    if wanted[3] and attn_mask is not None and attn_mask.is_floating_point():
        grads[3] = d_s.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return grads
