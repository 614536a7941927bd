"""A MultiheadAttention call as torch operators around mha.scaled_dot_product_attention, for
torch.func transforms (vmap, grad, jacrev, functional_call ensembles): their tensors are wrappers
the C++ module cannot read, while torch's operators and the SDPA's autograd Function (with its
vmap rules) take them. The steps are torch.nn.functional.multi_head_attention_forward's: the
in-projections, bias_k/bias_v and a zero key appended, the key padding mask merged into attn_mask
(bool masks as -inf), the heads' attention, the out-projection; is_causal applies a causal mask
as the eager module does (with attn_mask or without). The attention itself is mha's
fused kernel, or with need_weights the explicit softmax, whose weights are differentiable as
PyTorch's are. Arithmetic is in the parameters' dtype (bfloat16 modules: bfloat16 projections,
as PyTorch's; the eager module computes them in float32)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import scaled_dot_product_attention


def _additive(mask, dtype):
    """A bool mask (True = masked out) as -inf / 0, a float one in `dtype`."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, -math.inf)
    return mask.to(dtype)


def run(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask, average,
        is_causal, static_k=None, static_v=None):
    """(output, weights or None), as _call.run returns them. static_k / static_v [N * H, S, hd]
    replace the projected keys / values (multi_head_attention_forward's arguments)."""
    E, H = options.embed_dim, options.num_heads
    hd = E // H
    batched = query.dim() == 3
    if batched and options.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    if not batched:  # [L, E]: a batch of one
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    L, N, keys = query.shape[0], query.shape[1], key.shape[0]

    if "in_proj_weight" in params:
        wq, wk, wv = params["in_proj_weight"].chunk(3)
    else:
        wq, wk, wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    bq, bk, bv = params["in_proj_bias"].chunk(3) if "in_proj_bias" in params else (None, None, None)
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    dtype = q.dtype
    attn_mask, key_padding_mask = _additive(attn_mask, dtype), _additive(key_padding_mask, dtype)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)  # [1, L, S], or [N * H, L, S] as given
    if "bias_k" in params:
        k = torch.cat([k, params["bias_k"].reshape(1, 1, E).expand(1, N, E)])
        v = torch.cat([v, params["bias_v"].reshape(1, 1, E).expand(1, N, E)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))

    q, k, v = (x.reshape(x.shape[0], N * H, hd).transpose(0, 1) for x in (q, k, v))  # [N * H, len, hd]
    if static_k is not None:
        k = static_k
        keys = k.shape[1]
    if static_v is not None:
        v = static_v
    if options.add_zero_attn:
        k = torch.cat([k, k.new_zeros(N * H, 1, hd)], dim=1)
        v = torch.cat([v, v.new_zeros(N * H, 1, hd)], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    S = k.shape[1]
    if key_padding_mask is not None:
        padding = key_padding_mask.reshape(N, 1, 1, S).expand(N, H, 1, S).reshape(N * H, 1, S)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    if is_causal and S > keys:
        # As the eager module: the causal mask hides later keys of the sequence, never the
        # appended ones (bias_k, the zero key), which every query sees.
        hidden = torch.ones(L, S, dtype=torch.bool).triu(1)
        hidden[:, keys:] = False
        causal = torch.zeros(1, L, S, dtype=dtype).masked_fill(hidden, -math.inf)
        attn_mask = causal if attn_mask is None else attn_mask + causal
        is_causal = False
    dropout_p = options.dropout if training else 0.0

    if need_weights:
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hd)
        if attn_mask is not None:
            scores = scores + attn_mask
        if is_causal:
            scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v)  # [N * H, L, hd]
        weights = weights.reshape(N, H, L, S)
        if average:
            weights = weights.mean(dim=1)
    else:
        mask = None
        if attn_mask is not None:
            mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.reshape(N, H, -1, S)
        out = scaled_dot_product_attention(q.reshape(N, H, L, hd), k.reshape(N, H, S, hd), v.reshape(N, H, S, hd),
                                           attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        weights = None
    out = out.reshape(N, H, L, hd).permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(out, params["out_proj.weight"], params.get("out_proj.bias"))
    if batched and options.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights
