"""torch.func transforms over mha.scaled_dot_product_attention: vmap (one kernel call with the
vmapped dimension as a batch dimension, or example by example), grad, jacrev, vmap of a gradient
and a gradient of a vmap, against a float64 reference written from the formula (its gradients
by autograd), on fresh random inputs (the parity seed, printed)."""

import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import mha
import mha.nn
from mha import torch_sdpa

func = torch.func

# float64 runs the kernel in float64 (agreement to rounding); float32 is the fused float32
# kernel, whose online softmax reorders the sums (about 1e-6 relative at these lengths).
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, bottom_right=False):
    """softmax(Q K^T * scale + mask) V in float64 torch operators; its autograd is the reference backward."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.double())
    if is_causal:
        L, S = scores.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool).tril(S - L if bottom_right else 0)
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, -1) @ v


def close(actual, expected, dtype):
    scale = expected.abs().max().item() or 1.0
    err = (actual.double() - expected.double()).abs().max().item() / scale
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert err <= TOL[dtype], f"relative error {err:.3g} above {TOL[dtype]:.0e}"


@pytest.fixture
def gen(parity_seed):
    return torch.Generator().manual_seed(parity_seed)


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vmap_matches_the_reference(gen, dtype):
    B, H, L, S, E = 3, 2, 7, 9, 8
    q, k, v = randn(gen, B, H, L, E, dtype=dtype), randn(gen, B, H, S, E, dtype=dtype), randn(gen, B, H, S, E,
                                                                                             dtype=dtype)
    out = func.vmap(mha.scaled_dot_product_attention)(q, k, v)
    close(out, reference(q, k, v), dtype)
    # the vmapped dimension elsewhere in each input, and out_dims moved
    out = func.vmap(mha.scaled_dot_product_attention, in_dims=(2, 1, 0), out_dims=1)(
        q.movedim(0, 2), k.movedim(0, 1), v)
    close(out, reference(q, k, v).movedim(0, 1), dtype)


def test_vmap_with_inputs_of_other_ranks_and_unbatched_ones(gen):
    B, H, L, S, E = 4, 3, 5, 6, 8
    q = randn(gen, B, H, L, E)
    k, v = randn(gen, S, E), randn(gen, S, E)  # one key/value set for every example and head
    out = func.vmap(mha.scaled_dot_product_attention, in_dims=(0, None, None))(q, k, v)
    close(out, reference(q, k, v), torch.float64)
    # only the mask vmapped: every example attends through its own mask to the same inputs
    q1, k1, v1 = q[0], randn(gen, H, S, E), randn(gen, H, S, E)
    masks = torch.rand(B, L, S, generator=gen) > 0.3
    masks[..., 0] = True
    out = func.vmap(lambda m: mha.scaled_dot_product_attention(q1, k1, v1, attn_mask=m))(masks)
    close(out, reference(q1, k1, v1, masks[:, None]), torch.float64)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_vmap_of_grouped_causal_attention(gen, causal):
    B, Hq, Hkv, L, S, E = 2, 4, 2, 6, 9, 16
    q, k, v = randn(gen, B, Hq, L, E), randn(gen, B, Hkv, S, E), randn(gen, B, Hkv, S, E)

    def f(q, k, v):
        return mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, causal_alignment=causal,
                                                scale=0.3)

    close(func.vmap(f)(q, k, v),
          reference(q, k, v, is_causal=True, enable_gqa=True, bottom_right=causal == "bottom_right", scale=0.3),
          torch.float64)


def test_vmap_past_six_dimensions_runs_example_by_example(gen):
    q, k, v = randn(gen, 3, 2, 1, 2, 2, 5, 8), randn(gen, 3, 2, 1, 2, 2, 5, 8), randn(gen, 3, 2, 1, 2, 2, 5, 8)
    close(func.vmap(mha.scaled_dot_product_attention)(q, k, v), reference(q, k, v), torch.float64)
    with pytest.raises(ValueError, match="dimensions"):  # (outside vmap, seven are an error as before)
        mha.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grad_and_jacrev_match_the_reference(gen, dtype):
    H, L, S, E = 2, 5, 7, 8
    q, k, v = randn(gen, H, L, E, dtype=dtype), randn(gen, H, S, E, dtype=dtype), randn(gen, H, S, E, dtype=dtype)
    w = randn(gen, H, L, E)

    def loss(attention):
        return lambda q, k, v: (attention(q, k, v, is_causal=True) * w.to(q.dtype)).sum()

    got = func.grad(loss(mha.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    want = func.grad(loss(reference), argnums=(0, 1, 2))(q.double(), k.double(), v.double())
    for a, b in zip(got, want):
        close(a, b, dtype)
    got = func.jacrev(lambda k: mha.scaled_dot_product_attention(q, k, v), argnums=0)(k)
    want = func.jacrev(lambda k: reference(q.double(), k, v.double()))(k.double())
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_forward_mode_matches_the_reference(gen, dtype, causal):
    """jvp (tangents for query, key, value and a float mask), jacfwd and torch.autograd.forward_ad,
    with grouped heads, against the reference's forward-mode derivative (PyTorch's own CPU SDPA
    has none)."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 5, 7, 8
    q, k, v = randn(gen, B, Hq, L, E, dtype=dtype), randn(gen, B, Hkv, S, E, dtype=dtype), randn(gen, B, Hkv, S, E,
                                                                                                 dtype=dtype)
    mask = randn(gen, L, S, dtype=dtype)
    primals = (q, k, v, mask)
    tangents = tuple(randn(gen, *x.shape, dtype=dtype) for x in primals)
    options = dict(is_causal=causal is not None, enable_gqa=True)

    def ours(q, k, v, m):
        return mha.scaled_dot_product_attention(q, k, v, attn_mask=m, causal_alignment=causal or "top_left", **options)

    def theirs(q, k, v, m):
        return reference(q, k, v, m, bottom_right=causal == "bottom_right", **options)

    out, d_out = func.jvp(ours, primals, tangents)
    want_out, want_d_out = func.jvp(theirs, tuple(x.double() for x in primals), tuple(t.double() for t in tangents))
    close(out, want_out, dtype)
    close(d_out, want_d_out, dtype)
    close(func.jacfwd(ours, argnums=1)(*primals), func.jacfwd(theirs, argnums=1)(*(x.double() for x in primals)),
          dtype)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(v, tangents[2])
        d_out = torch.autograd.forward_ad.unpack_dual(ours(q, k, dual, mask)).tangent
    assert d_out is not None, "the tangent was dropped"
    close(d_out, func.jvp(lambda v: theirs(q.double(), k.double(), v, mask.double()), (v.double(),),
                          (tangents[2].double(),))[1], dtype)


