"""Inside torch.autocast("cpu"): mha casts its inputs as PyTorch's SDPA and module are cast there
(every floating tensor but float64 to the autocast dtype, parameters included), so results come
in the dtypes PyTorch's would, and gradients flow back to the float32 tensors. Values against a
float64 reference computed from the same rounded inputs, on fresh random inputs (parity seed)."""

import math

import pytest
import torch
import torch.nn.functional as F

import mha
import mha.nn
from mha import torch_sdpa

# The kernels compute in float32 from the rounded inputs and round the result once: an output
# element is off by at most half an ulp of its dtype after the float32 arithmetic (bfloat16:
# 2^-9 relative; float16: 2^-12), so 1e-2 and 2e-3 of the largest element leave room for sums.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def gen(parity_seed):
    return torch.Generator().manual_seed(parity_seed)


def reference(q, k, v, mask=None, is_causal=False):
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.double()
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, -1) @ v


def relative(a, b):
    return (a.double() - b.double()).abs().max().item() / b.double().abs().max().item()


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_sdpa_results_in_the_autocast_dtype(gen, dtype):
    q, k, v = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(3))
    mask = torch.randn(9, 9, generator=gen)
    cases = {"float32": (q, k, v), "mixed": (q.to(dtype), k, v.bfloat16()), "float64": (q.double(), k.double(),
                                                                                        v.double())}
    for name, inputs in cases.items():
        with torch.autocast("cpu", dtype=dtype):
            ours = mha.scaled_dot_product_attention(*inputs, attn_mask=mask.to(inputs[0].dtype))
            theirs = F.scaled_dot_product_attention(*inputs, attn_mask=mask.to(inputs[0].dtype))
        assert ours.dtype == theirs.dtype, name
        if name != "float64":
            assert ours.dtype == dtype
            rounded = [x.to(dtype) for x in inputs]
            assert relative(ours, reference(*rounded, mask.to(dtype))) < TOL[dtype], name
    with torch.autocast("cpu", dtype=dtype, enabled=False):  # a region that turns it off
        assert mha.scaled_dot_product_attention(q, k, v).dtype == torch.float32


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_sdpa_gradients_reach_the_float32_inputs(gen, dtype):
    q, k, v = (torch.randn(2, 3, 7, 16, generator=gen).requires_grad_() for _ in range(3))
    w = torch.randn(2, 3, 7, 16, generator=gen)
    with torch.autocast("cpu", dtype=dtype):
        out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    (out.float() * w).sum().backward()
    rounded = [x.detach().to(dtype).double().requires_grad_() for x in (q, k, v)]
    (reference(*rounded, is_causal=True) * w.double()).sum().backward()
    for x, r in zip((q, k, v), rounded):
        assert x.grad.dtype == torch.float32
        # (the gradients are rounded to the autocast dtype once, then widened by the cast's backward)
        assert relative(x.grad, r.grad) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
def test_module_runs_in_the_autocast_dtype(gen, dtype):
    """A float32 mha.nn.MultiheadAttention inside autocast: output and weights in PyTorch's dtypes,
    values against the float64 module on the rounded parameters and inputs, float32 gradients for
    the parameters (an optimizer step under autocast)."""
    torch.manual_seed(gen.initial_seed())
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    x = torch.randn(2, 10, 32, generator=gen)
    padding = torch.rand(2, 10, generator=gen) < 0.3
    padding[:, 0] = False
    with torch.autocast("cpu", dtype=dtype):
        out, weights = ours(x, x, x, key_padding_mask=padding)
        want_out, want_weights = theirs(x, x, x, key_padding_mask=padding)
    assert (out.dtype, weights.dtype) == (want_out.dtype, want_weights.dtype) == (dtype, dtype)
    wide = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    wide.load_state_dict({name: p.to(dtype).double() for name, p in theirs.state_dict().items()})
    ref_out, ref_weights = wide(*(x.to(dtype).double(),) * 3, key_padding_mask=padding)
    assert relative(out, ref_out) < TOL[dtype]
    assert relative(weights, ref_weights) < TOL[dtype]
    out.float().square().sum().backward()
    ref_out.square().sum().backward()
    for (name, p), (_, r) in zip(ours.named_parameters(), wide.named_parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert relative(p.grad, r.grad) < 3 * TOL[dtype], name


def test_patched_torch_sdpa_under_autocast(gen, monkeypatch):
    """PyTorch's module calls F.scaled_dot_product_attention with the bfloat16 projections autocast
    made: with the patch on, mha's kernel takes the call."""
    calls = []
    monkeypatch.setattr(torch_sdpa, "_mha_sdpa",
                        lambda *a, **kw: calls.append(1) or mha.scaled_dot_product_attention(*a, **kw))
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True)  # (training mode: not its fused fast path)
    x = torch.randn(2, 10, 32, generator=gen)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = module(x, x, x, need_weights=False)
        with mha.patch_torch_sdpa():
            got, _ = module(x, x, x, need_weights=False)
            q = torch.randn(2, 4, 10, 8, generator=gen)
            F.scaled_dot_product_attention(q, q.bfloat16(), q)  # mixed dtypes, made one by autocast
    assert len(calls) == 2
    assert got.dtype == want.dtype == torch.bfloat16
    assert relative(got, want) < 2e-2
