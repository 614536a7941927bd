"""Logit soft-capping (softcap=, Gemma 2's attn_logit_softcapping) from Python: against the float64
reference as Hugging Face's eager Gemma 2 attention writes it (scores scaled, divided by the cap,
tanh, multiplied back, then the mask added and the softmax), forward and backward, the additive
mask's gradient included; float32 within 2e-5 of the largest output and 1e-4 of the largest
gradient, bfloat16 within 1e-2, float64 1e-12 / 1e-10. Then torch.compile, torch.func (vmap of
grad, jvp), gradcheck and gradgradcheck, differentiable weights, varlen, nested, paged, errors."""

import numpy as np
import pytest
import torch
from torch import func

import mha
from _compare import relative as _relative


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 83])


def _t(rng, shape, dtype=torch.float32, requires_grad=False):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(requires_grad)


def _reference(q, k, v, softcap, mask=None, is_causal=False, scale=None):
    """Gemma 2's eager attention in float64 (grouped key heads repeated): the capped scores, then
    a float mask added (or a bool mask's False at -inf) and the causal mask; rows of no key zeros."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    scores = torch.tanh(scores / softcap) * softcap
    L, S = scores.shape[-2:]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    if is_causal:
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_and_backward_match_float64_reference(rng, dtype):
    for trial in range(4):
        B, hkv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
        hq, L, S, E = hkv * group, int(rng.choice([1, 7, 60])), int(rng.choice([5, 40, 100])), 16
        q = _t(rng, (B, hq, L, E), dtype, True)
        k, v = _t(rng, (B, hkv, S, E), dtype, True), _t(rng, (B, hkv, S, E), dtype, True)
        softcap = float(rng.choice([0.5, 2.0, 20.0]))
        mask = None
        if trial == 2:  # a float mask that takes a gradient (its gradient is not the cap's)
            mask = _t(rng, (L, S), torch.float64 if dtype == torch.float64 else torch.float32, True)
        causal = trial == 1
        out = mha.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=group > 1, scale=1.0,
                                               softcap=softcap)
        assert out.dtype == dtype
        grad = _t(rng, out.shape, dtype)
        out.backward(grad)
        inputs = [x for x in (q, k, v, mask) if x is not None]
        doubles = [x.detach().double().requires_grad_() for x in inputs]
        qd, kd, vd = doubles[:3]
        ref, _ = _reference(qd, kd, vd, softcap, doubles[3] if mask is not None else None, causal, scale=1.0)
        ref.backward(grad.double())
        tol_out, tol_grad = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1e-2, None),
                             torch.float64: (1e-12, 1e-10)}[dtype]
        assert _relative(out, ref.detach()) < tol_out
        if tol_grad is None:  # bfloat16: D = rowsum(dO O) of the rounded output (the C++ tests hold its bits)
            continue
        floor = 0.05 * max(d.grad.abs().max().item() for d in doubles[:3])
        for got, want in zip(inputs, doubles):
            assert _relative(got.grad, want.grad, floor=floor) < tol_grad


def test_numpy_inputs_and_a_cap_that_changes_nothing(rng):
    """numpy in and out; a cap far above the scores is the uncapped call to float32 rounding."""
    q, k, v = (_t(rng, (2, 3, 9, 16)) for _ in range(3))
    plain = mha.scaled_dot_product_attention(q, k, v)
    far = mha.scaled_dot_product_attention(q, k, v, softcap=1e5)
    assert _relative(far, plain) < 1e-6
    got = mha.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), softcap=1.0)
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, mha.scaled_dot_product_attention(q, k, v, softcap=1.0).numpy())
    assert _relative(torch.from_numpy(got), plain) > 1e-3  # (a cap of 1 bends these scores)


def test_weights_are_capped_and_differentiable(rng):
    """need_weights: the kernel's weights and the differentiable ones (grad mode, torch operators)
    agree with the reference; the latter's gradient passes through the cap."""
    q, k, v = (_t(rng, (2, 3, 5, 8)) for _ in range(3))
    _, ref = _reference(q, k, v, 0.7, scale=1.0)
    with torch.no_grad():
        _, w = mha.scaled_dot_product_attention(q, k, v, need_weights=True, scale=1.0, softcap=0.7)
    assert _relative(w, ref) < 2e-5
    qg = q.clone().requires_grad_()
    _, wg = mha.scaled_dot_product_attention(qg, k, v, need_weights=True, scale=1.0, softcap=0.7)
    assert _relative(wg, ref) < 2e-5
    wg.square().sum().backward()
    qd = q.double().requires_grad_()
    _reference(qd, k, v, 0.7, scale=1.0)[1].square().sum().backward()
    assert _relative(qg.grad, qd.grad) < 1e-4


