"""The fused SDPA as PyTorch custom operators (torch.library), for torch.compile and torch.export.

Inside a compiled region, mha.scaled_dot_product_attention becomes one node of the graph,
mha::sdpa_train, whose fake implementation gives the output's shape without running anything; its
gradient is the node mha::sdpa_backward (the C++ backward, only the gradients autograd needs).
mha.nn.MultiheadAttention is the node mha::multihead_attention with nothing to differentiate
(inference), else mha::multihead_attention_train, which also returns the activations its backward
needs as tensors (the projections, the attention output, the row log-sum-exp; a compiled graph
saves tensors, not the C++ context) for mha::multihead_attention_backward, which rebuilds the
context from them. Outside compiled code the same functions run the autograd paths of
autograd.py, which cost fewer microseconds per call (the dispatcher is not crossed).

The dropout seed is a tensor operand (a compiled graph draws a fresh one per call, as eager does),
holding the 64-bit seed's two's-complement bits.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import _auto_threading, _mha, _vmap
from .autograd import _tensor, weights_gradient

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"mha's PyTorch integration (mha.nn, torch.compile) needs torch >= 2.4 (torch.library.custom_op), "
                      f"found torch {torch.__version__}")

_U64 = 1 << 64


def _seed_value(seed: torch.Tensor) -> int:
    return int(seed.item()) % _U64


def seed_tensor(dropout_seed: Optional[int], dropout_p: float) -> torch.Tensor:
    """The seed operand: the caller's seed, or a fresh one per call where dropout runs."""
    if dropout_seed is None:
        if dropout_p > 0:
            return torch.randint(0, 1 << 62, (), dtype=torch.int64)
        dropout_seed = 0
    seed = int(dropout_seed) % _U64
    return torch.tensor(seed - _U64 if seed >= 1 << 63 else seed, dtype=torch.int64)


@torch.library.custom_op("mha::sdpa_train", mutates_args=(), device_types="cpu")
def sdpa_train(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
               dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, dropout_seed: torch.Tensor,
               bottom_right: bool, window_left: int, window_right: int,
               alibi_slopes: Optional[torch.Tensor], num_threads: int, softcap: float = 0.0,
               sinks: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output [..., Hq, L, Ev] and the row log-sum-exp [..., Hq, L] (float32; float64 for float64
    inputs) of the training forward (and of an inference call over scaled float8 keys and values)."""
    _auto_threading()
    out, lse = _mha.sdpa_train(query, key, value, attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa,
                               _seed_value(dropout_seed), bottom_right, window_left, window_right, alibi_slopes, num_threads,
                               sinks, k_descale, v_descale)
    return _tensor(out), torch.from_numpy(lse)


def _rows(query, key, value, enable_gqa):
    """The output's shape without its last dimension: the batch dimensions of query, key and value
    broadcast as the kernel (and PyTorch) broadcasts them, then the query rows."""
    heads = [t.shape[-3] if t.dim() >= 3 else 1 for t in (query, key, value)]
    leading = torch.broadcast_shapes(*(t.shape[:-3] for t in (query, key, value)))
    grouped = enable_gqa and (heads[1] != heads[0] or heads[2] != heads[0])
    batch = (*leading, heads[0] if grouped else max(heads)) if max(t.dim() for t in (query, key, value)) >= 3 else ()
    return (*batch, query.shape[-2])


@sdpa_train.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right, window_left,
      window_right, alibi_slopes, num_threads, softcap=0.0, sinks=None, k_descale=None, v_descale=None):
    rows = _rows(query, key, value, enable_gqa)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return query.new_empty((*rows, value.shape[-1])), query.new_empty(rows, dtype=lse_dtype)


@torch.library.custom_op("mha::sdpa_backward", mutates_args=(), device_types="cpu")
def sdpa_backward(grad_output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
                  is_causal: bool, scale: Optional[float], enable_gqa: bool, dropout_seed: torch.Tensor,
                  bottom_right: bool, window_left: int, window_right: int, alibi_slopes: Optional[torch.Tensor], num_threads: int,
                  wanted: List[bool], softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """The gradients of query, key, value, a float mask and the sinks, in that order; one not in
    `wanted` (four flags) is an empty tensor and is not computed, and so is the sinks' without sinks."""
    dq, dk, dv, dm, ds = _mha.sdpa_backward(query, key, value, out, lse, grad_output.to(out.dtype).contiguous(),
                                            attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa,
                                            _seed_value(dropout_seed), bottom_right, window_left, window_right,
                                            alibi_slopes, num_threads, bool(wanted[3]),
                                            tuple(bool(w) for w in wanted[:3]), sinks)
    # (each left-out slot its own empty tensor: a custom operator's outputs may not alias)
    return [query.new_empty(0) if d is None else _tensor(d) for d in (dq, dk, dv)] + [
        _tensor(dm) if dm is not None else query.new_empty(0, dtype=torch.float32),
        _tensor(ds) if ds is not None else query.new_empty(0, dtype=torch.float32)]


@sdpa_backward.register_fake
def _(grad_output, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
      bottom_right, window_left, window_right, alibi_slopes, num_threads, wanted, softcap=0.0, sinks=None):
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) if w else query.new_empty(0)
             for t, w in zip((query, key, value), wanted[:3])]
    mask = attn_mask.new_empty(attn_mask.shape) if wanted[3] else query.new_empty(0, dtype=torch.float32)
    sink = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0, dtype=torch.float32)
    return grads + [mask, sink]


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right, window_left,
     window_right, alibi_slopes, num_threads, softcap, sinks, *_descales) = inputs  # (float8 inference's)
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, dropout_seed, alibi_slopes, sinks)
    ctx.options = (dropout_p, is_causal, scale, enable_gqa, bottom_right, window_left, window_right, num_threads, softcap)
    ctx.mask_is_float = attn_mask is not None and attn_mask.is_floating_point()


