"""Attention sinks (sinks=, gpt-oss's per-head sink logits) from Python: against the float64
reference as gpt-oss's own eager attention writes it (the sink appended as one more logit per row,
the softmax taken, the sink's column dropped), forward and backward including the sinks' gradient;
float32 within 2e-5 of the largest output and 1e-4 of the largest gradient (float32 statistics and
sums of up to a few hundred O(1) terms), bfloat16 within 1e-2 (outputs rounded once to 8 bits),
float64 1e-12 / 1e-10. Then torch.compile, torch.func (per-example gradients of shared sinks,
forward mode), gradcheck and gradgradcheck, differentiable weights, varlen, paged caches, errors."""

import numpy as np
import pytest
import torch
from torch import func

import mha
from _compare import relative as _relative


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 71])


def _t(rng, shape, dtype=torch.float32, requires_grad=False):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(requires_grad)


def _reference(q, k, v, sinks, mask=None, is_causal=False, scale=None):
    """gpt-oss's eager attention in float64: logits [.., Hq, L, S] with the sink as one more
    column, softmax, the sink's column dropped; grouped key heads repeated."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = q @ k.transpose(-1, -2) * scale
    L, S = logits.shape[-2:]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if is_causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    sink = sinks.reshape(-1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    return probs @ v, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_and_backward_match_float64_reference(rng, dtype):
    for trial in range(4):
        B, hkv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
        hq, L, S, E = hkv * group, int(rng.choice([1, 7, 33])), int(rng.choice([5, 40, 100])), 16
        q = _t(rng, (B, hq, L, E), dtype, True)
        k, v = _t(rng, (B, hkv, S, E), dtype, True), _t(rng, (B, hkv, S, E), dtype, True)
        sinks = torch.from_numpy(rng.uniform(-3, 3, hq)).to(torch.float64 if dtype == torch.float64
                                                             else torch.float32).requires_grad_()
        mask = torch.from_numpy(rng.random((L, S)) < 0.8) if trial == 2 else None
        if mask is not None:
            mask[0] = False  # a row that sees no key: zeros, its softmax the sink's alone
        causal = trial == 1
        out = mha.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=group > 1, sinks=sinks)
        assert out.dtype == dtype
        grad = _t(rng, out.shape, dtype)
        out.backward(grad)
        qd, kd, vd, sd = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
        ref, _ = _reference(qd, kd, vd, sd, mask, causal)
        ref.backward(grad.double())
        tol_out, tol_grad = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1e-2, None),
                             torch.float64: (1e-12, 1e-10)}[dtype]
        assert _relative(out, ref.detach()) < tol_out
        if tol_grad is None:  # bfloat16: D = rowsum(dO O) of the rounded output; the float32 path's
            continue
        for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad), (sinks.grad, sd.grad)):
            assert _relative(got, want, floor=0.05 * want.abs().max().item() + 1e-6) < tol_grad


def test_bfloat16_sinks_and_numpy(rng):
    """Sinks kept in bfloat16 (as a bfloat16 checkpoint holds them) are widened, differentiably;
    numpy arrays in and out."""
    q, k, v = (_t(rng, (1, 4, 6, 16), torch.bfloat16) for _ in range(3))
    sinks = _t(rng, (4,), torch.bfloat16, True)
    out = mha.scaled_dot_product_attention(q, k, v, sinks=sinks)
    want = mha.scaled_dot_product_attention(q, k, v, sinks=sinks.detach().float())
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    qn, kn, vn = (x.float().numpy() for x in (q, k, v))
    got = mha.scaled_dot_product_attention(qn, kn, vn, sinks=sinks.detach().float().numpy())
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (qn, kn, vn)),
                                                                sinks=sinks.detach().float()).numpy())


def test_weights_include_the_sink(rng):
    """need_weights: rows sum to 1 - P_sink; the kernel's weights (no grad) and the differentiable
    ones (grad mode) agree with the reference; their gradient reaches the sinks."""
    q, k, v = (_t(rng, (2, 3, 5, 8)) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0])
    _, ref = _reference(q, k, v, sinks)
    with torch.no_grad():
        _, w = mha.scaled_dot_product_attention(q, k, v, sinks=sinks, need_weights=True)
    assert _relative(w, ref) < 2e-5
    s = sinks.clone().requires_grad_()
    _, wg = mha.scaled_dot_product_attention(q, k, v, sinks=s, need_weights=True)
    assert _relative(wg, ref) < 2e-5
    wg.sum().backward()
    sd = sinks.double().requires_grad_()
    _reference(q, k, v, sd)[1].sum().backward()
    assert _relative(s.grad, sd.grad) < 1e-4


def test_compiled_call_gives_the_eager_bits(rng):
    """Under torch.compile (fullgraph) the call is mha::sdpa_train with the sinks an operand, its
    backward mha::sdpa_backward: output and every gradient the eager call's bits; varlen too."""
    q, k, v = (_t(rng, (2, 4, 9, 16), requires_grad=True) for _ in range(3))
    sinks = _t(rng, (4,), requires_grad=True)
    fn = (lambda q, k, v, s: mha.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=s))
    eager = fn(q, k, v, sinks)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v, sinks))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, sinks)
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert torch.equal(out, eager)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)
    with torch.no_grad():  # the weights: mha::sdpa_with_weights, the sinks an operand
        weighted = (lambda q, k, v, s: mha.scaled_dot_product_attention(q, k, v, sinks=s, need_weights=True))
        got = torch.compile(weighted, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
        want = weighted(q, k, v, sinks)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert float(want[1].sum(-1).max()) < 1.0  # (the sink takes its share)
    cu = torch.tensor([0, 4, 9])
    pq, pk, pv = (_t(rng, (9, 4, 16), requires_grad=True) for _ in range(3))
    vfn = (lambda q, k, v, s: mha.varlen_attention(q, k, v, cu, is_causal=True, sinks=s))
    eager = vfn(pq, pk, pv, sinks)
    eager_grad = torch.autograd.grad(eager.sum(), sinks)[0]
    out = torch.compile(vfn, backend="aot_eager", fullgraph=True)(pq, pk, pv, sinks)
    assert torch.equal(out, eager)
    assert torch.equal(torch.autograd.grad(out.sum(), sinks)[0], eager_grad)


def test_func_transforms(rng):
    """Per-example gradients of shared sinks (vmap of grad): each example's own, as a loop of
    single calls gives them; jvp with a tangent on the sinks against the float64 reference's."""
    q, k, v = (_t(rng, (5, 2, 6, 8)) for _ in range(3))
    sinks = _t(rng, (2,))

    def loss(s, q, k, v):
        return mha.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, sinks=s).square().sum()

    per_example = func.vmap(func.grad(loss), in_dims=(None, 0, 0, 0))(sinks, q, k, v)
    for i in range(5):
        assert torch.allclose(per_example[i], func.grad(loss)(sinks, q[i], k[i], v[i]), rtol=1e-6, atol=1e-7)
    tangent = _t(rng, (2,))
    _, d_out = func.jvp(lambda s: mha.scaled_dot_product_attention(q, k, v, sinks=s), (sinks,), (tangent,))
    _, d_ref = func.jvp(lambda s: _reference(q, k, v, s)[0], (sinks.double(),), (tangent.double(),))
    assert _relative(d_out, d_ref) < 1e-4
    with pytest.raises(ValueError, match="sinks: vmap over the sinks is not supported"):
        func.vmap(lambda s: mha.scaled_dot_product_attention(q, k, v, sinks=s))(torch.zeros(3, 2))


