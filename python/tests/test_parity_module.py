"""mha.MultiheadAttention against torch.nn.MultiheadAttention on randomized configurations.

Every constructor and forward option is drawn at random and combined: masks of each kind and dtype
(2-D and 3-D attn_mask, bool and float key_padding_mask), add_bias_kv with add_zero_attn, kdim and
vdim different from embed_dim, batch_first or not, batched and unbatched inputs, non-contiguous
inputs, need_weights with and without averaging, is_causal, dropout in eval mode.

PyTorch runs in float64 as the reference; ours in float32. Tolerance: 1e-5, normwise, of the
output's magnitude: the same forward with the absolute values of the projected values, of the
weights and of the biases (the attention weights are positive already), so the size of the terms
each output sums rather than of the sum. float32 rounding over sums of at most a few hundred terms
stays near 1e-6 of that; relative to the output itself it does not where terms cancel (one run
had values of about 2 averaging to 0.07 and then two products of 0.04 giving 0.006). Where PyTorch gives NaN (a query whose every key is masked out, in some
head), the documented behaviour is checked instead: that head's attention is zero (so its weights
are zero and the output row is out_proj applied to zeros for that head). `safe_reference` below
computes exactly that, in float64, following PyTorch's multi_head_attention_forward step by step;
it is itself checked against PyTorch wherever PyTorch is finite.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha

TOL = 1e-5


def random_mask(rng, shape, kind):
    if kind == "bool":
        return rng.random(shape) < 0.25  # True = masked out
    m = rng.standard_normal(shape).astype(np.float32)
    m[rng.random(shape) < 0.1] = -np.inf
    return m


def additive(mask):
    """A module mask as float64 additive: bool True (masked out) becomes -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(mask, -np.inf)
    return mask.double()


def safe_reference(ref, query, key, value, kpm, attn_mask, need_weights, average, c):
    """PyTorch's multi_head_attention_forward in float64, with fully masked rows giving zeros."""
    N, H, E = c["N"] if c["batched"] else 1, c["num_heads"], c["embed_dim"]
    hd = E // H

    def seq_first(x):
        if not c["batched"]:
            return x.unsqueeze(1)
        return x.transpose(0, 1) if c["batch_first"] else x

    q, k, v = seq_first(query), seq_first(key), seq_first(value)
    if ref.in_proj_weight is not None:
        w_q, w_k, w_v = ref.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
    b_q = b_k = b_v = None
    if ref.in_proj_bias is not None:
        b_q, b_k, b_v = ref.in_proj_bias.chunk(3)
    Q, K, V = F.linear(q, w_q, b_q), F.linear(k, w_k, b_k), F.linear(v, w_v, b_v)
    L, S = Q.shape[0], K.shape[0]
    if ref.bias_k is not None:
        K = torch.cat([K, ref.bias_k.repeat(1, N, 1)])
        V = torch.cat([V, ref.bias_v.repeat(1, N, 1)])
    if c["add_zero_attn"]:
        K = torch.cat([K, torch.zeros(1, N, E, dtype=K.dtype)])
        V = torch.cat([V, torch.zeros(1, N, E, dtype=V.dtype)])
    St = K.shape[0]
    total = torch.zeros(N, H, L, St, dtype=torch.float64)
    if attn_mask is not None:  # extra columns stay 0: attend
        m = additive(attn_mask)
        total[..., :S] += m if m.dim() == 2 else m.view(N, H, L, S)
    if kpm is not None:
        total[..., :S] += additive(kpm).view(N, 1, 1, S)
    Qh = Q.view(L, N, H, hd).permute(1, 2, 0, 3)
    Kh = K.view(St, N, H, hd).permute(1, 2, 0, 3)
    Vh = V.view(St, N, H, hd).permute(1, 2, 0, 3)
    scores = Qh @ Kh.transpose(-1, -2) / np.sqrt(hd) + total
    dead = torch.isneginf(scores.amax(-1, keepdim=True))
    w = torch.where(dead, torch.zeros_like(scores), torch.softmax(scores, -1))

    def absolute(t):
        return None if t is None else t.abs()

    # The magnitude of each output: the steps after the weights on absolute values.
    V_abs = F.linear(v.abs(), w_v.abs(), absolute(b_v))
    if ref.bias_k is not None:
        V_abs = torch.cat([V_abs, ref.bias_v.abs().repeat(1, N, 1)])
    if c["add_zero_attn"]:
        V_abs = torch.cat([V_abs, torch.zeros(1, N, E, dtype=V_abs.dtype)])
    magnitude = (w @ V_abs.view(St, N, H, hd).permute(1, 2, 0, 3)).permute(2, 0, 1, 3).reshape(L, N, E)
    magnitude = F.linear(magnitude, ref.out_proj.weight.abs(), absolute(ref.out_proj.bias))
    out = (w @ Vh).permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(out, ref.out_proj.weight, ref.out_proj.bias)

    def caller_layout(t):
        if not c["batched"]:
            return t.squeeze(1)
        return t.transpose(0, 1) if c["batch_first"] else t

    out, magnitude = caller_layout(out), caller_layout(magnitude)
    if not need_weights:
        return out, None, magnitude
    w = w.mean(1) if average else w
    return out, (w if c["batched"] else w.squeeze(0)), magnitude


