"""PyTorch autograd for the fused kernels: torch.autograd.Functions whose forward runs the C++
training forward and whose backward runs the C++ backward (deterministic, flash-style)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import _explicit, _forward_ad, _levels, _mha, _vmap


def _detached(x):
    return None if x is None else x.detach()


def _tensor(array):
    """A torch tensor sharing the returned numpy array's memory. numpy has no bfloat16: the
    extension hands bfloat16 over as its uint16 bits, viewed back here without a copy."""
    t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t


class _Keeper:
    """Keeps `obj` alive as the base of a one-byte numpy array (numpy holds the object whose
    __array_interface__ it reads)."""

    def __init__(self, obj):
        self.obj = obj
        self._byte = np.zeros(1, np.uint8)
        self.__array_interface__ = self._byte.__array_interface__


# Each live token's keeper, by the address of its byte (unique while the keeper lives).
_keepers: "weakref.WeakValueDictionary[int, _Keeper]" = weakref.WeakValueDictionary()


def _lifetime_token(obj) -> torch.Tensor:
    """A one-byte tensor that keeps `obj` alive. Saved for backward, the token gives obj the
    lifetime of autograd's saved tensors: freed after the backward unless retain_graph keeps the
    graph, so a second backward works where it is allowed, and is autograd's own error where it is
    not. Under activation checkpointing (torch.utils.checkpoint) the forward runs again and the
    backward receives that run's token, whose object token_object finds."""
    keeper = _Keeper(obj)
    token = torch.from_numpy(np.asarray(keeper))
    _keepers[token.data_ptr()] = keeper
    return token


def weights_gradient(grad_weights, dtype):
    """The gradient of a module's returned weights for its C++ backward, contiguous in `dtype`:
    None where there is none, or where it is all zeros (the weights left out of the loss: a
    compiled graph hands zeros, not None), so that such a backward takes the fused kernels, as an
    eager one without it does."""
    if grad_weights is None or grad_weights.numel() == 0 or not bool(grad_weights.any()):
        return None
    return grad_weights.detach().to(dtype).contiguous()


def token_object(token: torch.Tensor):
    """The object a token from _lifetime_token keeps alive."""
    return _keepers[token.data_ptr()].obj


def _sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right,
                  window_left, window_right, alibi_slopes, num_threads, softcap=0.0, sinks=None):
    """(output, log-sum-exp) of the C++ training forward."""
    out, lse = _mha.sdpa_train(query.detach(), key.detach(), value.detach(), _detached(attn_mask), dropout_p,
                               is_causal, scale, softcap, enable_gqa, dropout_seed, bottom_right, window_left,
                               window_right, _detached(alibi_slopes), num_threads, _detached(sinks))
    return _tensor(out), torch.from_numpy(lse)


def _sdpa_backward(ctx, grad_output):
    """The gradients of SdpaFunction's (or SdpaTransformFunction's) inputs, from what it saved; the
    options' last entry is the sinks, whose gradient comes last."""
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    mask_grad = attn_mask is not None and ctx.needs_input_grad[3]
    # The incoming gradient in the output's dtype (autograd may hand over another one).
    grad = grad_output.detach().to(out.dtype)
    # Only the gradients autograd needs: keys and values that need none (a frozen encoder's, a
    # cached prefix) skip their products, dK = dS^T Q and dV = P^T dO.
    arguments = (query, key, value, attn_mask, out, lse, grad, *ctx.options, mask_grad,
                 tuple(ctx.needs_input_grad[:3]))
    if _levels.transforms_active():  # (its tensors may be vmap's: the Function has the rule for them)
        dq, dk, dv, dm, ds = SdpaBackwardFunction.apply(*arguments)
    else:
        dq, dk, dv, dm, ds = SdpaBackwardFunction.forward(*arguments)
    sinks_grad = ds if ctx.needs_input_grad[-1] else None
    return (dq, dk, dv, dm if mask_grad else None) + (None,) * (len(ctx.options) - 1) + (sinks_grad,)


