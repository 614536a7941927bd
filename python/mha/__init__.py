"""mha: multi-head attention with PyTorch's semantics, on a fused C++ CPU kernel.

The API mirrors PyTorch's, so that either can stand in for the other::

    import mha
    m = mha.MultiheadAttention(embed_dim, num_heads, batch_first=True)
    m.load_state_dict(torch_module.state_dict())
    out, weights = m(query, key, value, key_padding_mask=mask)
    o = mha.scaled_dot_product_attention(q, k, v, is_causal=True)

Inputs are numpy arrays or CPU torch tensors, of any strides, read without copies. Outputs are of
the kind of the query: numpy in, numpy out; torch in, torch out.
"""

from __future__ import annotations

import os as _os
import random as _random
import re as _re
import sys as _sys
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as _np

from . import _mha, _varlen, _window
from ._softcap import check_softcap
from ._paged import _descales, merge_attention_states, paged_attention, write_paged_cache
from ._varlen import varlen_attention, varlen_dropout_seed

__all__ = [
    "MultiheadAttention",
    "scaled_dot_product_attention",
    "varlen_attention",
    "paged_attention",
    "write_paged_cache",
    "merge_attention_states",
    "varlen_dropout_seed",
    "set_num_threads",
    "get_num_threads",
    "cpu_isa",
    "bfloat16_products",
    "set_threading",
    "get_threading",
    "release_host_cache",
    "load_safetensors",
    "save_safetensors",
]

set_num_threads = _mha.set_num_threads
get_num_threads = _mha.get_num_threads
cpu_isa = _mha.cpu_isa
bfloat16_products = _mha.bfloat16_products  # bfloat16 modules round as PyTorch's (else: float32, rounded once)
get_threading = _mha.get_threading
release_host_cache = _mha.release_host_cache  # frees the large blocks kept for reuse (MHA_HOST_CACHE_MB)

_threading_decided = False


def set_threading(threading: str) -> None:
    """Where the parallel work runs: "pool" (the library's own threads) or "openmp" (the OpenMP
    runtime's team, shared with PyTorch's CPU operators). By default the first call made once torch
    is imported picks "openmp" when the process holds a single OpenMP runtime (so both libraries
    share one team), unless MHA_THREADING is set; calling this fixes the choice."""
    global _threading_decided
    _mha.set_threading(threading)
    _threading_decided = True


def _openmp_runtimes() -> set:
    """The OpenMP runtime libraries mapped into this process (libgomp, libiomp, libomp)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return set()
    return {p for p in paths if _re.search(r"/lib(g|i)?omp[^/]*\.so", p)}


def _auto_threading() -> None:
    """PyTorch's OpenMP threads spin for a while after each of its operators; on a machine without
    spare cores they would take cores from our pool during a short call that follows one of theirs
    (measured: twice the time of an L=128 SDPA). Sharing the one OpenMP runtime avoids that."""
    global _threading_decided
    if _threading_decided or "torch" not in _sys.modules:
        return
    _threading_decided = True
    if _os.environ.get("MHA_THREADING") or not _mha.openmp_available():
        return
    if len(_openmp_runtimes()) == 1:
        _mha.set_threading("openmp")


def load_safetensors(path: str) -> Dict[str, _np.ndarray]:
    """The tensors of a .safetensors file as numpy arrays, read by the library's C++ reader
    (bounds-checked: a malformed file raises ValueError). bfloat16 comes back as float32."""
    tensors, _ = _mha.load_safetensors(str(path))
    return tensors


def save_safetensors(path: str, tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes numpy arrays or CPU torch tensors (any strides) to a .safetensors file."""
    arrays = {name: _as_array(value, f"tensors['{name}']") for name, value in tensors.items()}
    _mha.save_safetensors(str(path), arrays, dict(metadata or {}))


def _torch():
    try:
        import torch  # noqa: PLC0415 - optional dependency
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


def _loaded_torch():
    """torch if the program has imported it (an input can be a tensor only then), else None:
    a lookup, where _torch() would import it. Called several times per call, so it must be cheap."""
    return _sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _loaded_torch()
    return torch is not None and isinstance(x, torch.Tensor)


