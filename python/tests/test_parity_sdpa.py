"""mha.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

Random configurations over ranks 2 to 6, batch dimensions that broadcast (q, k and v each with
leading dimensions dropped or of size 1, as PyTorch broadcasts them), grouped-query attention
(enable_gqa), scale, bool and float masks broadcast from every rank, Lq != Lk, d_k != d_v, causal masks in both alignments
(PyTorch's bottom-right one is torch.nn.attention.bias.causal_lower_right), causal combined with a
mask, and non-contiguous inputs. PyTorch in float64 is the reference, ours in float32, tolerance
1e-5 of the largest reference magnitude. Fully masked rows must be zero in ours (documented);
PyTorch's result there (NaN or zero, depending on its backend) is not compared.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import mha

TOL = 1e-5


def maybe_strided(rng, x):
    if x.ndim >= 3 and rng.random() < 0.3:
        return np.ascontiguousarray(x.swapaxes(-3, -2)).swapaxes(-3, -2)  # [B, L, H, D] storage
    if rng.random() < 0.15:
        padded = np.zeros(x.shape[:-1] + (x.shape[-1] * 2,), dtype=x.dtype)
        padded[..., ::2] = x
        return padded[..., ::2]
    return x


def draw(rng):
    rank = int(rng.integers(2, 5)) if rng.random() < 0.8 else int(rng.integers(5, 7))
    gqa = rank >= 3 and rng.random() < 0.4
    hkv = int(rng.integers(1, 4))
    hq = hkv * int(rng.integers(1, 4)) if gqa else hkv
    c = dict(rank=rank, gqa=gqa, B=tuple(int(b) for b in rng.integers(1, 4, size=max(rank - 3, 1))), Hq=hq, Hkv=hkv,
             broadcast=rng.random() < 0.3, Lq=int(rng.integers(1, 40)),
             Lk=int(rng.integers(1, 40)), Dk=int(rng.integers(1, 40)), Dv=int(rng.integers(1, 40)),
             scale=float(rng.uniform(0.05, 1.0)) if rng.random() < 0.3 else None,
             causal=str(rng.choice(["none", "none", "top_left", "bottom_right"])),
             mask=str(rng.choice(["none", "bool", "float"])), mask_rank=int(rng.integers(1, rank + 1)))
    if rng.random() < 0.3:
        c["Lk"] = c["Lq"]
    return c


def shape(c, heads, length, dim):
    full = (*c["B"], heads, length, dim)
    return full[len(full) - c["rank"]:]


def broadcast_form(rng, x, keep_heads):
    """x with some batch dimensions cut to size 1 and some leading ones dropped (PyTorch broadcasts
    them back); the heads stay where grouped attention needs them."""
    for d in range(x.ndim - 2):
        if rng.random() < 0.35 and not (keep_heads and d == x.ndim - 3):
            x = x[(slice(None),) * d + (slice(0, 1),)]
    while x.ndim > 2 and x.shape[0] == 1 and not (keep_heads and x.ndim == 3) and rng.random() < 0.5:
        x = x[0]
    return x


def batch_shape(c, q, k, v):
    """The output's batch dimensions: the leading ones broadcast, the heads grouped or broadcast."""
    heads = [x.shape[-3] if x.ndim >= 3 else 1 for x in (q, k, v)]
    lead = np.broadcast_shapes(*(x.shape[:-3] for x in (q, k, v)))
    if max(x.ndim for x in (q, k, v)) < 3:
        return ()
    return (*lead, heads[0] if c["gqa"] else max(heads))


