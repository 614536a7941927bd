"""Variable-length attention from Python: mha.varlen_attention on packed [T, H, D] tensors and
cu_seqlens, and jagged nested tensors through mha.scaled_dot_product_attention and through
PyTorch's function under mha.patch_torch_sdpa. The reference is PyTorch's SDPA in float64 on each
sequence alone (its output and gradients); tolerances of the largest reference value per tensor:
float32 1e-5 forward and 1e-4 for gradients (as the other parity suites), bfloat16 2e-2 for both
(the output and gradients rounded once to bfloat16, 2^-9 relative, against a reference whose
backward reads that rounded output, as flash-style backwards do: _reference_per_sequence; 1500
cases measured 6.9e-3 at worst, and 4.6e-2 against the plain float64 gradients), float64 1e-12 and
1e-11. A gradient that cancels to zero is judged against a floor (below)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from _compare import relative as _relative

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float64: (1e-12, 1e-11)}


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 41])


def _draw(rng, dtype):
    count = int(rng.integers(1, 7))
    self_attention = bool(rng.random() < 0.5)
    lq = [0 if rng.random() < 0.1 else int(rng.integers(1, 70)) for _ in range(count)]
    lk = lq if self_attention else [0 if rng.random() < 0.1 else int(rng.integers(1, 70)) for _ in range(count)]
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.integers(1, 3))
    d, dv = int(rng.choice([8, 16, 32, 64])), int(rng.choice([8, 16, 64]))
    cu_q, cu_k = np.cumsum([0] + lq), np.cumsum([0] + lk)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()

    q, k, v = t(int(cu_q[-1]), hq, d), t(int(cu_k[-1]), hkv, d), t(int(cu_k[-1]), hkv, dv)
    options = dict(is_causal=bool(rng.random() < 0.5), enable_gqa=hq != hkv,
                   scale=None if rng.random() < 0.7 else float(rng.uniform(0.05, 0.4)))
    return q, k, v, cu_q, cu_k, options


def _reference_per_sequence(q, k, v, cu_q, cu_k, options, grad, read_output=None):
    """PyTorch's SDPA in float64, one sequence at a time: output, and the gradients of sum(out * grad).
    With read_output (the output as returned, rounded to the inputs' dtype), the gradients of the
    backward that reads it, as flash-style backwards (ours, FlashAttention's, PyTorch's CPU flash
    kernel) do: its delta_i = rowsum(dO_i O_i) is off by c_i = dO_i (read_i - O_i), which moves dS_ij
    = P_ij (dP_ij - delta_i) by -c_i P_ij, the gradient of -c_i lse_i. Where a row's probabilities
    nearly vanish but for one key, that shift is the whole of a query's gradient (2 visible keys, one
    at P = 0.96: 3% of the largest query gradient in bfloat16), however exact the arithmetic after it."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    outs, shift = [], 0.0
    for s in range(len(cu_q) - 1):
        qs = q64[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        ks, vs = k64[cu_k[s]:cu_k[s + 1]].transpose(0, 1), v64[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        if qs.shape[1] == 0:
            continue
        if ks.shape[1] == 0:  # no key: zeros (as ours, and PyTorch's for a fully masked row)
            outs.append(torch.zeros(qs.shape[1], qs.shape[0], vs.shape[-1], dtype=torch.float64))
            continue
        out = F.scaled_dot_product_attention(qs, ks, vs, **options).transpose(0, 1)
        outs.append(out)
        if read_output is not None:
            c = (grad[cu_q[s]:cu_q[s + 1]].double() * (read_output[cu_q[s]:cu_q[s + 1]].double() - out.detach())).sum(-1)
            shift = shift - (c.transpose(0, 1) * _log_sum_exp(qs, ks, options)).sum()
    out = torch.cat(outs) if outs else torch.zeros(0, q.shape[1], v.shape[-1], dtype=torch.float64)
    if out.requires_grad:  # (not when no sequence has both queries and keys)
        ((out * grad.double()).sum() + shift).backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (q64, k64, v64)]
    return (out.detach(), *grads)


def _log_sum_exp(qs, ks, options):
    """[H, Lq] log-sum-exp of one sequence's scaled scores (causal: top-left, key j seen by rows i >= j)."""
    if options["enable_gqa"]:
        ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], 0)
    scale = options["scale"] if options["scale"] is not None else qs.shape[-1] ** -0.5
    scores = scale * qs @ ks.transpose(-1, -2)
    if options["is_causal"]:
        seen = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.logsumexp(scores, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_varlen_matches_each_sequence_alone(rng, dtype):
    fwd_tol, grad_tol = TOL[dtype]
    for _ in range(25):
        q, k, v, cu_q, cu_k, options = _draw(rng, dtype)
        # (a causal call of PyTorch's with Lq != Lk is top-left, as ours by default)
        out = mha.varlen_attention(q, k, v, torch.from_numpy(cu_q), cu_k, **options)
        assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], v.shape[-1])
        grad = torch.from_numpy(rng.standard_normal(tuple(out.shape))).to(dtype)
        out.backward(grad)
        # (bfloat16: the gradients of the backward that reads the rounded output)
        ref, dq, dk, dv = _reference_per_sequence(q, k, v, cu_q, cu_k, options, grad,
                                                  out.detach() if dtype == torch.bfloat16 else None)
        what = f"{dtype} cu_q={cu_q.tolist()} cu_k={cu_k.tolist()} {options}"
        assert _relative(out.detach(), ref) < fwd_tol, what
        # A gradient that is zero in exact arithmetic (one visible key) is what is left of
        # cancelling sums: judged against 5% of the sequence batch's largest gradient.
        floor = 0.05 * max((g.abs().max().item() for g in (dq, dk, dv) if g.numel()), default=0.0)
        for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
            assert got.dtype == dtype
            assert _relative(got, want, floor) < grad_tol, what


