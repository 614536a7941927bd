"""float8 keys and values (torch.float8_e4m3fn, torch.float8_e5m2; a quantized key/value cache)
from Python. The kernels widen each
element exactly, so a call must give the bits of the same call on the keys and values converted
to float32 (a 16-bit query: on its float32 copy too, the output rounded once), and agree with
PyTorch's SDPA in float64 on those values (float32 within 2e-5 of the largest output, as the SDPA
tests). Rounding into a float8 cache is PyTorch's .to(), bit for bit. Paged
caches, packed sequences, torch.compile, and the clear errors: a float8 query, mixed dtypes,
autograd."""

import numpy as np
import pytest
import torch

import mha
from _compare import relative as _relative

F8 = torch.float8_e4m3fn
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 97])


def _t(rng, shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_gives_the_bits_of_widened_keys_and_values(rng, dtype, fmt):
    for trial, L in enumerate([1, 3, 40, 600]):  # dot mode, the decoding kernel's rows, tiles, long tiles
        B, hkv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
        S, E = int(rng.choice([9, 100, 300])), int(rng.choice([16, 64, 80]))
        q = _t(rng, (B, hkv * group, L, E), dtype)
        k, v = _t(rng, (B, hkv, S, E), fmt), _t(rng, (B, hkv, S, E), fmt)
        mask = _t(rng, (L, S)) if trial == 2 else None
        options = dict(is_causal=trial % 2 == 1, enable_gqa=group > 1)
        with torch.no_grad():
            out = mha.scaled_dot_product_attention(q, k, v, mask, **options)
            wide = mha.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, **options)
        assert out.dtype == dtype
        assert torch.equal(out, wide.to(dtype))
        if dtype is torch.float32:  # PyTorch's SDPA on the same values, in float64
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), None if mask is None else mask.double(), enable_gqa=group > 1,
                is_causal=options["is_causal"])
            assert _relative(out, ref) < 2e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_into_a_cache_is_torchs(rng, fmt):
    """Rows written into float8 caches round as torch's conversion does: ties to even, subnormals,
    the top of the range (e4m3 saturates beyond 448, e5m2 overflows to infinity), NaN kept."""
    special = torch.tensor([0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -7 + 2.0 ** -10, 2.0 ** -17, 3 * 2.0 ** -17,
                            448.0, 460.0, 464.0, 470.0, 479.0, 480.0, 57344.0, 61439.0, 61440.0, 1e6, float("inf"),
                            float("-inf"), float("nan"), -300.5, 1.0625, 1.125, 1.375])
    drawn = torch.from_numpy(rng.standard_normal(16 * 64 - special.numel())
                             * np.exp2(rng.integers(-18, 16, 16 * 64 - special.numel())))
    rows = torch.cat([special, drawn.float()]).reshape(1, 16, 1, 64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = rows.to(dtype)
        kc, vc = torch.zeros(1, 16, 1, 64, dtype=fmt), torch.zeros(1, 16, 1, 64, dtype=fmt)
        mha.write_paged_cache(x, x, kc, vc, None, 0)
        assert torch.equal(kc.view(torch.uint8), x.to(fmt).view(torch.uint8)), dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_cache_decoding_loop(rng, fmt):
    """A float8 cache filled by a bfloat16 model's decoding loop (its rows rounded as they are
    written): each step the bits of SDPA over the rounded keys, read in place (one token) and
    gathered (a chunk of 40)."""
    batch, hq, hkv, e, page_size, prompt, steps = 2, 4, 2, 64, 8, 11, 5
    per_seq = (prompt + 40 + steps + page_size - 1) // page_size
    kc = torch.full((batch * per_seq + 1, page_size, hkv, e), float("nan")).to(fmt)
    vc = kc.clone()
    table = torch.tensor(rng.permutation(batch * per_seq + 1)[: batch * per_seq].reshape(batch, per_seq),
                         dtype=torch.int32)
    keys = _t(rng, (batch, prompt + 40 + steps, hkv, e), torch.bfloat16)
    values = _t(rng, (batch, prompt + 40 + steps, hkv, e), torch.bfloat16)
    lens = torch.zeros(batch, dtype=torch.int64)
    for new in [prompt, 40] + [1] * steps:
        n0 = int(lens[0])
        mha.write_paged_cache(keys[:, n0:n0 + new], values[:, n0:n0 + new], kc, vc, table, lens)
        lens += new
        q = _t(rng, (batch, new, hq, e), torch.bfloat16)
        out = mha.paged_attention(q, kc, vc, table, lens, is_causal=True, enable_gqa=True)
        n = int(lens[0])
        k8, v8 = keys[:, :n].to(fmt), values[:, :n].to(fmt)
        alone = mha.scaled_dot_product_attention(q.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
        assert torch.equal(out.transpose(1, 2), alone)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_sequences_and_compile(rng, fmt):
    q = _t(rng, (50, 4, 32))
    k, v = _t(rng, (70, 2, 32), fmt), _t(rng, (70, 2, 32), fmt)
    cu_q, cu_k = torch.tensor([0, 10, 50]), torch.tensor([0, 30, 70])
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, enable_gqa=True)
    assert torch.equal(out, mha.varlen_attention(q, k.float(), v.float(), cu_q, cu_k, is_causal=True, enable_gqa=True))
    qs, ks, vs = _t(rng, (2, 4, 5, 32)), _t(rng, (2, 2, 60, 32), fmt), _t(rng, (2, 2, 60, 32), fmt)
    compiled = torch.compile(lambda a, b, c: mha.scaled_dot_product_attention(a, b, c, enable_gqa=True),
                             backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(qs, ks, vs)
    assert got.dtype == torch.float32
    assert torch.equal(got, mha.scaled_dot_product_attention(qs, ks.float(), vs.float(), enable_gqa=True))


def test_calls_that_take_no_float8_are_clear_errors(rng, tmp_path):
    q, k, v = _t(rng, (1, 2, 5, 16)), _t(rng, (1, 2, 9, 16), F8), _t(rng, (1, 2, 9, 16), F8)
    with pytest.raises(ValueError, match="float8 is taken for key and value"):
        mha.scaled_dot_product_attention(q.to(F8), k, v)
    with pytest.raises(ValueError, match="float8 keys and values .* go together"):
        mha.scaled_dot_product_attention(q, k, v.float())
    with pytest.raises(ValueError, match="key float8_e4m3fn, value float8_e5m2"):
        mha.scaled_dot_product_attention(q, k, v.float().to(torch.float8_e5m2))
    for fmt in FORMATS:
        with pytest.raises(ValueError, match="float8 keys and values are for inference"):
            mha.scaled_dot_product_attention(q.detach().requires_grad_(), k.float().to(fmt), v.float().to(fmt))
    with pytest.raises(ValueError, match="float8"):
        mha.scaled_dot_product_attention(q.double().detach(), k, v)
    # a file's float8 tensor comes back to numpy (which has none) widened to float32, exactly
    path = str(tmp_path / "cache.safetensors")
    mha.save_safetensors(path, {"k": k, "k2": k.float().to(torch.float8_e5m2)})
    loaded = mha.load_safetensors(path)
    assert loaded["k"].dtype == np.float32 and np.array_equal(loaded["k"], k.float().numpy())
    assert np.array_equal(loaded["k2"], k.float().to(torch.float8_e5m2).float().numpy())
