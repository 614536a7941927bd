"""mha.nn.functional.multi_head_attention_forward: torch.nn.functional.multi_head_attention_forward
(the function torch.nn.MultiheadAttention calls, and models such as CLIP's attention pooling call
directly) with its signature and conventions, computed by the fused C++ module forward and
backward: sequence-first inputs [L, N, E] (or unbatched [L, E]), weights passed in, gradients for
every input and weight tensor that requires one.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _call, _composed

__all__ = ["multi_head_attention_forward"]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def multi_head_attention_forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim_to_check: int, num_heads: int,
        in_proj_weight: Optional[torch.Tensor], in_proj_bias: Optional[torch.Tensor], bias_k: Optional[torch.Tensor],
        bias_v: Optional[torch.Tensor], add_zero_attn: bool, dropout_p: float, out_proj_weight: torch.Tensor,
        out_proj_bias: Optional[torch.Tensor], training: bool = True, key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True, attn_mask: Optional[torch.Tensor] = None, use_separate_proj_weight: bool = False,
        q_proj_weight: Optional[torch.Tensor] = None, k_proj_weight: Optional[torch.Tensor] = None,
        v_proj_weight: Optional[torch.Tensor] = None, static_k: Optional[torch.Tensor] = None,
        static_v: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
        is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """PyTorch's function, argument for argument. Difference: `is_causal` applies a causal mask
    (PyTorch takes it as a hint about attn_mask, which it then requires; here attn_mask is optional
    and applies as well, as in mha.nn.MultiheadAttention). static_k / static_v (keys / values
    already projected into heads, [N * num_heads, S, head_dim], as an incremental decoder keeps
    them) replace the projected ones, as in PyTorch; such calls run as torch operators around the
    fused attention (the in-projection of `key` / `value` still runs and is discarded, as
    PyTorch's does)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    E, H = int(embed_dim_to_check), int(num_heads)
    _check(query.dim() in (2, 3) and query.shape[-1] == E,
           f"query: expected [L, N, {E}] or [L, {E}] (embed_dim_to_check={E}), got {list(query.shape)}")
    _check((bias_k is None) == (bias_v is None), "bias_k, bias_v: expected both or neither, got "
           f"bias_k {'None' if bias_k is None else 'given'} and bias_v {'None' if bias_v is None else 'given'}")
    if use_separate_proj_weight:
        for name, w in (("q_proj_weight", q_proj_weight), ("k_proj_weight", k_proj_weight),
                        ("v_proj_weight", v_proj_weight)):
            _check(isinstance(w, torch.Tensor) and w.dim() == 2,
                   f"{name}: expected a 2-D tensor with use_separate_proj_weight=True, got "
                   f"{'None' if w is None else list(w.shape)}")
        kdim, vdim = int(k_proj_weight.shape[1]), int(v_proj_weight.shape[1])
    else:
        _check(isinstance(in_proj_weight, torch.Tensor),
               "in_proj_weight: expected a tensor with use_separate_proj_weight=False, got None")
        kdim = vdim = E

    # The C++ module's parameters by their names, in its named_parameters() order. Separate
    # weights of equal widths are its packed in_proj_weight (a concatenation autograd sees
    # through); a bias given for one projection only has zeros for the other.
    params = {}
    if kdim == E and vdim == E:
        params["in_proj_weight"] = (torch.cat([q_proj_weight, k_proj_weight, v_proj_weight])
                                    if use_separate_proj_weight else in_proj_weight)
    else:
        params.update(q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight)
    bias = in_proj_bias is not None or out_proj_bias is not None
    like = out_proj_weight
    if bias:
        params["in_proj_bias"] = in_proj_bias if in_proj_bias is not None else like.new_zeros(3 * E)
    if bias_k is not None:
        params["bias_k"], params["bias_v"] = bias_k.reshape(1, 1, -1), bias_v.reshape(1, 1, -1)
    params["out_proj.weight"] = out_proj_weight
    if bias:
        params["out_proj.bias"] = out_proj_bias if out_proj_bias is not None else like.new_zeros(E)

    options = _call.Options(E, H, float(dropout_p), bias, bias_k is not None, bool(add_zero_attn), kdim, vdim, False)
    if static_k is not None or static_v is not None:
        _check_static(static_k, static_v, bias_k, query, E, H)
        return _composed.run(options, params, bool(training), query, key, value, key_padding_mask, need_weights,
                             attn_mask, average_attn_weights, is_causal, static_k, static_v)
    return _call.run(None, options, params, bool(training), query, key, value, key_padding_mask,
                     need_weights, attn_mask, average_attn_weights, is_causal)


def _check_static(static_k, static_v, bias_k, query, E: int, H: int) -> None:
    """static_k / static_v: [N * H, S, E / H] (one S for both), never with bias_k / bias_v."""
    N = query.shape[1] if query.dim() == 3 else 1
    lengths = set()
    for name, x in (("static_k", static_k), ("static_v", static_v)):
        if x is None:
            continue
        if bias_k is not None:
            raise ValueError(f"{name}: bias_k/bias_v cannot be added to a static key or value (as in PyTorch)")
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != N * H or x.shape[2] != E // H:
            raise ValueError(f"{name}: expected [N * num_heads, S, head_dim] = [{N * H}, S, {E // H}], got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        lengths.add(x.shape[1])
    if len(lengths) > 1:
        raise ValueError(f"static_k, static_v: expected the same length S, got {sorted(lengths)}")
