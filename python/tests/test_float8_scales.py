"""Scaled float8 keys and values (k_descale, v_descale: FlashAttention 3's descales, vLLM's k_scale
and v_scale) from Python. A call attends over key * k_descale and value * v_descale per key/value
head: held against PyTorch's SDPA in float64 on the keys and values dequantised by torch itself
(float32 queries within 2e-5 of the largest output, as the float8 tests; bfloat16 within 8e-3,
one rounding of the output twice over). Writes into float8 caches divide by the scales first, bit
for bit as torch's (x.float() / scale).to(float8). Paged, packed, torch.compile, and the errors."""

import numpy as np
import pytest
import torch

import mha
from _compare import relative as _relative

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 131])


def _t(rng, shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def _scales(rng, shape, lo, hi):
    return torch.from_numpy(np.asarray(np.exp(rng.uniform(np.log(lo), np.log(hi), shape)))).float()


def _per_head(scales, batch, heads):
    """Scales of shape [], [Hkv] or [B, Hkv] as [B, Hkv, 1, 1] float64, to multiply [B, Hkv, S, E]."""
    return scales.double().expand(batch, heads).reshape(batch, heads, 1, 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_attends_over_scaled_keys_and_values(rng, dtype, fmt):
    for trial, L in enumerate([1, 3, 40, 600]):  # dot mode, the decoding kernel's rows, tiles, long tiles
        B, hkv, group = 2, int(rng.integers(1, 3)), int(rng.integers(1, 3))
        S, E = int(rng.choice([9, 100, 300])), int(rng.choice([16, 64, 80]))
        q = _t(rng, (B, hkv * group, L, E), dtype)
        k, v = _t(rng, (B, hkv, S, E), fmt), _t(rng, (B, hkv, S, E), fmt)
        shapes = [(), (hkv,), (B, hkv), (B, 1)]
        kd = _scales(rng, shapes[trial], 0.125, 2.0)
        vd = _scales(rng, shapes[(trial + 1) % 4], 1 / 64, 64.0)
        options = dict(is_causal=trial % 2 == 1, enable_gqa=group > 1)
        with torch.no_grad():
            out = mha.scaled_dot_product_attention(q, k, v, k_descale=kd, v_descale=vd, **options)
        assert out.dtype == dtype
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double() * _per_head(kd, B, hkv), v.double() * _per_head(vd, B, hkv), **options)
        assert _relative(out, ref) < (2e-5 if dtype is torch.float32 else 8e-3), (L, kd.shape, vd.shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_divide_by_the_scales_and_reads_multiply(rng, fmt):
    """A decoding loop of a bfloat16 model into a scaled float8 cache, each sequence and head with its
    own scales: the rows written are torch's (x.float() / scale).to(float8) bit for bit, and each
    step is PyTorch's SDPA in float64 over those rows times the scales."""
    batch, hq, hkv, e, page_size, prompt, steps = 2, 4, 2, 32, 8, 13, 4
    per_seq = (prompt + steps + page_size - 1) // page_size
    kc = torch.zeros((batch * per_seq, page_size, hkv, e), dtype=fmt)
    vc = kc.clone()
    table = torch.tensor(rng.permutation(batch * per_seq).reshape(batch, per_seq), dtype=torch.int32)
    kd, vd = _scales(rng, (batch, hkv), 1 / 16, 16.0), _scales(rng, (batch, hkv), 1 / 16, 16.0)
    keys = _t(rng, (batch, prompt + steps, hkv, e), torch.bfloat16) * 8
    values = _t(rng, (batch, prompt + steps, hkv, e), torch.bfloat16) * 8
    lens = torch.zeros(batch, dtype=torch.int64)
    for new in [prompt] + [1] * steps:
        n0 = int(lens[0])
        q = _t(rng, (batch, new, hq, e), torch.float32)
        out = mha.paged_attention(q, kc, vc, table, lens, k=keys[:, n0:n0 + new], v=values[:, n0:n0 + new],
                                  k_descale=kd, v_descale=vd, is_causal=True, enable_gqa=True)
        lens += new
        n = int(lens[0])
        k8 = (keys[:, :n].float() / kd[:, None, :, None]).to(fmt)  # [B, n, Hkv, E], as written
        v8 = (values[:, :n].float() / vd[:, None, :, None]).to(fmt)
        for b in range(batch):
            rows = torch.arange(n)
            pages, slots = table[b, rows // page_size].long(), rows % page_size
            assert torch.equal(kc[pages, slots].view(torch.uint8), k8[b].view(torch.uint8))
            assert torch.equal(vc[pages, slots].view(torch.uint8), v8[b].view(torch.uint8))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).double(), k8.transpose(1, 2).double() * kd.double()[:, :, None, None],
            v8.transpose(1, 2).double() * vd.double()[:, :, None, None], enable_gqa=True,
            attn_mask=torch.ones(new, n, dtype=torch.bool).tril(n - new))
        assert _relative(out.transpose(1, 2), ref) < 2e-5, new


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_sequences_and_compile(rng, fmt):
    q = _t(rng, (50, 4, 32))
    k, v = _t(rng, (70, 2, 32), fmt), _t(rng, (70, 2, 32), fmt)
    cu_q, cu_k = torch.tensor([0, 10, 50]), torch.tensor([0, 30, 70])
    kd, vd = _scales(rng, (2, 2), 0.25, 4.0), _scales(rng, (2,), 0.25, 4.0)  # per sequence and head; per head
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, enable_gqa=True, k_descale=kd, v_descale=vd)
    for s in range(2):
        qs, ks, vs = (x[int(c[s]):int(c[s + 1])].transpose(0, 1).double() for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks * kd[s].double()[:, None, None],
                                                               vs * vd.double()[:, None, None], enable_gqa=True)
        assert _relative(out[int(cu_q[s]):int(cu_q[s + 1])].transpose(0, 1), ref) < 2e-5
    compiled_varlen = torch.compile(lambda a, b, c: mha.varlen_attention(a, b, c, cu_q, cu_k, enable_gqa=True,
                                                                         k_descale=kd, v_descale=vd),
                                    backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled_varlen(q, k, v), out)
    qs, ks, vs = _t(rng, (2, 4, 5, 32)), _t(rng, (2, 2, 60, 32), fmt), _t(rng, (2, 2, 60, 32), fmt)
    kd2 = torch.tensor(0.5)
    compiled = torch.compile(lambda a, b, c, d, w: mha.scaled_dot_product_attention(a, b, c, enable_gqa=True,
                                                                                     k_descale=d, v_descale=w,
                                                                                     need_weights=True),
                             backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got, weights = compiled(qs, ks, vs, kd2, kd)
        want, want_weights = mha.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, k_descale=kd2, v_descale=kd,
                                                              need_weights=True)
    assert torch.equal(got, want) and torch.equal(weights, want_weights)
    compiled_out = torch.compile(lambda a, b, c, d, w: mha.scaled_dot_product_attention(a, b, c, enable_gqa=True,
                                                                                         k_descale=d, v_descale=w),
                                 backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled_out(qs, ks, vs, kd2, kd),
                           mha.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, k_descale=kd2, v_descale=kd))


