"""The weights scaled_dot_product_attention(need_weights=True) returns are differentiable (a loss
of them reaches the inputs, as with the module's), eagerly, under torch.func and compiled, against
a float64 reference from the formula, on fresh random inputs (the parity seed, printed)."""

import math

import pytest
import torch

import mha

torch_func = torch.func

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


@pytest.fixture
def gen(parity_seed):
    return torch.Generator().manual_seed(parity_seed)


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def reference(q, k, v, mask=None, is_causal=False, bottom_right=False, enable_gqa=False, keep=None, p=0.0):
    """(output, weights) in float64 torch operators; `keep` is a dropout mask to apply."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    if is_causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1 + (S - L if bottom_right else 0)),
                                    -math.inf)
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # (fully masked rows: zeros, as the kernel's)
    if keep is not None:
        weights = weights * keep / (1 - p)
    return weights @ v, weights


def close(actual, expected, dtype, what=""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = expected.abs().max().item() or 1.0
    err = (actual.double() - expected.double()).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} above {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["float mask", "causal", "bottom_right gqa", "broadcast"])
def test_gradients_of_a_loss_of_the_weights(gen, dtype, case):
    B, H, L, S, E = 2, 4, 6, 9, 8
    kv_heads = 2 if "gqa" in case else H
    q = randn(gen, B, H, L, E, dtype=dtype)
    k = randn(gen, 1 if case == "broadcast" else B, kv_heads, S, E, dtype=dtype)
    v = randn(gen, 1 if case == "broadcast" else B, kv_heads, S, E, dtype=dtype)
    mask = randn(gen, L, S, dtype=dtype) if case in ("float mask", "broadcast") else None
    options = dict(is_causal=case in ("causal", "bottom_right gqa"), enable_gqa="gqa" in case)
    bottom_right = case.startswith("bottom_right")
    w_out, w_weights = randn(gen, B, H, L, E), randn(gen, B, H, L, S)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)] + ([mask.clone().requires_grad_()] if mask is not None
                                                                else [])
    out, weights = mha.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if mask is not None else None,
                                                    need_weights=True, causal_alignment="bottom_right" if bottom_right
                                                    else "top_left", **options)
    ((out * w_out.to(dtype)).sum() + (weights * w_weights.to(dtype)).sum()).backward()
    wide = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, ref_weights = reference(*wide[:3], wide[3] if mask is not None else None, bottom_right=bottom_right,
                                     **options)
    ((ref_out * w_out).sum() + (ref_weights * w_weights).sum()).backward()
    close(weights, ref_weights, dtype, "weights")
    for name, x, r in zip(("query", "key", "value", "mask"), inputs, wide):
        close(x.grad, r.grad, dtype, name)
    # the same weights as a call without gradients (the kernel's)
    _, plain = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True,
                                                causal_alignment="bottom_right" if bottom_right else "top_left",
                                                **options)
    close(weights, plain, dtype, "weights against the kernel's")


@pytest.mark.parametrize("kind", ["bool", "float -inf"])
def test_fully_masked_rows_have_zero_weights_and_no_nan_gradients(gen, kind):
    q, k, v = (randn(gen, 2, 5, 8).requires_grad_() for _ in range(3))
    keep = torch.rand(2, 5, 5, generator=gen) > 0.4
    keep[0, 2] = False  # (a query row that sees no key)
    keep[1, :, 0] = True
    mask = keep if kind == "bool" else torch.zeros(2, 5, 5, dtype=torch.float64).masked_fill(~keep, -math.inf)
    out, weights = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    weights.square().sum().backward()
    assert torch.equal(weights[0, 2], torch.zeros(5, dtype=torch.float64))
    assert all(torch.isfinite(x.grad).all() for x in (q, k))  # (value: no gradient, the loss has no output)
    assert torch.equal(q.grad[0, 2], torch.zeros(8, dtype=torch.float64))


def test_dropout_weights_keep_the_outputs_mask(gen):
    """With dropout the differentiable weights are the kernel's (its mask, drawn with the output's
    seed): output = weights @ value, and their gradient is the reference's with that mask."""
    p = 0.3
    q, k, v = (randn(gen, 2, 3, 7, 8).requires_grad_() for _ in range(3))
    w_weights = randn(gen, 2, 3, 7, 7)
    out, weights = mha.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_seed=7, need_weights=True)
    close(out, weights @ v, torch.float64, "output against weights @ value")
    _, plain = mha.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), dropout_p=p, dropout_seed=7,
                                                need_weights=True)
    close(weights, plain, torch.float64, "weights against the kernel's")
    (weights * w_weights).sum().backward()
    keep = (plain != 0).double()
    wide = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    (reference(*wide, keep=keep, p=p)[1] * w_weights).sum().backward()
    for name, x, r in zip(("query", "key"), (q, k), wide):
        close(x.grad, r.grad, torch.float64, name)