def maybe_strided(rng, x):
    """The same values, sometimes through a non-contiguous view."""
    if x.ndim >= 2 and rng.random() < 0.3:
        # Stored transposed, viewed back: strides no longer row-major.
        return np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
    if rng.random() < 0.2:
        padded = np.zeros(x.shape[:-1] + (x.shape[-1] * 2,), dtype=x.dtype)
        padded[..., ::2] = x
        return padded[..., ::2]  # every other element: last stride 2
    return x


def draw_config(rng):
    H = int(rng.integers(1, 5))
    c = dict(
        num_heads=H,
        embed_dim=H * int(rng.integers(1, 9)),
        bias=bool(rng.random() < 0.7),
        add_bias_kv=bool(rng.random() < 0.3),
        add_zero_attn=bool(rng.random() < 0.3),
        batch_first=bool(rng.random() < 0.5),
        dropout=float(rng.choice([0.0, 0.0, 0.3])),
        batched=bool(rng.random() < 0.8),
        N=int(rng.integers(1, 4)),
        L=int(rng.integers(1, 10)),
        cross=bool(rng.random() < 0.5),
        need_weights=bool(rng.random() < 0.6),
        average=bool(rng.random() < 0.5),
        is_causal=bool(rng.random() < 0.2),
        attn_mask=str(rng.choice(["none", "2d", "3d"])),
        attn_mask_kind=str(rng.choice(["bool", "float"])),
        kpm=str(rng.choice(["none", "bool", "float"])),
    )
    if c["cross"]:
        c["S"] = int(rng.integers(1, 10))
        c["kdim"] = int(rng.integers(1, 12)) if rng.random() < 0.5 else None
        c["vdim"] = int(rng.integers(1, 12)) if rng.random() < 0.5 else None
    else:
        c["S"], c["kdim"], c["vdim"] = c["L"], None, None
    if c["is_causal"]:
        c["attn_mask"] = "2d"  # PyTorch needs the causal mask itself as attn_mask
    return c


