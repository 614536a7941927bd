"""Variable-length attention: sequences of different lengths packed one after another (the
cu_seqlens layout of FlashAttention's varlen functions), and PyTorch's jagged nested tensors,
whose values are that layout."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _mha
from ._softcap import check_softcap
from ._window import check_window, sides


def offsets_list(offsets: Any, name: str) -> list:
    """cu_seqlens as a list of Python ints: from a 1-D integer torch tensor or numpy array, or a
    sequence of ints."""
    if hasattr(offsets, "detach") and hasattr(offsets, "tolist"):  # a torch tensor
        if offsets.is_floating_point() or offsets.is_complex() or str(offsets.dtype) == "torch.bool":
            raise TypeError(f"{name}: expected integer offsets, got a tensor of {offsets.dtype}")
        if offsets.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of offsets, got shape {list(offsets.shape)}")
        return offsets.detach().cpu().tolist()
    if isinstance(offsets, np.ndarray):
        if offsets.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer offsets, got an array of {offsets.dtype}")
        if offsets.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array of offsets, got shape {list(offsets.shape)}")
        return offsets.tolist()
    if isinstance(offsets, (list, tuple)):
        if not all(isinstance(o, (int, np.integer)) and not isinstance(o, bool) for o in offsets):
            raise TypeError(f"{name}: expected a sequence of ints")
        return [int(o) for o in offsets]
    raise TypeError(f"{name}: expected a 1-D integer tensor, array or list of offsets, got {type(offsets).__name__}")


def _options(dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, bottom_right, window, alibi_slopes,
             num_threads) -> tuple:
    """The options in the order of the extension's varlen functions."""
    return (float(dropout_p), bool(is_causal), None if scale is None else float(scale), float(softcap),
            bool(enable_gqa), int(dropout_seed), bool(bottom_right), *sides(window), alibi_slopes, int(num_threads))


def varlen_function():
    """The torch.autograd.Function of varlen attention (torch is imported only when used)."""
    global _VarlenFunction
    if _VarlenFunction is None:
        import torch  # noqa: PLC0415 - optional dependency
        from torch.autograd.function import once_differentiable  # noqa: PLC0415

        from .autograd import _tensor  # noqa: PLC0415

        class VarlenFunction(torch.autograd.Function):
            """Packed attention with gradients for query, key and value; the C++ training forward
            and backward, the inputs' dtype throughout (float32 arithmetic inside for bfloat16 and
            float16), the log-sum-exp saved, not the probabilities. Differentiable once."""

            @staticmethod
            def forward(ctx, query, key, value, cu_q, cu_k, sinks, *options):
                detached = None if sinks is None else sinks.detach()
                out, lse = _mha.sdpa_varlen_train(query.detach(), key.detach(), value.detach(), cu_q, cu_k, *options,
                                                  detached)
                out = _tensor(out)
                lse = torch.from_numpy(lse)
                ctx.save_for_backward(query, key, value, out, lse)
                ctx.offsets = (cu_q, cu_k)
                ctx.options = options
                ctx.sinks = detached
                return out

            @staticmethod
            @once_differentiable
            def backward(ctx, grad_output):
                query, key, value, out, lse = ctx.saved_tensors
                grad = grad_output.to(out.dtype)
                dq, dk, dv, ds = _mha.sdpa_varlen_backward(query.detach(), key.detach(), value.detach(),
                                                           *ctx.offsets, out, lse, grad, *ctx.options,
                                                           tuple(ctx.needs_input_grad[:3]), ctx.sinks)
                wrap = (lambda a: None if a is None else _tensor(a))
                ds = wrap(ds) if ctx.needs_input_grad[5] else None
                return (wrap(dq), wrap(dk), wrap(dv), None, None, ds) + (None,) * len(ctx.options)

        _VarlenFunction = VarlenFunction
    return _VarlenFunction


_VarlenFunction = None