def test_module_forward_mode_matches_torch(gen):
    """The module's jvp (its SDPA through the forward-mode rule) against torch's module (whose
    need_weights path has one: its fused SDPA has none on the CPU)."""
    theirs = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, dtype=torch.float64)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    x, t = randn(gen, 6, 2, 16), randn(gen, 6, 2, 16)
    padding = torch.rand(2, 6, generator=gen) < 0.3
    padding[:, 0] = False
    out, d_out = func.jvp(lambda x: ours(x, x, x, key_padding_mask=padding, need_weights=False)[0], (x,), (t,))
    want, want_d_out = func.jvp(lambda x: theirs(x, x, x, key_padding_mask=padding)[0], (x,), (t,))
    close(out, want, torch.float64)
    close(d_out, want_d_out, torch.float64)


def test_vmap_of_grad_and_grad_of_vmap(gen):
    """Per-example gradients (vmap of grad), with unbatched keys and a learned float mask, and the
    gradient of a vmapped call."""
    B, H, L, S, E = 3, 2, 6, 5, 8
    q, k, v = randn(gen, B, H, L, E), randn(gen, H, S, E), randn(gen, B, H, S, E)
    bias = randn(gen, B, L, S)
    w = randn(gen, H, L, E)

    def loss(attention):
        return lambda q, k, v, m: (attention(q, k, v, attn_mask=m) * w).sum()

    got = func.vmap(func.grad(loss(mha.scaled_dot_product_attention), argnums=(0, 1, 2, 3)),
                    in_dims=(0, None, 0, 0))(q, k, v, bias)
    want = func.vmap(func.grad(loss(reference), argnums=(0, 1, 2, 3)), in_dims=(0, None, 0, 0))(q, k, v, bias)
    for a, b in zip(got, want):
        close(a, b, torch.float64)
    assert got[1].shape == (B, H, S, E)  # one key gradient per example, not their sum

    def total(attention):
        return lambda q: func.vmap(lambda q, v: attention(q, k, v, is_causal=True))(q, v).square().sum()

    close(func.grad(total(mha.scaled_dot_product_attention))(q), func.grad(total(reference))(q), torch.float64)


