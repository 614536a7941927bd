"""mha.scaled_dot_product_attention and mha.nn.MultiheadAttention inside torch.compile and
torch.export: one graph node each (the custom operators of mha/ops.py), no graph break, the same
results and gradients as eager."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from mha import ops
from torch._dynamo.backends.registry import lookup_backend


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 11])


def _expect_fake_like_real(op, args):
    """The fake implementation's outputs have the real outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake_of(mode, x):
        if isinstance(x, torch.Tensor):
            return mode.from_tensor(x)
        return [fake_of(mode, y) for y in x] if isinstance(x, list) else x

    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*[fake_of(mode, a) for a in args])
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype), (r.shape, r.dtype, f.shape, f.dtype)


def test_custom_operators_pass_opcheck(rng):
    """PyTorch's own checks of a custom operator: schema, autograd registration, fake (meta)
    implementation against the real one, and AOT dispatch with dynamic shapes."""
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(grad)

    seed = ops.seed_tensor(int(rng.integers(2**64, dtype=np.uint64)), 0.3)
    cases = [
        (t(2, 4, 9, 16), t(2, 2, 11, 16), t(2, 2, 11, 12), t(9, 11), 0.3, False, 0.3, True, seed, False, -1, -1, None,
         0),
        (t(2, 4, 9, 16, dtype=torch.bfloat16), t(2, 4, 11, 16, dtype=torch.bfloat16, grad=False),
         t(2, 4, 11, 16, dtype=torch.bfloat16), None, 0.0, True, None, False, seed, True, -1, -1,
         torch.tensor([0.5, 0.25, 0.125, 0.0625]), 0),  # (ALiBi's slopes)
        (t(3, 5, 8), t(3, 7, 8), t(3, 7, 8, grad=False), t(5, 7, grad=False) > 0, 0.0, False, None, False, seed,
         False, 3, 1, None, 1),  # (a sliding window of (3, 1))
        # batch dimensions that broadcast: keys and values shared across a batch, one key/value
        # head for every query head, a 5-D query; grouped heads with a value-only batch dimension
        (t(2, 3, 4, 9, 16), t(4, 11, 16), t(1, 1, 11, 12), t(3, 1, 9, 11), 0.0, True, None, False, seed, False, -1, -1,
         t(3, 4, grad=False), 0),  # (slopes per second batch dimension and head, shared along the first)
        (t(1, 4, 9, 16), t(2, 11, 16), t(3, 2, 11, 8), None, 0.0, False, None, True, seed, False, -1, -1, None, 0),
    ]
    for args in cases:
        result = torch.library.opcheck(torch.ops.mha.sdpa_train.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result
        _expect_fake_like_real(torch.ops.mha.sdpa_train.default, args)


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


def test_sdpa_with_weights_compiles_into_one_graph(rng):
    """need_weights=True under fullgraph=True: the weights from mha::sdpa_with_weights (the same
    dropout mask as the output's), output, weights and gradients with the eager bits; the
    operator passes opcheck, its fake shapes those of the real outputs."""
    for n in range(4):
        dtype = torch.bfloat16 if n == 3 else torch.float32
        # n == 0 draws fresh masks and checks they differ: at least 4 x 4 scores per head (64 draws
        # at p = 0.3) make an identical mask by chance about 1e-15 likely (at 1 x 1 it was 1 in 9)
        low = 4 if n == 0 else 1
        B, H, L, S, D = 2, 2, int(rng.integers(low, 12)), int(rng.integers(low, 12)), 8
        grad = n % 2 == 0
        q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_(grad)
                   for s in ((B, H, L, D), (B, H, S, D), (B, H, S, D + 4)))
        mask = torch.from_numpy(rng.standard_normal((L, S))).float() if n == 1 else None
        seed, dropout = int(rng.integers(2**63)), 0.3 if n < 3 else 0.0

        def call(q, k, v):
            return mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, dropout_seed=seed,
                                                    is_causal=n == 2, need_weights=True)

        torch._dynamo.reset()
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
        (out, weights), (e_out, e_weights) = compiled(q, k, v), call(q, k, v)
        assert torch.equal(out, e_out) and torch.equal(weights, e_weights) and weights.dtype == dtype
        if n == 0:  # a fresh seed per call, the same one for the output and the weights
            seed, fixed = None, seed
            fresh_out, fresh_weights = compiled(q, k, v)
            assert not torch.equal(fresh_out, e_out)
            assert torch.allclose(fresh_out, fresh_weights @ v, rtol=1e-5, atol=1e-5)
            seed = fixed
        if grad:
            g = torch.from_numpy(rng.standard_normal(out.shape)).to(dtype)
            for a, b in zip(torch.autograd.grad((out * g).sum(), (q, k, v)),
                            torch.autograd.grad((e_out * g).sum(), (q, k, v))):
                assert torch.equal(a, b)
        args = (q.detach(), k.detach(), v.detach(), mask, dropout, n == 2, None, False, ops.seed_tensor(seed, dropout),
                False, -1, 2 if n == 1 else -1, torch.tensor([0.5, 0.25]) if n == 2 else None, 0)
        result = torch.library.opcheck(torch.ops.mha.sdpa_with_weights.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result
        _expect_fake_like_real(torch.ops.mha.sdpa_with_weights.default, args)


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


def _module_case(rng):
    batch_first, batched = bool(rng.random() < 0.5), bool(rng.random() < 0.8)
    kdim = int(rng.integers(3, 9)) if rng.random() < 0.4 else None
    options = dict(batch_first=batch_first, kdim=kdim, vdim=kdim, add_bias_kv=bool(rng.random() < 0.3),
                   add_zero_attn=bool(rng.random() < 0.3), bias=bool(rng.random() < 0.8))
    N, L, S = int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(1, 9))

    def seq(length, width):
        shape = ((N, length) if batch_first else (length, N)) if batched else (length,)
        return torch.from_numpy(rng.standard_normal((*shape, width))).float()

    q, k, v = seq(L, 16), seq(S, kdim or 16), seq(S, kdim or 16)
    kpm = torch.from_numpy(rng.random((N, S) if batched else (S,)) < 0.3) if rng.random() < 0.5 else None
    if kpm is not None:
        kpm[..., 0] = False  # key 0 stays visible
    mask = torch.from_numpy(rng.standard_normal((L, S))).float() if rng.random() < 0.4 else None
    return options, (q, k, v), dict(key_padding_mask=kpm, attn_mask=mask, need_weights=bool(rng.random() < 0.6),
                                    average_attn_weights=bool(rng.random() < 0.5))


