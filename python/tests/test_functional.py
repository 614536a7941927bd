"""mha.nn.functional.multi_head_attention_forward against PyTorch's function, which runs in float64
as the reference (ours in float32), on random calls: packed and separate projection weights (of
equal widths, packed for the C++ module by a concatenation, or kdim/vdim), each bias present or
not, bias_k/bias_v, add_zero_attn, batched and unbatched, float and bool masks, weights averaged
or per head; forward and every gradient. Tolerances, of the largest reference value per tensor,
as in the parity suites: 1e-5 for the output and the weights (float32 rounding over sums of at
most a few dozen terms), 1e-4 for the gradients (longer chains of float32 sums, through the
softmax Jacobian and the projections' transposes); a gradient that cancels to zero is judged
against a floor (below)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
import mha.nn.functional as MF

FORWARD_TOL, GRADIENT_TOL = 1e-5, 1e-4


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 23])


def _draw_call(rng):
    H = int(rng.integers(1, 4))
    E = H * int(rng.integers(1, 6))
    batched = bool(rng.random() < 0.8)
    N, L, S = int(rng.integers(1, 4)), int(rng.integers(1, 8)), int(rng.integers(1, 8))
    separate = bool(rng.random() < 0.5)
    kdim = int(rng.integers(1, 9)) if separate and rng.random() < 0.5 else E
    vdim = int(rng.integers(1, 9)) if separate and rng.random() < 0.5 else E

    def t(*shape, grad=True):
        return torch.from_numpy(rng.standard_normal(shape) * 0.5).double().requires_grad_(grad and bool(rng.random() < 0.8))

    def seq(length, width):
        return t(*((length, N, width) if batched else (length, width)))

    query = seq(L, E)
    key, value = seq(S, kdim), seq(S, vdim)
    in_bias, out_bias = (t(3 * E) if rng.random() < 0.7 else None), (t(E) if rng.random() < 0.7 else None)
    bias_kv = rng.random() < 0.3
    args = dict(query=query, key=key, value=value, embed_dim_to_check=E, num_heads=H,
                in_proj_weight=None if separate else t(3 * E, E), in_proj_bias=in_bias,
                bias_k=t(1, 1, E) if bias_kv else None, bias_v=t(1, 1, E) if bias_kv else None,
                add_zero_attn=bool(rng.random() < 0.3), dropout_p=0.3, out_proj_weight=t(E, E),
                out_proj_bias=out_bias, training=False, need_weights=bool(rng.random() < 0.6),
                average_attn_weights=bool(rng.random() < 0.5), use_separate_proj_weight=separate,
                q_proj_weight=t(E, E) if separate else None, k_proj_weight=t(E, kdim) if separate else None,
                v_proj_weight=t(E, vdim) if separate else None)
    if rng.random() < 0.4:
        shape = (L, S) if rng.random() < 0.5 else ((N if batched else 1) * H, L, S)
        args["attn_mask"] = t(*shape, grad=False)
    if rng.random() < 0.4:
        kpm = torch.from_numpy(rng.random((N, S) if batched else (S,)) < 0.3)
        kpm[..., 0] = False  # key 0 stays visible: no row is masked out entirely
        args["key_padding_mask"] = kpm
    return args


def _float32(args):
    """The same call in float32, as leaves of their own."""
    def f(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().float().requires_grad_(x.requires_grad)
        return x
    return {k: f(v) for k, v in args.items()}


def _close(got, ref, what, args, tol, floor=0.0):
    scale = max(ref.abs().max().item(), floor, 1e-30)
    err = (got.double() - ref).abs().max().item() / scale
    assert err <= tol, (what, err, {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in args.items()})


def _forward_matches(ours, args):
    """Our call on `ours` (float32) and PyTorch's on `args` (float64): the outputs and weights
    agree; returns both outputs."""
    out, weights = MF.multi_head_attention_forward(**ours)
    ref_out, ref_weights = F.multi_head_attention_forward(**args)
    _close(out, ref_out.detach(), "output", args, FORWARD_TOL)
    assert (weights is None) == (ref_weights is None)
    if weights is not None:
        _close(weights, ref_weights.detach(), "weights", args, FORWARD_TOL)
    return out, ref_out


def test_matches_pytorch_forward_and_gradients(rng, parity_count):
    for _ in range(max(50, parity_count // 20)):
        args = _draw_call(rng)
        ours = _float32(args)
        out, ref_out = _forward_matches(ours, args)
        grad = torch.from_numpy(rng.standard_normal(out.shape))
        names = [k for k, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not names:
            continue
        got = torch.autograd.grad((out * grad.float()).sum(), [ours[k] for k in names])
        ref = torch.autograd.grad((ref_out * grad).sum(), [args[k] for k in names])
        # A gradient that cancels to zero (the query's, over a single key: the softmax is then
        # constant) is judged at the rounding scale of its products, a hundredth of the call's
        # largest gradient, or of the output times its gradient where every gradient asked for
        # cancels (the query's alone, over a single key).
        floor = 1e-2 * max(r.abs().max().item() for r in ref)
        if floor == 0:
            floor = 1e-2 * ref_out.abs().max().item() * grad.abs().max().item()
        for name, a, b in zip(names, got, ref):
            _close(a, b, f"gradient of {name}", args, GRADIENT_TOL, floor)


def test_bits_of_the_module_and_dropout_in_training_only(rng):
    """The module's call on its own parameters (its forward passes them to the same C++ module):
    the same bits; dropout applies only with training=True."""
    m = mha.nn.MultiheadAttention(12, 3, dropout=0.4, add_bias_kv=True)
    x = torch.from_numpy(rng.standard_normal((6, 2, 12))).float()
    args = (x, x, x, 12, 3, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, False, 0.4, m.out_proj.weight,
            m.out_proj.bias)
    out, weights = MF.multi_head_attention_forward(*args, training=False)
    m_out, m_weights = m.eval()(x, x, x)
    assert torch.equal(out, m_out) and torch.equal(weights, m_weights)
    dropped, _ = MF.multi_head_attention_forward(*args, training=True)
    assert not torch.equal(dropped, out)


def test_static_keys_and_values_as_pytorch(rng):
    """static_k / static_v (keys and values already in heads, an incremental decoder's cache)
    replace the projected ones, as in PyTorch's function: with add_zero_attn, a key padding mask
    over the static length, an attn_mask, weights or not, batched or not; the output, the weights
    and the gradients of the query, the statics and the projections (tolerances above)."""
    for trial in range(12):
        E, H, L, S = 8, 2, int(rng.integers(1, 5)), int(rng.integers(1, 6))
        batched = trial % 4 != 3
        N = int(rng.integers(1, 3)) if batched else 1

        def t(*shape):
            return torch.from_numpy(rng.standard_normal(shape) * 0.5).double().requires_grad_()

        def seq(length):
            return t(length, N, E) if batched else t(length, E)

        static_k = t(N * H, S, E // H) if trial % 3 != 1 else None
        static_v = t(N * H, S, E // H) if trial % 3 != 0 else None
        args = dict(query=seq(L), key=seq(S), value=seq(S), embed_dim_to_check=E, num_heads=H,
                    in_proj_weight=t(3 * E, E), in_proj_bias=t(3 * E), bias_k=None, bias_v=None,
                    add_zero_attn=trial % 2 == 1, dropout_p=0.0, out_proj_weight=t(E, E), out_proj_bias=t(E),
                    training=False, need_weights=trial % 4 < 2, average_attn_weights=trial % 5 != 0,
                    static_k=static_k, static_v=static_v)
        if trial % 3 == 2:
            kpm = torch.from_numpy(rng.random((N, S) if batched else (S,)) < 0.3)
            kpm[..., 0] = False
            args["key_padding_mask"] = kpm
        if trial % 5 == 1:
            args["attn_mask"] = torch.from_numpy(rng.standard_normal((L, S)) * 0.5)
        ours = _float32(args)
        out, ref_out = _forward_matches(ours, args)
        if static_k is not None and static_v is not None and "attn_mask" not in args:
            # is_causal over the static keys (a key input of another length, its projection
            # discarded): the causal mask as a bool attn_mask; a zero key stays visible.
            longer = dict(ours, key=_float32({"x": seq(S + 2)})["x"], value=_float32({"x": seq(S + 2)})["x"])
            causal, _ = MF.multi_head_attention_forward(**longer, is_causal=True)
            masked, _ = MF.multi_head_attention_forward(**longer, attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1))
            assert torch.equal(causal, masked)
        names = [k for k, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        grad = torch.from_numpy(rng.standard_normal(out.shape))
        got = torch.autograd.grad((out * grad.float()).sum(), [ours[k] for k in names], allow_unused=True)
        ref = torch.autograd.grad((ref_out * grad).sum(), [args[k] for k in names], allow_unused=True)
        floor = 1e-2 * max(r.abs().max().item() for r in ref if r is not None)
        for name, a, b in zip(names, got, ref):
            if b is None:  # (the input of a static side's discarded projection: no gradient, or zeros)
                assert a is None or not a.any(), name
                continue
            _close(a, b, f"gradient of {name}", args, GRADIENT_TOL, floor)


def test_bad_calls_name_the_argument(rng):
    E, H = 8, 2
    x = torch.randn(3, 2, E)
    w, b, wo = torch.randn(3 * E, E), torch.randn(3 * E), torch.randn(E, E)
    call = dict(query=x, key=x, value=x, embed_dim_to_check=E, num_heads=H, in_proj_weight=w, in_proj_bias=b,
                bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=wo, out_proj_bias=None)
    bad = [
        (dict(embed_dim_to_check=E + 1), "query"),
        (dict(static_k=torch.randn(3, 3, 4)), r"static_k: expected \[N \* num_heads, S, head_dim\] = \[4, S, 4\]"),
        (dict(static_k=torch.randn(4, 3, 4), static_v=torch.randn(4, 2, 4)), "static_k, static_v: expected the same"),
        (dict(static_v=torch.randn(4, 3, 4), bias_k=torch.randn(1, 1, E), bias_v=torch.randn(1, 1, E)),
         "static_v: bias_k/bias_v cannot be added"),
        (dict(bias_k=torch.randn(1, 1, E)), "bias_k"),
        (dict(in_proj_weight=None), "in_proj_weight"),
        (dict(use_separate_proj_weight=True, q_proj_weight=wo, k_proj_weight=wo), "v_proj_weight"),
        (dict(in_proj_weight=torch.randn(3 * E, E + 1)), "in_proj_weight"),
        (dict(num_heads=3), "num_heads"),
        (dict(out_proj_weight=wo.double()), "dtype"),
    ]
    for change, name in bad:
        with pytest.raises(ValueError, match=name):
            MF.multi_head_attention_forward(**{**call, **change})
    with pytest.raises(TypeError, match="query"):
        MF.multi_head_attention_forward(**{**call, "query": x.numpy()})


def test_compiles_into_one_graph(rng):
    """Attention pooling as CLIP writes it (one query over the tokens, separate weights of equal
    widths, in_proj_bias concatenated), under torch.compile fullgraph: the eager bits, gradients
    included."""
    from torch._dynamo.backends.registry import lookup_backend

    E, H = 16, 4
    q_w, k_w, v_w, c_w = (torch.nn.Linear(E, E) for _ in range(4))
    x = torch.from_numpy(rng.standard_normal((10, 3, E))).float().requires_grad_()

    def pool(x):
        out, _ = MF.multi_head_attention_forward(
            query=x[:1], key=x, value=x, embed_dim_to_check=E, num_heads=H, q_proj_weight=q_w.weight,
            k_proj_weight=k_w.weight, v_proj_weight=v_w.weight, in_proj_weight=None,
            in_proj_bias=torch.cat([q_w.bias, k_w.bias, v_w.bias]), bias_k=None, bias_v=None, add_zero_attn=False,
            dropout_p=0.0, out_proj_weight=c_w.weight, out_proj_bias=c_w.bias, use_separate_proj_weight=True,
            training=True, need_weights=False)
        return out.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(pool, backend=lookup_backend("aot_eager"), fullgraph=True)
    leaves = [x, q_w.weight, k_w.bias, c_w.weight]
    for a, b in zip(torch.autograd.grad(compiled(x), leaves), torch.autograd.grad(pool(x), leaves)):
        assert torch.equal(a, b)