def test_numpy_in_numpy_out_and_offsets_of_every_kind(rng):
    q, k, v, cu_q, cu_k, options = _draw(rng, torch.float32)
    options.pop("scale")
    expected = mha.varlen_attention(q.detach(), k.detach(), v.detach(), cu_q, cu_k, **options)
    for offsets in (cu_q, cu_q.tolist(), torch.from_numpy(cu_q).int(), cu_q.astype(np.int32)):
        got = mha.varlen_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), offsets, cu_k,
                                   **options)
        assert isinstance(got, np.ndarray)
        assert np.array_equal(got, expected.numpy())


def test_nested_tensors_as_pytorch_takes_them(rng):
    """Jagged nested [B, H, j, D] inputs, as PyTorch's SDPA takes them (which on this CPU build runs
    them only in its math path, under sdpa_kernel(MATH), and not causal): a nested output, and
    gradients through values(); causal, the varlen kernel on the values, bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dim = 4, 32
    lengths = [int(rng.integers(1, 60)) for _ in range(5)]
    packed = torch.from_numpy(rng.standard_normal((sum(lengths), 3, heads, dim))).float()
    offsets = torch.tensor(np.cumsum([0] + lengths))

    def nested(i, grad):
        values = packed[:, i].clone().requires_grad_(grad)  # [T, H, D]
        return values, torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    (qv, q), (kv, k), (vv, v) = nested(0, True), nested(1, True), nested(2, True)
    out = mha.scaled_dot_product_attention(q, k, v)
    assert out.is_nested and out.shape[0] == len(lengths) and out.shape[1] == heads
    values = out.transpose(1, 2).values()
    grad = torch.randn_like(values)
    values.backward(grad)

    (qr, q2), (kr, k2), (vr, v2) = nested(0, True), nested(1, True), nested(2, True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q2.double(), k2.double(), v2.double())
    ref_values = ref.transpose(1, 2).values()
    ref_values.backward(grad.double())
    assert _relative(values.detach(), ref_values.detach()) < 1e-5
    for got, want in ((qv.grad, qr.grad), (kv.grad, kr.grad), (vv.grad, vr.grad)):
        assert _relative(got, want.double()) < 1e-4

    causal = mha.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    packed_causal = mha.varlen_attention(qv.detach(), kv.detach(), vv.detach(), offsets, offsets, is_causal=True)
    assert torch.equal(causal.transpose(1, 2).values(), packed_causal)
    with mha.patch_torch_sdpa():  # PyTorch's function, whose default backends find none here
        patched = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    assert torch.equal(patched.transpose(1, 2).values(), packed_causal)


def test_dropout_is_each_sequence_with_its_seed(rng):
    q, k, v, cu_q, cu_k, options = _draw(rng, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.3, dropout_seed=1234, **options)
    again = mha.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.3, dropout_seed=1234, **options)
    assert torch.equal(out, again)
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        ks, vs = k[cu_k[s]:cu_k[s + 1]].transpose(0, 1), v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        alone = mha.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.3,
                                                 dropout_seed=mha.varlen_dropout_seed(1234, s), **options)
        assert torch.equal(out[cu_q[s]:cu_q[s + 1]], alone.transpose(0, 1))


def test_bad_arguments_are_clear_errors():
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected the last offset to be the number of key/value rows"):
        mha.varlen_attention(q, k, v, [0, 4, 10], [0, 5, 13])
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets"):
        mha.varlen_attention(q, k, v, [0, 6, 4, 10], [0, 5, 6, 12])
    with pytest.raises(TypeError, match="cu_seqlens_q: expected integer offsets"):
        mha.varlen_attention(q, k, v, torch.tensor([0.0, 10.0]), [0, 12])
    with pytest.raises(ValueError, match="query: expected a packed"):
        mha.varlen_attention(q[None], k, v, [0, 10], [0, 12])
    with pytest.raises(ValueError, match="causal_alignment"):
        mha.varlen_attention(q, k, v, [0, 10], [0, 12], causal_alignment="diagonal")
    nested = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged)
    with pytest.raises(ValueError, match="attn_mask: nested inputs take no mask"):
        mha.scaled_dot_product_attention(nested.transpose(1, 2), nested.transpose(1, 2), nested.transpose(1, 2),
                                         attn_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape \\[B, H, j, D\\]"):
        mha.scaled_dot_product_attention(nested, nested, nested)
    # differentiable once: a second derivative is autograd's own clear error
    qg = q.clone().requires_grad_()
    out = mha.varlen_attention(qg, k, v, [0, 10], [0, 12])
    (g,) = torch.autograd.grad(out.sum(), qg, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()


@pytest.mark.parametrize("causal", [False, True])
def test_module_on_nested_tensors(rng, causal):
    """mha.nn.MultiheadAttention (batch_first) on jagged nested [B, j, E] query, key and value, self-
    and cross-attention, in training mode with gradients: each sequence's output and the gradients
    of the parameters and inputs are those of PyTorch's module applied to each sequence alone, in
    float64 (PyTorch's module takes no jagged tensor; its fast path only strided ones, in inference)."""
    E, H = 32, 4
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ours = mha.nn.MultiheadAttention.from_torch(copy.deepcopy(ref)).float()  # (it shares the parameters)
    for cross in (False, True):
        lq = [int(rng.integers(1, 40)) for _ in range(4)]
        lk = [int(rng.integers(1, 40)) for _ in range(4)] if cross else lq
        xq = torch.from_numpy(rng.standard_normal((sum(lq), E))).float().requires_grad_()
        xk = torch.from_numpy(rng.standard_normal((sum(lk), E))).float().requires_grad_() if cross else xq
        cu_q, cu_k = torch.tensor(np.cumsum([0] + lq)), torch.tensor(np.cumsum([0] + lk))
        q = torch.nested.nested_tensor_from_jagged(xq, cu_q)
        k = torch.nested.nested_tensor_from_jagged(xk, cu_k) if cross else q
        out, weights = ours(q, k, k, need_weights=False, is_causal=causal)
        assert out.is_nested and weights is None
        grad = torch.from_numpy(rng.standard_normal((sum(lq), E))).float()
        out.values().backward(grad)

        ref.zero_grad()
        xq64 = xq.detach().double().requires_grad_()
        xk64 = xk.detach().double().requires_grad_() if cross else xq64
        loss = 0
        for s in range(len(lq)):
            qs, ks = xq64[cu_q[s]:cu_q[s + 1]][None], xk64[cu_k[s]:cu_k[s + 1]][None]
            mask = torch.ones(lq[s], lk[s], dtype=torch.bool).triu(1) if causal else None
            o, _ = ref(qs, ks, ks, need_weights=False, attn_mask=mask)
            assert _relative(out.values()[cu_q[s]:cu_q[s + 1]].detach(), o[0].detach()) < 1e-5
            loss = loss + (o[0] * grad[cu_q[s]:cu_q[s + 1]].double()).sum()
        loss.backward()
        assert _relative(xq.grad, xq64.grad) < 1e-4
        if cross:
            assert _relative(xk.grad, xk64.grad) < 1e-4
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert _relative(a.grad, b.grad) < 1e-4, name
        ours.zero_grad()

    x = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)], layout=torch.jagged)
    with pytest.raises(ValueError, match="need_weights: the weights of nested inputs are not returned"):
        ours(x, x, x)
    with pytest.raises(ValueError, match="batch_first"):
        mha.nn.MultiheadAttention(E, H)(x, x, x, need_weights=False)