def test_module_inference_compiles_into_one_graph(rng):
    """mha.nn.MultiheadAttention with nothing to differentiate: one node, mha::multihead_attention,
    with the eager call's bits (output and weights), batched or not, with masks, bias_kv, zero_attn,
    kdim/vdim, and in bfloat16."""
    for n in range(8):
        options, inputs, call = _module_case(rng)
        dtype = torch.bfloat16 if n % 4 == 3 else torch.float32
        m = mha.nn.MultiheadAttention(16, 2, dtype=dtype, **options).eval()
        inputs = [t.to(dtype) for t in inputs]
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: m(q, k, v, **call), backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            (out, weights), (e_out, e_weights) = compiled(*inputs), m(*inputs, **call)
        assert torch.equal(out, e_out), (options, call)
        assert (weights is None) == (e_weights is None) and (weights is None or torch.equal(weights, e_weights))
        # PyTorch's checks of the operator, its fake implementation's shapes against the real ones
        # included (with the weights, averaged or not).
        args = (*inputs, call["key_padding_mask"], call["attn_mask"], list(m.parameters()),
                ",".join(name for name, _ in m.named_parameters()), [16, 2, m.kdim, m.vdim], 0.0,
                [options["bias"], options["add_bias_kv"], options["add_zero_attn"], options["batch_first"], False],
                True, n % 2 == 0, False, ops.seed_tensor(0, 0.0))
        with torch.no_grad():
            result = torch.library.opcheck(torch.ops.mha.multihead_attention.default, args)
            assert all(v == "SUCCESS" for v in result.values()), (result, options)
            _expect_fake_like_real(torch.ops.mha.multihead_attention.default, args)


