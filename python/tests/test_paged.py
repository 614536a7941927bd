"""Paged key/value caches from Python: mha.paged_attention and mha.write_paged_cache in
FlashAttention's layout. Each sequence's rows must be the bits of mha.scaled_dot_product_attention
on its keys gathered here with torch indexing, and agree with PyTorch's float64 SDPA on the same
(rounded) inputs: float32 within 2e-5 of the largest output (softmax statistics and sums of up to
a few hundred O(1) terms in float32), bfloat16 and float16 within 1e-2 (the output rounded once to
8 or 11 bits; 2^-8 = 0.4%); float64 1e-12. Unused pages hold NaN, so reading one shows."""

import numpy as np
import pytest
import torch

import mha
from _compare import relative as _relative

TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 53])


def _draw(rng, dtype, lq, page_size):
    """Caches of shuffled pages (NaN where unused), a table with -1 padding, and each sequence's
    keys and values [1, S, Hkv, E] gathered by torch indexing."""
    batch, hkv = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    hq, e = hkv * int(rng.integers(1, 3)), int(rng.choice([16, 32, 64]))
    lens = [int(rng.choice([0, 1, page_size, int(rng.integers(1, 200))])) for _ in range(batch)]
    per_seq = max(max((n + page_size - 1) // page_size for n in lens), 1) + 1
    pages = sum((n + page_size - 1) // page_size for n in lens) + 2
    order = rng.permutation(pages).tolist()
    key_cache = torch.full((pages, page_size, hkv, e), float("nan"), dtype=dtype)
    value_cache = torch.full((pages, page_size, hkv, e), float("nan"), dtype=dtype)
    table = torch.full((batch, per_seq), -1, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens):
        k = torch.from_numpy(rng.standard_normal((n, hkv, e))).to(dtype)
        v = torch.from_numpy(rng.standard_normal((n, hkv, e))).to(dtype)
        for i in range((n + page_size - 1) // page_size):
            page = order.pop()
            table[b, i] = page
            rows = slice(i * page_size, min(n, (i + 1) * page_size))
            key_cache[page, : rows.stop - rows.start] = k[rows]
            value_cache[page, : rows.stop - rows.start] = v[rows]
        keys.append(k[None])
        values.append(v[None])
    q = torch.from_numpy(rng.standard_normal((batch, lq, hq, e))).to(dtype)
    return q, key_cache, value_cache, table, torch.tensor(lens), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lq", [1, 4, 40])
def test_sequences_match_their_own_calls_and_float64(rng, dtype, lq):
    for trial in range(3):
        page_size = int(rng.choice([1, 7, 16, 64]))
        q, kc, vc, table, lens, keys, values = _draw(rng, dtype, lq, page_size)
        hq, hkv = q.shape[2], kc.shape[2]
        slopes = torch.from_numpy(rng.uniform(0.01, 0.3, (q.shape[0], hq))).float() if trial == 1 else None
        if slopes is not None and dtype == torch.float64:
            slopes = slopes.double()
        window = (int(rng.integers(0, 50)), 0) if trial == 2 else None
        bottom_right = trial != 1
        out = mha.paged_attention(q, kc, vc, table, lens, is_causal=trial > 0, enable_gqa=hq != hkv,
                                  causal_alignment="bottom_right" if bottom_right else "top_left",
                                  window_size=window, alibi_slopes=slopes)
        assert out.shape == (q.shape[0], lq, hq, vc.shape[3]) and out.dtype == dtype and out.is_contiguous()
        for b in range(q.shape[0]):
            qb = q[b:b + 1].transpose(1, 2)
            kb, vb = keys[b].transpose(1, 2), values[b].transpose(1, 2)
            if kb.shape[2] == 0:
                assert torch.all(out[b] == 0)
                continue
            own = slopes[b:b + 1] if slopes is not None else None
            alone = mha.scaled_dot_product_attention(qb, kb, vb, is_causal=trial > 0, enable_gqa=hq != hkv,
                                                     causal_alignment="bottom_right" if bottom_right else "top_left",
                                                     window_size=window, alibi_slopes=own)
            assert torch.equal(out[b:b + 1].transpose(1, 2), alone)
            if own is None and window is None:  # PyTorch's float64 SDPA as the reference
                L, S = qb.shape[2], kb.shape[2]
                mask = None
                if trial > 0:
                    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L if bottom_right else 0)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    qb.double(), kb.double(), vb.double(), attn_mask=mask, enable_gqa=hq != hkv)
                ref = torch.where(torch.isnan(ref), 0, ref)  # fully masked rows: mha gives zeros
                assert _relative(out[b:b + 1].transpose(1, 2).double(), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_queries_of_different_counts(rng, dtype):
    """cu_seqlens_q: packed [Tq, Hq, E] rows, a different count per sequence (none, a decoding token,
    a prompt chunk past the 32 rows read in place): each sequence's rows are its own call's bits;
    under torch.compile too (one graph node, the offsets a tensor operand)."""
    for trial in range(3):
        q4, kc, vc, table, lens, keys, values = _draw(rng, dtype, 1, int(rng.choice([4, 16, 64])))
        batch, hq, e = q4.shape[0], q4.shape[2], q4.shape[3]
        counts = [int(rng.choice([0, 1, 3, 40])) for _ in range(batch)]
        cu = torch.tensor([0, *np.cumsum(counts).tolist()])
        q = torch.from_numpy(rng.standard_normal((int(cu[-1]), hq, e))).to(dtype)
        options = dict(is_causal=trial > 0, enable_gqa=hq != kc.shape[2])
        out = mha.paged_attention(q, kc, vc, table, lens, cu_seqlens_q=cu, **options)
        assert out.shape == (q.shape[0], hq, vc.shape[3]) and out.dtype == dtype
        for b in range(batch):
            rows = q[cu[b]:cu[b + 1]]
            if counts[b] == 0:
                continue
            if keys[b].shape[1] == 0:
                assert torch.all(out[cu[b]:cu[b + 1]] == 0)
                continue
            alone = mha.scaled_dot_product_attention(rows.transpose(0, 1)[None], keys[b].transpose(1, 2),
                                                     values[b].transpose(1, 2), causal_alignment="bottom_right",
                                                     **options)
            assert torch.equal(out[cu[b]:cu[b + 1]].transpose(0, 1)[None], alone)
        compiled = torch.compile(lambda *a: mha.paged_attention(*a, cu_seqlens_q=cu, **options), backend="aot_eager",
                                 fullgraph=True)
        assert torch.equal(compiled(q, kc, vc, table, lens), out)
    q = torch.randn(3, hq, e).to(dtype)
    with pytest.raises(ValueError, match=r"query: expected a packed \[Tq, Hq, E\] tensor \(rank 3\)"):
        mha.paged_attention(q[None], kc, vc, table, lens, cu_seqlens_q=torch.tensor([0] * batch + [3]))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected the last offset to be the number of query rows, 3"):
        mha.paged_attention(q, kc, vc, table, lens, cu_seqlens_q=torch.tensor([0] * batch + [2]))


def test_decoding_loop_writes_its_cache(rng):
    """A prompt written into empty pages, then a key per step, each step attending over the cache
    so far: the bits of mha's SDPA over the contiguous keys; numpy arrays too."""
    for dtype in (torch.float32, torch.bfloat16):
        batch, hq, hkv, e, page_size, prompt, steps = 2, 4, 2, 32, 8, 11, 12
        per_seq = (prompt + steps + page_size - 1) // page_size
        kc = torch.full((batch * per_seq + 1, page_size, hkv, e), float("nan"), dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
        table = torch.tensor(rng.permutation(batch * per_seq + 1)[: batch * per_seq].reshape(batch, per_seq),
                             dtype=torch.int32)
        keys = torch.from_numpy(rng.standard_normal((batch, prompt + steps, hkv, e))).to(dtype)
        values = torch.from_numpy(rng.standard_normal((batch, prompt + steps, hkv, e))).to(dtype)
        lens = torch.zeros(batch, dtype=torch.int64)
        mha.write_paged_cache(keys[:, :prompt], values[:, :prompt], kc, vc, table, lens)
        lens += prompt
        for t in range(steps):
            mha.write_paged_cache(keys[:, prompt + t:prompt + t + 1], values[:, prompt + t:prompt + t + 1], kc, vc,
                                  table, lens)
            lens += 1
            q = torch.from_numpy(rng.standard_normal((batch, 1, hq, e))).to(dtype)
            out = mha.paged_attention(q, kc, vc, table, lens, is_causal=True, enable_gqa=True)
            n = int(lens[0])
            alone = mha.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :n].transpose(1, 2),
                                                     values[:, :n].transpose(1, 2), is_causal=True,
                                                     enable_gqa=True, causal_alignment="bottom_right")
            assert torch.equal(out.transpose(1, 2), alone)
    # numpy arrays, lists for the table and lengths
    kc = np.full((4, 4, 1, 8), np.nan, dtype=np.float32)
    vc = np.full((4, 4, 1, 8), np.nan, dtype=np.float32)
    k = rng.standard_normal((1, 6, 1, 8)).astype(np.float32)
    mha.write_paged_cache(k, k, kc, vc, [[2, 0]], [0])
    assert np.array_equal(kc[2], k[0, :4]) and np.array_equal(kc[0, :2], k[0, 4:])
    q = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    out = mha.paged_attention(q, kc, vc, np.array([[2, 0]]), np.array([6]))
    assert isinstance(out, np.ndarray) and out.shape == (1, 1, 1, 8)
    alone = mha.scaled_dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), k.swapaxes(1, 2))
    assert np.array_equal(out.swapaxes(1, 2), alone)