_numpy_viewable = None


def _viewable_by_numpy(torch, dtype) -> bool:
    """Whether numpy can view a tensor of this dtype (bfloat16 cannot)."""
    global _numpy_viewable
    if _numpy_viewable is None:
        _numpy_viewable = {torch.float32, torch.float16, torch.bool}
    return dtype in _numpy_viewable


def _as_array(x: Any, name: str, allow_none: bool = False, once: bool = False):
    """An object the extension reads without a copy: a numpy array, a CPU torch tensor, or with
    `once` (the result is handed to one extension call and dropped) a DLPack capsule of the tensor.

    Per tensor, a capsule from torch's C exporter costs about 0.7 us, a numpy view about 2 and the
    tensor's own __dlpack__ about 3.4 (a decoding step on a small cache takes tens of us). A
    capsule can be read only once, so results that are kept or passed on (autograd's saved
    inputs, loaded parameters) are numpy views, or the tensor itself for bfloat16."""
    if x is None:
        if allow_none:
            return None
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got None")
    if isinstance(x, _np.ndarray):
        return x
    torch = _loaded_torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got one on device '{x.device}'")
        if x.requires_grad:
            x = x.detach()
        try:
            if once:
                return _to_dlpack(torch)(x)
            if _viewable_by_numpy(torch, x.dtype):
                return x.numpy()
        except (RuntimeError, TypeError, BufferError):  # a conjugate or negative view, say: the tensor itself
            pass
        return x
    if isinstance(x, (list, tuple, float, int)):
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}; "
                        "wrap it with numpy.asarray(..., dtype=numpy.float32)")
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


_dlpack_exporter = None


def _to_dlpack(torch):
    global _dlpack_exporter
    if _dlpack_exporter is None:
        from torch.utils.dlpack import to_dlpack  # noqa: PLC0415 - torch is loaded already
        _dlpack_exporter = to_dlpack
    return _dlpack_exporter


def _like(template: Any, array: Optional[_np.ndarray]):
    """The output in the kind of the input: a torch tensor sharing memory, or the numpy array."""
    if array is None or isinstance(template, _np.ndarray):
        return array
    torch = _loaded_torch()
    if torch is None or not isinstance(template, torch.Tensor):
        return array
    out = torch.from_numpy(array)
    if template.dtype is torch.bfloat16:  # numpy has no bfloat16: it came back as its bits
        out = out.view(torch.bfloat16)
    return out


_DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")


def _dtype_name(dtype: Any) -> str:
    """'float32', 'float64', 'bfloat16' or 'float16' from that name, a numpy dtype or a torch dtype."""
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if not isinstance(dtype, str):
        try:
            name = _np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: expected float32, float64, bfloat16 or float16 for the module's parameters, "
                         f"got {dtype!r}")
    return name


def _tensor_of(array: _np.ndarray):
    """A torch tensor sharing a parameter array's memory; bfloat16 arrives as its uint16 bits."""
    t = _torch().from_numpy(array)
    return t.view(_torch().bfloat16) if t.dtype == _torch().uint16 else t


def _needs_grad(*xs) -> bool:
    """Whether PyTorch autograd must see this call: a torch input requires grad, grad mode is on."""
    torch = _loaded_torch()
    if torch is None:
        return False
    tensor = torch.Tensor
    for x in xs:  # a plain loop: a generator in any() cost twice the time, per call
        if isinstance(x, tensor) and x.requires_grad:
            return torch.is_grad_enabled()
    return False


def _new_seed() -> int:
    return _random.getrandbits(64)


def _compiling() -> bool:
    """Whether torch.compile / torch.export is tracing this call (then the kernels enter the graph
    as the custom operators of ops.py)."""
    torch = _sys.modules.get("torch")
    # (torch < 2.4 has no custom operators: its compiled code breaks the graph around the call)
    return torch is not None and hasattr(torch.library, "custom_op") and torch.compiler.is_compiling()


