"""Gradients against PyTorch autograd on randomized configurations: mha.scaled_dot_product_attention
(query, key, value and a float attn_mask) and mha.nn.MultiheadAttention (inputs and every
parameter), with PyTorch in float64 as the reference and ours in float32.

Tolerance 1e-4 of the largest reference gradient (normwise): a gradient is a longer chain of
float32 sums than the forward (1e-5), through the softmax Jacobian and the projections' transposes.
A gradient that is zero in exact arithmetic (the query gradient when a single key is visible)
is judged against 1% of the largest gradient of its case instead of its own size.
Masks keep key 0 visible to every query, since a fully masked row is NaN in PyTorch and so are
all the gradients it touches; dropout is left out, since the two libraries' random masks differ
(our backward's dropout is checked against the float64 reference in the C++ tests).
"""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from test_parity_sdpa import batch_shape, broadcast_form

TOL = 1e-4
CHUNKS = 5


def rel(a, b, floor=1e-30):
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), floor)


def case_floor(tensors):
    return 0.01 * max([t.grad.abs().max().item() for t in tensors if t is not None and t.grad is not None] + [1e-30])


def output_terms_floor(module, inputs, **kwargs):
    """A quarter of the largest output of the module with its parameters and inputs replaced by
    their magnitudes: the size of the terms an output sums, so that an output that cancels to
    near zero (one value head of one dimension, E=1) is judged by the rounding of its terms."""
    magnitudes = copy.deepcopy(module)
    with torch.no_grad():
        for p in magnitudes.parameters():
            p.abs_()
    leaves = {id(t): t.detach().abs() for t in inputs}  # self-attention: one tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = magnitudes(*[leaves[id(t)] for t in inputs], **kwargs)
    return 0.25 * out.abs().max().item()


def full_gradient_floor(module, inputs, g, **kwargs):
    """1% of the largest gradient of the case with every parameter and input trained: the scale
    of its rounding where all the gradients asked for cancel to zero (one key: the query's)."""
    params = list(module.parameters())
    trained = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    leaves = {id(t): t.detach().requires_grad_() for t in inputs}  # self-attention: one leaf
    xs = [leaves[id(t)] for t in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = module(*xs, **kwargs)
    grads = torch.autograd.grad(out, params + list(leaves.values()), g, allow_unused=True)
    for p, t in zip(params, trained):
        p.requires_grad_(t)
    return 0.01 * max([d.abs().max().item() for d in grads if d is not None] + [1e-30])


def sdpa_case(rng):
    rank = int(rng.integers(2, 5)) if rng.random() < 0.85 else 5
    gqa = rank >= 3 and rng.random() < 0.4
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.integers(1, 3)) if gqa else hkv
    B, Lq, Lk = tuple(int(b) for b in rng.integers(1, 3, size=max(rank - 3, 1))), int(rng.integers(1, 24)), int(rng.integers(1, 24))
    Dk, Dv = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    lead = (*B, hq)[len(B) + 1 - (rank - 2):] if rank > 2 else ()
    lead_kv = (*B, hkv)[len(B) + 1 - (rank - 2):] if rank > 2 else ()
    arrays = [rng.standard_normal(lead + (Lq, Dk)), rng.standard_normal(lead_kv + (Lk, Dk)),
              rng.standard_normal(lead_kv + (Lk, Dv))]
    if rng.random() < 0.3:  # batch dimensions that broadcast (their gradients are summed over them)
        arrays = [broadcast_form(rng, x, gqa) for x in arrays]
        lead = batch_shape({"gqa": gqa}, *arrays)
    # Some inputs need no gradient (frozen keys and values, a fixed query): ours then computes none.
    needs = [bool(rng.random() < 0.8) for _ in range(3)]
    needs[int(rng.integers(3))] = True
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).requires_grad_(n) for x, n in zip(arrays, needs))
    mask = None
    kind = rng.choice(["none", "float", "bool"])
    if kind != "none":
        shape = (Lq, Lk) if rng.random() < 0.5 else tuple(lead) + (Lq, Lk)
        if kind == "float":
            mask = torch.from_numpy(rng.standard_normal(shape)).requires_grad_(bool(rng.random() < 0.7))
        else:
            m = rng.random(shape) < 0.8
            m[..., 0] = True  # key 0 stays visible (True = attend)
            mask = torch.from_numpy(m)
    causal = bool(rng.random() < 0.3) and mask is None
    scale = float(rng.uniform(0.1, 1.0)) if rng.random() < 0.3 else None
    return q, k, v, mask, causal, scale, gqa


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_sdpa_gradients_match_torch(chunk, parity_seed, parity_count):
    rng = np.random.default_rng([parity_seed, 5, chunk])
    n = max(300 // CHUNKS, parity_count // 8 // CHUNKS)
    for _ in range(n):
        q, k, v, mask, causal, scale, gqa = sdpa_case(rng)
        # q expanded to the output's batch dimensions (PyTorch adds a mask to q k^T in place, so it
        # takes no mask with a dimension only v has); autograd sums its gradient back.
        out_batch = batch_shape({"gqa": gqa}, q, k, v)
        ref = F.scaled_dot_product_attention(q.expand(*out_batch, *q.shape[-2:]), k, v, attn_mask=mask,
                                             is_causal=causal, scale=scale, enable_gqa=gqa)
        g = torch.from_numpy(rng.standard_normal(tuple(ref.shape)))
        ref.backward(g)
        leaves = [t.detach().float().requires_grad_(t.requires_grad) if t is not None and t.is_floating_point()
                  else t for t in (q, k, v, mask)]
        out = mha.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], attn_mask=leaves[3],
                                               is_causal=causal, scale=scale, enable_gqa=gqa)
        assert rel(out.detach(), ref.detach()) <= 1e-5
        out.backward(g.float())
        floor = case_floor((q, k, v, mask))
        # dS = P (dP - D) cancels where P V is nearly dO's own direction (exactly, with one key:
        # the query and key gradients are then zero): float32 leaves each dS_ij an absolute error
        # of about 2 Dv u max|dO| max|V| P_ij, which dQ sums over keys (weights summing to 1) and
        # dK over up to Lq queries. That bound (of maxima, so well above the typical error) is allowed
        # on top of the relative tolerance.
        s = scale if scale is not None else 1.0 / np.sqrt(q.shape[-1])
        ds_noise = 2 * v.shape[-1] * 2.0**-24 * g.abs().max().item() * v.abs().max().item()
        # An input that broadcasts sums that many more terms.
        summed = {name: np.prod(ref.shape[:-2]) / max(np.prod(x.shape[:-2]), 1)
                  for name, x in (("query", q), ("key", k), ("value", v))}
        noise = {"query": s * k.abs().max().item() * ds_noise * summed["query"],
                 "key": s * q.abs().max().item() * q.shape[-2] * ds_noise * summed["key"], "attn_mask": ds_noise}
        for ours, theirs, name in zip(leaves, (q, k, v, mask), ("query", "key", "value", "attn_mask")):
            if theirs is None or not theirs.requires_grad:
                assert ours is None or ours.grad is None, name
                continue
            denom = max(theirs.grad.abs().max().item(), floor)
            err = (ours.grad.double() - theirs.grad).abs().max().item()
            assert err <= TOL * denom + noise.get(name, 0.0), (
                f"{name} gradient: relative error {err / denom:.2e} (shapes {tuple(q.shape)}, {tuple(k.shape)})")


