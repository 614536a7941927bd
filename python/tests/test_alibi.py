"""ALiBi from Python: alibi_slopes on mha.scaled_dot_product_attention and mha.varlen_attention.
The reference is softmax(q k^T * scale + mask + bias) v in float64 torch operators, with the bias
written here from the definition (-slope * |i + diagonal - j|, the diagonal key i, or key
i + S - L bottom-right) and the slopes as given (float32 values, exact in float64). Tolerances of
the largest reference value per tensor, as the other parity suites: float32 1e-5 forward and 1e-4
for gradients, plus 4 u_f32 times the largest bias (the kernels add a score and its bias in
float32: the sum rounds relative to the bias); float64 1e-12 and 1e-11. A gradient that cancels to
zero is judged against 5% of the largest."""

import numpy as np
import pytest
import torch

import mha
from _compare import relative as _relative

TOL = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-12, 1e-11)}
U32 = 2.0 ** -24


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 47])


def _biases(slopes, L, S, bottom_right):
    """[..., H, L, S] in float64 from the definition, a loop per query row."""
    bias = torch.empty(*slopes.shape, L, S, dtype=torch.float64)
    for i in range(L):
        diagonal = i + (S - L if bottom_right else 0)
        distance = torch.tensor([abs(diagonal - j) for j in range(S)], dtype=torch.float64)
        bias[..., i, :] = -slopes.double()[..., None] * distance
    return bias