def _autocast_dtype():
    """CPU autocast's lower-precision dtype where it is on (inside torch.autocast("cpu")), else None."""
    torch = _loaded_torch()
    if torch is None:
        return None
    if not torch.compiler.is_compiling() and not torch._C._is_any_autocast_enabled():
        return None  # (the cheap test first: this runs on every call)
    if not hasattr(torch, "get_autocast_dtype"):  # (torch < 2.4 names it per device)
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _autocast(dtype, *tensors) -> tuple:
    """The tensors as CPU autocast casts the arguments of an operator it runs in lower precision
    (PyTorch's SDPA and linear among them): every floating CPU tensor but a float64 one in
    `dtype`; bool masks, tensors on other devices (another autocast's), numpy arrays and None as
    they are. The casts are torch operators, so gradients flow back to the tensors in their own
    dtype. float8 keys and values (a quantized cache, which the kernels widen exactly) stay as
    they are too: autocast would only spend memory widening them."""
    torch = _loaded_torch()
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.is_cpu
                 and x.dtype not in (dtype, torch.float64) and x.element_size() > 1 else x for x in tensors)


def _check_float8_inference(key, value, *others) -> None:
    """float8_e4m3fn keys and values are an inference call: an error where autograd would need the
    call's backward (a quantized cache takes no gradient, and the C++ backward takes one dtype)."""
    torch = _loaded_torch()
    if torch is None:
        return
    eight_bit = (isinstance(key, torch.Tensor) and key.dtype in _float8_dtypes(torch)) or \
        (isinstance(value, torch.Tensor) and value.dtype in _float8_dtypes(torch))
    if eight_bit and _needs_grad(key, value, *others):
        raise ValueError("key, value: float8 keys and values are for inference (a quantized cache takes no "
                         "gradient); run the call under torch.no_grad() or detach the inputs that require grad")


_float8 = None