def test_vmap_with_dropout_follows_the_randomness_flag(gen):
    B, H, L, S, E = 3, 2, 8, 8, 8
    q, k, v = randn(gen, H, L, E), randn(gen, H, S, E), randn(gen, B, H, S, E)

    def f(v):
        return mha.scaled_dot_product_attention(q, k, v, dropout_p=0.4, dropout_seed=11)

    with pytest.raises(RuntimeError, match="randomness"):
        func.vmap(f)(v)  # vmap's default: random operations are an error
    same_v = v[:1].expand(B, H, S, E)
    same = func.vmap(f, randomness="same")(same_v)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2])
    torch.testing.assert_close(same[0], f(v[0]), rtol=1e-12, atol=1e-12)  # the seed's mask, as outside vmap
    different = func.vmap(f, randomness="different")(same_v)
    assert not torch.equal(different[0], different[1])
    # 'different' is the kernel's batch dimension: the call on the stacked inputs, same seed
    stacked = mha.scaled_dot_product_attention(q, k, same_v, dropout_p=0.4, dropout_seed=11)
    torch.testing.assert_close(different, stacked, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_vmap_of_grad_with_dropout_keeps_the_forwards_mask(gen, randomness):
    """The backward's vmap rule must draw the forward's masks: per-example gradients equal those
    of the unvmapped calls that draw the same masks."""
    B, H, L, S, E = 3, 2, 6, 7, 8
    q, k, v = randn(gen, B, H, L, E), randn(gen, H, S, E), randn(gen, H, S, E)
    w = randn(gen, H, L, E)

    def loss(q, k):
        return (mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=5) * w).sum()

    got = func.vmap(func.grad(loss, argnums=(0, 1)), in_dims=(0, None), randomness=randomness)(q, k)
    if randomness == "same":  # each example alone, with the seed's one mask
        want = [torch.stack(g) for g in zip(*(func.grad(loss, argnums=(0, 1))(q[i], k) for i in range(B)))]
    else:  # the stacked call, one key set per example
        kk = k.expand(B, H, S, E).clone()
        want = func.grad(lambda q, kk: loss(q, kk), argnums=(0, 1))(q, kk)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_need_weights_under_vmap(gen):
    B, H, L, S, E = 2, 3, 4, 6, 8
    q, k, v = randn(gen, B, H, L, E), randn(gen, B, H, S, E), randn(gen, B, H, S, E)
    out, weights = func.vmap(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, need_weights=True))(q, k, v)
    close(out, reference(q, k, v), torch.float64)
    close(weights, torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), -1), torch.float64)