def test_module_dropout_under_compile_draws_fresh_masks(rng):
    m = mha.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True).train()
    x = torch.from_numpy(rng.standard_normal((2, 9, 16))).float()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: m(x, x, x, need_weights=False)[0], backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert not torch.equal(compiled(x), compiled(x))
        m.eval()
        torch._dynamo.reset()
        assert torch.equal(compiled(x), m(x, x, x, need_weights=False)[0])


def test_module_float_masks_get_their_gradients_under_compile(rng):
    """A float mask that requires grad (a learned bias: T5's relative positions, Swin's windows) is
    differentiated by the module's graph node as in eager mode: the same bits, for a 2-D and a 3-D
    attn_mask, a float key_padding_mask, both at once, and a bfloat16 mask of a bfloat16 module
    (its gradient in bfloat16, as PyTorch returns a mask's gradient in the mask's dtype)."""
    N, H, L, S = 2, 2, 5, 6
    cases = [("2-D", torch.float32), ("3-D", torch.float32), ("padding", torch.float32), ("both", torch.float32),
             ("2-D", torch.bfloat16)]
    for kind, dtype in cases:
        m = mha.nn.MultiheadAttention(16, H, batch_first=True, dtype=dtype)
        x = torch.from_numpy(rng.standard_normal((N, L, 16))).to(dtype).requires_grad_()
        kv = torch.from_numpy(rng.standard_normal((N, S, 16))).to(dtype)
        mask_shape = (L, S) if kind in ("2-D", "both") else (N * H, L, S)
        attn_mask = torch.from_numpy(rng.standard_normal(mask_shape)).to(dtype) if kind != "padding" else None
        padding = torch.from_numpy(rng.standard_normal((N, S))).to(dtype) if kind in ("padding", "both") else None
        leaves = [t.requires_grad_() for t in (x, attn_mask, padding) if t is not None]
        grad = torch.from_numpy(rng.standard_normal((N, L, 16))).to(dtype)

        def loss(x, attn_mask, padding):
            out, _ = m(x, kv, kv, attn_mask=attn_mask, key_padding_mask=padding, need_weights=False)
            return (out.float() * grad.float()).sum()

        torch._dynamo.reset()
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(x, attn_mask, padding), leaves)
        expected = torch.autograd.grad(loss(x, attn_mask, padding), leaves)
        for a, b in zip(got, expected):
            assert a.dtype == dtype and torch.equal(a, b), (kind, dtype)
        # Some gradient reaches every mask entry (none is masked out here).
        assert all(bool((g != 0).any()) for g in got), (kind, dtype)