def test_errors_are_clear():
    q = torch.randn(2, 1, 2, 8)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8])
    mha.paged_attention(q, kc, vc, table, lens)
    with pytest.raises(ValueError, match=r"query: expected a \[B, Lq, Hq, E\] tensor \(rank 4\)"):
        mha.paged_attention(q[0], kc, vc, table, lens)
    with pytest.raises(ValueError, match="expected one row and one length per sequence"):
        mha.paged_attention(q, kc, vc, table[:1], lens)
    with pytest.raises(ValueError, match=r"block_table: expected 2 dimensions, got shape \[4\]"):
        mha.paged_attention(q, kc, vc, table.flatten(), lens)
    with pytest.raises(TypeError, match="block_table: expected an integer tensor"):
        mha.paged_attention(q, kc, vc, table.float(), lens)
    with pytest.raises(ValueError, match=r"expected page indices in \[0, 4\), got block_table\[1\]\[1\] = 9"):
        mha.paged_attention(q, kc, vc, torch.tensor([[0, 1], [2, 9]]), lens)
    with pytest.raises(ValueError, match="sequence 1 reads keys up to position 9, more than its 2 table entries"):
        mha.paged_attention(q, kc, vc, table, torch.tensor([5, 9]))
    with pytest.raises(ValueError, match="causal_alignment"):
        mha.paged_attention(q, kc, vc, table, lens, causal_alignment="middle")
    with pytest.raises(ValueError, match="inference only"):
        mha.paged_attention(q.requires_grad_(), kc, vc, table, lens)
    with torch.no_grad():
        mha.paged_attention(q, kc, vc, table, lens)
    with pytest.raises(ValueError, match="sequence 0 writes rows up to position 9"):
        mha.write_paged_cache(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), kc, vc, table, torch.tensor([8, 0]))
    with pytest.raises(ValueError, match="key: expected the caches' dtype float32, got bfloat16"):
        mha.write_paged_cache(torch.randn(2, 1, 2, 8).bfloat16(), torch.randn(2, 1, 2, 8), kc, vc, table, lens)