@pytest.mark.parametrize("transform", ["grad(grad)", "hessian", "jacrev(jacrev)", "jvp(grad)", "jacrev(jacfwd)"])
def test_second_order_transforms_match_the_reference(gen, transform, monkeypatch):
    """Hessians and gradients of gradients (MAML, Newton steps): the backward runs as torch
    operators where a grad or jvp level outside it differentiates it, and only there (vmap of
    grad and plain grad keep the fused backward)."""
    from mha import autograd
    q, k, v, t = randn(gen, 2, 3, 4), randn(gen, 2, 5, 4), randn(gen, 2, 5, 4), randn(gen, 2, 3, 4)
    mask = randn(gen, 3, 5)

    def loss(attention):
        return lambda q, k: (attention(q, k, v, attn_mask=mask) * t).square().sum()

    transforms = {
        "grad(grad)": lambda f: func.grad(lambda q, k: func.grad(f, argnums=(0, 1))(q, k)[1].square().sum())(q, k),
        "hessian": lambda f: func.hessian(f)(q, k),
        "jacrev(jacrev)": lambda f: func.jacrev(func.jacrev(f, argnums=1), argnums=0)(q, k),
        "jvp(grad)": lambda f: func.jvp(lambda q: func.grad(f)(q, k), (q,), (t,))[1],
        "jacrev(jacfwd)": lambda f: func.jacrev(func.jacfwd(f, argnums=1), argnums=0)(q, k),
    }
    explicit = []
    original = autograd._differentiable_sdpa_backward
    monkeypatch.setattr(autograd, "_differentiable_sdpa_backward",
                        lambda *a: explicit.append(1) or original(*a))
    got = transforms[transform](loss(mha.scaled_dot_product_attention))
    want = transforms[transform](loss(lambda q, k, v, attn_mask: reference(q, k, v, attn_mask)))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        close(a, b, torch.float64)
    assert explicit or transform == "jacrev(jacfwd)"  # (reverse over the jvp rule's torch operators)
    explicit.clear()
    func.grad(loss(mha.scaled_dot_product_attention))(q, k)
    func.vmap(func.grad(loss(mha.scaled_dot_product_attention)), in_dims=(0, None))(q[None].expand(3, 2, 3, 4), k)
    assert not explicit, "a first derivative left the fused backward"


def test_what_the_transforms_cannot_do_is_a_clear_error(gen):
    q = randn(gen, 2, 4, 8)
    with pytest.raises(RuntimeError, match="forward mode over forward mode"):  # (torch.func would drop a term)
        func.jacfwd(func.jacfwd(lambda x: mha.scaled_dot_product_attention(x, q, q).sum()))(q)
    with pytest.raises(RuntimeError, match="dropout"):  # forward mode cannot redraw the kernel's mask
        func.jvp(lambda x: mha.scaled_dot_product_attention(x, q, q, dropout_p=0.5), (q,), (q,))
    with pytest.raises(TypeError, match="key: expected a torch tensor"):
        func.vmap(lambda x: mha.scaled_dot_product_attention(x, q.numpy(), q))(q[None])


def test_patched_torch_sdpa_under_vmap(gen, monkeypatch):
    """A model that calls F.scaled_dot_product_attention, vmapped (per-example gradients) with the
    patch on."""
    B, H, L, E = 3, 2, 5, 8
    x = randn(gen, B, L, H * E, dtype=torch.float32)  # (float64 calls are left to PyTorch's function)
    weight = randn(gen, 3 * H * E, H * E, dtype=torch.float32) / 8

    def model(weight, x):
        q, k, v = (x @ weight.T).unflatten(-1, (3, H, E)).permute(1, 2, 0, 3)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    want = func.vmap(func.grad(model), in_dims=(None, 0))(weight.double(), x.double())
    calls = []
    monkeypatch.setattr(torch_sdpa, "_mha_sdpa", lambda *a, **kw: calls.append(1) or mha.scaled_dot_product_attention(*a, **kw))
    with mha.patch_torch_sdpa():
        got = func.vmap(func.grad(model), in_dims=(None, 0))(weight, x)
    assert calls, "the patched function did not run mha's kernel"
    close(got, want, torch.float32)


# ---- the module: mha.nn.MultiheadAttention (and the functional form) under transforms ----