def run_one(rng, c):
    q = rng.standard_normal(shape(c, c["Hq"], c["Lq"], c["Dk"])).astype(np.float32)
    k = rng.standard_normal(shape(c, c["Hkv"], c["Lk"], c["Dk"])).astype(np.float32)
    v = rng.standard_normal(shape(c, c["Hkv"], c["Lk"], c["Dv"])).astype(np.float32)
    if c["broadcast"]:
        q, k, v = (broadcast_form(rng, x, c["gqa"]) for x in (q, k, v))
    full_mask_shape = (*batch_shape(c, q, k, v), c["Lq"], c["Lk"])
    mask = None
    if c["mask"] != "none":
        # Broadcast from a lower rank, with random size-1 dimensions.
        mshape = [s if rng.random() < 0.7 else 1 for s in full_mask_shape[max(len(full_mask_shape) - c["mask_rank"], 0):]]
        if c["mask"] == "bool":
            mask = rng.random(mshape) < 0.8  # True = attend
        else:
            mask = rng.standard_normal(mshape).astype(np.float32)
            mask[rng.random(mshape) < 0.1] = -np.inf

    # The reference: PyTorch in float64, with causality (and any mask) as one explicit mask.
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    ref_mask = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
    if ref_mask is not None and ref_mask.dtype != torch.bool:
        ref_mask = ref_mask.double()
    visible = None
    if c["causal"] != "none":
        Lq, Lk = c["Lq"], c["Lk"]
        if c["causal"] == "top_left":
            visible = torch.ones(Lq, Lk, dtype=torch.bool).tril()
        else:
            with warnings.catch_warnings():  # its NaN warning for Lq > Lk: those rows are checked below
                warnings.filterwarnings("ignore", message="Lower right causal bias")
                visible = causal_lower_right(Lq, Lk)._materialize()
        if ref_mask is None:
            ref_mask = visible
        elif ref_mask.dtype == torch.bool:
            ref_mask = ref_mask & visible
        else:
            ref_mask = torch.where(visible, ref_mask, torch.tensor(-np.inf, dtype=torch.float64))
    if ref_mask is not None:  # PyTorch wants at least 2 mask dimensions; ours broadcasts any rank
        ref_mask = ref_mask.expand(full_mask_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # q expanded to the output's batch dimensions: PyTorch adds the mask to q k^T in place, so
        # it takes no mask with a batch dimension that only v has (ours does)
        ref_q = t(q).expand(*full_mask_shape[:-2], c["Lq"], c["Dk"])
        ref = F.scaled_dot_product_attention(ref_q, t(k), t(v), attn_mask=ref_mask, scale=c["scale"],
                                             enable_gqa=c["gqa"]).numpy()
    # Which query rows have no visible key at all.
    if ref_mask is None:
        dead = np.zeros(ref.shape[:-1], dtype=bool)
    else:
        m = ref_mask.numpy()
        alive = m if m.dtype == bool else ~np.isneginf(m)
        dead = ~np.broadcast_to(alive, full_mask_shape).any(-1)

    out, w = mha.scaled_dot_product_attention(
        maybe_strided(rng, q), maybe_strided(rng, k), maybe_strided(rng, v), attn_mask=mask,
        is_causal=c["causal"] != "none", scale=c["scale"], enable_gqa=c["gqa"],
        causal_alignment=c["causal"] if c["causal"] != "none" else "top_left", need_weights=True)
    assert out.shape == ref.shape == full_mask_shape[:-1] + (c["Dv"],) and out.dtype == np.float32, c
    assert not np.isnan(out).any(), f"NaN in our output for {c}"
    assert np.all(out[dead] == 0), f"fully masked rows are not zero for {c}"
    assert np.all(w[dead] == 0), f"fully masked weight rows are not zero for {c}"
    live = ~dead
    if live.any():
        # An output row is a convex combination of value rows, so its fp32 rounding is a few eps
        # times the values' magnitude, not the output's: where the combination cancels (few keys,
        # Dv = 1), the output is judged against a tenth of the largest value instead.
        scale = max(np.abs(ref[live]).max(), 0.1 * np.abs(v).max(), 1e-30)
        err = np.abs(out[live] - ref[live]).max() / scale
        assert err <= TOL, f"relative error {err:.3e} > {TOL} for {c}"
        sums = w.sum(-1)[live]
        assert np.allclose(sums, 1.0, atol=1e-5), f"weights do not sum to 1 for {c}"


CHUNKS = 10


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_sdpa_matches_torch(chunk, parity_seed, parity_count):
    rng = np.random.default_rng([parity_seed, 2, chunk])
    n = parity_count // CHUNKS + (chunk < parity_count % CHUNKS)
    for _ in range(n):
        run_one(rng, draw(rng))


def test_torch_in_torch_out_and_errors():
    q = torch.randn(2, 3, 5, 8)
    out = mha.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 5, 8)
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    with pytest.raises(ValueError, match="enable_gqa"):
        mha.scaled_dot_product_attention(q, torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), enable_gqa=True)
    with pytest.raises(TypeError):
        mha.scaled_dot_product_attention([1.0], q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        mha.scaled_dot_product_attention(q, q, q, dropout_p=1.5)


def test_decoding_matches_torch(parity_seed):
    """A few queries per head against a long cache: the decoding kernel's shapes (up to 32 queries,
    caches split into runs past 1008 keys), in float32 and with bfloat16 and float16 tensors as
    inference engines keep their caches, against PyTorch in float64 on the same (rounded) values.
    Tolerances: float32 1e-5 of the largest value (as above); bfloat16 1e-2 and float16 2e-3, the
    rounding of the output to 8 and 11 significant bits plus the float32 arithmetic's."""
    rng = np.random.default_rng([parity_seed, 3])
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    for n in range(48):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[n % 3]
        hkv = int(rng.integers(1, 3))
        group = int(rng.choice([1, 2, 4]))
        B, Lq = int(rng.integers(1, 3)), int(rng.choice([1, 1, 2, 3, 4, 8, 13, 32]))
        Lk = int(rng.choice([1, 17, 300, 1008, 1500, 2100]))
        Dk, Dv = int(rng.choice([16, 20, 64, 128])), int(rng.choice([16, 48, 64]))
        q = torch.randn(B, hkv * group, Lq, Dk, generator=gen).to(dtype)
        k = torch.randn(B, hkv, Lk, Dk, generator=gen).to(dtype)
        v = torch.randn(B, hkv, Lk, Dv, generator=gen).to(dtype)
        if rng.random() < 0.3:  # [B, L, H, D] storage, viewed as [B, H, L, D]
            k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        causal = Lq > 1 and rng.random() < 0.6
        mask = None
        if rng.random() < 0.4:
            mask = torch.randn(Lq, Lk, generator=gen) if rng.random() < 0.5 else torch.rand(B, 1, 1, Lk, generator=gen) < 0.9
        ours = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                causal_alignment="bottom_right", enable_gqa=group > 1)
        assert ours.dtype == dtype and ours.shape == (B, hkv * group, Lq, Dv)
        ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
        if causal:
            visible = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
            ref_mask = visible if ref_mask is None else (
                ref_mask & visible if ref_mask.dtype == torch.bool else ref_mask.masked_fill(~visible, -np.inf))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_mask,
                                             enable_gqa=group > 1)
        alive = torch.ones(ref.shape[:-1], dtype=torch.bool)
        if ref_mask is not None:
            m = ref_mask if ref_mask.dtype == torch.bool else ~torch.isneginf(ref_mask)
            alive = m.expand(B, hkv * group, Lq, Lk).any(-1)
        assert torch.all(ours[~alive] == 0), f"case {n}: rows that see no key are not zero"
        scale = max(ref[alive].abs().max().item(), 0.1 * v.double().abs().max().item()) if alive.any() else 1.0
        err = ((ours.double() - ref)[alive].abs().max().item() / scale) if alive.any() else 0.0
        assert err <= tolerance[dtype], (
            f"case {n}: relative error {err:.3e} for {dtype} B={B} H={hkv * group}/{hkv} Lq={Lq} Lk={Lk} "
            f"Dk={Dk} Dv={Dv} causal={causal} mask={None if mask is None else mask.dtype}")


