"""A MultiheadAttention call on jagged nested tensors [B, j, E] (batch_first): sequences of
different lengths without padding. The in-projections run on the packed rows (torch.nn.functional.
linear), each sequence's attention on its own keys in the varlen kernel (is_causal within each
sequence; dropout in training), then the out-projection; the output is nested like the query, and
every step is differentiable. PyTorch's module takes nested tensors only in its inference fast
path, and only of the strided layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._varlen import varlen_attention


def _packed(x, name):
    """(values [T, E], offsets) of a jagged nested [B, j, E] tensor."""
    if not (isinstance(x, torch.Tensor) and x.is_nested):
        raise ValueError(f"{name}: expected a nested tensor like the query, got a dense one")
    if x.layout != torch.jagged:
        raise ValueError(f"{name}: nested tensors must be of layout torch.jagged (torch.nested.nested_tensor(..., "
                         f"layout=torch.jagged)), got {x.layout}")
    if x.dim() != 3 or x._ragged_idx != 1:
        raise ValueError(f"{name}: expected a jagged nested tensor of shape [B, j, E] (batch_first), got "
                         f"{x.dim()} dimensions with the ragged one at {x._ragged_idx}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on device '{x.device}'")
    if x._lengths is not None:  # holes between the sequences: packed first
        x = x.contiguous()
    return x.values(), x.offsets()


def run(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask, average,
        is_causal):
    """(nested output, None), as _call.run returns a call's results."""
    xq, cu_q = _packed(query, "query")
    xk, cu_k = _packed(key, "key")
    xv, cu_v = _packed(value, "value")
    if not options.batch_first:
        raise ValueError("batch_first: nested inputs are [B, j, E]; construct the module with batch_first=True")
    if key_padding_mask is not None or attn_mask is not None:
        raise ValueError("key_padding_mask/attn_mask: nested inputs take no mask (each sequence attends to its own "
                         "keys; is_causal applies within each sequence)")
    if need_weights:
        raise ValueError("need_weights: the weights of nested inputs are not returned (their shape is ragged); "
                         "pass need_weights=False")
    if options.add_bias_kv or options.add_zero_attn:
        raise ValueError("add_bias_kv/add_zero_attn: not supported with nested inputs; pad them "
                         "(to_padded_tensor) and pass key_padding_mask")
    if cu_k is not cu_v and not torch.equal(cu_k, cu_v):
        raise ValueError("key/value: expected the same sequence lengths")
    E, H = options.embed_dim, options.num_heads
    if "in_proj_weight" in params:
        wq, wk, wv = params["in_proj_weight"].chunk(3)
    else:
        wq, wk, wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    bq, bk, bv = params["in_proj_bias"].chunk(3) if "in_proj_bias" in params else (None, None, None)
    q = F.linear(xq, wq, bq).view(-1, H, E // H)
    k = F.linear(xk, wk, bk).view(-1, H, E // H)
    v = F.linear(xv, wv, bv).view(-1, H, E // H)
    dropout_p = options.dropout if training else 0.0
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None  # torch.manual_seed repeats it
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=is_causal, dropout_p=dropout_p, dropout_seed=seed)
    out = F.linear(out.reshape(-1, E), params["out_proj.weight"], params.get("out_proj.bias"))
    return torch.nested.nested_tensor_from_jagged(out, cu_q), None
