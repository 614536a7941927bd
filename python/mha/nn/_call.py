"""One call of a MultiheadAttention on parameters given by name: what mha.nn.MultiheadAttention
and mha.nn.functional.multi_head_attention_forward share. Eager calls run the C++ module (through
autograd.ModuleFunction when something needs a gradient); traced ones (torch.compile,
torch.export) are one node of the graph, a custom operator of ops.py; calls under torch.func
transforms are torch operators around the SDPA kernel (_composed.py)."""

from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional

import torch

from .. import _mha, _auto_threading, _autocast, _autocast_dtype, _compiling, _transformed
from .. import ops as _ops
from ..autograd import ModuleFunction, _tensor
from . import _composed, _nested

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Options(NamedTuple):
    """The C++ module's options, in the order of its constructor."""
    embed_dim: int
    num_heads: int
    dropout: float
    bias: bool
    add_bias_kv: bool
    add_zero_attn: bool
    kdim: Optional[int]
    vdim: Optional[int]
    batch_first: bool

    def new_impl(self):
        """A C++ module with these options and no parameters of its own (they come by name)."""
        return _mha._Module(*self, 0, own_parameters=False)


def checked_dtype(params: Dict[str, torch.Tensor]) -> torch.dtype:
    """The one supported dtype of every parameter."""
    dtypes = {p.dtype for p in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise ValueError("parameters: expected one dtype among torch.float32, torch.float64, torch.bfloat16 and "
                         "torch.float16, "
                         f"got {sorted(str(d) for d in dtypes)}")
    return next(iter(dtypes))


def _check_dense_cpu(name: str, x) -> None:
    """A clear error for what the C++ module cannot read: nested, sparse, or not in host memory."""
    if x is None or not isinstance(x, torch.Tensor):
        return
    if x.is_nested:
        raise ValueError(f"{name}: nested tensors are taken as query, key and value only (jagged, [B, j, E]); "
                         "pad them (to_padded_tensor) and pass key_padding_mask")
    if x.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on device '{x.device}'")


def run(impl, options: Options, params: Dict[str, torch.Tensor], training: bool, query, key, value,
        key_padding_mask, need_weights: bool, attn_mask, average_attn_weights: bool, is_causal: bool):
    """(output, weights or None) of the C++ module `impl` (options `options`; None: a new one for
    an eager call) on `params`, by name in named_parameters() order. The C++ module takes their
    dtype and the training mode."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if query.is_nested or key.is_nested or value.is_nested:  # jagged [B, j, E]: sequences without padding
        return _nested.run(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask,
                           average_attn_weights, is_causal)
    for name, x in (("query", query), ("key", key), ("value", value), ("key_padding_mask", key_padding_mask),
                    ("attn_mask", attn_mask), *params.items()):
        _check_dense_cpu(name, x)
    autocast = _autocast_dtype()
    if autocast is not None:  # (PyTorch's module runs its projections and attention in that dtype there)
        query, key, value, key_padding_mask, attn_mask = _autocast(autocast, query, key, value, key_padding_mask,
                                                                   attn_mask)
        params = dict(zip(params, _autocast(autocast, *params.values())))
    dtype = checked_dtype(params)
    if _transformed():
        return _composed.run(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask,
                             average_attn_weights, is_causal)
    if _compiling():
        return _traced(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask,
                       average_attn_weights, is_causal)
    _auto_threading()
    if impl is None:
        impl = options.new_impl()
    if impl.dtype != DTYPES[dtype]:
        impl.to(DTYPES[dtype])
    if impl.training != training:  # (no write while another thread may be computing)
        impl.train(training)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if training and options.dropout > 0 else None
    flags = (bool(need_weights), bool(average_attn_weights), bool(is_causal), seed, 0)
    masks = [m for m in (key_padding_mask, attn_mask) if isinstance(m, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *masks, *params.values()))):
        # Nothing to differentiate (inference, or a module and inputs all frozen): no
        # activations saved for a backward that will not come.
        out, weights = impl.forward(query.detach(), key.detach(), value.detach(),
                                    None if key_padding_mask is None else key_padding_mask.detach(), flags[0],
                                    None if attn_mask is None else attn_mask.detach(), flags[1], flags[2], seed, 0,
                                    {name: p.detach() for name, p in params.items()})
        return _tensor(out), None if weights is None else _tensor(weights)
    # Second derivatives recompute the call as torch operators (not with dropout: its mask is the kernel's).
    if seed is None:
        flags = (*flags, functools.partial(_composed_call, options, training, need_weights, average_attn_weights,
                                           is_causal))
    return ModuleFunction.apply(impl, list(params), flags, query, key, value, key_padding_mask, attn_mask,
                                *params.values())


def _composed_call(options, training, need_weights, average, is_causal, params, query, key, value, key_padding_mask,
                   attn_mask):
    return _composed.run(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask,
                         average, is_causal)


def _traced(options, params, training, query, key, value, key_padding_mask, need_weights, attn_mask, average,
            is_causal):
    """Under torch.compile / torch.export: one graph node, the custom operator
    mha::multihead_attention with nothing to differentiate, else mha::multihead_attention_train
    (whose gradient is the node mha::multihead_attention_backward)."""
    dropout_p = options.dropout if training else 0.0
    masks = [m for m in (key_padding_mask, attn_mask) if isinstance(m, torch.Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *masks, *params.values()))
    op = _ops.multihead_attention_train if grad else _ops.multihead_attention
    out, weights, *_ = op(
        query, key, value, key_padding_mask, attn_mask, list(params.values()), ",".join(params),
        [options.embed_dim, options.num_heads, *(options.embed_dim if d is None else d for d in (options.kdim, options.vdim))],
        options.dropout,
        [options.bias, options.add_bias_kv, options.add_zero_attn, options.batch_first, bool(training)],
        bool(need_weights), bool(average), bool(is_causal), _ops.seed_tensor(None, dropout_p))
    return out, weights if need_weights else None
