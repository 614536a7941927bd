"""Sliding-window (local) attention from Python: window_size=(left, right) on
mha.scaled_dot_product_attention and mha.varlen_attention. The reference is softmax(q k^T * scale
+ mask) v in float64 torch operators with the band written from the definition here (query i keeps
keys from `left` before to `right` after its diagonal, key i or key i + S - L bottom-right; -1
unbounded), a row that sees no key giving zeros; tolerances of the largest reference value per
tensor, as the other parity suites: float32 1e-5 forward and 1e-4 for gradients, float64 1e-12 and
1e-11. A gradient that cancels to zero is judged against 5% of the largest."""

import numpy as np
import pytest
import torch

import mha
from _compare import relative as _relative

TOL = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-12, 1e-11)}


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 43])


def _band(L, S, left, right, is_causal, bottom_right):
    keep = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        diagonal = i + (S - L if bottom_right else 0)
        for j in range(S):
            keep[i, j] = ((left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)
                          and not (is_causal and j > diagonal))
    return keep


def _reference(q, k, v, keep, mask, scale):
    """float64 attention with the keys of `keep` (and an additive or bool mask); zeros for rows
    that see no key. q [B, Hq, L, E], k, v [B, Hkv, S, E] (grouped heads repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        scores = scores + mask
        keep = keep & (mask > float("-inf"))
    seen = keep.any(-1, keepdim=True)
    scores = torch.where(keep, scores, float("-inf"))
    p = torch.softmax(torch.where(seen, scores, 0.0), -1) * seen
    return p @ v


def _draw_window(rng):
    def side():
        kind = int(rng.integers(0, 5))
        return [-1, 0, int(rng.integers(1, 9)), int(rng.integers(9, 80)), int(rng.integers(80, 300))][kind]

    left, right = side(), side()
    if left < 0 and right < 0:
        left = int(rng.integers(0, 30))
    return left, right


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_window_matches_the_band_reference(rng, dtype):
    """Forward and gradients (query, key, value, and a float mask's) with windows from none to wider
    than the sequence on each side, is_causal on and off, both alignments, GQA, L != S, and no
    mask, a bool mask or a float mask requiring grad (a key must pass them all)."""
    out_tol, grad_tol = TOL[dtype]
    for case in range(30):
        L = int(rng.integers(1, 130))
        S = L if rng.random() < 0.5 else int(rng.integers(1, 130))
        hkv = int(rng.integers(1, 3))
        hq, d, B = hkv * int(rng.integers(1, 3)), int(rng.choice([8, 16, 32])), int(rng.integers(1, 3))
        left, right = _draw_window(rng)
        is_causal, bottom_right = bool(rng.random() < 0.3), bool(rng.random() < 0.5)
        scale = None if rng.random() < 0.7 else float(rng.uniform(0.05, 0.4))

        def t(*shape):
            return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()

        q, k, v = t(B, hq, L, d), t(B, hkv, S, d), t(B, hkv, S, d)
        kind = int(rng.integers(0, 3))
        mask = None if kind == 0 else (torch.from_numpy(rng.random((L, S)) < 0.8) if kind == 1 else t(L, S))
        what = (f"case {case}: B={B} Hq={hq} Hkv={hkv} L={L} S={S} d={d} window=({left}, {right}) "
                f"causal={is_causal} bottom_right={bottom_right} mask={kind}")
        out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                               enable_gqa=hq != hkv, window_size=(left, right),
                                               causal_alignment="bottom_right" if bottom_right else "top_left")
        keep = _band(L, S, left, right, is_causal, bottom_right)
        inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        mask64 = mask.detach().double().requires_grad_() if kind == 2 else mask
        ref = _reference(*inputs64, keep, mask64, scale)
        assert _relative(out, ref.detach()) < out_tol, what
        grad = torch.from_numpy(rng.standard_normal(tuple(ref.shape)))
        wanted = [q, k, v] + ([mask] if kind == 2 else [])
        got = torch.autograd.grad(out, wanted, grad.to(dtype))
        want = torch.autograd.grad(ref, inputs64 + ([mask64] if kind == 2 else []), grad)
        floor = 0.05 * max(w.abs().max().item() for w in want)
        for name, a, b in zip(("query", "key", "value", "attn_mask"), got, want):
            assert _relative(a, b, floor) < grad_tol, f"{what}: {name}"


def test_window_weights_are_zero_outside_the_band(rng):
    """need_weights returns the windowed softmax: zeros outside the band, rows summing to 1."""
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 40, 16))).float() for _ in range(3))
    out, w = mha.scaled_dot_product_attention(q, k, v, window_size=(5, 2), need_weights=True)
    keep = _band(40, 40, 5, 2, False, False)
    assert torch.all(w[..., ~keep] == 0)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 40), atol=1e-6)
    assert torch.equal(out, mha.scaled_dot_product_attention(q, k, v, window_size=(5, 2)))


def test_varlen_window_is_each_sequence_windowed(rng):
    """Each packed sequence gets its own window: the bits of mha.scaled_dot_product_attention on
    that sequence alone with the same window_size, forward and gradients; nested inputs too."""
    lengths = [37, 1, 90, 64]
    cu = torch.tensor(np.cumsum([0] + lengths))
    q, k, v = (torch.from_numpy(rng.standard_normal((int(cu[-1]), 4, 32))).float().requires_grad_()
               for _ in range(3))
    grad = torch.from_numpy(rng.standard_normal((int(cu[-1]), 4, 32))).float()
    for window, causal in (((15, -1), True), ((4, 6), False), ((-1, 0), False)):
        out = mha.varlen_attention(q, k, v, cu, cu, is_causal=causal, window_size=window)
        got = torch.autograd.grad(out, (q, k, v), grad)
        for s in range(len(lengths)):
            a, b = int(cu[s]), int(cu[s + 1])
            parts = [x[a:b].detach().transpose(0, 1).requires_grad_() for x in (q, k, v)]
            alone = mha.scaled_dot_product_attention(*parts, is_causal=causal, window_size=window)
            assert torch.equal(out[a:b].transpose(0, 1), alone), (window, s)
            want = torch.autograd.grad(alone, parts, grad[a:b].transpose(0, 1))
            for g, w in zip(got, want):
                assert torch.equal(g[a:b].transpose(0, 1), w), (window, s)
        nested = [torch.nested.nested_tensor_from_jagged(x.detach(), cu).transpose(1, 2) for x in (q, k, v)]
        through_nested = mha.scaled_dot_product_attention(*nested, is_causal=causal, window_size=window)
        assert torch.equal(through_nested.transpose(1, 2).values(), out.detach()), window


def test_window_under_compile_is_one_graph(rng):
    """torch.compile(fullgraph=True) through both functions with a window: the eager bits."""
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 70, 16))).float() for _ in range(3))
    cu = torch.tensor([0, 30, 140])
    packed = [x[0].transpose(0, 1).reshape(140, 2, 16).contiguous() for x in (q, k, v)]

    def both(q, k, v, packed_q, packed_k, packed_v, cu):
        dense = mha.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(9, -1))
        ragged = mha.varlen_attention(packed_q, packed_k, packed_v, cu, cu, window_size=(3, 3))
        return dense, ragged

    compiled = torch.compile(both, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, v, *packed, cu), both(q, k, v, *packed, cu)):
        assert torch.equal(a, b)


def test_numpy_inputs_take_a_window(rng):
    q, k, v = (rng.standard_normal((2, 50, 8)).astype(np.float32) for _ in range(3))
    mask = rng.standard_normal((50, 50)).astype(np.float32)
    got = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, window_size=(7, 0))
    want = mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                            attn_mask=torch.from_numpy(mask), window_size=(7, 0))
    assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())


def test_windows_wider_than_the_sequences_bound_nothing():
    q = torch.randn(1, 2, 30, 16)
    plain = mha.scaled_dot_product_attention(q, q, q)
    for window in ((10**30, 10**30), (60, -1), (-1, 60)):
        assert torch.equal(mha.scaled_dot_product_attention(q, q, q, window_size=window), plain), window


def test_bad_windows_are_clear_errors():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"window_size: expected -1 \(unbounded\) or a key count >= 0 on each side, "
                                         r"got \(-2, 0\)"):
        mha.scaled_dot_product_attention(q, q, q, window_size=(-2, 0))
    for bad in ((1,), "ab", (1.5, 2), (True, 0)):
        with pytest.raises(TypeError, match="window_size: expected"):
            mha.scaled_dot_product_attention(q, q, q, window_size=bad)
    with pytest.raises(ValueError, match="window_size"):
        mha.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), [0, 8],
                             window_size=(0, -3))


def test_window_under_torch_func_and_second_derivatives(rng):
    """The paths formed in torch operators take the window too: vmap (one kernel call), jvp,
    second derivatives (backward of backward) and differentiable weights, against the float64
    band reference within 1e-10."""
    B, H, L, S, E = 2, 2, 12, 15, 8
    window = (3, 1)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).requires_grad_()

    q, k, v = t(B, H, L, E), t(B, H, S, E), t(B, H, S, E)
    keep = _band(L, S, *window, False, True)

    def ours(q, k, v):
        return mha.scaled_dot_product_attention(q, k, v, window_size=window, causal_alignment="bottom_right")

    def reference(q, k, v):
        return _reference(q, k, v, keep, None, None)

    want = reference(q, k, v)
    assert _relative(torch.func.vmap(ours)(q, k, v), want.detach()) < 1e-10
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    _, jvp_ours = torch.func.jvp(ours, (q, k, v), tangents)
    _, jvp_ref = torch.func.jvp(reference, (q, k, v), tangents)
    assert _relative(jvp_ours, jvp_ref) < 1e-10
    grad = torch.randn_like(want)
    first_ours = torch.autograd.grad(ours(q, k, v), (q, k, v), grad, create_graph=True)
    first_ref = torch.autograd.grad(want, (q, k, v), grad, create_graph=True)
    second_ours = torch.autograd.grad(sum((g * g).sum() for g in first_ours), (q, k, v))
    second_ref = torch.autograd.grad(sum((g * g).sum() for g in first_ref), (q, k, v))
    for a, b in zip(second_ours, second_ref):
        assert _relative(a, b) < 1e-10
    _, weights = mha.scaled_dot_product_attention(q, k, v, window_size=window, causal_alignment="bottom_right",
                                                  need_weights=True)
    assert torch.all(weights[..., ~keep] == 0)
    (dq_w,) = torch.autograd.grad((weights * torch.arange(S, dtype=torch.float64)).sum(), (q,))
    scores = q @ k.transpose(-1, -2) / E ** 0.5
    p_ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    (dq_ref,) = torch.autograd.grad((p_ref * torch.arange(S, dtype=torch.float64)).sum(), (q,))
    assert _relative(dq_w, dq_ref) < 1e-10