def module_case(rng, gen):
    """A float64 torch.nn.MultiheadAttention with random options and parameters, its mha copy,
    inputs (a vmapped first dimension of 3 examples), masks and call flags."""
    E = rng.choice([8, 12, 16])
    H = rng.choice([h for h in (1, 2, 4) if E % h == 0])
    options = dict(bias=rng.random() < 0.7, add_bias_kv=rng.random() < 0.3, add_zero_attn=rng.random() < 0.3,
                   batch_first=rng.random() < 0.5)
    if rng.random() < 0.3:
        options.update(kdim=rng.choice([5, 7]), vdim=rng.choice([6, 9]))
    theirs = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    N, L, S = 2, rng.randint(1, 6), rng.randint(1, 6)
    unbatched = rng.random() < 0.3  # each example [L, E]

    def inputs(length, width):
        shape = (length, width) if unbatched else (N, length, width) if options["batch_first"] else (length, N, width)
        return randn(gen, 3, *shape)

    q, k, v = inputs(L, E), inputs(S, options.get("kdim", E)), inputs(S, options.get("vdim", E))
    kwargs = dict(need_weights=rng.random() < 0.5, average_attn_weights=rng.random() < 0.5)
    if rng.random() < 0.5:
        padding = torch.rand((S,) if unbatched else (N, S), generator=gen) < 0.3
        padding[..., 0] = False  # (no fully masked rows)
        if rng.random() < 0.5:  # a float mask: large negatives and small offsets
            padding = torch.zeros(padding.shape, dtype=torch.float64).masked_fill(padding, -1e4) + randn(
                gen, *padding.shape)
        kwargs["key_padding_mask"] = padding
    if rng.random() < 0.5:
        kwargs["attn_mask"] = randn(gen, *((L, S) if rng.random() < 0.5 else ((1 if unbatched else N) * H, L, S)))
    elif L == S and rng.random() < 0.4:  # PyTorch takes is_causal as a hint about this mask
        kwargs.update(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), is_causal=True)
    return theirs, ours, (q, k, v), kwargs


def module_loss(module, kwargs):
    def loss(params, q, k, v):
        out, weights = func.functional_call(module, params, (q, k, v), kwargs)
        return out.square().sum() + (0 if weights is None else weights.square().sum() + weights.sum() / 2)
    return loss


def test_module_gradients_under_transforms_match_torch(parity_seed, gen):
    """Per-example gradients of the parameters and inputs (vmap of grad) and the gradient of a
    vmapped call, over random module options, masks and flags, against torch's module."""
    rng = random.Random(parity_seed)
    for case in range(24):
        theirs, ours, (q, k, v), kwargs = module_case(rng, gen)
        params = {name: p.detach() for name, p in theirs.named_parameters()}
        transforms = {
            "vmap(grad)": lambda f: func.vmap(func.grad(f, argnums=(0, 1, 2, 3)), in_dims=(None, 0, 0, 0)),
            "grad(vmap)": lambda f: func.grad(lambda p, q, k, v: func.vmap(f, in_dims=(None, 0, 0, 0))(p, q, k, v).sum(),
                                              argnums=(0, 1, 2, 3)),
        }
        # PyTorch's one inconsistency (README, "Semantics worth knowing"; test_parity_module.py):
        # with is_causal, extra key columns, no padding mask and no weights, it hides those
        # columns from early queries; its mask path, which ours follows, keeps them visible.
        their_kwargs = dict(kwargs)
        if (kwargs.get("is_causal") and (theirs.bias_k is not None or theirs.add_zero_attn)
                and "key_padding_mask" not in kwargs and not kwargs["need_weights"]):
            their_kwargs["is_causal"] = False
        for name, transform in transforms.items():
            got = transform(module_loss(ours, kwargs))(params, q, k, v)
            want = transform(module_loss(theirs, their_kwargs))(params, q, k, v)
            got = [*got[0].values(), *got[1:]]
            want = [*want[0].values(), *want[1:]]
            floor = max(w.abs().max().item() for w in want)  # (some gradients are exact zeros: one key)
            for a, b in zip(got, want):
                err = (a - b).abs().max().item() / floor
                assert err < 1e-10, f"case {case} {name}: {kwargs.keys()} relative error {err:.3g}"


def test_module_ensemble_by_vmap_over_parameters(gen):
    """Three modules' parameters stacked (torch.func.stack_module_state) and vmapped: an ensemble
    in one call, as with torch's module."""
    theirs = [torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64) for _ in range(3)]
    ours = [mha.nn.MultiheadAttention.from_torch(t) for t in theirs]
    x = randn(gen, 2, 5, 16)

    def ensemble(modules):
        params, buffers = func.stack_module_state(modules)
        base = modules[0]
        return func.vmap(lambda p, b: func.functional_call(base, (p, b), (x, x, x), {"is_causal": False})[0])(
            params, buffers)

    close(ensemble(ours), ensemble(theirs), torch.float64)


