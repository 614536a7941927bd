"""mha.nn.MultiheadAttention: a torch.nn.Module with the parameters, names, initialisation and
forward signature of torch.nn.MultiheadAttention, computed by the fused C++ kernels forward and
backward. A drop-in replacement inside a PyTorch model on the CPU:

    attn = mha.nn.MultiheadAttention(512, 8, batch_first=True)
    attn.load_state_dict(torch_attn.state_dict())
    out, w = attn(x, x, x)
    out.sum().backward()          # fills attn.in_proj_weight.grad, ..., and x.grad

The returned weights are differentiable, as PyTorch's are (a loss may supervise them); a float
mask that requires grad (a learned bias) gets its gradient; backward(retain_graph=True), activation
checkpointing and torch.compile work as with PyTorch's module. A second-order gradient through it
(create_graph=True, then a backward of that gradient) runs the call again as torch operators around
the attention kernel; with dropout in training it is an error.

Jagged nested tensors [B, j, E] (layout=torch.jagged; batch_first modules) are taken as query, key
and value: each sequence attends to its own keys in the varlen kernel, without padding, and the
output is nested (need_weights=False; no masks, no bias_k/bias_v or zero key).

Parameters may be float32, float64, bfloat16 or float16 (`dtype=` or `.to(dtype)`, as in
PyTorch); the inputs must then be of that dtype. float64 computes in float64 throughout, so that
torch.autograd.gradcheck works on models that hold the module. bfloat16 on a CPU with bfloat16
products (mha.bfloat16_products(): AVX512-BF16 or AMX) runs in them and rounds where PyTorch's
bf16 module rounds (each projection, the attention output, each product of the backward) in
training, and in inference of more than 32 queries without the weights; other calls, bfloat16
elsewhere and float16 everywhere compute in float32 and round the output, the weights and the
gradients once to the module's dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from . import _call
from . import functional  # noqa: F401  (mha.nn.functional, as torch.nn.functional)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: only 'cpu' is supported, got {device!r}")
        if dtype is not None and dtype not in _call.DTYPES:
            raise ValueError(f"dtype: expected torch.float32, torch.float64, torch.bfloat16 or torch.float16, got {dtype}")
        dtype = dtype or torch.float32
        # The C++ module validates the options and runs the kernels on this module's parameters,
        # which it reads in place at every call (forward_with); it holds none of its own.
        self._impl_options = _call.Options(int(embed_dim), int(num_heads), float(dropout), bool(bias),
                                           bool(add_bias_kv), bool(add_zero_attn), kdim, vdim, bool(batch_first))
        self._impl = self._new_impl()
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.kdim, self.vdim = self._impl.kdim, self._impl.vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first, self.add_zero_attn = float(dropout), bool(batch_first), bool(add_zero_attn)
        self.head_dim = self.embed_dim // self.num_heads
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * E, E, dtype=dtype))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(E, E, dtype=dtype))
            self.k_proj_weight = nn.Parameter(torch.empty(E, self.kdim, dtype=dtype))
            self.v_proj_weight = nn.Parameter(torch.empty(E, self.vdim, dtype=dtype))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * E, dtype=dtype))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(E, E, bias=bias, dtype=dtype)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, E, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty(1, 1, E, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None  # plain attributes, as in PyTorch
        self._reset_parameters()

    def _new_impl(self):
        return self._impl_options.new_impl()

    # copy.deepcopy, pickle and torch.save(module): the C++ module holds nothing but the options
    # (the parameters are this module's tensors; its dtype and training mode are set at each call),
    # so it is left out of the state and built again from the options.
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_impl", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._impl_options = _call.Options(*self._impl_options)  # (a plain tuple in older pickles)
        self._impl = self._new_impl()

    def _reset_parameters(self):
        """PyTorch's initialisation: xavier-uniform projections, zero biases, xavier-normal bias_k/v."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiheadAttention":
        """A module with the options and training mode of `module`, holding its very parameters
        (the same torch.nn.Parameter objects: an optimizer built over them keeps working, and
        either module sees the other's updates)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module: expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
        dtype = module.out_proj.weight.dtype
        ours = cls(module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
                   add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn, kdim=module.kdim,
                   vdim=module.vdim, batch_first=module.batch_first, device="cpu",
                   dtype=dtype if dtype in _call.DTYPES else None)
        for name, param in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            setattr(ours.get_submodule(owner) if owner else ours, leaf, param)
        return ours.train(module.training)

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """torch.nn.MultiheadAttention.merge_masks, which TransformerEncoderLayer's inference fast
        path calls (then PyTorch's fused kernel runs on this module's parameters; with
        torch.backends.mha.set_fastpath_enabled(False) the layer calls this module instead).
        Returns (mask, type): key_padding_mask alone is type 1; with attn_mask ([L, L] or
        [N * H, L, L]) both become [N, H, L, L], added, type 2."""
        if attn_mask is None:
            return key_padding_mask, None if key_padding_mask is None else 1
        batch, length = query.shape[0], query.shape[1]
        if attn_mask.dim() == 3:
            merged = attn_mask.view(batch, -1, length, length)
        else:
            merged = attn_mask.view(1, 1, length, length).expand(batch, self.num_heads, -1, -1)
        if key_padding_mask is not None:
            merged = merged + key_padding_mask.view(batch, 1, 1, length).expand(-1, self.num_heads, -1, -1)
        return merged, 2

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return _call.run(self._current_impl(), self._impl_options, dict(self.named_parameters()), self.training,
                         query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                         is_causal)

    def _current_impl(self):
        """The C++ module, built again where the attributes PyTorch's module reads at each call
        (dropout, batch_first, add_zero_attn) were changed since."""
        o = self._impl_options
        if (self.dropout, self.batch_first, self.add_zero_attn) != (o.dropout, o.batch_first, o.add_zero_attn):
            self._impl_options = o._replace(dropout=float(self.dropout), batch_first=bool(self.batch_first),
                                            add_zero_attn=bool(self.add_zero_attn))
            self._impl = self._new_impl()
        return self._impl


def replace_attention(model: nn.Module) -> nn.Module:
    """Every torch.nn.MultiheadAttention inside `model` (its own class, not a subclass) replaced in
    place by an mha.nn.MultiheadAttention holding the same parameters (from_torch); returns
    `model` (itself replaced when it is one)."""
    if type(model) is nn.MultiheadAttention:
        return MultiheadAttention.from_torch(model)
    for name, child in list(model.named_modules()):
        if type(child) is nn.MultiheadAttention:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, MultiheadAttention.from_torch(child))
    return model