def test_hugging_face_min_masks_match_torch(parity_seed):
    """Hugging Face's float masks: causal and left padding at torch.finfo(dtype).min, not -inf. The
    query rows of a padded prefix see no key but at that value: PyTorch gives them uniform weights
    (each score plus the mask rounds to the mask), the mean of the values, not zeros, and so do we.
    Against PyTorch's own kernel in the same dtype: float32 within 1e-5 of the largest value (both
    round the same sums), bfloat16 within 1e-2 (the output's rounding)."""
    rng = np.random.default_rng([parity_seed, 4])
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for L in (1, 5, 130):
            B, H, D = 3, 2, 32
            q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(3))
            lowest = torch.finfo(dtype).min
            pad = [0, L // 2, L - 1]  # entry b's first pad[b] positions are padding
            mask = torch.zeros(B, 1, L, L, dtype=dtype)
            for b in range(B):
                mask[b, 0].masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), lowest)
                mask[b, 0, :, :pad[b]] = lowest
            ours = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            err = (ours.double() - theirs.double()).abs().max().item() / theirs.double().abs().max().item()
            assert err <= tolerance, f"{dtype} L={L}: relative error {err:.3e}"
            if L > 1:  # the padded rows are the mean of the values, not zeros
                mean = v[2, :, :, :].double().mean(dim=1)
                assert torch.allclose(ours[2, :, 0].double(), mean, atol=tolerance * 10)


def test_hugging_face_min_masks_backward_follow_the_formula(parity_seed):
    """The gradients under the masks above, against autograd through the formula itself
    (softmax(q k^T / sqrt(d) + mask) v in float64). A padded row gives each of its l keys 1/l; a
    float32 log-sum-exp cannot hold log(l) next to -3.4e38, and recomputing the weights from it gives
    each key 1 (PyTorch's CPU SDPA backward does, in float64 as well), which we do not. float32
    within 1e-5 of the largest gradient, bfloat16 within 2e-2 (its rounding of inputs and gradients),
    float64 (finfo(float64).min, the same fault in a float64 log-sum-exp) within 1e-12."""
    rng = np.random.default_rng([parity_seed, 5])
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)):
        for L in (5, 130):
            B, H, D = 3, 2, 32
            q, k, v, go = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(4))
            lowest = torch.finfo(dtype).min
            mask = torch.zeros(B, 1, L, L, dtype=dtype)
            for b, pad in enumerate([0, L // 2, L - 1]):
                mask[b, 0].masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), lowest)
                mask[b, 0, :, :pad] = lowest

            def grads(fn, dt):
                inputs = [t.to(dt).detach().requires_grad_() for t in (q, k, v)]
                fn(*inputs, mask.to(dt)).backward(go.to(dt))
                return [t.grad.double() for t in inputs]

            ref = grads(lambda q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + m, -1) @ v, torch.float64)
            ours = grads(lambda q, k, v, m: mha.scaled_dot_product_attention(q, k, v, attn_mask=m), dtype)
            for name, a, r in zip(("query", "key", "value"), ours, ref):
                err = (a - r).abs().max().item() / r.abs().max().item()
                assert err <= tolerance, f"{dtype} L={L} d{name}: relative error {err:.3e}"