@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn", "none"])
def test_module_under_grad_agrees_with_the_eager_module(gen, extra):
    """mha's own conventions carry over: is_causal without attn_mask (and beside appended keys,
    which every query sees), and the result of torch.func.grad equals the eager (C++ module)
    backward."""
    module = mha.nn.MultiheadAttention(16, 2, add_bias_kv=extra == "bias_kv", add_zero_attn=extra == "zero_attn",
                                       dtype=torch.float64)
    q, k = randn(gen, 6, 3, 16), randn(gen, 6, 3, 16)
    padding = torch.rand(3, 6, generator=gen) < 0.3
    padding[:, 0] = False
    for need_weights in (False, True):
        kwargs = dict(is_causal=True, need_weights=need_weights, average_attn_weights=False,
                      key_padding_mask=padding)
        params = {name: p.detach() for name, p in module.named_parameters()}
        got = func.grad(module_loss(module, kwargs), argnums=(0, 1))(params, q, k, k)
        module.zero_grad()
        qq = q.clone().requires_grad_()
        module_loss(module, kwargs)(dict(module.named_parameters()), qq, k, k).backward()
        close(got[1], qq.grad, torch.float64)
        for name, p in module.named_parameters():
            close(got[0][name], p.grad, torch.float64)


def test_low_precision_module_under_vmap(gen):
    """bfloat16: the composed steps in bfloat16 (as PyTorch's module), against the float64 module."""
    wide = mha.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    narrow = mha.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.bfloat16)
    narrow.load_state_dict({name: p.to(torch.bfloat16) for name, p in wide.state_dict().items()})
    x = randn(gen, 3, 2, 10, 32)
    got = func.vmap(lambda x: narrow(x.to(torch.bfloat16), x.to(torch.bfloat16), x.to(torch.bfloat16))[0])(x)
    wide.load_state_dict({name: p.to(torch.bfloat16).double() for name, p in wide.state_dict().items()})
    want = func.vmap(lambda x: wide(x, x, x)[0])(x.to(torch.bfloat16).double())
    assert got.dtype == torch.bfloat16
    # bfloat16 rounds each of the chain's steps (8 bits of mantissa: 2^-8 relative per step)
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < 3e-2, err


def test_numpy_level_module_and_functional_form_under_vmap(gen):
    module = mha.MultiheadAttention(8, 2, batch_first=True, dtype="float64", seed=3).eval()
    x = randn(gen, 4, 2, 5, 8)
    out, weights = func.vmap(lambda x: module(x, x, x))(x)
    for i in range(4):
        o, w = module(x[i], x[i], x[i])
        close(out[i], o, torch.float64)
        close(weights[i], w, torch.float64)
    torch_module = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    args = (8, 2, torch_module.in_proj_weight, torch_module.in_proj_bias, None, None, False, 0.0,
            torch_module.out_proj.weight, torch_module.out_proj.bias)
    x = randn(gen, 4, 5, 2, 8)
    got = func.vmap(lambda x: mha.nn.functional.multi_head_attention_forward(x, x, x, *args)[0])(x)
    want = func.vmap(lambda x: F.multi_head_attention_forward(x, x, x, *args)[0])(x)
    close(got, want, torch.float64)


def test_module_dropout_under_vmap_follows_the_randomness_flag(gen):
    module = mha.nn.MultiheadAttention(8, 2, dropout=0.5, dtype=torch.float64)  # training mode
    x = randn(gen, 3, 4, 2, 8)
    for need_weights in (False, True):
        with pytest.raises(RuntimeError, match="randomness"):
            func.vmap(lambda x: module(x, x, x, need_weights=need_weights)[0])(x)
        out = func.vmap(lambda x: module(x, x, x, need_weights=need_weights)[0], randomness="different")(x)
        assert out.shape == x.shape and torch.isfinite(out).all()


