"""mha.scaled_dot_product_attention inside torch.compile and torch.export: one graph node (the
custom operator mha::sdpa_train), no graph break, the same results and gradients as eager."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from mha import ops


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 11])


def test_custom_operators_pass_opcheck(rng):
    """PyTorch's own checks of a custom operator: schema, autograd registration, fake (meta)
    implementation against the real one, and AOT dispatch with dynamic shapes."""
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(grad)

    seed = ops.seed_tensor(int(rng.integers(2**64, dtype=np.uint64)), 0.3)
    cases = [
        (t(2, 4, 9, 16), t(2, 2, 11, 16), t(2, 2, 11, 12), t(9, 11), 0.3, False, 0.3, True, seed, False, 0),
        (t(2, 4, 9, 16, dtype=torch.bfloat16), t(2, 4, 11, 16, dtype=torch.bfloat16, grad=False),
         t(2, 4, 11, 16, dtype=torch.bfloat16), None, 0.0, True, None, False, seed, True, 0),
        (t(3, 5, 8), t(3, 7, 8), t(3, 7, 8, grad=False), t(5, 7, grad=False) > 0, 0.0, False, None, False, seed,
         False, 1),
    ]
    for args in cases:
        result = torch.library.opcheck(torch.ops.mha.sdpa_train.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_sdpa_compiles_into_one_graph(rng):
    """fullgraph=True (a graph break would raise): outputs and gradients as eager mha computes them
    (the same kernels: the same bits) and within float32 rounding of PyTorch's SDPA."""
    for _ in range(6):
        B, Hkv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
        L, S, D = int(rng.integers(1, 20)), int(rng.integers(1, 20)), int(rng.choice([8, 16, 24]))
        q, k, v = (torch.from_numpy(rng.standard_normal(s)).float().requires_grad_()
                   for s in ((B, Hkv * group, L, D), (B, Hkv, S, D), (B, Hkv, S, D + 4)))
        mask = torch.from_numpy(rng.standard_normal((L, S))).float().requires_grad_() if rng.random() < 0.5 else None
        causal = mask is None and L <= S and bool(rng.random() < 0.5)
        seed = int(rng.integers(2**63))
        dropout = 0.25 if rng.random() < 0.3 else 0.0
        g = torch.from_numpy(rng.standard_normal((B, Hkv * group, L, D + 4))).float()

        def loss(q, k, v, mask):
            out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                                   dropout_p=dropout, dropout_seed=seed)
            return (out * g).sum(), out

        torch._dynamo.reset()
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        leaves = [q, k, v] + ([mask] if mask is not None else [])
        (c_loss, c_out), (e_loss, e_out) = compiled(q, k, v, mask), loss(q, k, v, mask)
        assert torch.equal(c_out, e_out)
        for a, b in zip(torch.autograd.grad(c_loss, leaves), torch.autograd.grad(e_loss, leaves)):
            assert torch.equal(a, b)
        if dropout == 0:
            ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                 attn_mask=mask, is_causal=causal)
            assert (c_out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_compiled_dropout_draws_a_fresh_mask_per_call(rng):
    q = torch.from_numpy(rng.standard_normal((1, 2, 16, 8))).float()
    torch._dynamo.reset()
    f = torch.compile(lambda q: mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5), backend="aot_eager",
                      fullgraph=True)
    assert not torch.equal(f(q), f(q))
    seeded = torch.compile(lambda q: mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5, dropout_seed=2**64 - 3),
                           backend="aot_eager", fullgraph=True)
    assert torch.equal(seeded(q), mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5, dropout_seed=2**64 - 3))


def test_export_holds_the_operator(rng):
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return mha.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 7, 8))).float() for _ in range(3))
    exported = torch.export.export(Attention(), (q, k, v))
    assert torch.ops.mha.sdpa_train.default in {n.target for n in exported.graph.nodes}
    assert torch.equal(exported.module()(q, k, v), mha.scaled_dot_product_attention(q, k, v, is_causal=True))