def test_weights_under_vmap_of_grad_and_compiled(gen):
    B, H, L, E = 3, 2, 5, 8
    q, k, v = randn(gen, B, H, L, E), randn(gen, B, H, L, E), randn(gen, B, H, L, E)

    def loss(attention):
        def f(q, k, v):
            _, weights = attention(q, k, v)
            return (weights * torch.arange(L, dtype=torch.float64)).sum()
        return f

    ours = loss(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True))
    theirs = loss(lambda q, k, v: reference(q, k, v, is_causal=True))
    got = torch_func.vmap(torch_func.grad(ours, argnums=(0, 1)))(q, k, v)
    want = torch_func.vmap(torch_func.grad(theirs, argnums=(0, 1)))(q, k, v)
    for a, b in zip(got, want):
        close(a, b, torch.float64, "vmap(grad)")
    qq = q.clone().requires_grad_()
    torch.compile(ours, backend="aot_eager", fullgraph=True)(qq, k, v).backward()
    close(qq.grad, torch_func.grad(theirs)(q, k, v), torch.float64, "compiled")


# ---- second derivatives: backward(create_graph=True) runs the backward in torch operators ----

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["float mask", "bottom_right gqa", "broadcast"])
def test_gradient_penalty_matches_the_reference(gen, dtype, case):
    """The gradient of a penalty on the first gradients (WGAN-GP, R1) of query, key, value and a
    learned float mask, against the float64 reference's double backward; PyTorch's CPU SDPA has
    no second derivative."""
    B, H, L, S, E = 2, 4, 5, 7, 8
    kv_heads = 2 if "gqa" in case else H
    q = randn(gen, B, H, L, E, dtype=dtype)
    k, v = (randn(gen, 1 if case == "broadcast" else B, kv_heads, S, E, dtype=dtype) for _ in range(2))
    mask = randn(gen, L, S, dtype=dtype) if case != "bottom_right gqa" else None
    options = dict(is_causal=case != "broadcast", enable_gqa="gqa" in case)
    bottom_right = case.startswith("bottom_right")
    w = randn(gen, B, H, L, E)

    def penalty(attention, tensors):
        out = attention(*tensors)
        first = torch.autograd.grad((out * w.to(out.dtype)).sum(), tensors, create_graph=True)
        return sum(g.square().sum() for g in first), first

    tensors = [x.clone().requires_grad_() for x in (q, k, v, mask) if x is not None]
    ours, first = penalty(lambda q, k, v, m=None: mha.scaled_dot_product_attention(
        q, k, v, attn_mask=m, causal_alignment="bottom_right" if bottom_right else "top_left", **options), tensors)
    wide = [x.detach().double().requires_grad_() for x in tensors]
    theirs, want_first = penalty(lambda q, k, v, m=None: reference(q, k, v, m, bottom_right=bottom_right,
                                                                      **options)[0], wide)
    for a, b in zip(first, want_first):
        close(a, b, dtype, "first gradients")
    for a, b in zip(torch.autograd.grad(ours, tensors), torch.autograd.grad(theirs, wide)):
        close(a, b, dtype, "second derivatives")


def test_double_backward_with_dropout_and_gradgradcheck(gen):
    p = 0.25
    q, k, v = (randn(gen, 2, 3, 5, 8).requires_grad_() for _ in range(3))
    _, plain = mha.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), dropout_p=p, dropout_seed=9,
                                                need_weights=True)
    keep = (plain != 0).double()

    def penalty(attention, tensors):
        first = torch.autograd.grad(attention(*tensors).square().sum(), tensors, create_graph=True)
        return sum(g.square().sum() for g in first)

    ours = penalty(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_seed=9), (q, k, v))
    wide = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    theirs = penalty(lambda q, k, v: reference(q, k, v, keep=keep, p=p)[0], wide)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v)), torch.autograd.grad(theirs, wide)):
        close(a, b, torch.float64, "second derivatives with dropout")
    small = [randn(gen, 1, 2, 3, 4).requires_grad_() for _ in range(3)]
    assert torch.autograd.gradgradcheck(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, is_causal=True),
                                        small)


def test_self_attention_gradient_penalty(gen):
    """One tensor as query, key and value: each position's gradient, summed by autograd once."""
    x = randn(gen, 2, 3, 6, 8).requires_grad_()
    g, = torch.autograd.grad(mha.scaled_dot_product_attention(x, x, x, is_causal=True).square().sum(), x,
                             create_graph=True)
    ours = torch.autograd.grad(g.square().sum(), x)[0]
    y = x.detach().clone().requires_grad_()
    h, = torch.autograd.grad(reference(y, y, y, is_causal=True)[0].square().sum(), y, create_graph=True)
    close(g, h, torch.float64, "first gradient")
    close(ours, torch.autograd.grad(h.square().sum(), y)[0], torch.float64, "second derivative")