class SdpaFunction(torch.autograd.Function):
    """scaled_dot_product_attention with gradients for query, key, value and a float attn_mask.
    bfloat16 and float16 inputs go to the C++ training forward and backward as they are: float32
    arithmetic inside the kernels, the output and the gradients rounded once to the inputs' dtype
    (the log-sum-exp stays float32; a float mask's gradient is in the mask's dtype); no float32
    copy is saved. (The eager form: a forward taking ctx costs less per call than
    SdpaTransformFunction's, whose apply binds its arguments by signature.)"""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, *options):
        out, lse = _sdpa_forward(query, key, value, attn_mask, *options)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if _levels.differentiated_again(ctx, grad_output):
            return _differentiable_sdpa_backward(ctx, grad_output)
        return _sdpa_backward(ctx, grad_output)


def _differentiable_sdpa_backward(ctx, grad_output):
    """The gradients of SdpaFunction's (or SdpaTransformFunction's) inputs as torch operators that
    autograd differentiates again (_explicit.py): second derivatives (gradient penalties, double
    backward, torch.func's grad of grad and Hessians), O(L * S) memory per head. With dropout,
    the kernel's mask for the call's seed (read off its weights)."""
    query, key, value, attn_mask, _, _ = ctx.saved_tensors
    (dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right, window_left, window_right, alibi_slopes,
     num_threads, softcap, sinks) = ctx.options
    keep = None
    if dropout_p > 0:
        inputs = [None if x is None else x.detach() for x in (query, key, value, attn_mask)]
        if _levels.transforms_active():
            weights = SdpaWeightsFunction.apply(*inputs, *ctx.options)
        else:
            weights = _tensor(_mha.sdpa(*inputs, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, True,
                                        bottom_right, window_left, window_right, _detached(alibi_slopes), num_threads,
                                        _detached(sinks))[1])
        keep = _explicit.dropout_keep(weights, dropout_p, _explicit.wide_dtype(query))
    wanted = (list(ctx.needs_input_grad[:3]) + [attn_mask is not None and ctx.needs_input_grad[3]]
              + [sinks is not None and ctx.needs_input_grad[-1]])
    grads = _explicit.backward(query, key, value, attn_mask, grad_output, wanted, is_causal, scale, enable_gqa,
                               bottom_right, (window_left, window_right), alibi_slopes, keep, sinks, softcap)
    return (*grads[:4],) + (None,) * (len(ctx.options) - 1) + (grads[4],)


class SdpaTransformFunction(torch.autograd.Function):
    """SdpaFunction for torch.func transforms; returns (output, log-sum-exp), the second not
    differentiable. grad, vjp and jacrev go through setup_context, vmap through the rule below
    (the vmapped dimension becomes a batch dimension of one kernel call), vmap of a gradient
    through SdpaBackwardFunction's rule; forward mode (jvp, jacfwd, torch.autograd.forward_ad)
    through jvp, in torch operators (_forward_ad.py)."""

    forward = staticmethod(_sdpa_forward)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, attn_mask, *options = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.save_for_forward(query, key, value, attn_mask)
        ctx.options = tuple(options)

    @staticmethod
    def backward(ctx, grad_output, _grad_lse):
        if _levels.differentiated_again(ctx, grad_output):
            return _differentiable_sdpa_backward(ctx, grad_output)
        # (under a transform, SdpaBackwardFunction: its vmap rule batches it, and a level that
        # differentiates it meets its clear error, never a gradient silently left out)
        return _sdpa_backward(ctx, grad_output)

    @staticmethod
    def jvp(ctx, dq, dk, dv, dmask, *tangents):
        if _levels.forward_levels() > 1:
            # (torch.func drops the outer derivative of an autograd.Function's jvp rule: the
            # result would be silently wrong, so it is an error)
            raise RuntimeError("mha.scaled_dot_product_attention: forward mode over forward mode (jvp of jvp, "
                               "jacfwd of jacfwd) is not supported for autograd Functions; take second "
                               "derivatives as hessian (jacfwd of jacrev), jacrev of jacrev or jvp of grad")
        query, key, value, attn_mask = ctx.saved_tensors[:4]
        (dropout_p, is_causal, scale, enable_gqa, _seed, bottom_right, window_left, window_right, alibi_slopes,
         _threads, softcap, sinks) = ctx.options
        d_sinks = tangents[-1] if sinks is not None else None
        d_out = _forward_ad.sdpa_jvp(query, key, value, attn_mask, (dq, dk, dv, dmask), dropout_p, is_causal, scale,
                                     enable_gqa, bottom_right, (window_left, window_right), alibi_slopes, sinks,
                                     d_sinks, softcap)
        return d_out, None

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, *options):
        outputs = _vmap.forward_rule(info, in_dims, (query, key, value, attn_mask), options[0],
                                     lambda *tensors: SdpaTransformFunction.apply(*tensors, *options))
        return outputs, (0, 0)