def _float8_dtypes(torch) -> tuple:
    """The float8 formats the kernels take for keys and values, as torch dtypes."""
    global _float8
    if _float8 is None:
        _float8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
    return _float8


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, dropout_seed: Optional[int] = None,
                                 causal_alignment: str = "top_left", need_weights: bool = False,
                                 num_threads: int = 0, window_size: Optional[Tuple[int, int]] = None,
                                 alibi_slopes=None, sinks=None, softcap: float = 0.0, k_descale=None,
                                 v_descale=None):
    """torch.nn.functional.scaled_dot_product_attention on the fused kernel.

    query [..., Hq, L, E], key [..., Hkv, S, E], value [..., Hkv, S, Ev] -> [..., Hq, L, Ev], rank 2
    to 6; the batch dimensions (all but the last two) broadcast as PyTorch's do, and a broadcast
    input's gradient is summed over them. With enable_gqa, key and value head counts each divide
    Hq (they may differ, as in PyTorch). float32, bfloat16, float16 or float64 (computed in
    float64, for torch.autograd.gradcheck; its float mask may be float64). key and value may
    instead both be torch.float8_e4m3fn or both torch.float8_e5m2 under a float32, bfloat16 or
    float16 query: a quantized cache, half a bfloat16 one's memory, widened exactly as the kernels
    read it (the output in the query's dtype; inference only). k_descale and v_descale dequantise
    them (FlashAttention 3's descales, vLLM's k_scale and v_scale): float32 [], [Hkv] or
    [..., Hkv] (per batch entry and key/value head), finite and > 0; the call attends over
    key * k_descale and value * v_descale, the kernels folding the scales into the softmax scale
    and the output's normalisation (no key or value is multiplied).
    attn_mask: bool (True = attend) or float (added to the scores; float32, or the inputs' bfloat16 or
    float16, as PyTorch takes it), broadcastable to [..., Hq, L, S].
    is_causal may be combined with attn_mask (a key must pass both). causal_alignment is
    "top_left" (PyTorch's) or "bottom_right" (the last query sees every key). Fully masked rows
    give zeros. dropout_seed fixes the dropout mask (a fresh one is drawn when None).
    window_size=(left, right) is sliding-window (local) attention, FlashAttention's: query i sees
    keys from `left` before to `right` after its diagonal (the one causal_alignment names), -1
    leaving a side unbounded; with is_causal or attn_mask a key must pass them all (Mistral's
    window of W keys: is_causal=True, window_size=(W - 1, -1)). Blocks of keys outside it are
    skipped, not computed.
    alibi_slopes is ALiBi, FlashAttention's: float32 slopes [Hq] or [..., Hq] (per batch entry
    and head; float64 too for float64 inputs), and -slope * |i + diagonal - j| is added to the
    score of query i and key j (the diagonal causal_alignment names; FlashAttention's is
    "bottom_right"). The kernels read one head's biases from Lq + Lk - 1 values, never an L x S
    matrix; the slopes take no gradient.
    sinks are attention sinks, gpt-oss's learned per-head sink logits: float32 [Hq] (float64 for
    float64 inputs); each row's softmax takes exp(sinks[h]) in its denominator, as if a key with
    that (already scaled) score and a zero value were appended, so a row's weights sum to less
    than 1. The sinks take a gradient (a trainable parameter, as in gpt-oss); the training
    forward's log-sum-exp includes them.
    softcap > 0 is logit soft-capping (Gemma 2's attn_logit_softcapping, FlashAttention's softcap):
    each scaled score s becomes softcap * tanh(s / softcap) before the masks, ALiBi and the
    softmax; its gradients pass through the tanh. 0 (the default) leaves the scores as they are.
    With need_weights=True, returns (output, weights) instead of the output. The weights are
    differentiable, as mha.nn.MultiheadAttention's are: where autograd (or a torch.func transform)
    needs their derivative they are formed in torch operators (O(L*S) per head, as the weights
    themselves; with dropout, the output's dropout mask applied), else they come from the kernel.
    Inside torch.autocast("cpu") the inputs are cast as PyTorch's SDPA casts them there (floating
    tensors but float64 to the autocast dtype), so the output is in that dtype.
    Jagged nested tensors [B, H, j, D] (layout=torch.jagged, as PyTorch's SDPA takes them; no
    attn_mask, no weights) run mha.varlen_attention on their values: a nested output.
    Under torch.compile (and torch.export) the call is one node of the graph, forward and backward
    (the operator mha::sdpa_train; the weights come from mha::sdpa_with_weights).
    torch.func transforms (vmap, grad, vjp, jacrev, jvp, jacfwd) and torch.autograd.forward_ad
    compose with it: vmap folds the vmapped dimension into the batch (one kernel call); forward
    mode is computed in torch operators (no dropout).
    """
    autocast = _autocast_dtype()
    if autocast is not None:
        query, key, value, attn_mask = _autocast(autocast, query, key, value, attn_mask)
    window = _window.check_window(window_size)
    softcap = check_softcap(softcap)
    k_descale, v_descale = _check_descales(query, key, k_descale, v_descale)
    if _is_torch(query) and query.is_nested:  # jagged [B, H, j, D]: packed sequences, no padding
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale, v_descale: not taken with nested (jagged) inputs; pass the packed values "
                             "to mha.varlen_attention, which takes them")
        return _varlen.nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   dropout_seed, causal_alignment, num_threads, need_weights, window, alibi_slopes,
                                   sinks, softcap)
    window = _window.sides(window)
    if alibi_slopes is not None and _is_torch(query) and not _is_torch(alibi_slopes):
        alibi_slopes = _loaded_torch().as_tensor(alibi_slopes)  # (the torch paths pass tensors on)
    sinks = _sinks_operand(query, sinks)
    _check_float8_inference(key, value, query, attn_mask, sinks)
    if _compiling():
        return _traced_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                            causal_alignment, num_threads, need_weights, window, alibi_slopes, sinks, softcap,
                            k_descale, v_descale)
    _auto_threading()
    if _transformed():
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale, v_descale: scaled float8 keys and values are not taken under torch.func "
                             "transforms or forward-mode AD (an inference call: run it outside them)")
        return _transformed_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                                 causal_alignment, num_threads, need_weights, window, alibi_slopes, sinks, softcap)
    grad = _needs_grad(query, key, value, attn_mask, sinks)
    q = _as_array(query, "query", once=True)  # each feeds one extension call at most
    k = _as_array(key, "key", once=True)
    v = _as_array(value, "value", once=True)
    m = _as_array(attn_mask, "attn_mask", allow_none=True, once=True)
    a = _as_array(alibi_slopes, "alibi_slopes", allow_none=True)
    sk = _as_array(sinks, "sinks", allow_none=True)
    kd = _as_array(k_descale, "k_descale", allow_none=True, once=True)
    vd = _as_array(v_descale, "v_descale", allow_none=True, once=True)
    _check_alignment_and_mask(causal_alignment, attn_mask)
    if dropout_seed is None:
        dropout_seed = _new_seed() if dropout_p > 0 else 0
    if grad:
        from .autograd import SdpaFunction
        out = SdpaFunction.apply(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                                 None if scale is None else float(scale), bool(enable_gqa), int(dropout_seed),
                                 causal_alignment == "bottom_right", *window, alibi_slopes, int(num_threads), softcap,
                                 sinks)
        if not need_weights:
            return out
        dropped = None
        if dropout_p > 0:  # (the kernel's weights for its dropout mask: the output's, same seed)
            _, dropped = _mha.sdpa(q, k, v, m, float(dropout_p), bool(is_causal),
                                   None if scale is None else float(scale), softcap, bool(enable_gqa), int(dropout_seed), True,
                                   causal_alignment == "bottom_right", *window, a, int(num_threads), sk)
            dropped = _like(query, dropped)
        return out, _differentiable_weights(query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            causal_alignment == "bottom_right", window, alibi_slopes, dropped, sinks,
                                            softcap)
    out, weights = _mha.sdpa(q, k, v, m, float(dropout_p), bool(is_causal),
                             None if scale is None else float(scale), softcap, bool(enable_gqa), int(dropout_seed),
                             bool(need_weights), causal_alignment == "bottom_right", *window, a, int(num_threads), sk,
                             kd, vd)
    if need_weights:
        return _like(query, out), _like(query, weights)
    return _like(query, out)