def _backward(ctx, grad_output, grad_lse):
    query, key, value, attn_mask, out, lse, dropout_seed, alibi_slopes, sinks = ctx.saved_tensors
    dropout_p, is_causal, scale, enable_gqa, bottom_right, window_left, window_right, num_threads, softcap = ctx.options
    wanted = [bool(n) for n in ctx.needs_input_grad[:3]] + [ctx.mask_is_float and bool(ctx.needs_input_grad[3])]
    grads = torch.ops.mha.sdpa_backward(grad_output, query, key, value, out, lse, attn_mask, dropout_p, is_causal,
                                        scale, enable_gqa, dropout_seed, bottom_right, window_left, window_right,
                                        alibi_slopes, num_threads, wanted, softcap, sinks)
    sinks_grad = grads[4] if sinks is not None and ctx.needs_input_grad[15] else None
    return (*(g if w else None for g, w in zip(grads, wanted)),) + (None,) * 11 + (sinks_grad, None, None)


sdpa_train.register_autograd(_backward, setup_context=_setup_context)


# vmap rules (torch.func.vmap of a compiled or exported call): the vmapped dimension becomes a
# batch dimension of one kernel call, as for the eager autograd Functions (_vmap.py). (A torch
# without CustomOpDef.register_vmap runs such calls one example at a time, PyTorch's fallback.)
_registers_vmap = hasattr(sdpa_train, "register_vmap")


def _train_vmap(info, in_dims, query, key, value, attn_mask, *options):
    outputs = _vmap.forward_rule(info, in_dims, (query, key, value, attn_mask), options[0],
                                 lambda *tensors: sdpa_train(*tensors, *options))
    return outputs, (0, 0)


def _backward_vmap(info, in_dims, grad_output, query, key, value, out, lse, attn_mask, dropout_p, *options):
    wanted, sinks = options[9], options[11] if len(options) > 11 else None

    def call(query, key, value, attn_mask, out, lse, grad_output):
        return sdpa_backward(grad_output, query, key, value, out, lse, attn_mask, dropout_p, *options)

    tensors = (query, key, value, attn_mask, out, lse, grad_output)
    dims = (*in_dims[1:4], in_dims[6], *in_dims[4:6], in_dims[0])
    if sinks is not None:  # each example's own gradient of the shared sinks: a call per example
        _vmap.check_randomness(info, dropout_p)
        grads = _vmap.looped(info.batch_size, dims, tensors, call)
    else:
        grads = _vmap.backward_rule(info, dims, tensors, dropout_p, bool(wanted[3]), call)
    return list(grads), list(_vmap.out_dims(grads))


if _registers_vmap:
    sdpa_train.register_vmap(_train_vmap)
    sdpa_backward.register_vmap(_backward_vmap)