def test_module_training_compiles_into_one_graph(rng):
    """mha.nn.MultiheadAttention with gradients to compute: one node, mha::multihead_attention_train,
    whose backward node rebuilds the C++ context from the saved activations; the output, the
    weights and every gradient (inputs and parameters that need one, frozen ones left out; with
    the weights in the loss or not) have the eager call's bits, in float32, float64 and bfloat16."""
    for n in range(8):
        options, inputs, call = _module_case(rng)
        dtype = torch.bfloat16 if n % 4 == 3 else torch.float64 if n % 4 == 1 else torch.float32
        m = mha.nn.MultiheadAttention(16, 2, dtype=dtype, **options).train()
        for p in m.parameters():
            p.requires_grad_(bool(rng.random() < 0.7))
        self_attention = n % 3 == 0 and inputs[0].shape == inputs[1].shape  # (then L = S, no kdim)
        inputs = [t.to(dtype).requires_grad_(bool(rng.random() < 0.6)) for t in inputs]
        if self_attention:
            inputs = [inputs[0]] * 3
        grad = torch.from_numpy(rng.standard_normal(inputs[0].shape)).to(dtype)

        def step(q, k, v):
            out, weights = m(q, k, v, **call)
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            loss = (out.to(wide) * grad).sum()
            if weights is not None and n % 2 == 0:  # a loss of the weights too (they are differentiable)
                loss = loss + (weights.to(wide) ** 2).sum()
            return loss, out, weights

        torch._dynamo.reset()
        traced = set()

        def backend(graph, example_inputs):
            traced.update(node.target for node in graph.graph.nodes)
            return lookup_backend("aot_eager")(graph, example_inputs)

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        (c_loss, c_out, c_w), (e_loss, e_out, e_w) = compiled(*inputs), step(*inputs)
        training = any(t.requires_grad for t in [*inputs, *m.parameters()])
        op = torch.ops.mha.multihead_attention_train if training else torch.ops.mha.multihead_attention
        assert op.default in traced or op in traced, traced
        assert torch.equal(c_out, e_out), (options, call)
        assert (c_w is None) == (e_w is None) and (c_w is None or torch.equal(c_w, e_w))
        assert c_w is None or c_w.requires_grad == e_w.requires_grad  # (differentiable, as in eager mode)
        leaves = list({id(t): t for t in [*inputs, *m.parameters()] if t.requires_grad}.values())
        if not leaves:
            continue
        for a, b in zip(torch.autograd.grad(c_loss, leaves), torch.autograd.grad(e_loss, leaves)):
            assert torch.equal(a, b), (n, options, call)


def test_module_training_operator(rng):
    """mha::multihead_attention_train by itself: PyTorch's operator checks (autograd registration,
    fake shapes against the real ones, AOT dispatch), and with dropout the gradients of the eager
    autograd function for the same seed (the seed reaches the rebuilt context); float32, and
    float64 (whose activations are float64)."""
    for n in range(4):
        options, inputs, call = _module_case(rng)
        dtype = torch.float64 if n == 3 else torch.float32
        m = mha.nn.MultiheadAttention(16, 2, dropout=0.3, dtype=dtype, **options).train()
        inputs = [t.to(dtype).requires_grad_() for t in inputs]
        call = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in call.items()}
        seed = int(rng.integers(2**62))
        names = ",".join(name for name, _ in m.named_parameters())
        args = (*inputs, call["key_padding_mask"], call["attn_mask"], list(m.parameters()), names,
                [16, 2, m.kdim, m.vdim], 0.3,
                [options["bias"], options["add_bias_kv"], options["add_zero_attn"], options["batch_first"], True],
                call["need_weights"], call["average_attn_weights"], False, ops.seed_tensor(seed, 0.3))
        result = torch.library.opcheck(torch.ops.mha.multihead_attention_train.default, args)
        assert all(v == "SUCCESS" for v in result.values()), (result, options)
        _expect_fake_like_real(torch.ops.mha.multihead_attention_train.default, args)

        out = torch.ops.mha.multihead_attention_train(*args)[0]
        grad = torch.from_numpy(rng.standard_normal(out.shape)).to(dtype)
        leaves = [*inputs, *m.parameters()]
        got = torch.autograd.grad((out * grad).sum(), leaves)
        m._impl.to(str(dtype).removeprefix("torch."))  # (a call through the module sets it)
        e_out, _ = mha.autograd.ModuleFunction.apply(
            m._impl, [name for name, _ in m.named_parameters()],
            (call["need_weights"], call["average_attn_weights"], False, seed, 0), *inputs,
            call["key_padding_mask"], call["attn_mask"], *m.parameters())
        assert torch.equal(out, e_out)
        for a, b in zip(got, torch.autograd.grad((e_out * grad).sum(), leaves)):
            assert torch.equal(a, b)