def test_compiled_varlen_is_one_node_with_the_eager_bits(rng):
    """Inside torch.compile (fullgraph: no graph break) the call is the operator
    mha::sdpa_varlen_train, its gradient mha::sdpa_varlen_backward: the eager output and gradients,
    bit for bit, and a second batch of other lengths runs the same graph's operator."""
    for _ in range(2):
        q, k, v, cu_q, cu_k, options = _draw(rng, torch.float32)
        grad = torch.from_numpy(rng.standard_normal((q.shape[0], q.shape[1], v.shape[-1]))).float()

        def loss(q, k, v, cu_q, cu_k):
            return (mha.varlen_attention(q, k, v, cu_q, cu_k, **options) * grad).sum()

        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k)), (q, k, v))
        want = torch.autograd.grad(loss(q, k, v, cu_q, cu_k), (q, k, v))
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_varlen_operator_passes_opcheck(rng):
    """PyTorch's checks of the custom operator: schema, autograd registration, fake implementation
    against the real one, AOT dispatch with dynamic shapes."""
    from mha import ops

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cu_q, cu_k, options = _draw(rng, dtype)
        args = (q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 0.25, options["is_causal"], options["scale"],
                options["enable_gqa"], ops.seed_tensor(7, 0.25), False, 6, 2,
                torch.tensor([0.5] * q.shape[1]) if dtype == torch.float32 else None, 0)  # (a window of (6, 2); ALiBi)
        result = torch.library.opcheck(torch.ops.mha.sdpa_varlen_train.default, args)
        assert all(r == "SUCCESS" for r in result.values()), result