def test_bad_scales_are_clear_errors(rng):
    q, k, v = _t(rng, (2, 4, 5, 16)), _t(rng, (2, 2, 9, 16), torch.float8_e4m3fn), _t(rng, (2, 2, 9, 16), torch.float8_e4m3fn)
    good = torch.tensor([0.5, 2.0])
    with pytest.raises(ValueError, match="k_descale: dequantisation scales are taken with float8 keys and values"):
        mha.scaled_dot_product_attention(q, k.float(), v.float(), enable_gqa=True, k_descale=good)
    with pytest.raises(ValueError, match="v_descale: dequantisation scales are taken with float8"):
        mha.scaled_dot_product_attention(q.requires_grad_(), k.float(), v.float(), enable_gqa=True, v_descale=good)
    q = q.detach()
    with pytest.raises(ValueError, match="k_descale: expected dtype float32, got float64"):
        mha.scaled_dot_product_attention(q, k, v, enable_gqa=True, k_descale=good.double())
    with pytest.raises(ValueError, match=r"v_descale: expected one scale per key/value head.*got \[3\]"):
        mha.scaled_dot_product_attention(q, k, v, enable_gqa=True, v_descale=torch.ones(3))
    with pytest.raises(ValueError, match="v_descale: expected finite scales > 0, got -1"):
        mha.scaled_dot_product_attention(q, k, v, enable_gqa=True, v_descale=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="not taken under torch.func"):
        torch.func.vmap(lambda a: mha.scaled_dot_product_attention(a, k, v, enable_gqa=True, k_descale=good))(q[None])
    cache = torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_descale: scales are taken for float8 caches"):
        mha.write_paged_cache(_t(rng, (2, 1, 2, 16), torch.bfloat16), _t(rng, (2, 1, 2, 16), torch.bfloat16), cache,
                              cache, torch.tensor([[0, 1], [2, 3]]), 0, k_descale=good)