def run_one(rng, c):
    E, H, N, L, S = c["embed_dim"], c["num_heads"], c["N"], c["L"], c["S"]
    kdim = c["kdim"] or E
    vdim = c["vdim"] or E
    seed = int(rng.integers(2**31))
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, dropout=c["dropout"], bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                      add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                      batch_first=c["batch_first"])
    ref.eval()
    ours = mha.MultiheadAttention.from_torch(ref)
    ref = ref.double()

    def seq(length, width):
        shape = (N, length, width) if c["batch_first"] else (length, N, width)
        if not c["batched"]:
            shape = (length, width)
        return rng.standard_normal(shape).astype(np.float32)

    query = seq(L, E)
    if c["cross"]:
        key, value = seq(S, kdim), seq(S, vdim)
    else:
        key = value = query

    attn_mask = None
    if c["attn_mask"] != "none":
        shape = (L, S) if c["attn_mask"] == "2d" else ((N if c["batched"] else 1) * H, L, S)
        attn_mask = random_mask(rng, shape, c["attn_mask_kind"])
        if c["is_causal"]:
            causal = np.triu(np.ones((L, S), dtype=bool), k=1)  # True above the diagonal: masked
            attn_mask = causal if c["attn_mask_kind"] == "bool" else np.where(causal, -np.inf, 0).astype(np.float32)
    kpm = None
    if c["kpm"] != "none":
        kpm = random_mask(rng, (N, S) if c["batched"] else (S,), c["kpm"])

    def t64(x):
        if x is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.double() if t.dtype == torch.float32 else t

    # PyTorch's one inconsistency: with is_causal, extra key columns (bias_k, zero attention), no
    # padding mask and no weights, it drops attn_mask and hides those columns from early queries;
    # everywhere else the causal attn_mask is padded and they stay visible. Ours always does the
    # latter (README, "Semantics worth knowing"), so the reference is PyTorch's mask path there.
    torch_is_causal = c["is_causal"]
    if (c["is_causal"] and (c["add_bias_kv"] or c["add_zero_attn"]) and kpm is None
            and not c["need_weights"]):
        torch_is_causal = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            q64 = t64(query)
            k64 = q64 if key is query else t64(key)
            v64 = q64 if value is query else t64(value)
            ref_out, ref_w = ref(q64, k64, v64, key_padding_mask=t64(kpm), need_weights=c["need_weights"],
                                 attn_mask=t64(attn_mask), average_attn_weights=c["average"],
                                 is_causal=torch_is_causal)
    # Ours: strided views where the call allows; with is_causal, sometimes without the mask.
    our_mask = attn_mask
    if c["is_causal"] and rng.random() < 0.5:
        our_mask = None
    q_in = maybe_strided(rng, query)
    if c["cross"]:
        k_in, v_in = maybe_strided(rng, key), maybe_strided(rng, value)
    else:
        k_in = v_in = q_in
    out, w = ours(q_in, k_in, v_in, key_padding_mask=kpm, need_weights=c["need_weights"], attn_mask=our_mask,
                  average_attn_weights=c["average"], is_causal=c["is_causal"])
    with torch.no_grad():
        safe_out, safe_w, magnitude = safe_reference(ref, q64, k64, v64, t64(kpm), t64(attn_mask),
                                                     c["need_weights"], c["average"], c)
    compare(out, ref_out.numpy(), safe_out.numpy(), "output", c, magnitude.numpy())
    if c["need_weights"]:
        compare(w, ref_w.numpy(), safe_w.numpy(), "weights", c)
    else:
        assert w is None


def relative_error(a, b, magnitude=None):
    """max|a - b| / max(|b|), or over the largest magnitude where one is given."""
    if not a.size:
        return 0.0
    scale = np.abs(b).max() if magnitude is None else max(np.abs(b).max(), magnitude.max())
    return np.abs(a - b).max() / max(scale, 1e-30)


def compare(ours, ref, safe, what, c, magnitude=None):
    """Weights against their largest value; the output against its magnitude (see the top)."""
    assert ours.shape == ref.shape, f"{what} shape {ours.shape} != {ref.shape} for {c}"
    assert ours.dtype == np.float32
    assert not np.isnan(ours).any(), f"{what}: NaN in our result for {c}"
    finite = ~np.isnan(ref)
    # Against PyTorch wherever PyTorch is finite.
    err = relative_error(ours[finite], ref[finite], None if magnitude is None else magnitude[finite])
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL} against PyTorch for {c}"
    # The safe reference agrees with PyTorch there too, so where PyTorch is NaN it shows the
    # documented behaviour (zero attention for fully masked rows), and ours must match it.
    assert relative_error(safe[finite], ref[finite]) <= 1e-12, f"{what}: safe reference drifted for {c}"
    err = relative_error(ours, safe, magnitude)
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL} against the safe reference for {c}"


CHUNKS = 10


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_module_matches_torch(chunk, parity_seed, parity_count):
    rng = np.random.default_rng([parity_seed, 1, chunk])
    n = parity_count // CHUNKS + (chunk < parity_count % CHUNKS)
    for _ in range(n):
        c = draw_config(rng)
        run_one(rng, c)