def test_compiled_call_gives_the_eager_bits(rng):
    """Under torch.compile (fullgraph) the cap is an operand of mha::sdpa_train and
    mha::sdpa_backward: output and gradients the eager call's bits; weights and varlen too."""
    q, k, v = (_t(rng, (2, 4, 9, 16), requires_grad=True) for _ in range(3))
    fn = (lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=0.8))
    eager = fn(q, k, v)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.equal(out, eager)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), eager_grads):
        assert torch.equal(a, b)
    with torch.no_grad():
        weighted = (lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, need_weights=True, softcap=0.8))
        got, want = torch.compile(weighted, backend="aot_eager", fullgraph=True)(q, k, v), weighted(q, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cu = torch.tensor([0, 4, 9])
    pq, pk, pv = (_t(rng, (9, 4, 16), requires_grad=True) for _ in range(3))
    vfn = (lambda q, k, v: mha.varlen_attention(q, k, v, cu, is_causal=True, softcap=0.8))
    eager = vfn(pq, pk, pv)
    eager_grad = torch.autograd.grad(eager.sum(), pq)[0]
    out = torch.compile(vfn, backend="aot_eager", fullgraph=True)(pq, pk, pv)
    assert torch.equal(out, eager)
    assert torch.equal(torch.autograd.grad(out.sum(), pq)[0], eager_grad)


def test_func_transforms(rng):
    """vmap of grad: each example's gradient as a single call gives it; jvp (torch operators,
    the tangent through the cap) against the float64 reference's."""
    q, k, v = (_t(rng, (5, 2, 6, 8)) for _ in range(3))

    def loss(q, k, v):
        return mha.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, softcap=0.6,
                                                scale=1.0).square().sum()

    per_example = func.vmap(func.grad(loss))(q, k, v)
    for i in range(5):
        assert torch.equal(per_example[i], func.grad(loss)(q[i], k[i], v[i]))
    tq, tk = _t(rng, q.shape), _t(rng, k.shape)
    _, d_out = func.jvp(lambda q, k: mha.scaled_dot_product_attention(q, k, v, softcap=0.6, scale=1.0), (q, k),
                        (tq, tk))
    _, d_ref = func.jvp(lambda q, k: _reference(q, k, v, 0.6, scale=1.0)[0], (q.double(), k.double()),
                        (tq.double(), tk.double()))
    assert _relative(d_out, d_ref) < 1e-4


def test_gradcheck_and_gradgradcheck(rng):
    """float64: first derivatives (the fused backward through the tanh) and second ones (the
    backward in torch operators) against finite differences, with an additive mask's gradient."""
    q, k, v = (_t(rng, (1, 2, 3, 4), torch.float64, True) for _ in range(3))
    mask = _t(rng, (3, 3), torch.float64, True)
    fn = (lambda q, k, v, m: mha.scaled_dot_product_attention(q, k, v, m, is_causal=True, scale=1.0, softcap=0.9))
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, mask))
    fused = torch.autograd.grad(fn(q, k, v, mask).square().sum(), (q, k, v, mask))
    composed = torch.autograd.grad(fn(q, k, v, mask).square().sum(), (q, k, v, mask), create_graph=True)
    for a, b in zip(composed, fused):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_varlen_nested_and_paged_sequences_are_their_own_calls(rng):
    """varlen and nested inputs: each sequence's rows (and gradients) the bits of its own call;
    paged: each sequence's rows its own call's."""
    cu = [0, 3, 11]
    q, k, v = (_t(rng, (11, 4, 16), requires_grad=True) for _ in range(3))
    out = mha.varlen_attention(q, k, v, cu, is_causal=True, softcap=1.2)
    grad = _t(rng, out.shape)
    (dq,) = torch.autograd.grad(out, q, grad)
    for a, b in ((0, 3), (3, 11)):
        rows = (lambda x: x[a:b].transpose(0, 1)[None])
        alone = mha.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, softcap=1.2)
        assert torch.equal(rows(out), alone)
        assert torch.equal(rows(dq), torch.autograd.grad(alone, q, rows(grad))[0][a:b].transpose(0, 1)[None])
    nested = [torch.nested.nested_tensor_from_jagged(x.detach(), torch.tensor(cu)).transpose(1, 2)
              for x in (q, k, v)]
    got = mha.scaled_dot_product_attention(*nested, is_causal=True, softcap=1.2)
    assert torch.equal(got.transpose(1, 2).values(), out.detach())
    kc, vc = _t(rng, (4, 8, 2, 16)), _t(rng, (4, 8, 2, 16))
    table, lens = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), torch.tensor([13, 9])
    qp = _t(rng, (2, 1, 4, 16))
    paged = mha.paged_attention(qp, kc, vc, table, lens, enable_gqa=True, softcap=1.2)
    keys = torch.cat([kc[2], kc[0]])[:13].transpose(0, 1)[None]
    values = torch.cat([vc[2], vc[0]])[:13].transpose(0, 1)[None]
    alone = mha.scaled_dot_product_attention(qp[:1].transpose(1, 2), keys, values, enable_gqa=True, softcap=1.2)
    assert torch.equal(paged[:1].transpose(1, 2), alone)
    compiled = torch.compile(lambda q: mha.paged_attention(q, kc, vc, table, lens, enable_gqa=True, softcap=1.2),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(qp), paged)


def test_bad_caps_are_clear_errors():
    q = torch.randn(1, 2, 3, 8)
    for bad in (-1.0, float("nan"), float("inf"), 2e30, 1e-31):
        with pytest.raises(ValueError, match=r"softcap: expected 0 \(no soft-capping\) or a value in \[1e-30, 1e30\]"):
            mha.scaled_dot_product_attention(q, q, q, softcap=bad)
    with pytest.raises(TypeError, match="softcap: expected a float >= 0, got str"):
        mha.scaled_dot_product_attention(q, q, q, softcap="1")
    with pytest.raises(ValueError, match=r"softcap: expected 0 \(no soft-capping\) or a value in"):
        mha.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), [0, 3], softcap=-2)
    with pytest.raises(ValueError, match=r"softcap: expected 0 \(no soft-capping\) or a value in"):
        mha.paged_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, 3, softcap=-2)