def _reference(q, k, v, bias, mask, is_causal, bottom_right, scale):
    """float64 attention; q [B, Hq, L, E], k, v [B, Hkv, S, E] (grouped heads repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    L, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5) + bias
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep = ~torch.ones(L, S, dtype=torch.bool).triu(1 + (S - L if bottom_right else 0))
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        scores = scores + mask
    seen = keep.any(-1, keepdim=True)
    scores = torch.where(keep, scores, float("-inf"))
    p = torch.softmax(torch.where(seen, scores, 0.0), -1) * seen
    return p @ v


def _slopes(rng, shape, heads):
    """Slopes as models use them, 2^(-8 h / H) for head h (scaled a little at random)."""
    base = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    return torch.from_numpy(base * rng.uniform(0.5, 1.5, shape)).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_alibi_matches_the_reference(rng, dtype):
    """Forward and gradients (query, key, value, and a float mask's) with slopes per head or per
    batch entry and head, is_causal on and off, both alignments, GQA, L != S, and no mask, a bool
    mask or a float mask requiring grad."""
    out_tol, grad_tol = TOL[dtype]
    for case in range(24):
        L = int(rng.integers(1, 130))
        S = L if rng.random() < 0.5 else int(rng.integers(1, 130))
        hkv = int(rng.integers(1, 3))
        hq, d, B = hkv * int(rng.integers(1, 3)), int(rng.choice([8, 16, 32])), int(rng.integers(1, 3))
        is_causal, bottom_right = bool(rng.random() < 0.3), bool(rng.random() < 0.5)
        scale = None if rng.random() < 0.7 else float(rng.uniform(0.05, 0.4))
        slopes = _slopes(rng, (B, hq) if rng.random() < 0.4 else (hq,), hq)
        if dtype == torch.float64 and rng.random() < 0.5:
            slopes = slopes.double()

        def t(*shape):
            return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()

        q, k, v = t(B, hq, L, d), t(B, hkv, S, d), t(B, hkv, S, d)
        kind = int(rng.integers(0, 3))
        mask = None if kind == 0 else (torch.from_numpy(rng.random((L, S)) < 0.8) if kind == 1 else t(L, S))
        what = (f"case {case}: B={B} Hq={hq} Hkv={hkv} L={L} S={S} d={d} slopes {tuple(slopes.shape)} "
                f"causal={is_causal} bottom_right={bottom_right} mask={kind}")
        out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                               enable_gqa=hq != hkv, alibi_slopes=slopes,
                                               causal_alignment="bottom_right" if bottom_right else "top_left")
        bias = _biases(slopes if slopes.dim() == 2 else slopes.expand(B, hq), L, S, bottom_right)
        rounding = 0.0 if dtype == torch.float64 else 4 * U32 * bias.abs().max().item()
        inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        mask64 = mask.detach().double().requires_grad_() if kind == 2 else mask
        ref = _reference(*inputs64, bias, mask64, is_causal, bottom_right, scale)
        assert _relative(out, ref.detach()) < out_tol + rounding, what
        grad = torch.from_numpy(rng.standard_normal(tuple(ref.shape)))
        wanted = [q, k, v] + ([mask] if kind == 2 else [])
        got = torch.autograd.grad(out, wanted, grad.to(dtype))
        want = torch.autograd.grad(ref, inputs64 + ([mask64] if kind == 2 else []), grad)
        floor = 0.05 * max(w.abs().max().item() for w in want)
        for name, a, b in zip(("query", "key", "value", "attn_mask"), got, want):
            assert _relative(a, b, floor) < grad_tol + rounding, f"{what}: {name}"


def test_alibi_is_its_biases_as_a_float_mask(rng):
    """The bits of the same call with the biases written out as a float32 attn_mask (each the
    slope times the distance rounded once, as the kernels form them): output, weights, gradients;
    a decoding step (one query against a longer cache, bottom-right) too."""
    for B, H, L, S, causal in ((2, 4, 70, 70, True), (3, 8, 1, 300, False), (1, 2, 5, 90, True)):
        q = torch.from_numpy(rng.standard_normal((B, H, L, 32))).float().requires_grad_()
        k, v = (torch.from_numpy(rng.standard_normal((B, H, S, 32))).float().requires_grad_() for _ in range(2))
        slopes = _slopes(rng, (H,), H)
        i = torch.arange(L)[:, None] + (S - L)
        mask = -(slopes[:, None, None] * (i - torch.arange(S)).abs().float())
        options = dict(is_causal=causal, causal_alignment="bottom_right")
        out, w = mha.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, need_weights=True, **options)
        out_m, w_m = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True, **options)
        assert torch.equal(out, out_m) and torch.equal(w, w_m), (B, H, L, S)
        grad = torch.randn_like(out)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                                                      torch.autograd.grad(out_m, (q, k, v), grad)))


def test_varlen_alibi_is_each_sequence_alone(rng):
    """Each packed sequence gets its own biases (per head, or its row of [sequences, Hq] slopes):
    the bits of mha.scaled_dot_product_attention on that sequence alone, forward and gradients;
    nested inputs too."""
    lengths = [37, 1, 90, 64]
    cu = torch.tensor(np.cumsum([0] + lengths))
    q, k, v = (torch.from_numpy(rng.standard_normal((int(cu[-1]), 4, 32))).float().requires_grad_()
               for _ in range(3))
    grad = torch.from_numpy(rng.standard_normal((int(cu[-1]), 4, 32))).float()
    for slopes in (_slopes(rng, (4,), 4), _slopes(rng, (4, 4), 4)):
        out = mha.varlen_attention(q, k, v, cu, cu, is_causal=True, alibi_slopes=slopes)
        got = torch.autograd.grad(out, (q, k, v), grad)
        for s in range(len(lengths)):
            a, b = int(cu[s]), int(cu[s + 1])
            parts = [x[a:b].detach().transpose(0, 1).requires_grad_() for x in (q, k, v)]
            own = slopes if slopes.dim() == 1 else slopes[s]
            alone = mha.scaled_dot_product_attention(*parts, is_causal=True, alibi_slopes=own)
            assert torch.equal(out[a:b].transpose(0, 1), alone), s
            want = torch.autograd.grad(alone, parts, grad[a:b].transpose(0, 1))
            for g, w in zip(got, want):
                assert torch.equal(g[a:b].transpose(0, 1), w), s
        nested = [torch.nested.nested_tensor_from_jagged(x.detach(), cu).transpose(1, 2) for x in (q, k, v)]
        through_nested = mha.scaled_dot_product_attention(*nested, is_causal=True, alibi_slopes=slopes)
        assert torch.equal(through_nested.transpose(1, 2).values(), out.detach())


def test_alibi_under_compile_is_one_graph(rng):
    """torch.compile(fullgraph=True) through both functions with slopes, forward and backward:
    the eager bits."""
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 70, 16))).float().requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 30, 140])
    packed = [x.detach()[0].transpose(0, 1).reshape(140, 2, 16).contiguous().requires_grad_() for x in (q, k, v)]
    slopes, per_sequence = _slopes(rng, (4,), 4), _slopes(rng, (2, 2), 2)

    def both(q, k, v, packed_q, packed_k, packed_v, cu):
        dense = mha.scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes)
        ragged = mha.varlen_attention(packed_q, packed_k, packed_v, cu, cu, alibi_slopes=per_sequence)
        return dense, ragged

    compiled = torch.compile(both, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v, *packed, cu), both(q, k, v, *packed, cu)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    grads = [torch.randn_like(w) for w in want]
    inputs = (q, k, v, *packed)
    for a, b in zip(torch.autograd.grad(got, inputs, grads), torch.autograd.grad(want, inputs, grads)):
        assert torch.equal(a, b)


def test_numpy_inputs_take_slopes(rng):
    q, k, v = (rng.standard_normal((3, 50, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.25, 0.125], dtype=np.float32)
    got = mha.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, is_causal=True)
    want = mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                            alibi_slopes=torch.from_numpy(slopes), is_causal=True)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())
    # numpy slopes with torch inputs
    assert torch.equal(mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                                        alibi_slopes=slopes, is_causal=True), want)


def test_bad_slopes_are_clear_errors():
    q = torch.randn(2, 3, 8, 16)
    with pytest.raises(ValueError, match="alibi_slopes: expected dtype float32, got bfloat16"):
        mha.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"alibi_slopes: shape \[4\] cannot be broadcast to the batch dimensions "
                                         r"and heads \[2, 3\]"):
        mha.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="alibi_slopes: expected finite slopes, got inf"):
        mha.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.tensor([1.0, float("inf"), 0.5]))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \[Hq\] or \[sequences, Hq\]"):
        packed = q[0].transpose(0, 1)
        mha.varlen_attention(packed, packed, packed, [0, 3, 8], alibi_slopes=torch.ones(3, 3))
    with pytest.raises(ValueError, match="alibi_slopes: vmap over the slopes is not supported"):
        torch.func.vmap(lambda s: mha.scaled_dot_product_attention(q, q, q, alibi_slopes=s))(torch.ones(2, 3))


def test_alibi_under_torch_func_and_second_derivatives(rng):
    """The paths formed in torch operators take the biases too: vmap (one kernel call), jvp,
    second derivatives (backward of backward) and differentiable weights, against the float64
    reference within 1e-10."""
    B, H, L, S, E = 2, 2, 12, 15, 8
    slopes = torch.tensor([0.5, 0.0625], dtype=torch.float64)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).requires_grad_()

    q, k, v = t(B, H, L, E), t(B, H, S, E), t(B, H, S, E)
    bias = _biases(slopes, L, S, True)

    def ours(q, k, v):
        return mha.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, causal_alignment="bottom_right")

    def reference(q, k, v):
        return _reference(q, k, v, bias, None, False, True, None)

    want = reference(q, k, v)
    assert _relative(torch.func.vmap(ours)(q, k, v), want.detach()) < 1e-10
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    _, jvp_ours = torch.func.jvp(ours, (q, k, v), tangents)
    _, jvp_ref = torch.func.jvp(reference, (q, k, v), tangents)
    assert _relative(jvp_ours, jvp_ref.detach()) < 1e-10
    # a gradient penalty: d/dq of |dL/dk|^2 through the explicit backward
    def penalty(f):
        out = f(q, k, v)
        (gk,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
        return torch.autograd.grad(gk.square().sum(), q)[0]
    assert _relative(penalty(ours), penalty(reference)) < 1e-10
    _, w = mha.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, causal_alignment="bottom_right",
                                            need_weights=True)
    w_ref = torch.softmax(q @ k.transpose(-1, -2) * E ** -0.5 + bias, -1)
    assert _relative(w, w_ref.detach()) < 1e-10
    gw = torch.autograd.grad(w.square().sum(), q)[0]
    gw_ref = torch.autograd.grad(w_ref.square().sum(), q)[0]
    assert _relative(gw, gw_ref) < 1e-10