def test_compiled_decoding_step_is_one_graph_with_the_eager_bits(rng):
    """A decoding step under torch.compile (fullgraph: no graph break): the cache write is the
    mutating operator mha::write_paged_cache, the attention mha::paged_attention; the caches and
    the output are the eager call's bits, and later steps (longer caches) run the same graph."""
    q, kc, vc, table, lens, _, _ = _draw(rng, torch.float32, 1, 16)
    table = torch.where(table < 0, table.max() + 1, table)  # room for the new rows: a spare page
    kc, vc = (torch.cat([c, torch.zeros(2, *c.shape[1:])]) for c in (kc, vc))
    lens = torch.clamp(lens, max=table.shape[1] * 16 - 3)
    hq, hkv = q.shape[2], kc.shape[2]

    def step(q, k_new, v_new, kc, vc, table, lens):
        mha.write_paged_cache(k_new, v_new, kc, vc, table, lens)
        return mha.paged_attention(q, kc, vc, table, lens + 1, is_causal=True, enable_gqa=hq != hkv)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    kc2, vc2 = kc.clone(), vc.clone()
    for t in range(2):
        k_new, v_new = (torch.from_numpy(rng.standard_normal((q.shape[0], 1, hkv, kc.shape[3]))).float() for _ in "kv")
        got = compiled(q, k_new, v_new, kc, vc, table, lens + t)
        want = step(q, k_new, v_new, kc2, vc2, table, lens + t)
        assert torch.equal(got, want)
        assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))