def test_gradcheck_and_gradgradcheck(rng):
    """float64: first derivatives (the fused backward, the sinks' included) and second ones (the
    backward in torch operators) against finite differences."""
    q, k, v = (_t(rng, (1, 2, 3, 4), torch.float64, True) for _ in range(3))
    sinks = _t(rng, (2,), torch.float64, True)
    fn = (lambda q, k, v, s: mha.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=s))
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks))
    # The first derivatives a second one starts from (torch operators) are the fused backward's.
    fused = torch.autograd.grad(fn(q, k, v, sinks).square().sum(), (q, k, v, sinks))
    composed = torch.autograd.grad(fn(q, k, v, sinks).square().sum(), (q, k, v, sinks), create_graph=True)
    for a, b in zip(composed, fused):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_varlen_and_paged_sequences_are_their_own_calls(rng):
    """varlen: each sequence's rows the bits of its own call, the sinks' gradient the sum of the
    sequences' (1e-6: another order of summation); paged: each sequence's rows its own call's."""
    sinks = _t(rng, (4,), requires_grad=True)
    cu = [0, 3, 3, 11]
    q, k, v = (_t(rng, (11, 4, 16), requires_grad=True) for _ in range(3))
    out = mha.varlen_attention(q, k, v, cu, is_causal=True, sinks=sinks)
    grad = _t(rng, out.shape)
    (ds,) = torch.autograd.grad(out, sinks, grad)
    total = torch.zeros(4, dtype=torch.float64)
    for a, b in ((0, 3), (3, 11)):
        rows = (lambda x: x[a:b].transpose(0, 1)[None])
        alone = mha.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, sinks=sinks)
        assert torch.equal(rows(out), alone)
        total += torch.autograd.grad(alone, sinks, rows(grad))[0].double()
    assert _relative(ds, total) < 1e-6
    # paged
    kc, vc = _t(rng, (4, 8, 2, 16)), _t(rng, (4, 8, 2, 16))
    table, lens = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), torch.tensor([13, 0])
    qp = _t(rng, (2, 1, 4, 16))
    with torch.no_grad():
        out, lse = mha.paged_attention(qp, kc, vc, table, lens, enable_gqa=True, sinks=sinks,
                                       return_softmax_lse=True)
    keys = torch.cat([kc[2], kc[0]])[:13].transpose(0, 1)[None]
    values = torch.cat([vc[2], vc[0]])[:13].transpose(0, 1)[None]
    alone = mha.scaled_dot_product_attention(qp[:1].transpose(1, 2), keys, values, enable_gqa=True,
                                             sinks=sinks.detach())
    assert torch.equal(out[:1].transpose(1, 2), alone)
    assert torch.all(out[1] == 0) and torch.equal(lse[1, :, 0], sinks.detach())
    with pytest.raises(ValueError, match="inference only"):
        mha.paged_attention(qp, kc, vc, table, lens, enable_gqa=True, sinks=sinks)


def test_bad_sinks_are_clear_errors():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"sinks: expected shape \[Hq\] = \[4\] \(one per query head\), got \[3\]"):
        mha.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks: expected finite values, got sinks\[1\]"):
        mha.scaled_dot_product_attention(q, q, q, sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(ValueError, match="sinks: expected dtype float32, got float64"):
        mha.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sinks: expected shape \[Hq\] = \[4\]"):
        mha.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), [0, 3],
                             sinks=torch.zeros(2))