class SdpaBackwardFunction(torch.autograd.Function):
    """The C++ backward of SdpaFunction: (dQ, dK, dV, dMask, dSinks), None where not wanted. A
    Function of its own only for its vmap rule (vmap of a gradient, jacrev); it is not
    differentiated."""

    @staticmethod
    def forward(query, key, value, attn_mask, out, lse, grad, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                bottom_right, window_left, window_right, alibi_slopes, num_threads, softcap, sinks, mask_grad, wanted):
        grads = _mha.sdpa_backward(query.detach(), key.detach(), value.detach(), out.detach(), lse.detach(),
                                   grad.detach(), _detached(attn_mask), dropout_p, is_causal, scale, softcap, enable_gqa,
                                   dropout_seed, bottom_right, window_left, window_right, _detached(alibi_slopes),
                                   num_threads, mask_grad, wanted, _detached(sinks))
        return tuple(None if d is None else _tensor(d) for d in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_FUSED_BACKWARD_DIFFERENTIATED)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_FUSED_BACKWARD_DIFFERENTIATED)

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, out, lse, grad, *options):
        dropout_p, sinks, mask_grad = options[0], options[-3], options[-2]
        tensors = (query, key, value, attn_mask, out, lse, grad)
        call = lambda *ts: SdpaBackwardFunction.apply(*ts, *options)  # noqa: E731
        if sinks is not None:  # each example's own gradient of the shared sinks: a call per example
            _vmap.check_randomness(info, dropout_p)
            grads = _vmap.looped(info.batch_size, in_dims[:7], tensors, call)
        else:
            grads = _vmap.backward_rule(info, in_dims[:7], tensors, dropout_p, mask_grad, call)
        return grads, _vmap.out_dims(grads)


_FUSED_BACKWARD_DIFFERENTIATED = (
    "mha.scaled_dot_product_attention: the fused backward is not differentiable; a second derivative is taken "
    "through backward(create_graph=True) or a torch.func grad/jvp transform around the call, which run the "
    "backward in torch operators")


class SdpaWeightsFunction(torch.autograd.Function):
    """The kernel's attention weights [..., Hq, L, S] of a scaled_dot_product_attention call
    (need_weights) under a transform, not differentiable: those returned where a derivative is
    needed are formed in torch operators, and these give them their dropout mask. A Function for
    its vmap rule."""

    @staticmethod
    def forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed, bottom_right,
                window_left, window_right, alibi_slopes, num_threads, softcap=0.0, sinks=None):
        _, weights = _mha.sdpa(query.detach(), key.detach(), value.detach(), _detached(attn_mask), dropout_p,
                               is_causal, scale, softcap, enable_gqa, dropout_seed, True, bottom_right, window_left,
                               window_right, _detached(alibi_slopes), num_threads, _detached(sinks))
        return _tensor(weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad_weights):  # (not reached: the output is not differentiable)
        return (None,) * 16

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, *options):
        (weights,) = _vmap.forward_rule(info, in_dims, (query, key, value, attn_mask), options[0],
                                        lambda *tensors: (SdpaWeightsFunction.apply(*tensors, *options),))
        return weights, 0