def _check_descales(query, key, k_descale, v_descale):
    """k_descale and v_descale as the kernels take them (float32 tensors beside torch inputs),
    after checking they come with float8 keys (the paths that never reach the kernels' own check,
    autograd's, would drop them)."""
    if k_descale is None and v_descale is None:
        return None, None
    torch = _loaded_torch()
    if torch is None or getattr(key, "dtype", None) not in _float8_dtypes(torch):
        name = "k_descale" if k_descale is not None else "v_descale"
        raise ValueError(f"{name}: dequantisation scales are taken with float8 keys and values (float8_e4m3fn or "
                         f"float8_e5m2), got keys of dtype {getattr(key, 'dtype', type(key).__name__)}")
    return _descales(query, k_descale, v_descale)


def _sinks_operand(query, sinks):
    """Sinks as the kernels take them: a torch tensor beside torch inputs, float32 where they
    come in bfloat16 or float16 (as a model in those dtypes keeps them; the cast is differentiable)."""
    if sinks is None:
        return None
    if _is_torch(query) and not _is_torch(sinks):
        sinks = _loaded_torch().as_tensor(sinks)
    if _is_torch(sinks) and sinks.dtype in (_loaded_torch().bfloat16, _loaded_torch().float16):
        sinks = sinks.float()
    return sinks


def _check_alignment_and_mask(causal_alignment, attn_mask) -> None:
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}")
    if getattr(attn_mask, "requires_grad", False) and not attn_mask.is_floating_point():
        raise ValueError("attn_mask: only a float (additive) mask can require grad")