def test_paged_operators_pass_opcheck(rng):
    """PyTorch's checks of the two custom operators: schema (the write mutates the caches and
    nothing else), fake implementations against the real ones."""
    from mha import ops  # noqa: F401 - registers the operators

    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, table, lens, _, _ = _draw(rng, dtype, 2, 7)
        kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)  # (opcheck compares outputs and caches with NaN-unaware checks)
        slopes = torch.full((q.shape[2],), 0.25) if dtype == torch.float32 else None
        for return_lse in (False, True):
            args = (q, kc, vc, table, lens, True, None, q.shape[2] != kc.shape[2], True, 5, 0, slopes, 0, None,
                    return_lse)
            result = torch.library.opcheck(torch.ops.mha.paged_attention.default, args)
            assert all(r == "SUCCESS" for r in result.values()), result
            cu = torch.arange(q.shape[0] + 1) * 2  # packed rows, two per sequence
            packed = (q.reshape(-1, *q.shape[2:]), *args[1:-2], cu, return_lse)
            result = torch.library.opcheck(torch.ops.mha.paged_attention.default, packed)
            assert all(r == "SUCCESS" for r in result.values()), result
        kc, vc = (torch.from_numpy(rng.standard_normal((4, 4, 2, 8))).to(dtype) for _ in "kv")
        k_new, v_new = (torch.from_numpy(rng.standard_normal((2, 2, 2, 8))).to(dtype) for _ in "kv")
        table = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
        args = (k_new, v_new, kc, vc, table, torch.tensor([3, 0]), None)
        result = torch.library.opcheck(torch.ops.mha.write_paged_cache.default, args)
        assert all(r == "SUCCESS" for r in result.values()), result
        args = (k_new.reshape(4, 2, 8)[:3], v_new.reshape(4, 2, 8)[:3], kc, vc, table, torch.tensor([3, 0]),
                torch.tensor([0, 1, 3]))
        result = torch.library.opcheck(torch.ops.mha.write_paged_cache.default, args)
        assert all(r == "SUCCESS" for r in result.values()), result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_keys_and_values_are_written_then_attended(rng, dtype):
    """k=, v= (FlashAttention's flash_attn_with_kvcache): the step's rows written at each sequence's
    length, then attention over the longer cache: the caches and the output are the bits of
    write_paged_cache followed by paged_attention over cache_seqlens + Lnew; cache_seqlens is left
    as it was. Padded and packed (a different count per sequence), eager and compiled."""
    for trial in range(3):
        q, kc, vc, table, lens, _, _ = _draw(rng, dtype, 3, 8)
        table = torch.where(table < 0, table.max() + 1, table)  # room for the new rows: two spare pages
        table = torch.cat([table, torch.full((table.shape[0], 1), table.max() + 2, dtype=torch.int32)], 1)
        kc, vc = (torch.cat([c, torch.zeros(3, *c.shape[1:], dtype=dtype)]) for c in (kc, vc))
        lens = torch.clamp(lens, max=(table.shape[1] - 1) * 8 - 3)
        batch, hq, hkv, e = q.shape[0], q.shape[2], kc.shape[2], kc.shape[3]
        options = dict(is_causal=trial > 0, enable_gqa=hq != hkv)
        packed = trial == 2
        if packed:  # each query row brings its key and value; some sequences none
            counts = [int(rng.choice([0, 1, 3])) for _ in range(batch)]
            cu = torch.tensor([0, *np.cumsum(counts).tolist()])
            q = torch.from_numpy(rng.standard_normal((int(cu[-1]), hq, e))).to(dtype)
            k_new, v_new = (torch.from_numpy(rng.standard_normal((int(cu[-1]), hkv, e))).to(dtype) for _ in "kv")
            options["cu_seqlens_q"] = cu
            longer = lens + torch.tensor(counts)
        else:
            k_new, v_new = (torch.from_numpy(rng.standard_normal((batch, 3, hkv, e))).to(dtype) for _ in "kv")
            longer = lens + 3
        before = lens.clone()
        kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        out = mha.paged_attention(q, kc, vc, table, lens, k=k_new, v=v_new, **options)
        assert torch.equal(lens, before)
        write = dict(cu_seqlens_new=options["cu_seqlens_q"]) if packed else {}
        mha.write_paged_cache(k_new, v_new, kc2, vc2, table, lens, **write)
        want = mha.paged_attention(q, kc2, vc2, table, longer, **options)
        assert torch.equal(out, want)
        assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
        compiled = torch.compile(lambda *a: mha.paged_attention(*a[:5], k=a[5], v=a[6], **options),
                                 backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(q, kc3, vc3, table, lens, k_new, v_new), out)
        assert torch.equal(kc3.nan_to_num(7.0), kc2.nan_to_num(7.0))
        assert torch.equal(vc3.nan_to_num(7.0), vc2.nan_to_num(7.0))


