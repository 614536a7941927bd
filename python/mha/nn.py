"""mha.nn.MultiheadAttention: a torch.nn.Module with the parameters, names, initialisation and
forward signature of torch.nn.MultiheadAttention, computed by the fused C++ kernels forward and
backward. A drop-in replacement inside a PyTorch model on the CPU:

    attn = mha.nn.MultiheadAttention(512, 8, batch_first=True)
    attn.load_state_dict(torch_attn.state_dict())
    out, w = attn(x, x, x)
    out.sum().backward()          # fills attn.in_proj_weight.grad, ..., and x.grad

Parameters may be float32, bfloat16 or float16 (`dtype=` or `.to(dtype)`, as in PyTorch); the
inputs must then be of that dtype. bfloat16/float16 compute in float32 and round the output, the
weights and the gradients once to the module's dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from . import _mha, _auto_threading, _compiling
from . import ops as _ops
from .autograd import ModuleFunction, _tensor

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: only 'cpu' is supported, got {device!r}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
        dtype = dtype or torch.float32
        # The C++ module validates the options and runs the kernels on this module's parameters,
        # which it reads in place at every call (forward_with); it holds none of its own.
        self._impl_options = (int(embed_dim), int(num_heads), float(dropout), bool(bias), bool(add_bias_kv),
                              bool(add_zero_attn), kdim, vdim, bool(batch_first))
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
        return _mha._Module(*self._impl_options, 0, own_parameters=False)

    # copy.deepcopy, pickle and torch.save(module): the C++ module holds nothing but the options
    # (the parameters are this module's tensors; its dtype and training mode are set at each call),
    # so it is left out of the state and built again from the options.
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_impl", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._impl = self._new_impl()

    def _traced(self, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal):
        """Under torch.compile / torch.export: one graph node, the custom operator
        mha::multihead_attention with nothing to differentiate, else mha::multihead_attention_train
        (whose gradient is the node mha::multihead_attention_backward)."""
        params = self._checked_parameters()
        dropout_p = self.dropout if self.training else 0.0
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *params.values()))
        op = _ops.multihead_attention_train if training else _ops.multihead_attention
        out, weights, *_ = op(
            query, key, value, key_padding_mask, attn_mask, list(params.values()), ",".join(params),
            [self.embed_dim, self.num_heads, self.kdim, self.vdim], self.dropout,
            [self.in_proj_bias is not None, self.bias_k is not None, self.add_zero_attn, self.batch_first,
             self.training], bool(need_weights), bool(average), bool(is_causal), _ops.seed_tensor(None, dropout_p))
        return out, weights if need_weights else None

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

    def _checked_parameters(self):
        """The parameters by name, all of one supported dtype."""
        params = dict(self.named_parameters())
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise ValueError("parameters: expected one dtype among torch.float32, torch.bfloat16 and torch.float16, "
                             f"got {sorted(str(d) for d in dtypes)}")
        return params

    def _parameters_for_call(self):
        """The parameters a call reads where they are, by name; the C++ module takes their dtype
        (after a .to(dtype)) and this module's training mode."""
        params = self._checked_parameters()
        dtype = _DTYPES[next(iter(params.values())).dtype]
        if self._impl.dtype != dtype:
            self._impl.to(dtype)
        if self._impl.training != self.training:  # (no write while another thread may be computing)
            self._impl.train(self.training)
        return params

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if _compiling():
            return self._traced(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                is_causal)
        _auto_threading()
        params = self._parameters_for_call()
        seed = int(torch.randint(0, 2**62, (1,)).item()) if self.training and self.dropout > 0 else None
        flags = (bool(need_weights), bool(average_attn_weights), bool(is_causal), seed, 0)
        tensors = (query, key, value, *params.values())
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            # Nothing to differentiate (inference, or a module and inputs all frozen): no
            # activations saved for a backward that will not come.
            out, weights = self._impl.forward(query.detach(), key.detach(), value.detach(),
                                              None if key_padding_mask is None else key_padding_mask.detach(),
                                              flags[0], None if attn_mask is None else attn_mask.detach(),
                                              flags[1], flags[2], seed, 0,
                                              {name: p.detach() for name, p in params.items()})
            return _tensor(out), None if weights is None else _tensor(weights)
        return ModuleFunction.apply(self._impl, list(params), flags, query, key, value, key_padding_mask, attn_mask,
                                    *params.values())