def test_vmap_of_compiled_calls_uses_the_operators_rules(gen):
    """Under torch.compile the call is the custom operator mha::sdpa_train: its vmap rule folds the
    vmapped dimension too (no per-example fallback, which PyTorch announces with a warning). A
    gradient transform inside a compiled function breaks the graph (PyTorch's custom operators do
    not compose with torch.func.grad): that part runs eagerly, still correct."""
    B, H, L, S, E = 3, 2, 6, 7, 8
    q, k, v = randn(gen, B, H, L, E), randn(gen, H, S, E), randn(gen, B, H, S, E)
    w = randn(gen, H, L, E)

    def loss(q, k, v):
        return (mha.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(func.vmap(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      in_dims=(0, None, 0)), backend="aot_eager", fullgraph=True)(q, k, v)
    assert not [w for w in caught if "mha::" in str(w.message)], [str(w.message) for w in caught]
    close(out, reference(q, k, v, is_causal=True), torch.float64)
    grads = torch.compile(func.vmap(func.grad(loss, argnums=(0, 1, 2)), in_dims=(0, None, 0)),
                          backend="aot_eager")(q, k, v)
    want = func.vmap(func.grad(lambda q, k, v: (reference(q, k, v, is_causal=True) * w).sum(), argnums=(0, 1, 2)),
                     in_dims=(0, None, 0))(q, k, v)
    for a, b in zip(grads, want):
        close(a, b, torch.float64)


def test_vmap_of_the_custom_operators_matches_calls_one_by_one(gen):
    """torch.ops.mha.sdpa_train / sdpa_backward / sdpa_with_weights under vmap (their registered
    rules) against each example's own call; the backward's left-out gradients stay empty."""
    from mha import ops
    B, H, L, S, E = 3, 2, 5, 6, 8
    q, k, v, g = randn(gen, B, H, L, E), randn(gen, H, S, E), randn(gen, B, H, S, E), randn(gen, B, H, L, E)
    seed = ops.seed_tensor(0, 0.0)
    options = (0.0, True, None, False, seed, False, 2, -1, None, 0)  # (causal, a window of 2 keys back)
    out, lse = func.vmap(lambda q, v: torch.ops.mha.sdpa_train(q, k, v, None, *options))(q, v)
    _, weights = func.vmap(lambda q, v: torch.ops.mha.sdpa_with_weights(q, k, v, None, *options))(q, v)
    grads = func.vmap(lambda g, q, v, o, l: torch.ops.mha.sdpa_backward(g, q, k, v, o, l, None, 0.0, True, None,
                                                                        False, seed, False, 2, -1, None, 0,
                                                                        [True, True, False, False]))(g, q, v, out, lse)
    for i in range(B):
        o, l = torch.ops.mha.sdpa_train(q[i], k, v[i], None, *options)
        torch.testing.assert_close(out[i], o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[i], l, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weights[i], torch.ops.mha.sdpa_with_weights(q[i], k, v[i], None, *options)[1])
        dq, dk, _, _, _ = torch.ops.mha.sdpa_backward(g[i], q[i], k, v[i], o, l, None, 0.0, True, None, False, seed,
                                                   False, 2, -1, None, 0, [True, True, False, False])
        torch.testing.assert_close(grads[0][i], dq, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[1][i], dk, rtol=1e-12, atol=1e-12)  # each example's own dK
    assert grads[2].numel() == 0 and grads[3].numel() == 0 and grads[4].numel() == 0


def test_module_hessian_matches_torch(gen):
    """torch.func.hessian of a loss of the module's output with respect to its input, against
    torch's module (its need_weights=True path: its fused SDPA has no second derivative)."""
    theirs = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    x = randn(gen, 3, 1, 8)

    def loss(module, need_weights):
        return lambda x: module(x, x, x, need_weights=need_weights)[0].square().sum()

    want = func.hessian(loss(theirs, True))(x)
    for need_weights in (False, True):
        close(func.hessian(loss(ours, need_weights))(x), want, torch.float64)