def _jagged_parts(t, name: str):
    """(values [T, H, D], offsets) of a jagged nested tensor of shape [B, H, j, D], the layout
    PyTorch's scaled_dot_product_attention takes nested tensors in."""
    import torch  # noqa: PLC0415

    if t.layout != torch.jagged:
        raise ValueError(f"{name}: expected a nested tensor of layout torch.jagged, got {t.layout}")
    if t.dim() != 4 or t._ragged_idx != 2:
        raise ValueError(f"{name}: expected a jagged nested tensor of shape [B, H, j, D] (the ragged sequence "
                         f"dimension third, as torch.nn.functional.scaled_dot_product_attention takes it), got "
                         f"{t.dim()} dimensions with the ragged one at {t._ragged_idx}")
    rows = t.transpose(1, 2)  # [B, j, H, D]: its values are the packed [T, H, D] rows
    if rows._lengths is not None:  # a view with holes between the sequences: packed first
        rows = rows.contiguous()
    return rows.values(), rows.offsets()


def nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                causal_alignment, num_threads, need_weights, window=None, alibi_slopes=None, sinks=None,
                softcap=0.0):
    """scaled_dot_product_attention of jagged nested tensors [B, H, j, D]: each sequence attends to
    its own keys, as PyTorch's nested SDPA does; the output is nested like the query."""
    import torch  # noqa: PLC0415

    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        if not (isinstance(t, torch.Tensor) and t.is_nested):
            raise ValueError(f"{name}: expected a nested tensor like the query, got a dense one")
    if attn_mask is not None:
        raise ValueError("attn_mask: nested inputs take no mask (each sequence's own keys are its mask; "
                         "is_causal applies within each sequence)")
    if need_weights:
        raise ValueError("need_weights: the weights of nested inputs are not returned (their shape is ragged)")
    q, cu_q = _jagged_parts(query, "query")
    k, cu_k = _jagged_parts(key, "key")
    v, cu_v = _jagged_parts(value, "value")
    if cu_k is not cu_v and not torch.equal(cu_k, cu_v):
        raise ValueError("key/value: expected the same sequence lengths")
    out = varlen_attention(q, k, v, cu_q, cu_k, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                           dropout_p=dropout_p, dropout_seed=dropout_seed, causal_alignment=causal_alignment,
                           num_threads=num_threads, window_size=window, alibi_slopes=alibi_slopes, sinks=sinks,
                           softcap=softcap)
    return torch.nested.nested_tensor_from_jagged(out, cu_q).transpose(1, 2)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k: Optional[Sequence[int]] = None, *,
                     is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                     dropout_p: float = 0.0, dropout_seed: Optional[int] = None, causal_alignment: str = "top_left",
                     num_threads: int = 0, window_size: Optional[Tuple[int, int]] = None, alibi_slopes=None,
                     sinks=None, softcap: float = 0.0, k_descale=None, v_descale=None):
    """Attention over sequences of different lengths packed without padding.

    query [Tq, Hq, E], key [Tk, Hkv, E], value [Tk, Hkv, Ev] -> [Tq, Hq, Ev]. Sequence s holds
    query rows cu_seqlens_q[s]:cu_seqlens_q[s+1] and key/value rows cu_seqlens_k[s]:cu_seqlens_k[s+1]
    (cu_seqlens_k defaults to cu_seqlens_q: self-attention) and attends to its own keys only:
    each sequence's rows are scaled_dot_product_attention of that sequence alone, bit for bit,
    without the padding a rectangular batch computes. Offsets are a 1-D integer tensor, array or
    list (B + 1 entries, from 0 to T; a jagged nested tensor's offsets()). is_causal applies within
    each sequence (causal_alignment "top_left" as PyTorch's, or "bottom_right"); sequence s draws
    dropout with seed mha.varlen_dropout_seed(dropout_seed, s). window_size=(left, right) is a
    sliding window within each sequence, as in mha.scaled_dot_product_attention (-1: unbounded
    on that side). alibi_slopes [Hq] or [B, Hq] (per sequence) is ALiBi within each sequence, as in
    mha.scaled_dot_product_attention, and so are sinks [Hq] (differentiable) and softcap (logit
    soft-capping, softcap * tanh(s / softcap)). float32, bfloat16, float16 or
    float64, or float8 key and value (torch.float8_e4m3fn or torch.float8_e5m2, inference) under a
    float32, bfloat16 or float16 query, with k_descale and v_descale (float32 [], [Hkv] or [B, Hkv],
    per sequence) dequantising them as in mha.scaled_dot_product_attention; torch tensors
    (differentiable, once) or numpy arrays. Nested inputs to
    mha.scaled_dot_product_attention (and to PyTorch's, under mha.patch_torch_sdpa) come here.
    Under torch.compile (and torch.export) the call is one node of the graph, mha::sdpa_varlen_train,
    its gradient mha::sdpa_varlen_backward; the offsets are tensor operands there.
    """
    from . import _as_array, _check_descales, _compiling, _like, _needs_grad, _new_seed, _sinks_operand  # noqa: PLC0415

    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}")
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    sinks = _sinks_operand(query, sinks)
    k_descale, v_descale = _check_descales(query, key, k_descale, v_descale)
    if (k_descale is not None or v_descale is not None) and _needs_grad(query, key, value, sinks):
        raise ValueError("key, value: float8 keys and values are for inference (a quantized cache takes no "
                         "gradient); run the call under torch.no_grad() or detach the inputs that require grad")
    if _compiling():  # one node of the graph, the offsets tensor operands (no specialisation on lengths)
        return _traced_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, enable_gqa, dropout_p,
                              dropout_seed, causal_alignment == "bottom_right", window, alibi_slopes, num_threads,
                              sinks, softcap, k_descale, v_descale)
    cu_q = offsets_list(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else offsets_list(cu_seqlens_k, "cu_seqlens_k")
    if dropout_seed is None:
        dropout_seed = _new_seed() if dropout_p > 0 else 0
    options = _options(dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, causal_alignment == "bottom_right",
                       window, _as_array(alibi_slopes, "alibi_slopes", allow_none=True), num_threads)
    if _needs_grad(query, key, value, sinks):
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            if not t.is_cpu:
                raise ValueError(f"{name}: expected a CPU tensor, got one on device '{t.device}'")
        if sinks is not None and not hasattr(sinks, "detach"):
            import torch  # noqa: PLC0415 - inputs that need grad are torch tensors

            sinks = torch.as_tensor(sinks)
        return varlen_function().apply(query, key, value, cu_q, cu_k, sinks, *options)
    q = _as_array(query, "query", once=True)
    k = _as_array(key, "key", once=True)
    v = _as_array(value, "value", once=True)
    return _like(query, _mha.sdpa_varlen(q, k, v, cu_q, cu_k, *options, _as_array(sinks, "sinks", allow_none=True),
                                         _as_array(k_descale, "k_descale", allow_none=True),
                                         _as_array(v_descale, "v_descale", allow_none=True)))


def _traced_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, enable_gqa, dropout_p,
                   dropout_seed, bottom_right, window, alibi_slopes, num_threads, sinks, softcap=0.0, k_descale=None,
                   v_descale=None):
    """varlen_attention inside torch.compile / torch.export: the operator mha::sdpa_varlen_train."""
    import torch  # noqa: PLC0415

    from . import ops  # noqa: PLC0415

    def offsets(x):
        return x.to(torch.int64) if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.int64)

    cu_q = offsets(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else offsets(cu_seqlens_k)
    out, _ = torch.ops.mha.sdpa_varlen_train(query, key, value, cu_q, cu_k, float(dropout_p), bool(is_causal),
                                             None if scale is None else float(scale), bool(enable_gqa),
                                             ops.seed_tensor(dropout_seed, dropout_p), bool(bottom_right),
                                             *sides(window),
                                             None if alibi_slopes is None else torch.as_tensor(alibi_slopes),
                                             int(num_threads), float(softcap),
                                             None if sinks is None else torch.as_tensor(sinks), k_descale, v_descale)
    return out


def varlen_dropout_seed(seed: int, sequence: int) -> int:
    """The dropout seed sequence `sequence` of a varlen call with `seed` draws its mask with."""
    return _mha.varlen_dropout_seed(int(seed), int(sequence))