def test_contiguous_caches_need_no_table(rng):
    """block_table=None: key_cache [B, S, Hkv, E], one contiguous cache per sequence (Hugging Face's
    static cache), cache_seqlens a tensor or one int; each sequence's rows are SDPA over its first
    cache_seqlens[b] keys; with k=, v= a decoding loop grows it in place, compiled as one graph."""
    batch, S, hq, hkv, e = 3, 40, 4, 2, 16
    kc = torch.from_numpy(rng.standard_normal((batch, S, hkv, e))).float()
    vc = torch.from_numpy(rng.standard_normal((batch, S, hkv, e))).float()
    lens = torch.tensor([0, 17, 33])
    q = torch.from_numpy(rng.standard_normal((batch, 2, hq, e))).float()
    out = mha.paged_attention(q, kc, vc, None, lens, is_causal=True, enable_gqa=True)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            assert torch.all(out[b] == 0)
            continue
        alone = mha.scaled_dot_product_attention(q[b:b + 1].transpose(1, 2), kc[b:b + 1, :n].transpose(1, 2),
                                                 vc[b:b + 1, :n].transpose(1, 2), is_causal=True, enable_gqa=True,
                                                 causal_alignment="bottom_right")
        assert torch.equal(out[b:b + 1].transpose(1, 2), alone)
    same = mha.paged_attention(q, kc, vc, None, 17, enable_gqa=True)
    assert torch.equal(same, mha.paged_attention(q, kc, vc, None, torch.tensor([17] * batch), enable_gqa=True))
    # A decoding loop over an empty contiguous cache, eager and compiled side by side.
    kc_e, vc_e = torch.zeros(batch, S, hkv, e), torch.zeros(batch, S, hkv, e)
    kc_c, vc_c = kc_e.clone(), vc_e.clone()
    step = torch.compile(lambda q, k, v, kc, vc, n: mha.paged_attention(q, kc, vc, None, n, k=k, v=v, is_causal=True,
                                                                       enable_gqa=True), backend="aot_eager",
                         fullgraph=True)
    history_k, history_v = [], []
    for t in range(4):
        qt = torch.from_numpy(rng.standard_normal((batch, 1, hq, e))).float()
        kt, vt = (torch.from_numpy(rng.standard_normal((batch, 1, hkv, e))).float() for _ in "kv")
        history_k.append(kt)
        history_v.append(vt)
        got = mha.paged_attention(qt, kc_e, vc_e, None, t, k=kt, v=vt, is_causal=True, enable_gqa=True)
        assert torch.equal(step(qt, kt, vt, kc_c, vc_c, torch.full((batch,), t)), got)
        keys, values = torch.cat(history_k, 1), torch.cat(history_v, 1)
        alone = mha.scaled_dot_product_attention(qt.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 enable_gqa=True)
        assert torch.equal(got.transpose(1, 2), alone)
    assert torch.equal(kc_e, kc_c) and torch.equal(kc_e[:, :4], torch.cat(history_k, 1))
    with pytest.raises(ValueError, match=r"without a block_table, expected one contiguous cache \[B, S, Hkv, E\] per "
                                         r"sequence \(B = 3\), got shape \[2, 40, 2, 16\]"):
        mha.paged_attention(q, kc[:2], vc[:2], None, lens, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_against_float64_and_merging_split_caches(rng, dtype):
    """return_softmax_lse: [B, Hq, Lq] ([Hq, Tq] packed), float32 (float64 for float64), against
    PyTorch's float64 logsumexp of the scaled scores (2e-6 relative to max(1, |lse|) in float32:
    statistics of sums of up to a few hundred terms in float32); +inf for a sequence with no key.
    A shared prefix's pages and each sequence's own rest, attended apart and merged by the
    documented formula, give the whole cache's output (float32 2e-5)."""
    tol_out, tol_lse = (1e-12, 1e-12) if dtype == torch.float64 else (2e-5, 2e-6)
    for trial in range(3):
        q, kc, vc, table, lens, keys, _ = _draw(rng, dtype, 1 + 4 * trial, 8)
        hq, hkv = q.shape[2], kc.shape[2]
        out, lse = mha.paged_attention(q, kc, vc, table, lens, enable_gqa=hq != hkv, return_softmax_lse=True)
        assert lse.shape == (q.shape[0], hq, q.shape[1])
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(out, mha.paged_attention(q, kc, vc, table, lens, enable_gqa=hq != hkv))
        for b in range(q.shape[0]):
            if int(lens[b]) == 0:
                assert torch.all(lse[b] == float("inf"))
                continue
            kb = keys[b][0].double().repeat_interleave(hq // hkv, dim=1)  # [S, Hq, E]
            scores = torch.einsum("lhe,she->hls", q[b].double(), kb) / q.shape[3] ** 0.5
            assert _relative(lse[b].double(), torch.logsumexp(scores, -1), floor=1.0) < tol_lse
        # The prefix: each sequence's first page; the rest: the remaining entries of its row.
        first = torch.clamp(lens, max=8)
        a_out, a_lse = mha.paged_attention(q, kc, vc, table, first, enable_gqa=hq != hkv, return_softmax_lse=True)
        z_out, z_lse = mha.paged_attention(q, kc, vc, table[:, 1:], lens - first, enable_gqa=hq != hkv,
                                           return_softmax_lse=True)
        merged, merged_lse = mha.merge_attention_states(a_out, a_lse, z_out, z_lse)
        assert merged.dtype == dtype and merged_lse.dtype == lse.dtype
        assert _relative(merged, out.double()) < tol_out
        empty = lse == float("inf")  # sequences with no key: +inf from both
        assert torch.equal(merged_lse == float("inf"), empty)
        assert _relative(merged_lse[~empty], lse.double()[~empty], floor=1.0) < tol_lse
    # Packed rows: [Hq, Tq], each sequence's columns its padded call's.
    cu = torch.tensor([0, *np.cumsum([2] * q.shape[0]).tolist()])
    qp = torch.from_numpy(rng.standard_normal((int(cu[-1]), hq, q.shape[3]))).to(dtype)
    _, lse_p = mha.paged_attention(qp, kc, vc, table, lens, enable_gqa=hq != hkv, cu_seqlens_q=cu,
                                   return_softmax_lse=True)
    assert lse_p.shape == (hq, int(cu[-1]))
    _, lse_b = mha.paged_attention(qp.reshape(q.shape[0], 2, hq, -1), kc, vc, table, lens, enable_gqa=hq != hkv,
                                   return_softmax_lse=True)
    assert torch.equal(lse_p, lse_b.permute(1, 0, 2).reshape(hq, -1))
    # The merge by hand on one row: weights e^1 and e^3 of lse 1 and 3; +inf carries none; numpy.
    out_a, out_b = torch.full((1, 1, 1, 2), 2.0), torch.full((1, 1, 1, 2), 6.0)
    got, got_lse = mha.merge_attention_states(out_a, torch.tensor([[[1.0]]]), out_b, torch.tensor([[[3.0]]]))
    share = 1 / (1 + np.exp(2.0))
    assert torch.allclose(got, torch.full((1, 1, 1, 2), 2 * share + 6 * (1 - share)))
    assert torch.allclose(got_lse, torch.tensor([[[3 + np.log1p(np.exp(-2.0))]]]).float())
    got, got_lse = mha.merge_attention_states(out_a.numpy(), np.array([[[np.inf]]], np.float32), out_b.numpy(),
                                              np.array([[[3.0]]], np.float32))
    assert np.array_equal(got, out_b.numpy()) and got_lse[0, 0, 0] == 3.0
    with pytest.raises(ValueError, match=r"lse_a: expected \[..., H, L\]"):
        mha.merge_attention_states(out_a, torch.zeros(1, 1, 2), out_b, torch.zeros(1, 1, 2))
    compiled = torch.compile(lambda *a: mha.paged_attention(*a, enable_gqa=hq != hkv, return_softmax_lse=True),
                             backend="aot_eager", fullgraph=True)
    c_out, c_lse = compiled(q, kc, vc, table, lens)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
    _, n_lse = mha.paged_attention(q.numpy(), kc.numpy(), vc.numpy(), table.numpy(), lens.numpy(),
                                       enable_gqa=hq != hkv, return_softmax_lse=True)
    assert isinstance(n_lse, np.ndarray) and np.array_equal(n_lse, lse.numpy())


def test_new_rows_errors_are_clear():
    q = torch.randn(2, 1, 2, 8)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 6])
    k = torch.randn(2, 1, 2, 8)
    with pytest.raises(ValueError, match="k, v: expected both or neither, got k given and v None"):
        mha.paged_attention(q, kc, vc, table, lens, k=k)
    with pytest.raises(ValueError, match=r"k: expected a \[B, Lnew, Hkv, E\] tensor \(rank 4\)"):
        mha.paged_attention(q, kc, vc, table, lens, k=k[0], v=k)
    with pytest.raises(ValueError, match=r"key/value: expected \[B, Hkv, Lnew, Dk\]"):
        mha.paged_attention(q, kc, vc, table, lens, k=k[:, :, :1], v=k[:, :, :1])
    with pytest.raises(ValueError, match="sequence 1 writes rows up to position 9"):
        mha.paged_attention(q, kc, vc, table, lens, k=torch.randn(2, 3, 2, 8), v=torch.randn(2, 3, 2, 8))
    qp = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"k: expected packed \[Tq, Hkv, E\] rows, one per query row \(Tq = 3\)"):
        mha.paged_attention(qp, kc, vc, table, lens, k=torch.randn(2, 2, 8), v=torch.randn(2, 2, 8),
                            cu_seqlens_q=[0, 1, 3])
    before = kc.clone()
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected offsets from 0, non-decreasing, ending at the 3"):
        mha.paged_attention(qp, kc, vc, table, lens, k=torch.randn(3, 2, 8), v=torch.randn(3, 2, 8),
                            cu_seqlens_q=[0, 2, 1])
    assert torch.equal(kc, before)  # nothing written before the offsets were checked
    with pytest.raises(ValueError, match=r"key: expected packed \[Tnew, Hkv, E\] rows \(rank 3\) with cu_seqlens_new"):
        mha.write_paged_cache(k, k, kc, vc, table, lens, cu_seqlens_new=[0, 1, 2])
    with pytest.raises(ValueError, match="cu_seqlens_new: expected the last offset to be the number of key rows, 2"):
        mha.write_paged_cache(k[:, 0], k[:, 0], kc, vc, table, lens, cu_seqlens_new=[0, 1, 1])
    with pytest.raises(ValueError, match="block_table/cache_seqlens: expected one row and one length per sequence"):
        mha.paged_attention(q, kc, vc, table, [5, 6, 7])