def module_case(rng):
    H = int(rng.integers(1, 4))
    E = H * int(rng.integers(1, 6))
    cross = bool(rng.random() < 0.5)
    c = dict(E=E, H=H, bias=bool(rng.random() < 0.7), add_bias_kv=bool(rng.random() < 0.3),
             add_zero_attn=bool(rng.random() < 0.3), batch_first=bool(rng.random() < 0.5),
             kdim=int(rng.integers(1, 8)) if cross and rng.random() < 0.5 else None,
             vdim=int(rng.integers(1, 8)) if cross and rng.random() < 0.5 else None,
             batched=bool(rng.random() < 0.8), N=int(rng.integers(1, 3)), L=int(rng.integers(1, 8)), cross=cross)
    c["S"] = int(rng.integers(1, 8)) if cross else c["L"]
    return c


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_module_gradients_match_torch(chunk, parity_seed, parity_count):
    rng = np.random.default_rng([parity_seed, 6, chunk])
    n = max(300 // CHUNKS, parity_count // 8 // CHUNKS)
    for _ in range(n):
        c = module_case(rng)
        E, H, N, L, S = c["E"], c["H"], c["N"], c["L"], c["S"]
        torch.manual_seed(int(rng.integers(2**31)))
        ref = torch.nn.MultiheadAttention(E, H, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                          add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                          batch_first=c["batch_first"]).double()
        ours = mha.nn.MultiheadAttention(E, H, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                         add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                         batch_first=c["batch_first"])
        ours.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        # Some parameters frozen (fine-tuning around a fixed attention): ours neither computes nor
        # returns their gradients, as PyTorch does not.
        for (_, p), (_, rp) in zip(ours.named_parameters(), ref.named_parameters()):
            if rng.random() < 0.25:
                p.requires_grad_(False)
                rp.requires_grad_(False)

        def seq(length, width):
            shape = (N, length, width) if c["batch_first"] else (length, N, width)
            return torch.from_numpy(rng.standard_normal(shape if c["batched"] else (length, width)))

        # In cross-attention an input may need no gradient (a frozen encoder's output): ours then
        # computes none (autograd's needs_input_grad), and the others are unchanged.
        wanted = [bool(rng.random() < 0.7) for _ in range(3)] if c["cross"] else [True] * 3
        query = seq(L, E).requires_grad_(wanted[0])
        key = seq(S, c["kdim"] or E).requires_grad_(wanted[1]) if c["cross"] else query
        value = seq(S, c["vdim"] or E).requires_grad_(wanted[2]) if c["cross"] else query
        kpm = None
        if rng.random() < 0.5:
            m = rng.random((N, S) if c["batched"] else (S,)) < 0.3
            m[..., 0] = False  # key 0 stays visible (True = masked out)
            kpm = torch.from_numpy(m)
        attn_mask = None
        if rng.random() < 0.4:
            attn_mask = torch.from_numpy(rng.standard_normal((L, S)))
        need_weights = bool(rng.random() < 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_out, _ = ref(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
        g = torch.from_numpy(rng.standard_normal(tuple(ref_out.shape)))
        if ref_out.requires_grad:
            ref_out.backward(g)

        q32 = query.detach().float().requires_grad_(wanted[0])
        k32 = key.detach().float().requires_grad_(wanted[1]) if c["cross"] else q32
        v32 = value.detach().float().requires_grad_(wanted[2]) if c["cross"] else q32
        out, _ = ours(q32, k32, v32, key_padding_mask=kpm, attn_mask=None if attn_mask is None else attn_mask.float(),
                      need_weights=need_weights)
        out_floor = output_terms_floor(ref, (query, key, value), key_padding_mask=kpm, attn_mask=attn_mask,
                                       need_weights=False)
        assert rel(out.detach(), ref_out.detach(), out_floor) <= 1e-5, c
        assert out.requires_grad == ref_out.requires_grad
        if not out.requires_grad:  # everything frozen: nothing to differentiate
            continue
        out.backward(g.float())
        inputs = [(q32, query, "query")] + ([(k32, key, "key"), (v32, value, "value")] if c["cross"] else [])
        params = [(p, rp, name) for (name, p), (_, rp) in zip(ours.named_parameters(), ref.named_parameters())]
        for a, b, name in inputs + params:
            assert (a.grad is None) == (b.grad is None), f"{name}: requires_grad {a.requires_grad}"
        pairs = [(a, b, name) for a, b, name in inputs + params if b.grad is not None]
        floor = max(case_floor([b for _, b, _ in pairs]),
                    full_gradient_floor(ref, (query, key, value), g, key_padding_mask=kpm, attn_mask=attn_mask,
                                        need_weights=need_weights))
        for a, b, name in pairs:
            err = rel(a.grad, b.grad, floor)
            assert err <= TOL, f"{name} gradient: relative error {err:.2e} for {c}"


@pytest.mark.parametrize("need_weights", [False, True])
def test_module_gradients_with_hugging_face_min_masks(need_weights, parity_seed):
    """A float attn_mask at finfo.min for causality and left padding (a batch entry's first three
    query rows see no key but at that value) plus a key_padding_mask (a second mask term): against
    PyTorch's module in float64 with need_weights=True, which forms the softmax itself. Its SDPA
    path (need_weights=False) gives those rows' keys weight 1 each in the backward instead of 1/l."""
    rng = np.random.default_rng([parity_seed, 8])
    torch.manual_seed(int(rng.integers(2**31)))
    E, H, N, L = 32, 4, 2, 9
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x = torch.from_numpy(rng.standard_normal((N, L, E)))
    lowest = torch.finfo(torch.float32).min
    mask = torch.zeros(N, L, L, dtype=torch.float64)
    for n, pad in enumerate([0, 3]):
        mask[n].masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), lowest)
        mask[n, :, :pad] = lowest
    mask = mask.repeat_interleave(H, dim=0)  # [N * H, L, L]
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[0, L - 1] = True  # (batch entry 0's last key, masked out: -inf)
    g = torch.from_numpy(rng.standard_normal((N, L, E)))
    x64 = x.clone().requires_grad_()
    ref(x64, x64, x64, key_padding_mask=kpm, attn_mask=mask, need_weights=True)[0].backward(g)
    x32 = x.float().requires_grad_()
    ours(x32, x32, x32, key_padding_mask=kpm, attn_mask=mask.float(), need_weights=need_weights)[0].backward(g.float())
    pairs = [(x32, x64, "input")] + [(p, rp, name) for (name, p), (_, rp) in
                                     zip(ours.named_parameters(), ref.named_parameters())]
    floor = case_floor([b for _, b, _ in pairs])
    for a, b, name in pairs:
        err = rel(a.grad, b.grad, floor)
        assert err <= TOL, f"{name} gradient: relative error {err:.2e}"


def test_frozen_module_passes_gradients_through(parity_seed):
    """Every parameter frozen (an adapter trained around a fixed attention): the inputs' gradients
    match PyTorch's, no parameter gets one; with the inputs frozen too, nothing is saved and the
    output needs no gradient."""
    rng = np.random.default_rng([parity_seed, 9])
    torch.manual_seed(int(rng.integers(2**31)))
    ref = torch.nn.MultiheadAttention(24, 3, batch_first=True).double().requires_grad_(False)
    ours = mha.nn.MultiheadAttention(24, 3, batch_first=True)
    ours.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    ours.requires_grad_(False)
    x = torch.from_numpy(rng.standard_normal((2, 7, 24))).requires_grad_()
    g = torch.from_numpy(rng.standard_normal((2, 7, 24)))
    ref(x, x, x, need_weights=False)[0].backward(g)
    x32 = x.detach().float().requires_grad_()
    ours(x32, x32, x32, need_weights=False)[0].backward(g.float())
    assert rel(x32.grad, x.grad) <= TOL
    assert all(p.grad is None for p in ours.parameters())
    out, _ = ours(x32.detach(), x32.detach(), x32.detach(), need_weights=False)
    assert not out.requires_grad and out.grad_fn is None


def test_loss_falls_with_torch_optimizer(parity_seed):
    """mha.nn.MultiheadAttention trains inside a PyTorch loop: copy a random sequence."""
    torch.manual_seed(parity_seed % 2**31)
    attn = mha.nn.MultiheadAttention(16, 2, batch_first=True)
    opt = torch.optim.Adam(attn.parameters(), lr=1e-2)
    x = torch.randn(8, 6, 16)
    first = None
    for _ in range(60):
        out, _ = attn(x, x, x, need_weights=False)
        loss = ((out - x) ** 2).mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_float64_sdpa_matches_torch_and_passes_gradcheck(parity_seed):
    """float64 inputs run in float64 (PyTorch's semantics): output and every gradient within 1e-12
    of PyTorch's float64 SDPA on the random cases above (broadcast batch dimensions, grouped heads,
    masks, causality), and torch.autograd.gradcheck passes (finite differences need float64)."""
    rng = np.random.default_rng([parity_seed, 13])
    checked = 0
    for _ in range(150):
        q, k, v, mask, causal, scale, gqa = sdpa_case(rng)
        out_batch = batch_shape({"gqa": gqa}, q, k, v)
        ref = F.scaled_dot_product_attention(q.expand(*out_batch, *q.shape[-2:]), k, v, attn_mask=mask,
                                             is_causal=causal, scale=scale, enable_gqa=gqa)
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None and t.is_floating_point()
                  else t for t in (q, k, v, mask)]
        out = mha.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], attn_mask=leaves[3],
                                               is_causal=causal, scale=scale, enable_gqa=gqa)
        assert out.dtype == torch.float64 and out.shape == ref.shape
        assert rel(out.detach(), ref.detach()) <= 1e-12
        g = torch.from_numpy(rng.standard_normal(tuple(ref.shape)))
        wanted = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
        ours = [t for t in leaves if t is not None and t.requires_grad]
        for a, b in zip(torch.autograd.grad(out, ours, g), torch.autograd.grad(ref, wanted, g)):
            assert (a - b).abs().max().item() <= 1e-12 * max(b.abs().max().item(), 1.0)
        if checked < 6 and sum(t.numel() for t in ours) + out.numel() <= 300:  # finite differences: small cases
            checked += 1

            def f(*xs):
                it = iter(xs)
                args = [next(it) if t is not None and t.requires_grad else t for t in leaves]
                return mha.scaled_dot_product_attention(args[0], args[1], args[2], attn_mask=args[3],
                                                        is_causal=causal, scale=scale, enable_gqa=gqa)
            assert torch.autograd.gradcheck(f, [t.detach().requires_grad_() for t in ours])
    assert checked >= 4, "too few small cases for gradcheck"