def _transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, jvp, ...) is tracing this call, or a
    forward-mode AD level is open (torch.autograd.forward_ad.dual_level: the inputs may carry
    tangents, which the extension would drop)."""
    torch = _loaded_torch()
    return torch is not None and (torch._C._are_functorch_transforms_active()
                                  or torch.autograd.forward_ad._current_level >= 0)


def _transformed_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                      causal_alignment, num_threads, need_weights, window, alibi_slopes, sinks, softcap=0.0):
    """Under torch.func transforms: the autograd Functions, whose vmap rules and setup_context
    the transforms call (their tensors are wrappers the extension cannot read)."""
    from .autograd import SdpaTransformFunction, SdpaWeightsFunction
    torch = _loaded_torch()
    for name, x in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
                    ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor under torch.func transforms, got {type(x).__name__}")
    _check_alignment_and_mask(causal_alignment, attn_mask)
    if dropout_seed is None:
        dropout_seed = _new_seed() if dropout_p > 0 else 0
    options = (float(dropout_p), bool(is_causal), None if scale is None else float(scale), bool(enable_gqa),
               int(dropout_seed), causal_alignment == "bottom_right", *window, alibi_slopes, int(num_threads), softcap,
               sinks)
    out, _ = SdpaTransformFunction.apply(query, key, value, attn_mask, *options)
    if not need_weights:
        return out
    dropped = SdpaWeightsFunction.apply(query, key, value, attn_mask, *options) if dropout_p > 0 else None
    return out, _differentiable_weights(query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        causal_alignment == "bottom_right", window, alibi_slopes, dropped, sinks,
                                            softcap)


def _differentiable_weights(query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right, window,
                            alibi_slopes, dropped, sinks=None, softcap=0.0):
    """The attention weights with their derivatives: P formed in torch operators (_explicit.py),
    where autograd or a transform must differentiate them; with dropout, the kernel's mask (the
    zeros of its weights `dropped`, drawn with the output's seed) applied and scaled by 1/(1-p)."""
    from ._explicit import dropout_keep, probabilities
    p = probabilities(query, key, attn_mask, is_causal, scale, enable_gqa, bottom_right, window, alibi_slopes, sinks,
                      softcap)
    if dropout_p > 0:
        p = p * dropout_keep(dropped, dropout_p, p.dtype)
    return p.to(query.dtype)


def _traced_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_seed,
                 causal_alignment, num_threads, need_weights, window, alibi_slopes, sinks, softcap=0.0,
                 k_descale=None, v_descale=None):
    from . import ops

    _check_alignment_and_mask(causal_alignment, attn_mask)
    # (one seed for both operators: the weights are those of the output's dropout mask)
    args = (float(dropout_p), bool(is_causal), None if scale is None else float(scale), bool(enable_gqa),
            ops.seed_tensor(dropout_seed, float(dropout_p)), causal_alignment == "bottom_right", *window,
            alibi_slopes, int(num_threads), softcap, sinks, k_descale, v_descale)
    if need_weights and not _needs_grad(query, key, value, attn_mask, sinks):
        return ops.sdpa_with_weights(query, key, value, attn_mask, *args)
    out, _ = ops.sdpa_train(query, key, value, attn_mask, *args)
    if not need_weights:
        return out
    dropped = None
    if dropout_p > 0:
        detached = (None if t is None else t.detach() for t in (query, key, value, attn_mask))
        dropped = ops.sdpa_with_weights(*detached, *args)[1]
    return out, _differentiable_weights(query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        causal_alignment == "bottom_right", window, alibi_slopes, dropped, sinks,
                                            softcap)