@torch.library.custom_op("mha::sdpa_with_weights", mutates_args=(), device_types="cpu")
def sdpa_with_weights(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
                      dropout_seed: torch.Tensor, bottom_right: bool, window_left: int, window_right: int,
                      alibi_slopes: Optional[torch.Tensor], num_threads: int, softcap: float = 0.0,
                      sinks: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output and the attention weights [..., Hq, L, S] (after dropout), in the inputs' dtype;
    not differentiated (a training call takes its output from mha::sdpa_train)."""
    _auto_threading()
    out, weights = _mha.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa,
                             _seed_value(dropout_seed), True, bottom_right, window_left, window_right, alibi_slopes, num_threads,
                             sinks, k_descale, v_descale)
    return _tensor(out), _tensor(weights)


@sdpa_with_weights.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right, window_left,
      window_right, alibi_slopes, num_threads, softcap=0.0, sinks=None, k_descale=None, v_descale=None):
    rows = _rows(query, key, value, enable_gqa)
    return query.new_empty((*rows, value.shape[-1])), query.new_empty((*rows, key.shape[-2]))


def _weights_vmap(info, in_dims, query, key, value, attn_mask, *options):
    outputs = _vmap.forward_rule(info, in_dims, (query, key, value, attn_mask), options[0],
                                 lambda *tensors: sdpa_with_weights(*tensors, *options))
    return outputs, (0, 0)


if _registers_vmap:
    sdpa_with_weights.register_vmap(_weights_vmap)


@torch.library.custom_op("mha::multihead_attention", mutates_args=(), device_types="cpu")
def multihead_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                        parameters: List[torch.Tensor], names: str, sizes: List[int], dropout: float,
                        flags: List[bool], need_weights: bool, average_attn_weights: bool, is_causal: bool,
                        dropout_seed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """mha.nn.MultiheadAttention's forward without autograd (inference), on the parameters given by
    name (`names`: comma-separated, in their order). sizes: embed_dim, num_heads, kdim, vdim;
    flags: bias, add_bias_kv, add_zero_attn, batch_first, training. The weights are an empty tensor
    unless need_weights."""
    _auto_threading()
    module = _module(sizes, dropout, flags, parameters[0].dtype)
    seed = _seed_value(dropout_seed) if flags[4] and dropout > 0 else None
    out, weights = module.forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                  is_causal, seed, 0, dict(zip(names.split(","), parameters)))
    return _tensor(out), query.new_empty(0) if weights is None else _tensor(weights)


@multihead_attention.register_fake
def _(query, key, value, key_padding_mask, attn_mask, parameters, names, sizes, dropout, flags, need_weights,
      average_attn_weights, is_causal, dropout_seed):
    return _fake_module_outputs(query, key, sizes, flags, need_weights, average_attn_weights)


def _fake_module_outputs(query, key, sizes, flags, need_weights, average_attn_weights):
    """The output and the weights (empty unless need_weights) a module call returns, as fakes."""
    if not need_weights:
        return query.new_empty(query.shape), query.new_empty(0)
    batch, length, keys, heads = _call_sizes(query, key, sizes, flags)
    shape = ([batch] if query.dim() == 3 else []) + ([] if average_attn_weights else [heads])
    return query.new_empty(query.shape), query.new_empty((*shape, length, keys))


def _module(sizes, dropout, flags, dtype):
    """A C++ module with the options of the call (it holds no parameters: they come by name)."""
    embed_dim, num_heads, kdim, vdim = sizes
    bias, add_bias_kv, add_zero_attn, batch_first, training = flags
    module = _mha._Module(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                          0, own_parameters=False)
    module.to(str(dtype).removeprefix("torch."))
    module.train(training)
    return module


def _call_sizes(query, key, sizes, flags):
    """N, L, the total keys S' (with the bias_k and zero-attention rows) and H of a module call."""
    _, add_bias_kv, add_zero_attn, batch_first, _ = flags
    batched = query.dim() == 3
    batch = query.shape[0 if batch_first else 1] if batched else 1
    length = query.shape[1 if batched and batch_first else 0]
    keys = key.shape[1 if batched and batch_first else 0] + int(add_bias_kv) + int(add_zero_attn)
    return batch, length, keys, sizes[1]


@torch.library.custom_op("mha::multihead_attention_train", mutates_args=(), device_types="cpu")
def multihead_attention_train(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                              parameters: List[torch.Tensor], names: str, sizes: List[int], dropout: float,
                              flags: List[bool], need_weights: bool, average_attn_weights: bool, is_causal: bool,
                              dropout_seed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """The training forward of mha.nn.MultiheadAttention (arguments as for multihead_attention):
    the output, the weights (empty unless need_weights) and the activations of its backward,
    float32 (float64 for a float64 module): the projections q [N, L, E], k and v [N, S', E], the
    attention output before out_proj (shaped like the output) and the row log-sum-exp [N, H, L]."""
    _auto_threading()
    module = _module(sizes, dropout, flags, parameters[0].dtype)
    seed = _seed_value(dropout_seed) if flags[4] and dropout > 0 else None
    out, weights, context = module.forward_train(query, key, value, key_padding_mask, need_weights, attn_mask,
                                                 average_attn_weights, is_causal, seed, 0,
                                                 dict(zip(names.split(","), parameters)))
    activations = [torch.from_numpy(a) for a in context.activations()]
    return (_tensor(out), query.new_empty(0) if weights is None else _tensor(weights), *activations)


@multihead_attention_train.register_fake
def _(query, key, value, key_padding_mask, attn_mask, parameters, names, sizes, dropout, flags, need_weights,
      average_attn_weights, is_causal, dropout_seed):
    out, weights = _fake_module_outputs(query, key, sizes, flags, need_weights, average_attn_weights)
    batch, length, keys, heads = _call_sizes(query, key, sizes, flags)
    kept = dict(dtype=torch.float64 if parameters[0].dtype == torch.float64 else torch.float32)
    return (out, weights, query.new_empty((batch, length, sizes[0]), **kept),
            query.new_empty((batch, keys, sizes[0]), **kept), query.new_empty((batch, keys, sizes[0]), **kept),
            query.new_empty(query.shape, **kept), query.new_empty((batch, heads, length), **kept))


@torch.library.custom_op("mha::multihead_attention_backward", mutates_args=(), device_types="cpu")
def multihead_attention_backward(grad_output: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                                 attn_mask: Optional[torch.Tensor], parameters: List[torch.Tensor], names: str,
                                 sizes: List[int], dropout: float, flags: List[bool], is_causal: bool,
                                 dropout_seed: torch.Tensor, activations: List[torch.Tensor],
                                 wanted: List[bool], grad_weights: Optional[torch.Tensor],
                                 average_attn_weights: bool) -> List[torch.Tensor]:
    """The gradients of query, key, value, the float key_padding_mask and attn_mask (a learned
    bias; in the mask's dtype) and each parameter (in `names` order) of the training forward that
    returned `activations`; one not in `wanted` (five flags in that order, then one per parameter)
    is an empty tensor and is not computed. grad_weights, where given, is the gradient of the
    weights the forward returned (averaged over the heads or not), as PyTorch differentiates them."""
    _auto_threading()
    module = _module(sizes, dropout, flags, parameters[0].dtype)
    seed = _seed_value(dropout_seed) if flags[4] and dropout > 0 else None
    names = names.split(",")
    frozen = [name for name, w in zip(names, wanted[5:]) if not w]
    dq, dk, dv, dparams, dpadding, dmask = module.backward_restored(
        query, key, value, key_padding_mask, attn_mask, is_causal, seed, 0, tuple(activations),
        grad_output.to(query.dtype).contiguous(), dict(zip(names, parameters)), tuple(bool(w) for w in wanted[:3]),
        frozen, (bool(wanted[3]), bool(wanted[4])),
        weights_gradient(grad_weights, query.dtype), average_attn_weights)
    inputs = [query.new_empty(0) if d is None else _tensor(d) for d in (dq, dk, dv)]
    masks = [query.new_empty(0) if d is None else _tensor(d).to(m.dtype)
             for d, m in ((dpadding, key_padding_mask), (dmask, attn_mask))]
    return inputs + masks + [_tensor(dparams[name]) if name in dparams else query.new_empty(0) for name in names]


@multihead_attention_backward.register_fake
def _(grad_output, query, key, value, key_padding_mask, attn_mask, parameters, names, sizes, dropout, flags, is_causal,
      dropout_seed, activations, wanted, grad_weights, average_attn_weights):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if w else query.new_empty(0)
            for t, w in zip((query, key, value, key_padding_mask, attn_mask, *parameters), wanted)]


def _module_setup_context(ctx, inputs, output):
    (query, key, value, key_padding_mask, attn_mask, parameters, names, sizes, dropout, flags, _, average,
     is_causal, dropout_seed) = inputs
    ctx.save_for_backward(query, key, value, key_padding_mask, attn_mask, dropout_seed, *output[2:], *parameters)
    ctx.options = (names, sizes, dropout, flags, is_causal, average)
    ctx.mark_non_differentiable(*output[2:])  # the activations (the weights are differentiable, as in eager mode)
    ctx.set_materialize_grads(False)  # (a loss without the weights: None for them, the fused backward)


def _module_backward(ctx, grad_output, grad_weights, *grad_activations):
    query, key, value, key_padding_mask, attn_mask, dropout_seed, *saved = ctx.saved_tensors
    activations, parameters = saved[:5], saved[5:]
    names, sizes, dropout, flags, is_causal, average = ctx.options
    needs = ctx.needs_input_grad
    if grad_output is None:  # a loss of the weights alone
        grad_output = torch.zeros_like(query, memory_format=torch.contiguous_format)  # (the output is shaped so)
    # (a float mask that requires grad, a learned bias, gets its gradient; a bool mask has none)
    wanted = [bool(n) for n in needs[:5]] + [bool(n) for n in needs[5]]
    grads = torch.ops.mha.multihead_attention_backward(grad_output, query, key, value, key_padding_mask, attn_mask,
                                                       list(parameters), names, sizes, dropout, flags, is_causal,
                                                       dropout_seed, list(activations), wanted,
                                                       grad_weights, average)
    inputs = [g if w else None for g, w in zip(grads[:5], wanted[:5])]
    params = [g if w else None for g, w in zip(grads[5:], wanted[5:])]
    return (*inputs, params, None, None, None, None, None, None, None, None)


multihead_attention_train.register_autograd(_module_backward, setup_context=_module_setup_context)


# Variable-length attention (mha.varlen_attention; nested inputs of the SDPA and the module): the
# offsets are int64 tensor operands, so a compiled graph does not specialise on the lengths.
@torch.library.custom_op("mha::sdpa_varlen_train", mutates_args=(), device_types="cpu")
def sdpa_varlen_train(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, dropout_p: float, is_causal: bool, scale: Optional[float],
                      enable_gqa: bool, dropout_seed: torch.Tensor, bottom_right: bool, window_left: int,
                      window_right: int, alibi_slopes: Optional[torch.Tensor], num_threads: int,
                      softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                      k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The packed output [Tq, Hq, Ev] and the log-sum-exp [Hq, Tq] of the varlen training forward."""
    _auto_threading()
    out, lse = _mha.sdpa_varlen_train(query, key, value, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), dropout_p,
                                      is_causal, scale, softcap, enable_gqa, _seed_value(dropout_seed), bottom_right,
                                      window_left, window_right, alibi_slopes, num_threads, sinks, k_descale, v_descale)
    return _tensor(out), torch.from_numpy(lse)


@sdpa_varlen_train.register_fake
def _(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
      bottom_right, window_left, window_right, alibi_slopes, num_threads, softcap=0.0, sinks=None, k_descale=None,
      v_descale=None):
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return (query.new_empty((query.shape[0], query.shape[1], value.shape[-1])),
            query.new_empty((query.shape[1], query.shape[0]), dtype=lse_dtype))


@torch.library.custom_op("mha::sdpa_varlen_backward", mutates_args=(), device_types="cpu")
def sdpa_varlen_backward(grad_output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
                         dropout_seed: torch.Tensor, bottom_right: bool, window_left: int, window_right: int,
                         alibi_slopes: Optional[torch.Tensor], num_threads: int, wanted: List[bool],
                         softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """The gradients of query, key, value and the sinks; one not in `wanted` (or the sinks' without
    sinks) is an empty tensor, not computed."""
    grads = _mha.sdpa_varlen_backward(query, key, value, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), out, lse,
                                      grad_output.to(out.dtype).contiguous(), dropout_p, is_causal, scale,
                                      softcap, enable_gqa, _seed_value(dropout_seed), bottom_right, window_left,
                                      window_right, alibi_slopes, num_threads, tuple(bool(w) for w in wanted), sinks)
    return [query.new_empty(0) if d is None else _tensor(d) for d in grads[:3]] + [
        query.new_empty(0, dtype=torch.float32) if grads[3] is None else _tensor(grads[3])]


@sdpa_varlen_backward.register_fake
def _(grad_output, query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, dropout_p, is_causal, scale, enable_gqa,
      dropout_seed, bottom_right, window_left, window_right, alibi_slopes, num_threads, wanted, softcap=0.0,
      sinks=None):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if w else query.new_empty(0)
            for t, w in zip((query, key, value), wanted)] + [
        sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0, dtype=torch.float32)]


def _varlen_setup_context(ctx, inputs, output):
    (query, key, value, cu_q, cu_k, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right, window_left,
     window_right, alibi_slopes, threads, softcap, sinks, *_descales) = inputs  # (float8 inference's)
    out, lse = output
    ctx.save_for_backward(query, key, value, cu_q, cu_k, out, lse, dropout_seed, alibi_slopes, sinks)
    ctx.options = (dropout_p, is_causal, scale, enable_gqa)
    ctx.threading = (bottom_right, window_left, window_right)
    ctx.threads, ctx.softcap = threads, softcap


def _varlen_backward(ctx, grad_output, grad_lse):
    query, key, value, cu_q, cu_k, out, lse, dropout_seed, alibi_slopes, sinks = ctx.saved_tensors
    wanted = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = torch.ops.mha.sdpa_varlen_backward(grad_output, query, key, value, cu_q, cu_k, out, lse, *ctx.options,
                                               dropout_seed, *ctx.threading, alibi_slopes, ctx.threads, wanted,
                                               ctx.softcap, sinks)
    sinks_grad = grads[3] if sinks is not None and ctx.needs_input_grad[16] else None
    return (*(g if w else None for g, w in zip(grads, wanted)),) + (None,) * 13 + (sinks_grad, None, None)


sdpa_varlen_train.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# Paged key/value caches (mha.paged_attention, mha.write_paged_cache): inference operators in
# FlashAttention's layout; the table and lengths are tensor operands (a compiled decoding step does
# not specialise on them), and the write mutates the caches in place.
@torch.library.custom_op("mha::paged_attention", mutates_args=(), device_types="cpu")
def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, is_causal: bool, scale: Optional[float], enable_gqa: bool,
                    bottom_right: bool, window_left: int, window_right: int, alibi_slopes: Optional[torch.Tensor],
                    num_threads: int, cu_seqlens_q: Optional[torch.Tensor],
                    return_lse: bool, softcap: float = 0.0,
                    sinks: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output [B, Lq, Hq, Ev] of query [B, Lq, Hq, E] over the cache's pages, or with
    cu_seqlens_q [Tq, Hq, Ev] of packed rows [Tq, Hq, E]; and the lse ([B, Hq, Lq] or [Hq, Tq])
    when return_lse, else an empty tensor."""
    from ._paged import run_paged_attention  # noqa: PLC0415

    _auto_threading()
    out, lse = run_paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale,
                                   enable_gqa, bottom_right, window_left, window_right, alibi_slopes, num_threads,
                                   cu_seqlens_q, return_lse, softcap, sinks, k_descale, v_descale)
    return out, lse if lse is not None else query.new_empty((0,), dtype=_lse_dtype(query))


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@paged_attention.register_fake
def _(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, enable_gqa, bottom_right,
      window_left, window_right, alibi_slopes, num_threads, cu_seqlens_q, return_lse, softcap=0.0, sinks=None,
      k_descale=None, v_descale=None):
    out = query.new_empty((*query.shape[:-1], value_cache.shape[-1]))
    if not return_lse:
        return out, query.new_empty((0,), dtype=_lse_dtype(query))
    rows = (query.shape[1], query.shape[0]) if cu_seqlens_q is not None else (query.shape[0], query.shape[2],
                                                                              query.shape[1])
    return out, query.new_empty(rows, dtype=_lse_dtype(query))


@torch.library.custom_op("mha::write_paged_cache", mutates_args=("key_cache", "value_cache"), device_types="cpu")
def write_paged_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                      cu_seqlens_new: Optional[torch.Tensor], k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None) -> None:
    """Writes key [B, Lnew, Hkv, E] (or packed [Tnew, Hkv, E] rows with cu_seqlens_new) and value
    into the caches at each sequence's length."""
    from ._paged import run_write_paged_cache  # noqa: PLC0415

    run_write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens, cu_seqlens_new, k_descale,
                          v_descale)


@write_paged_cache.register_fake
def _(key, value, key_cache, value_cache, block_table, cache_seqlens, cu_seqlens_new, k_descale=None, v_descale=None):
    return None
