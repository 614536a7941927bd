"""mha.patch_torch_sdpa: PyTorch's scaled_dot_product_attention replaced by ours where our kernel
takes the call (the bits of mha.scaled_dot_product_attention, forward and gradients, eager and
compiled), PyTorch's own elsewhere, and put back afterwards."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 41])


def _t(rng, *shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def test_patched_calls_are_ours_with_gradients(rng):
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (_t(rng, *s, dtype=dtype).requires_grad_() for s in ((2, 4, 7, 16), (2, 2, 9, 16), (2, 2, 9, 8)))
        mask = _t(rng, 7, 9, dtype=dtype)
        kwargs = dict(attn_mask=mask, scale=0.3, enable_gqa=True)
        with mha.patch_torch_sdpa():
            assert F.scaled_dot_product_attention is not ORIGINAL
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        assert F.scaled_dot_product_attention is ORIGINAL
        ours = mha.scaled_dot_product_attention(q, k, v, **kwargs)
        assert torch.equal(out, ours)
        g = _t(rng, *out.shape, dtype=dtype)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ours, (q, k, v), g)):
            assert torch.equal(a, b)
        # and within rounding of PyTorch's own
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        ref = ORIGINAL(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.3, enable_gqa=True)
        assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_calls_it_cannot_take_go_to_pytorch(rng):
    q = _t(rng, 1, 2, 5, 8)
    with mha.patch_torch_sdpa():
        for args, kwargs in [((q.double(),) * 3, {}),                      # float64
                             ((q[None, None, None],) * 3, {}),             # seven dimensions
                             ((q.double(),) * 3, dict(attn_mask=torch.zeros(5, 5, dtype=torch.float64)))]:
            assert torch.equal(F.scaled_dot_product_attention(*args, **kwargs), ORIGINAL(*args, **kwargs))


def _expect_float64_pytorch(rng, out, inputs, **kwargs):
    """out (float32, from `inputs`) within 1e-5 of PyTorch's float64 result with `kwargs`, and its
    gradients for a random output gradient within 1e-5 of PyTorch's (of at least 1)."""
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = ORIGINAL(*ref_inputs, **kwargs)
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    g = _t(rng, *out.shape)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, ref_inputs, g.double())):
        assert a.shape == b.shape
        assert (a.double() - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_grouped_key_and_value_heads_that_differ_are_ours(rng):
    """enable_gqa with key and value head counts of their own (PyTorch repeats each Hq / H times):
    the patched call is mha's, and within float32 rounding of PyTorch's float64 result, gradients
    included (1e-5 of the largest; the gradients of the repeated heads are summed back)."""
    for shapes in [((2, 6, 7, 16), (2, 2, 9, 16), (2, 3, 9, 8)),   # fewer key heads than value heads
                   ((2, 8, 7, 16), (2, 4, 9, 16), (2, 2, 9, 8)),   # and the other way
                   ((6, 7, 16), (1, 9, 16), (2, 9, 8)),            # one key head, unbatched
                   ((1, 2, 1, 6, 7, 16), (1, 2, 1, 2, 9, 16), (1, 1, 1, 3, 9, 8))]:  # six dimensions
        q, k, v = (_t(rng, *s).requires_grad_() for s in shapes)
        with mha.patch_torch_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(out, mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        _expect_float64_pytorch(rng, out, (q, k, v), is_causal=True, enable_gqa=True)


def test_batch_dimensions_broadcast_as_in_pytorch(rng):
    """Calls whose q, k, v batch dimensions differ but broadcast (PyTorch takes them) are ours, with
    PyTorch's output shape and within float32 rounding of its float64 result, gradients included."""
    cases = [((3, 10, 16), (12, 16), (12, 8)),                      # keys and values shared by a batch
             ((3, 1, 10, 16), (1, 4, 12, 16), (1, 4, 12, 8)),       # each side broadcasts a dimension
             ((2, 4, 10, 16), (2, 1, 12, 16), (2, 1, 12, 8)),       # one key/value head (MQA, no enable_gqa)
             ((2, 3, 4, 10, 16), (3, 1, 12, 16), (2, 1, 4, 12, 8))]  # five dimensions
    for shapes in cases:
        q, k, v = (_t(rng, *s).requires_grad_() for s in shapes)
        with mha.patch_torch_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        _expect_float64_pytorch(rng, out, (q, k, v), is_causal=True)


def test_dropout_follows_torch_manual_seed(rng):
    q = _t(rng, 1, 2, 6, 8)
    with mha.patch_torch_sdpa():
        torch.manual_seed(5)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        b = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        torch.manual_seed(5)
        c = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_patches_nest_and_pytorchs_module_runs_through_it(rng):
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = _t(rng, 2, 5, 16)
    expected = m(x, x, x, need_weights=False)[0]
    outer = mha.patch_torch_sdpa()
    try:
        inner = mha.patch_torch_sdpa()
        with torch.no_grad():
            got = m(x, x, x, need_weights=False)[0]  # PyTorch's module calls the patched function
        inner.restore()
        assert F.scaled_dot_product_attention is outer._function
    finally:
        outer.restore()
    assert F.scaled_dot_product_attention is ORIGINAL
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_patched_function_compiles_into_one_graph(rng):
    q, k, v = (_t(rng, 2, 2, 6, 8).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    with mha.patch_torch_sdpa():
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        for a, b in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), torch.autograd.grad(f(q, k, v), (q, k, v))):
            assert torch.equal(a, b)
    torch._dynamo.reset()
