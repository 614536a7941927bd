"""mha.patch_torch_sdpa(): torch.nn.functional.scaled_dot_product_attention computed by mha's
fused kernel, for models that call PyTorch's function and cannot be edited (Hugging Face
transformers' "sdpa" attention, torch.nn.MultiheadAttention itself, timm, ...):

    with mha.patch_torch_sdpa():
        logits = model(input_ids)      # every CPU call of F.scaled_dot_product_attention is ours

    patch = mha.patch_torch_sdpa()     # or for the rest of the program (patch.restore() undoes it)

Jagged nested tensors ([B, H, j, D], layout=torch.jagged, no mask) run the varlen kernel
(mha.varlen_attention): each sequence its own attention, no padding. Calls the kernel cannot
take (a device other than the CPU, strided nested or float64 tensors, more than six dimensions, a
mask of another dtype) go to PyTorch's function unchanged. Code that bound
the function under another name before the patch (`from torch.nn.functional import
scaled_dot_product_attention`) keeps PyTorch's. Dropout draws its seed from torch's generator,
so torch.manual_seed makes it repeatable; the masks differ from PyTorch's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _autocast, _autocast_dtype
from . import scaled_dot_product_attention as _mha_sdpa

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)


def _ours(query, key, value, attn_mask) -> bool:
    """Whether mha's kernel takes this call (else PyTorch's function runs it)."""
    for t in (query, key, value):
        if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
                and not t.is_nested and t.dtype == query.dtype and 2 <= t.dim() <= 6):
            return False
    if query.dtype not in _DTYPES:
        return False
    return attn_mask is None or (isinstance(attn_mask, torch.Tensor) and attn_mask.device.type == "cpu"
                                 and attn_mask.layout == torch.strided and not attn_mask.is_nested
                                 and attn_mask.dtype in _MASK_DTYPES)


def _ours_nested(query, key, value, attn_mask) -> bool:
    """Whether mha's varlen kernel takes a call on jagged nested tensors [B, H, j, D] (PyTorch's
    CPU build runs those only in its unfused math path, and by default finds no backend)."""
    for t in (query, key, value):
        if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged and t.device.type == "cpu"
                and t.dtype == query.dtype and t.dim() == 4 and t._ragged_idx == 2):
            return False
    return query.dtype in _DTYPES and attn_mask is None


class patch_torch_sdpa:  # noqa: N801 - used like a function: mha.patch_torch_sdpa()
    """Replaces torch.nn.functional.scaled_dot_product_attention until restore() (or the end of
    a with block), which puts back what was there before, so patches nest."""

    def __init__(self):
        self._replaced = F.scaled_dot_product_attention
        original = self._replaced

        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            autocast = _autocast_dtype()
            if autocast is not None:  # (inputs of mixed dtypes that autocast makes one)
                query, key, value, attn_mask = _autocast(autocast, query, key, value, attn_mask)
            if not (_ours(query, key, value, attn_mask) or _ours_nested(query, key, value, attn_mask)):
                extra = {"enable_gqa": True} if enable_gqa else {}  # (older torch has no such argument)
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, **extra)
            seed = int(torch.randint(0, 2**62, ()).item()) if dropout_p > 0 and not torch.compiler.is_compiling() else None
            return _mha_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa, dropout_seed=seed)

        scaled_dot_product_attention.__doc__ = ("torch.nn.functional.scaled_dot_product_attention on mha's fused "
                                                "kernel (mha.patch_torch_sdpa); PyTorch's for calls it cannot take.")
        self._function = scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention

    def restore(self) -> None:
        """PyTorch's function (or the one this patch replaced) back in place."""
        if F.scaled_dot_product_attention is self._function:
            F.scaled_dot_product_attention = self._replaced

    def __enter__(self) -> "patch_torch_sdpa":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