class MultiheadAttention:
    """torch.nn.MultiheadAttention on the fused kernel: the same arguments, parameter names,
    mask conventions (bool True = masked out) and results.

    `seed` sets the initialisation (PyTorch's scheme: xavier-uniform projections, zero biases) and
    the dropout stream. Like a PyTorch module it starts in training mode; call eval() for inference.

    `dtype` ("float32", "float64", "bfloat16" or "float16", or the numpy/torch dtype) is the
    parameters' dtype and so the inputs' and outputs'; `.to(dtype)` converts in place. float64
    computes in float64 throughout; bfloat16 and float16 compute in float32 and round the output
    and weights once. numpy has no bfloat16: bfloat16 modules take and
    return torch tensors, and their state_dict() is widened to float32.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, *, seed: Optional[int] = None,
                 dtype: Any = None):
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(value, (int, _np.integer)) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        self._m = _mha._Module(int(embed_dim), int(num_heads), float(dropout), bool(bias), bool(add_bias_kv),
                               bool(add_zero_attn), None if kdim is None else int(kdim),
                               None if vdim is None else int(vdim), bool(batch_first),
                               _new_seed() if seed is None else int(seed))
        self.dropout = float(dropout)
        self.bias = bool(bias)
        self.add_bias_kv = bool(add_bias_kv)
        self.add_zero_attn = bool(add_zero_attn)
        self.batch_first = bool(batch_first)
        if dtype is not None:
            self.to(dtype)

    embed_dim = property(lambda self: self._m.embed_dim)
    num_heads = property(lambda self: self._m.num_heads)
    head_dim = property(lambda self: self._m.head_dim)
    kdim = property(lambda self: self._m.kdim)
    vdim = property(lambda self: self._m.vdim)
    training = property(lambda self: self._m.training)
    dtype = property(lambda self: self._m.dtype, doc="The parameters' dtype: 'float32', 'float64', 'bfloat16' or 'float16'.")

    def to(self, dtype: Any) -> "MultiheadAttention":
        """Converts every parameter to `dtype` in place (rounding to nearest even), as torch's
        module.to(dtype) does; returns the module."""
        self._m.to(_dtype_name(dtype))
        return self

    def train(self, mode: bool = True) -> "MultiheadAttention":
        self._m.train(bool(mode))
        return self

    def eval(self) -> "MultiheadAttention":
        return self.train(False)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False, *, dropout_seed: Optional[int] = None,
                num_threads: int = 0) -> Tuple[Any, Optional[Any]]:
        """Returns (attn_output, attn_weights); attn_weights is None when need_weights is False.

        With torch inputs that require grad (and grad mode on), the call is recorded by autograd:
        loss.backward() fills the inputs' .grad, and this module's parameter gradients are left in
        `self.grad` (a dict of numpy arrays by parameter name). For a torch.nn.Module whose
        parameters receive .grad, use mha.nn.MultiheadAttention."""
        _auto_threading()
        if _transformed():
            return self._forward_transformed(query, key, value, key_padding_mask, need_weights, attn_mask,
                                             average_attn_weights, is_causal)
        if _needs_grad(query, key, value):
            return self._forward_autograd(query, key, value, key_padding_mask, need_weights, attn_mask,
                                          average_attn_weights, is_causal, dropout_seed, num_threads)
        out, weights = self._m.forward(
            _as_array(query, "query", once=True), _as_array(key, "key", once=True),
            _as_array(value, "value", once=True),
            _as_array(key_padding_mask, "key_padding_mask", allow_none=True, once=True), bool(need_weights),
            _as_array(attn_mask, "attn_mask", allow_none=True, once=True), bool(average_attn_weights), bool(is_causal),
            dropout_seed, int(num_threads))
        return _like(query, out), _like(query, weights)

    __call__ = forward

    def _forward_autograd(self, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal,
                          dropout_seed, num_threads):
        from .autograd import ModuleFunction
        torch = _torch()
        # The parameters enter autograd as leaf tensors (copies): their .grad is this call's gradient.
        params = [(name, _tensor_of(value).requires_grad_()) for name, value in self._m.parameters()]
        # The backward reads these copies (saved for it), so it uses the values the forward ran with.
        flags = (bool(need_weights), bool(average), bool(is_causal), dropout_seed, int(num_threads))
        out, weights = ModuleFunction.apply(
            self._m, [name for name, _ in params], flags, query, key, value,
            _as_array(key_padding_mask, "key_padding_mask", allow_none=True),
            _as_array(attn_mask, "attn_mask", allow_none=True), *[t for _, t in params])
        self._grad_holders = dict(params)
        return out, weights

    def _forward_transformed(self, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal):
        """Under torch.func transforms (of the inputs; the parameters are constants): the module's
        steps as torch operators around the SDPA kernel, as mha.nn.MultiheadAttention's."""
        from .nn import _call, _composed
        options = _call.Options(self.embed_dim, self.num_heads, self.dropout, self.bias, self.add_bias_kv,
                                self.add_zero_attn, self.kdim, self.vdim, self.batch_first)
        params = {name: _tensor_of(value) for name, value in self._m.parameters()}
        return _composed.run(options, params, self.training, query, key, value, key_padding_mask, need_weights,
                             attn_mask, average, is_causal)

    @property
    def grad(self) -> Dict[str, _np.ndarray]:
        """Parameter gradients accumulated by backward passes through autograd calls (bfloat16 ones
        widened to float32, as numpy has no bfloat16)."""
        holders = getattr(self, "_grad_holders", {})
        bf16 = _torch().bfloat16 if holders else None
        return {name: (t.grad.float() if t.grad.dtype == bf16 else t.grad).numpy()
                for name, t in holders.items() if t.grad is not None}

    def state_dict(self) -> Dict[str, _np.ndarray]:
        """Parameters by PyTorch's names, as numpy arrays (copies); bfloat16 ones widened to float32."""
        state = dict(self._m.parameters())
        if self.dtype == "bfloat16":  # they came back as their bits
            state = {name: (a.astype(_np.uint32) << 16).view(_np.float32) for name, a in state.items()}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Copies values in from numpy arrays or torch tensors, checking names and shapes."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        arrays = {}
        for name, value in state_dict.items():
            if _is_torch(value):  # numpy has no bfloat16: widened (exactly), converted back by the module
                value = value.detach().cpu()
                value = (value.float() if value.dtype == _torch().bfloat16 else value).contiguous()
            arrays[name] = _as_array(value, f"state_dict['{name}']")
        self._m.load_state_dict(arrays, bool(strict))

    @classmethod
    def from_torch(cls, module) -> "MultiheadAttention":
        """A module with the options, weights and training mode of a torch.nn.MultiheadAttention."""
        torch = _torch()
        if torch is None or not isinstance(module, torch.nn.MultiheadAttention):
            raise TypeError(f"module: expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
        weight = module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight
        m = cls(module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
                add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn, kdim=module.kdim,
                vdim=module.vdim, batch_first=module.batch_first, dtype=weight.dtype)
        m.load_state_dict(module.state_dict())
        m.train(module.training)
        return m

    # copy.deepcopy and pickle: the options, dtype, training mode and parameters travel (the
    # parameters in float32, which holds every bfloat16/float16 value exactly); the copy draws its
    # own dropout masks, and gradients of earlier calls (`grad`) stay with the original.
    def __getstate__(self) -> Dict[str, Any]:
        options = (self.embed_dim, self.num_heads, self.dropout, self.bias, self.add_bias_kv, self.add_zero_attn,
                   self.kdim, self.vdim, self.batch_first)
        parameters = {name: a.astype(_np.float32) for name, a in self.state_dict().items()}
        return {"options": options, "dtype": self.dtype, "training": self.training, "parameters": parameters}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(*state["options"], dtype=state["dtype"])
        self.load_state_dict(state["parameters"])
        self.train(state["training"])

    def __repr__(self) -> str:
        return (f"mha.MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, bias={self.bias}, add_bias_kv={self.add_bias_kv}, "
                f"add_zero_attn={self.add_zero_attn}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}" + ("" if self.dtype == "float32" else f", dtype={self.dtype}") + ")")


def __getattr__(name: str):
    """`mha.nn` and `mha.patch_torch_sdpa` (which need torch) are imported on first use."""
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    if name == "patch_torch_sdpa":
        from .torch_sdpa import patch_torch_sdpa
        return patch_torch_sdpa
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


if "torch" in _sys.modules:  # the custom operators, registered before anything is compiled
    try:
        from . import ops as _ops  # noqa: E402,F401
    except ImportError:  # torch < 2.4: numpy and eager torch calls still work
        pass