def test_float64_module_matches_torch_and_passes_gradcheck(parity_seed):
    """A float64 mha.nn.MultiheadAttention computes in float64, as PyTorch's float64 module does:
    on the random module cases above (cross-attention, kdim/vdim, bias_kv, zero attention,
    batch_first, unbatched, padding and float masks that require grad, weights or not), the output,
    the weights and every gradient (inputs, parameters, the float mask) within 1e-12 of PyTorch's,
    and torch.autograd.gradcheck passes through it (which runs the backward more than once per
    graph) on small cases."""
    rng = np.random.default_rng([parity_seed, 17])
    checked = 0
    for n in range(120):
        c = module_case(rng)
        E, H, N, L, S = c["E"], c["H"], c["N"], c["L"], c["S"]
        torch.manual_seed(int(rng.integers(2**31)))
        ref = torch.nn.MultiheadAttention(E, H, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                          add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                          batch_first=c["batch_first"], dtype=torch.float64)
        ours = mha.nn.MultiheadAttention(E, H, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                         add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                         batch_first=c["batch_first"], dtype=torch.float64)
        ours.load_state_dict(ref.state_dict())

        def seq(length, width):
            shape = (N, length, width) if c["batch_first"] else (length, N, width)
            return torch.from_numpy(rng.standard_normal(shape if c["batched"] else (length, width)))

        query = seq(L, E)
        key = seq(S, c["kdim"] or E) if c["cross"] else query
        value = seq(S, c["vdim"] or E) if c["cross"] else query
        kpm = None
        if rng.random() < 0.5:
            m = rng.random((N, S) if c["batched"] else (S,)) < 0.3
            m[..., 0] = False  # key 0 stays visible (True = masked out)
            kpm = torch.from_numpy(m)
        attn_mask = torch.from_numpy(rng.standard_normal((L, S))) if rng.random() < 0.5 else None
        need_weights = bool(rng.random() < 0.5)
        average = bool(rng.random() < 0.5)
        results, grads = [], []
        for module in (ref, ours):
            leaves = {id(t): t.detach().clone().requires_grad_() for t in (query, key, value)}  # self: one leaf
            q, k, v = (leaves[id(t)] for t in (query, key, value))
            mask = None if attn_mask is None else attn_mask.clone().requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, weights = module(q, k, v, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights,
                                      average_attn_weights=average)
            results.append((out, weights))
            g = torch.from_numpy(np.random.default_rng([parity_seed, 17, n]).standard_normal(tuple(out.shape)))
            wrt = [*leaves.values(), *([] if mask is None else [mask]), *module.parameters()]
            grads.append(torch.autograd.grad(out, wrt, g))
        (r_out, r_w), (o_out, o_w) = results
        assert o_out.dtype == torch.float64 and rel(o_out.detach(), r_out.detach()) <= 1e-12, c
        assert (o_w is None) == (r_w is None) and (o_w is None or rel(o_w, r_w.detach()) <= 1e-12), c
        scale = max(float(b.abs().max()) for b in grads[0])
        for a, b in zip(grads[1], grads[0]):
            assert float((a - b).abs().max()) <= 1e-12 * max(scale, 1.0), c

        params = dict(ours.named_parameters())
        if checked < 4 and E <= 6 and L * S <= 16 and sum(p.numel() for p in params.values()) <= 150:
            checked += 1

            def f(q, mask, *ps):
                kv = (key, value) if c["cross"] else (q, q)
                return torch.func.functional_call(ours, dict(zip(params, ps)), (q, *kv),
                                                  dict(key_padding_mask=kpm, attn_mask=mask, need_weights=False))[0]
            mask = None if attn_mask is None else attn_mask.clone().requires_grad_()
            assert torch.autograd.gradcheck(f, [query.clone().requires_grad_(), mask,
                                                *(p.detach().clone().requires_grad_() for p in params.values())])
    assert checked >= 2, "too few small cases for gradcheck"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_sdpa_gradients(dtype, parity_seed):
    """bfloat16 / float16 tensors inside autograd: output and .grad in the inputs' dtype, against
    float64 autograd on the same rounded inputs. The bound is a few units of the dtype's rounding
    (bf16 2^-9, fp16 2^-12) on the output, the saved output and each gradient; at least 8 keys, so
    no gradient is only the rounding of a cancelled sum (one visible key), and causal calls have
    at least 8 queries (causal row i sees i + 1 keys: with 2 queries, a key's gradient came from
    rows of 1 and 2 keys alone, and an fp16 case measured 1.06x the bound)."""
    rng = np.random.default_rng([parity_seed, 7])
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for _ in range(20):
        B, H, L, S, D = (int(rng.integers(1, 3)), 2, int(rng.integers(1, 40)), int(rng.integers(8, 40)),
                         int(rng.choice([16, 32, 64])))
        q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(dtype)
                   for s in ((B, H, L, D), (B, H, S, D), (B, H, S, D)))
        g = torch.from_numpy(rng.standard_normal((B, H, L, D))).to(dtype)
        causal = bool(rng.random() < 0.3) and 8 <= L <= S
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mha.scaled_dot_product_attention(*ours, is_causal=causal)
        # What autograd keeps for the backward is in the inputs' dtype (no float32 copies).
        assert all(t.dtype == dtype for t in out.grad_fn.saved_tensors[:3] + out.grad_fn.saved_tensors[4:5])
        out.backward(g)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal)
        ref.backward(g.double())
        assert out.dtype == dtype and all(t.grad.dtype == dtype for t in ours)
        assert rel(out.detach().double(), ref.detach()) <= tol
        floor = 0.05 * max(float(t.grad.abs().max()) for t in ref_leaves)
        for mine, theirs, name in zip(ours, ref_leaves, ("query", "key", "value")):
            err = rel(mine.grad.double(), theirs.grad, floor)
            assert err <= tol, f"{name} gradient ({dtype}): relative error {err:.2e} (B={B} L={L} S={S} D={D})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_mask_of_the_inputs_dtype(dtype, parity_seed):
    """A float mask of the inputs' bfloat16/float16 (as PyTorch takes it, and bfloat16 models pass
    it) is its float32 values: output and q/k/v gradients have the bits of the call with the
    mask widened; its own gradient is that call's, rounded to its dtype. Eager and compiled."""
    rng = np.random.default_rng([parity_seed, 13])
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(dtype) for s in ((2, 2, 7, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    g = torch.from_numpy(rng.standard_normal((2, 2, 7, 16))).to(dtype)
    mask = torch.from_numpy(rng.standard_normal((2, 1, 7, 9))).to(dtype)

    def grads(mask, fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad((out.float() * g.float()).sum(), leaves))

    def sdpa(q, k, v, m):
        return mha.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)

    torch._dynamo.reset()
    for fn in (sdpa, torch.compile(sdpa, backend="aot_eager", fullgraph=True)):
        ours, wide = grads(mask, fn), grads(mask.float(), fn)
        for a, b in zip(ours[:4], wide[:4]):
            assert a.dtype == dtype and torch.equal(a, b)
        assert ours[4].dtype == dtype and torch.equal(ours[4], wide[4].to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_module(dtype, parity_seed):
    """mha.nn.MultiheadAttention in bfloat16 / float16 (built with dtype= or converted with .to()):
    output, weights and .grad in its dtype, against torch's module in float64 on the same rounded
    parameters and inputs. Ours computes in float32 and rounds once, so the output and weights stay
    within the dtype's unit roundoff u (bf16 2^-8, fp16 2^-11) of the largest value, and each
    gradient within a few u (autograd sums the self-attention input's three gradients in the
    dtype), judged against 5% of the case's largest gradient. A bfloat16 module on a CPU with
    bfloat16 products rounds as PyTorch's bf16 module instead: each error within 16u (both reach
    7u on single cases), and the mean error within 1.5 times that of torch's own bfloat16 module
    on the same values (ours measures 0.8 times it)."""
    rng = np.random.default_rng([parity_seed, 8])
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    as_pytorch = dtype == torch.bfloat16 and mha.bfloat16_products()
    errors, their_errors = [], []
    for _ in range(24):
        c = module_case(rng)
        E, H, N, L, S = c["E"] * 4, c["H"], c["N"], c["L"] + 8, c["S"] + 8
        options = dict(bias=c["bias"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
                       kdim=c["kdim"], vdim=c["vdim"], batch_first=c["batch_first"])
        if not c["cross"]:
            S = L
        torch.manual_seed(int(rng.integers(2**31)))
        if rng.random() < 0.5:
            ours = mha.nn.MultiheadAttention(E, H, dtype=dtype, **options)
        else:
            ours = mha.nn.MultiheadAttention(E, H, **options).to(dtype)
        ref = torch.nn.MultiheadAttention(E, H, **options).double()
        ref.load_state_dict(ours.state_dict())
        theirs = torch.nn.MultiheadAttention(E, H, **options).to(dtype)
        theirs.load_state_dict(ours.state_dict())

        def seq(length, width):
            shape = (N, length, width) if c["batch_first"] else (length, N, width)
            return torch.from_numpy(rng.standard_normal(shape if c["batched"] else (length, width))).to(dtype)

        query = seq(L, E).requires_grad_()
        key = seq(S, c["kdim"] or E).requires_grad_() if c["cross"] else query
        value = seq(S, c["vdim"] or E).requires_grad_() if c["cross"] else query
        kpm = None
        if rng.random() < 0.5:
            m = rng.random((N, S) if c["batched"] else (S,)) < 0.3
            m[..., 0] = False
            kpm = torch.from_numpy(m)
        attn_mask = torch.from_numpy(rng.standard_normal((L, S))).to(dtype) if rng.random() < 0.5 else None
        out, weights = ours(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask)
        g = torch.from_numpy(rng.standard_normal(tuple(out.shape))).to(dtype)
        out.backward(g)
        their_leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        their_q, their_k, their_v = their_leaves if c["cross"] else (their_leaves[0],) * 3
        their_out, their_weights = theirs(their_q, their_k, their_v, key_padding_mask=kpm, attn_mask=attn_mask)
        their_out.backward(g)

        leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
        ref_q, ref_k, ref_v = leaves if c["cross"] else (leaves[0],) * 3
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_out, ref_weights = ref(ref_q, ref_k, ref_v, key_padding_mask=kpm,
                                       attn_mask=None if attn_mask is None else attn_mask.double())
        ref_out.backward(g.double())
        assert out.dtype == dtype and weights.dtype == dtype
        if as_pytorch:
            for a, b, r, name in [(out, their_out, ref_out, "output"), (weights, their_weights, ref_weights, "weights")]:
                errors.append(rel(a.detach().double(), r.detach()))
                their_errors.append(rel(b.detach().double(), r.detach()))
                assert errors[-1] <= 16 * u, f"{name}: {errors[-1]:.2e} (PyTorch's {their_errors[-1]:.2e}) for {c}"
        else:
            assert rel(out.detach().double(), ref_out.detach()) <= 1.1 * u, c
            assert rel(weights.double(), ref_weights.detach()) <= 1.1 * u, c
        pairs = [(query, ref_q, their_q, "query")]
        if c["cross"]:
            pairs += [(key, ref_k, their_k, "key"), (value, ref_v, their_v, "value")]
        pairs += [(p, rp, tp, name) for (name, p), rp, tp in zip(ours.named_parameters(), ref.parameters(),
                                                               theirs.parameters())]
        floor = 0.05 * max(float(b.grad.abs().max()) for _, b, _, _ in pairs)
        for a, b, t, name in pairs:
            assert a.grad.dtype == dtype, name
            err = rel(a.grad.double(), b.grad, floor)
            if as_pytorch:
                errors.append(err)
                their_errors.append(rel(t.grad.double(), b.grad, floor))
                assert err <= 16 * u, f"{name} gradient: {err:.2e} (PyTorch's {their_errors[-1]:.2e}) for {c}"
            else:
                assert err <= 4 * u, f"{name} gradient ({dtype}): relative error {err:.2e} for {c}"
    if as_pytorch:
        assert np.mean(errors) <= 1.5 * np.mean(their_errors), (np.mean(errors), np.mean(their_errors))


def test_bfloat16_training_rounds_as_pytorch(parity_seed):
    """A bfloat16 module's training step without the weights (on a CPU with bfloat16 products it
    runs in them, rounding its projections, attention output and every product of the backward
    to bfloat16 as PyTorch's bf16 module does): each gradient and the output, against torch's module
    in float64 on the same values, each within 16u (u = 2^-8; the query's gradient of a peaked
    softmax reaches 9u in both) or, where torch's own bfloat16 module errs more, within 1.25 times
    its error (the query's gradient of the unbatched cross-attention case, identical in both, was
    16.5u for parity seed 2794599132; 8-10u for 4 of 60 other seeds), their mean within 1.5 times
    that of torch's own bfloat16 module.
    Random biases, masks, causal, cross-attention with kdim/vdim, bias_k/bias_v and the zero key,
    unbatched inputs; lengths past 32, where the attention takes the pair products."""
    rng = np.random.default_rng([parity_seed, 10])
    u = 2.0**-8
    errors, their_errors = [], []
    for n in range(10):
        H, E = (2, 64) if n % 2 else (4, 64)
        cross, batch_first = n % 3 == 1, n % 2 == 0
        N, L = int(rng.integers(1, 3)), int(rng.integers(33, 70))
        S = int(rng.integers(33, 70)) if cross else L
        options = dict(bias=n % 5 != 4, add_bias_kv=n == 2, add_zero_attn=n == 5, batch_first=batch_first,
                       kdim=24 if cross and n % 2 == 0 else None, vdim=40 if cross and n % 2 == 0 else None)
        torch.manual_seed(int(rng.integers(2**31)))
        ref = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **options)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_((torch.randn_like(p) if "weight" not in name else p).to(torch.bfloat16))
        state = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
        ours = mha.nn.MultiheadAttention(E, H, dtype=torch.bfloat16, **options)
        theirs = torch.nn.MultiheadAttention(E, H, dtype=torch.bfloat16, **options)
        ours.load_state_dict(state)
        theirs.load_state_dict(state)

        batched = n != 7

        def rows(length, width):
            if not batched:
                return (length, width)
            return (N, length, width) if batch_first else (length, N, width)

        def seq(length, width):
            return torch.from_numpy(rng.standard_normal(rows(length, width)))

        values = [seq(L, E), seq(S, options["kdim"] or E), seq(S, options["vdim"] or E)]
        call = {}
        if n % 3 == 0:
            call["is_causal"], call["attn_mask"] = True, torch.ones(L, S, dtype=torch.bool).triu(1)
        elif n % 4 == 1:
            call["attn_mask"] = torch.from_numpy(rng.standard_normal((L, S))).to(torch.bfloat16)
        if n % 4 == 2:
            kpm = torch.zeros(N, S, dtype=torch.bool)
            kpm[:, S - 5:] = True
            call["key_padding_mask"] = kpm
        g = seq(L, E).to(torch.bfloat16)

        def step(module, dtype):
            inputs = [t.to(torch.bfloat16).to(dtype).requires_grad_() for t in values]
            q, k, v = inputs if cross else (inputs[0],) * 3
            kw = {key: (m.to(dtype) if key == "attn_mask" and m.dtype != torch.bool else m) for key, m in call.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, _ = module(q, k, v, need_weights=False, **kw)
            out.backward(g.to(dtype))
            grads = [t.grad for t in (inputs if cross else inputs[:1])] + [p.grad for p in module.parameters()]
            return [out.detach()] + grads

        exact = step(ref, torch.float64)
        mine, torch_bf16 = step(ours, torch.bfloat16), step(theirs, torch.bfloat16)
        names = ["output", "query"] + (["key", "value"] if cross else []) + [name for name, _ in ref.named_parameters()]
        for name, a, b, r in zip(names, mine, torch_bf16, exact):
            assert a.dtype == torch.bfloat16, name
            errors.append(rel(a, r))
            their_errors.append(rel(b, r))
            bound = max(16 * u, 1.25 * their_errors[-1])
            assert errors[-1] <= bound, f"{name} (case {n}): {errors[-1]:.2e}, PyTorch's {their_errors[-1]:.2e}"
    assert np.mean(errors) <= 1.5 * np.mean(their_errors), (np.mean(errors), np.mean(their_errors))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_numpy_level_module(dtype, parity_seed):
    """mha.MultiheadAttention (the numpy-level module) keeps a bfloat16/float16 torch module's dtype
    in from_torch, computes as mha.nn does (float32, rounded once: within the unit roundoff u of
    the largest value against torch's module in float64 on the same parameters), hands back its
    state_dict exactly (bfloat16 widened to float32, as numpy has none), and its parameter
    gradients within a few u. Built with dtype= it takes numpy float16 too. A float64 module (kept
    float64 by from_torch and load_state_dict) computes in float64: u is then 1e-13, some hundreds
    of float64's unit roundoff, where one float32 step would cost 6e-8. bfloat16 on a CPU with
    bfloat16 products rounds as PyTorch's bf16 module: held to it as in test_low_precision_module."""
    rng = np.random.default_rng([parity_seed, 9])
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 1e-13}[dtype]
    as_pytorch = dtype == torch.bfloat16 and mha.bfloat16_products()
    errors, their_errors = [], []
    for _ in range(8):
        c = module_case(rng)
        E, H, N, L = c["E"] * 4, c["H"], c["N"], c["L"] + 8
        S = c["S"] + 8 if c["cross"] else L
        options = dict(bias=c["bias"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
                       kdim=c["kdim"], vdim=c["vdim"], batch_first=c["batch_first"])
        torch.manual_seed(int(rng.integers(2**31)))
        # (float64 initialised as such: parameters that float32 cannot hold, which a float32 step loses)
        theirs = torch.nn.MultiheadAttention(E, H, **options, dtype=dtype if dtype == torch.float64 else None).to(dtype)
        ours = mha.MultiheadAttention.from_torch(theirs)
        assert ours.dtype == str(dtype).replace("torch.", "")
        state = ours.state_dict()
        for name, value in theirs.state_dict().items():
            assert torch.equal(torch.from_numpy(np.asarray(state[name])).to(dtype), value), name
        ref = torch.nn.MultiheadAttention(E, H, **options).double()
        ref.load_state_dict(theirs.state_dict())

        def seq(length, width):
            shape = (N, length, width) if c["batch_first"] else (length, N, width)
            return torch.from_numpy(rng.standard_normal(shape if c["batched"] else (length, width))).to(dtype)

        query = seq(L, E).requires_grad_()
        key = seq(S, c["kdim"] or E) if c["cross"] else query
        value = seq(S, c["vdim"] or E) if c["cross"] else query
        out, weights = ours(query, key, value)
        assert out.dtype == dtype and weights.dtype == dtype
        g = torch.from_numpy(rng.standard_normal(tuple(out.shape))).to(dtype)
        out.backward(g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_q = query.detach().double().requires_grad_()
            ref_k, ref_v = (key.detach().double(), value.detach().double()) if c["cross"] else (ref_q, ref_q)
            ref_out, ref_weights = ref(ref_q, ref_k, ref_v)
        ref_out.backward(g.double())
        grads = ours.grad
        floor = 0.05 * max(float(p.grad.abs().max()) for p in ref.parameters())
        if as_pytorch:  # torch's bfloat16 module on the same values, beside ours
            their_q = query.detach().clone().requires_grad_()
            their_k, their_v = (key, value) if c["cross"] else (their_q, their_q)
            their_out, their_weights = theirs(their_q, their_k, their_v)
            their_out.backward(g)
            pairs = [(out.detach(), their_out.detach(), ref_out.detach(), 1e-30),
                     (weights, their_weights.detach(), ref_weights.detach(), 1e-30)]
            pairs += [(torch.from_numpy(np.asarray(grads[name])), t.grad, r.grad, floor)
                      for (name, r), t in zip(ref.named_parameters(), theirs.parameters())]
            for a, b, r, f in pairs:
                errors.append(rel(a.double(), r, f))
                their_errors.append(rel(b.double(), r, f))
                assert errors[-1] <= 16 * u, f"{errors[-1]:.2e} (PyTorch's {their_errors[-1]:.2e}) for {c}"
            continue
        assert rel(out.detach().double(), ref_out.detach()) <= 1.1 * u, c
        assert rel(weights.double(), ref_weights.detach()) <= 1.1 * u, c
        for name, p in ref.named_parameters():
            err = rel(torch.from_numpy(np.asarray(grads[name])).double(), p.grad, floor)
            assert err <= 4 * u, f"{name} gradient ({dtype}): relative error {err:.2e} for {c}"
    if as_pytorch:
        assert np.mean(errors) <= 1.5 * np.mean(their_errors), (np.mean(errors), np.mean(their_errors))

    m = mha.MultiheadAttention(16, 2, seed=int(rng.integers(2**31)), dtype=np.float16)
    x = rng.standard_normal((3, 2, 16)).astype(np.float16)
    assert m.dtype == "float16" and m(x, x, x)[0].dtype == np.float16
    with pytest.raises(ValueError, match="expected dtype float16"):
        m(x.astype(np.float32), x.astype(np.float32), x.astype(np.float32))
    assert m.to(torch.float32).dtype == "float32" and "dtype=" not in repr(m)
    with pytest.raises(ValueError, match="dtype: expected float32, float64, bfloat16 or float16"):
        m.to("int8")


def test_parameters_changed_between_forward_and_backward(parity_seed):
    """As with PyTorch's module: a parameter changed in place between a forward and its backward
    is autograd's error, and a parameter replaced between two forwards leaves each backward with
    its own forward's values (backward of the first call after the second loaded other weights)."""
    torch.manual_seed(parity_seed)
    E, H, L, N = 8, 2, 5, 3
    for module in (mha.nn.MultiheadAttention(E, H), torch.nn.MultiheadAttention(E, H)):
        x = torch.randn(L, N, E)
        out, _ = module(x, x, x)
        with torch.no_grad():
            module.out_proj.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()

    ours = mha.nn.MultiheadAttention(E, H)
    ref = torch.nn.MultiheadAttention(E, H).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(L, N, E, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    g1, g2 = torch.randn(L, N, E), torch.randn(L, N, E)
    out1, _ = ours(x, x, x)
    ref1, _ = ref(x_ref, x_ref, x_ref)
    first, first_ref = ours.in_proj_weight, ref.in_proj_weight
    replacement = torch.randn(3 * E, E) * 0.4
    ours.in_proj_weight = torch.nn.Parameter(replacement.clone())
    ref.in_proj_weight = torch.nn.Parameter(replacement.double())
    out2, _ = ours(x, x, x)
    ref2, _ = ref(x_ref, x_ref, x_ref)
    for out, r, g in ((out1, ref1, g1), (out2, ref2, g2)):  # the first call's backward first
        (out * g).sum().backward()
        (r * g.double()).sum().backward()
    for a, b, name in ((x, x_ref, "input"), (first, first_ref, "first in_proj_weight"),
                       (ours.in_proj_weight, ref.in_proj_weight, "second in_proj_weight"),
                       (ours.out_proj.weight, ref.out_proj.weight, "out_proj.weight")):
        assert rel(a.grad, b.grad) <= TOL, f"{name} gradient: relative error {rel(a.grad, b.grad):.2e}"


def test_parameters_are_read_where_they_are(parity_seed):
    """mha.nn reads its parameters in place at every call (its C++ module holds none), so a write
    that autograd does not see (through .data) reaches the next call, forward and backward, as it
    does in PyTorch's module."""
    torch.manual_seed(parity_seed)
    E, H, L, N = 8, 2, 5, 3
    ours = mha.nn.MultiheadAttention(E, H, add_bias_kv=True)
    assert ours._impl.parameters() == []  # the C++ module keeps no second copy
    ref = torch.nn.MultiheadAttention(E, H, add_bias_kv=True).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(L, N, E)
    for module in (ours, ref):
        module(x.to(module.in_proj_weight.dtype), x.to(module.in_proj_weight.dtype), x.to(module.in_proj_weight.dtype))
        module.in_proj_weight.data.mul_(-1.5)
        module.out_proj.bias.data.add_(0.25)
        module.bias_k.data.mul_(3.0)
    out, _ = ours(x, x, x)
    expected, _ = ref(x.double(), x.double(), x.double())
    assert rel(out, expected) <= TOL, f"output after .data writes: relative error {rel(out, expected):.2e}"
    g = torch.randn(L, N, E)
    (out * g).sum().backward()
    (expected * g.double()).sum().backward()
    for name, p in ours.named_parameters():
        q = dict(ref.named_parameters())[name]
        assert rel(p.grad, q.grad) <= TOL, f"{name} gradient: relative error {rel(p.grad, q.grad):.2e}"


def test_numpy_level_module_backward_uses_its_forwards_parameters(parity_seed):
    """mha.MultiheadAttention (numpy-level) through autograd: values loaded between a forward and
    its backward do not change that backward's gradients."""
    torch.manual_seed(parity_seed)
    E, H, L, N = 8, 2, 5, 3
    reloaded, kept = mha.MultiheadAttention(E, H, seed=7), mha.MultiheadAttention(E, H, seed=7)
    x = torch.randn(L, N, E)
    g = torch.randn(L, N, E)
    grads = []
    for module in (reloaded, kept):
        xi = x.clone().requires_grad_()
        out, _ = module(xi, xi, xi)
        if module is reloaded:
            module.load_state_dict({k: v * 2 for k, v in module.state_dict().items()})
        (out * g).sum().backward()
        grads.append((xi.grad, module.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    for name in grads[1][1]:
        np.testing.assert_array_equal(grads[0][1][name], grads[1][1][name], err_msg=name)