class ModuleFunction(torch.autograd.Function):
    """MultiheadAttention.forward with gradients for the inputs and the parameters that need them
    (a frozen parameter's is neither computed nor returned). The module's
    parameters enter as tensors (after the flags), so that autograd hands their gradients back,
    and the C++ module reads them where they are (forward_with/backward_with), in the forward and
    again in the backward. They are saved for backward, as PyTorch's module saves its weights:
    changing one in place between the forward and the backward raises autograd's error. A
    bfloat16/float16 module returns its output and gradients in its dtype (computed in float32)."""

    @staticmethod
    def forward(ctx, module, names, flags, query, key, value, key_padding_mask, attn_mask, *params):
        # (an optional sixth flag: the call as torch operators, for second derivatives)
        need_weights, average, is_causal, dropout_seed, num_threads, *composed = flags
        ctx.composed = composed[0] if composed else None
        out, weights, context = module.forward_train(query.detach(), key.detach(), value.detach(),
                                                     _detached(key_padding_mask), need_weights,
                                                     _detached(attn_mask), average, is_causal, dropout_seed,
                                                     num_threads, {name: p.detach() for name, p in zip(names, params)})
        # The C++ context (the activations) lives as long as autograd's saved tensors do.
        token = _lifetime_token(context)
        ctx.module, ctx.names = module, names
        ctx.mask_dtypes = tuple(None if m is None else m.dtype for m in (key_padding_mask, attn_mask))
        masks = [m if ctx.composed is not None else None for m in (key_padding_mask, attn_mask)]
        ctx.save_for_backward(token, query, key, value, *masks, *params)
        # The weights are differentiable, as PyTorch's are; a loss that leaves them out hands the
        # backward None for them (not zeros), which keeps it on the fused kernels.
        ctx.set_materialize_grads(False)
        out = _tensor(out)
        ctx.output_shape, ctx.output_dtype = out.shape, out.dtype
        return out, None if weights is None else _tensor(weights)

    @staticmethod
    def backward(ctx, grad_output, grad_weights):
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative follows
            return _differentiable_module_backward(ctx, grad_output, grad_weights)
        # (autograd's checks: that no parameter changed in place since the forward, and that the
        # graph was retained where this is a second backward)
        token, _, _, _, _, _, *params = ctx.saved_tensors
        context = token_object(token)
        # Gradients only where autograd needs them: a key and value that need none (a frozen
        # encoder's output) save their projections' dX products, a frozen parameter its dW.
        frozen = [name for name, needed in zip(ctx.names, ctx.needs_input_grad[8:]) if not needed]
        if grad_output is None:  # a loss of the weights alone
            grad_output = torch.zeros(ctx.output_shape, dtype=ctx.output_dtype)
        # A float mask that requires grad (a learned bias) gets dS summed as it broadcasts.
        dq, dk, dv, dparams, dpadding, dmask = ctx.module.backward(
            context, grad_output.detach().contiguous(), {name: p.detach() for name, p in zip(ctx.names, params)},
            tuple(ctx.needs_input_grad[3:6]), frozen, tuple(ctx.needs_input_grad[6:8]),
            weights_gradient(grad_weights, ctx.output_dtype))
        param_grads = [_tensor(dparams[name]) if name in dparams else None for name in ctx.names]
        dq, dk, dv = (None if d is None else _tensor(d) for d in (dq, dk, dv))
        dpadding, dmask = (None if d is None else _tensor(d).to(dtype)
                           for d, dtype in zip((dpadding, dmask), ctx.mask_dtypes))
        return (None, None, None, dq, dk, dv, dpadding, dmask, *param_grads)


def _differentiable_module_backward(ctx, grad_output, grad_weights):
    """ModuleFunction's gradients that autograd differentiates again (gradient penalties): the call
    once more as torch operators around the SDPA (nn/_composed.py), whose own backward then runs
    in torch operators too, differentiated by autograd.grad(create_graph=True)."""
    _, query, key, value, key_padding_mask, attn_mask, *params = ctx.saved_tensors
    if ctx.composed is None:
        raise RuntimeError("mha MultiheadAttention: second derivatives (backward with create_graph=True) are not "
                           "supported with dropout in training mode or through the numpy-level module; use "
                           "mha.nn.MultiheadAttention in eval mode or with dropout=0")
    wanted = ctx.needs_input_grad[3:]
    # (each input its own alias: one tensor passed as query, key and value gets a gradient per
    # position, not the whole sum three times)
    inputs = [x.view_as(x) if w else x for x, w in zip((query, key, value, key_padding_mask, attn_mask, *params),
                                                        wanted)]
    query, key, value, key_padding_mask, attn_mask, *params = inputs
    out, weights = ctx.composed(dict(zip(ctx.names, params)), query, key, value, key_padding_mask, attn_mask)
    outputs, seeds = [out], [torch.zeros_like(out) if grad_output is None else grad_output]
    if weights is not None and grad_weights is not None:
        outputs.append(weights)
        seeds.append(grad_weights)
    chosen = [x for x, w in zip(inputs, wanted) if w]
    found = iter(torch.autograd.grad(outputs, chosen, seeds, create_graph=True, allow_unused=True))
    grads = [next(found) if w else None for w in wanted]
    grads = [None if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
    return (None, None, None, *grads)
