#!/usr/bin/env python3
"""Side-by-side benchmark: mha's fused CPU kernels against PyTorch on the same machine, in the same
run, on the same inputs and thread count; and against oneDNN's SDPA (its Graph API) where
`make onednn-bench` has built bench/onednn_sdpa.cpp.

  python bench/compare.py                      # the headline shapes (B=4, H=16, L=2048, d=64)
  python bench/compare.py --lengths 512 2048 --dims 64 128 --threads 2 --json out.json
  python bench/compare.py --lengths 128 512 2048 --dims 64 128 --plot docs/attention_gflops.png
  python bench/compare.py --batch 1 --lengths 8192 --reps 3 --no-module   # --dtypes fp32 to skip bf16

FLOPs: forward 4 * B * H * Lq * Lk * d (only the pairs a causal mask keeps), backward 2.5x that
(the convention of FlashAttention's papers); the module adds its four E x E projections (twice
that again in a training step's backward).
Each GFLOP/s is also given as a fraction of the machine's fp32 FMA ceiling, measured in the same
run by bench/fma_peak.cpp (built with the benchmarks).
Each figure is the median of --reps timed calls after three warm-up calls; ours and PyTorch's
alternate call by call, so a shared machine's load swings fall on both alike.
"""

import argparse
import json
import os
import subprocess
import sys
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import mha
from mha import _mha


class Rows(list):
    """The table's rows, each also told on stderr as it is measured: a full run takes tens of
    minutes on two cores, and the table waits for the ceilings measured at its end."""

    def append(self, row):
        op, shape, ours, theirs, _ = row
        print(f"  {op} {shape}: mha {ours * 1e3:.1f} ms, torch {theirs * 1e3:.1f} ms ({theirs / ours:.2f}x)",
              file=sys.stderr, flush=True)
        super().append(row)


def paired_medians(ours, theirs, reps):
    """Median seconds of each of two calls, timed in alternation (ours, theirs, ours, ...) so that
    a shared machine's load swings fall on both sides alike rather than on whichever ran second."""
    for _ in range(3):  # warm-up: thread pools, scratch buffers, caches
        ours()
        theirs()
    times = ([], [])
    for _ in range(reps):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


ONEDNN_DEFAULT = Path(__file__).resolve().parent.parent / "build" / "bench" / "onednn_sdpa"


def onednn_seconds(binary, B, H, L, d, causal, dtype, threads, reps):
    """Median seconds of oneDNN's SDPA graph (bench/onednn_sdpa.cpp, built by `make onednn-bench`),
    or None where it is not built, cannot run this case on this CPU (bf16 matmul without
    AVX512-BF16), or would not fit in memory: oneDNN 3.2 on CPUs without AVX-512 does not fuse
    the graph, so it materialises 3-4 score tensors of B*H*L*L floats."""
    if binary is None or not Path(binary).exists():
        return None
    needed = (4 if causal else 3) * B * H * L * L * 4
    if needed > 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        return None
    cmd = [str(binary), "--batch", str(B), "--heads", str(H), "--len", str(L), "--dim", str(d),
           "--dtype", dtype, "--reps", str(reps)] + (["--causal"] if causal else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None
    if "error" in result:
        return None
    if result["max_rel_error"] > (2e-2 if dtype == "bf16" else 1e-4):  # a wrong graph is not a result
        raise RuntimeError(f"oneDNN SDPA disagrees with float64: {result} for {' '.join(cmd)}")
    return result["ms"] / 1e3


def attention_flops(B, H, L, d, causal):
    pairs = L * (L + 1) / 2 if causal else L * L
    return 4.0 * B * H * pairs * d


def bench_sdpa(B, H, L, d, causal, dtype, reps, rows):
    """The forward and the backward in `dtype` on both sides: inputs, output and gradients in it."""
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g).to(dtype) for _ in range(4))
    flops = attention_flops(B, H, L, d, causal)
    shape = f"B={B} H={H} L={L} d={d}{' causal' if causal else ''}"
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]

    ours_fwd, torch_fwd = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps)
    rows.append((f"sdpa fwd {name}", shape, ours_fwd, torch_fwd, flops))

    options = dict(attn_mask=None, dropout_p=0.0, is_causal=causal, scale=None, softcap=0.0, enable_gqa=False,
                   dropout_seed=0, bottom_right=False, window_left=-1, window_right=-1, alibi_slopes=None,
                   num_threads=0)
    out, lse = _mha.sdpa_train(q, k, v, **options)
    out = torch.from_numpy(out)
    if dtype == torch.bfloat16:  # numpy has no bfloat16: its bits came back
        out = out.view(torch.bfloat16)
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    ours_bwd, torch_bwd = paired_medians(
        lambda: _mha.sdpa_backward(q, k, v, out, lse, go, **options, attn_mask_grad=False),
        lambda: torch.autograd.grad(ref, (qt, kt, vt), go, retain_graph=True), reps)
    rows.append((f"sdpa bwd {name}", shape, ours_bwd, torch_bwd, 2.5 * flops))


def bench_sdpa_masked(B, H, L, d, reps, rows):
    """The fp32 forward with the masks users pass most: an additive [L, L] float mask (a
    relative-position bias, say) and a bool key padding mask [B, 1, 1, L] (the last tenth of every
    sequence padded), FLOPs counted as unmasked; the backward of a learned bias [1, H, L, L] with
    its gradient; and Hugging Face's causal mask of a left-padded
    batch, [B, 1, L, L] at finfo.min where hidden (entry b's first b/8 of the keys padded), forward
    and backward, FLOPs counted as causal."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, d, generator=g) for _ in range(3))
    bias = torch.randn(L, L, generator=g)
    keep = (torch.arange(L) < L - L // 10).expand(B, 1, 1, L).contiguous()
    flops = attention_flops(B, H, L, d, False)
    for name, mask in (("+float mask", bias), ("+padding mask", keep)):
        ours, theirs = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                      lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps)
        rows.append((f"sdpa fwd fp32 {name}", f"B={B} H={H} L={L} d={d}", ours, theirs, flops))
    # A learned relative-position bias per head (T5, Swin): [1, H, L, L], trained with the rest,
    # so the backward also returns its gradient (dS summed over the batch).
    rel = torch.randn(1, H, L, L, generator=g, requires_grad=True)
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    go = torch.randn(B, H, L, d, generator=g)
    out = mha.scaled_dot_product_attention(qt, kt, vt, attn_mask=rel)
    ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=rel)
    ours, theirs = paired_medians(lambda: torch.autograd.grad(out, (qt, kt, vt, rel), go, retain_graph=True),
                                  lambda: torch.autograd.grad(ref, (qt, kt, vt, rel), go, retain_graph=True), reps)
    rows.append(("sdpa bwd fp32 +bias grad", f"B={B} H={H} L={L} d={d}", ours, theirs, 2.5 * flops))
    lowest = torch.finfo(torch.float32).min
    hf = torch.full((L, L), lowest).triu(1).expand(B, 1, L, L).clone()
    for b in range(B):
        hf[b, 0, :, : b * L // 8] = lowest
    flops = attention_flops(B, H, L, d, True)
    shape = f"B={B} H={H} L={L} d={d} causal"
    ours, theirs = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, attn_mask=hf),
                                  lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=hf), reps)
    rows.append(("sdpa fwd fp32 +HF left pad", shape, ours, theirs, flops))
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    go = torch.randn(B, H, L, d, generator=g)
    out, ref = mha.scaled_dot_product_attention(qt, kt, vt, attn_mask=hf), F.scaled_dot_product_attention(qt, kt, vt, attn_mask=hf)
    ours, theirs = paired_medians(lambda: torch.autograd.grad(out, (qt, kt, vt), go, retain_graph=True),
                                  lambda: torch.autograd.grad(ref, (qt, kt, vt), go, retain_graph=True), reps)
    rows.append(("sdpa bwd fp32 +HF left pad", shape, ours, theirs, 2.5 * flops))


def bench_decode(reps, rows, dtypes):
    """Decoding steps: one query per head against a cache of keys and values, with as many
    key/value heads as query heads, and grouped (GQA, 4 query heads per key/value head); and a
    speculative step, 8 new tokens that see the cache and the tokens before them (a bool mask,
    causal from the bottom right). In fp32; in bf16 one step of each and a GQA step of 4 tokens
    (16 query rows per key/value head). FLOPs as for any
    forward, every (query, key) pair counted; a step reads the whole cache, so bytes bound it."""
    shapes = [(B, Hq, Hkv, S, d, Lq, "fp32") for B, Hq, Hkv, S, d, Lq in
              ((4, 16, 16, 2048, 64, 1), (1, 32, 8, 4096, 128, 1), (1, 32, 8, 4096, 128, 8))]
    shapes += [(4, 16, 16, 2048, 64, 1, "bf16"), (1, 32, 8, 4096, 128, 1, "bf16"), (1, 32, 8, 4096, 128, 4, "bf16")]
    for B, Hq, Hkv, S, d, Lq, name in shapes:
        if name not in dtypes:
            continue
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        g = torch.Generator().manual_seed(2)
        q = torch.randn(B, Hq, Lq, d, generator=g).to(dtype)
        k, v = (torch.randn(B, Hkv, S, d, generator=g).to(dtype) for _ in range(2))
        mask = torch.ones(Lq, S, dtype=torch.bool).tril(S - Lq) if Lq > 1 else None
        gqa = Hq != Hkv
        ours, theirs = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
                                      lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
                                      reps * 3)
        op = f"sdpa decode {name}" if Lq == 1 else f"sdpa decode {name}, {Lq} tokens"
        rows.append((op, f"B={B} H={Hq}/{Hkv} S={S} d={d}", ours, theirs, 4.0 * B * Hq * Lq * S * d))
    if "bf16" in dtypes and hasattr(torch, "float8_e5m2"):
        bench_decode_float8(reps, rows)


def bench_decode_float8(reps, rows):
    """A decoding step (bf16 queries) over a float8 cache (e4m3 and e5m2), half a bf16 cache's bytes:
    mha widens it as it reads it. PyTorch's CPU SDPA takes no float8, so its sides are its step
    over a bf16 cache (what it runs instead) and, for e4m3, over the float8 cache converted to
    bf16 every step; and an e4m3 cache with scales per batch entry and key/value head (vLLM's
    k_scale / v_scale: mha's k_descale, v_descale) against the cache converted and multiplied by
    them every step."""
    for B, Hq, Hkv, S, d in ((4, 16, 16, 2048, 64), (1, 32, 8, 4096, 128)):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(B, Hq, 1, d, generator=g).to(torch.bfloat16)
        k16, v16 = (torch.randn(B, Hkv, S, d, generator=g).to(torch.bfloat16) for _ in range(2))
        gqa = Hq != Hkv
        for fmt, name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
            k8, v8 = k16.to(fmt), v16.to(fmt)
            ours = lambda: mha.scaled_dot_product_attention(q, k8, v8, enable_gqa=gqa)  # noqa: E731
            sides = [("bf16 cache", lambda: F.scaled_dot_product_attention(q, k16, v16, enable_gqa=gqa))]
            if name == "e4m3":
                sides.append(("fp8 to bf16", lambda: F.scaled_dot_product_attention(
                    q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), enable_gqa=gqa)))
            for against, theirs in sides:
                mine, its = paired_medians(ours, theirs, reps * 3)
                rows.append((f"sdpa decode fp8 {name} cache vs {against}", f"B={B} H={Hq}/{Hkv} S={S} d={d}", mine,
                             its, 4.0 * B * Hq * S * d))
            if name == "e4m3":
                kd, vd = (torch.rand(B, Hkv, generator=g) + 0.5 for _ in range(2))
                kd16, vd16 = (x.to(torch.bfloat16)[..., None, None] for x in (kd, vd))
                mine, its = paired_medians(
                    lambda: mha.scaled_dot_product_attention(q, k8, v8, enable_gqa=gqa, k_descale=kd, v_descale=vd),
                    lambda: F.scaled_dot_product_attention(q, k8.to(torch.bfloat16) * kd16, v8.to(torch.bfloat16) * vd16,
                                                           enable_gqa=gqa), reps * 3)
                rows.append(("sdpa decode fp8 e4m3 scaled cache vs fp8 to bf16 times scales",
                             f"B={B} H={Hq}/{Hkv} S={S} d={d}", mine, its, 4.0 * B * Hq * S * d))


def bench_paged(reps, rows):
    """Decoding over a paged key/value cache in FlashAttention's (and vLLM's) layout [pages,
    page_size, Hkv, d], each sequence's pages shuffled over the pool: mha.paged_attention reads
    them in place; PyTorch has no paged attention on the CPU, so its side is what a user writes,
    the pages gathered by the block table (index and reshape) and its SDPA on them, per step."""
    shapes = ((4, 16, 16, 2048, 64, 16, torch.float32), (4, 16, 16, 2048, 64, 256, torch.float32),
              (1, 32, 8, 4096, 128, 16, torch.float32), (8, 32, 8, 4096, 128, 16, torch.bfloat16))
    for B, Hq, Hkv, S, d, page, dtype in shapes:
        g = torch.Generator().manual_seed(6)
        per_seq = S // page
        kc, vc = (torch.randn(B * per_seq, page, Hkv, d, generator=g).to(dtype) for _ in range(2))
        table = torch.randperm(B * per_seq, generator=g).reshape(B, per_seq).to(torch.int32)
        lens = torch.full((B,), S, dtype=torch.int64)
        q = torch.randn(B, 1, Hq, d, generator=g).to(dtype)
        gqa = Hq != Hkv

        def theirs():
            k = kc[table.long()].reshape(B, S, Hkv, d).transpose(1, 2)
            v = vc[table.long()].reshape(B, S, Hkv, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=gqa)

        ours, theirs = paired_medians(lambda: mha.paged_attention(q, kc, vc, table, lens, enable_gqa=gqa), theirs,
                                      reps * 3)
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        rows.append((f"paged decode {name} vs gather", f"B={B} H={Hq}/{Hkv} S={S} d={d} page={page}", ours, theirs,
                     4.0 * B * Hq * S * d))


def bench_varlen(reps, rows):
    """A batch of sequences of different lengths (16, drawn once from 64..1024 with a fixed seed),
    H=16, d=64, fp32: mha.varlen_attention on the packed rows against what PyTorch runs on the CPU:
    its SDPA on the batch padded to the longest sequence, a bool mask hiding the padding keys (and
    the future, causal), forward and forward+backward; and its nested-tensor SDPA (jagged, the
    math path under sdpa_kernel(MATH): its only CPU path, which takes no causal call). FLOPs count
    the (query, key) pairs of the sequences themselves, not the padding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, d = 16, 64
    lengths = np.random.default_rng(5).integers(64, 1025, 16).tolist()
    B, longest, total = len(lengths), max(lengths), sum(lengths)
    cu = torch.tensor(np.cumsum([0] + lengths))
    g = torch.Generator().manual_seed(3)
    q, k, v, go = (torch.randn(total, H, d, generator=g) for _ in range(4))

    def padded(x):
        out = torch.zeros(B, H, longest, d)
        for b in range(B):
            out[b, :, :lengths[b]] = x[cu[b]:cu[b + 1]].transpose(0, 1)
        return out

    qp, kp, vp, gp = (padded(x) for x in (q, k, v, go))
    keys = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]: a real key
    shape = f"B={B} H={H} L=64..1024 d={d}"
    for causal in (False, True):
        mask = keys[:, None, None, :]
        if causal:
            mask = mask & torch.ones(longest, longest, dtype=torch.bool).tril()
        pairs = sum(n * (n + 1) / 2 if causal else n * n for n in lengths)
        flops = 4.0 * H * pairs * d
        tag = " causal" if causal else ""
        ours, theirs = paired_medians(lambda: mha.varlen_attention(q, k, v, cu, cu, is_causal=causal),
                                      lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask), reps)
        rows.append(("varlen fwd fp32 vs padded", shape + tag, ours, theirs, flops))
        qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
        qpt, kpt, vpt = (x.clone().requires_grad_() for x in (qp, kp, vp))
        ours, theirs = paired_medians(
            lambda: torch.autograd.grad(mha.varlen_attention(qt, kt, vt, cu, cu, is_causal=causal), (qt, kt, vt), go),
            lambda: torch.autograd.grad(F.scaled_dot_product_attention(qpt, kpt, vpt, attn_mask=mask), (qpt, kpt, vpt),
                                        gp), reps)
        rows.append(("varlen fwd+bwd fp32 vs padded", shape + tag, ours, theirs, 3.5 * flops))
        if not causal:
            def nested(x):
                return torch.nested.nested_tensor_from_jagged(x, cu).transpose(1, 2)

            qn, kn, vn = nested(q), nested(k), nested(v)

            def theirs_nested():
                with sdpa_kernel(SDPBackend.MATH):
                    return F.scaled_dot_product_attention(qn, kn, vn)

            ours, theirs = paired_medians(lambda: mha.varlen_attention(q, k, v, cu, cu), theirs_nested, reps)
            rows.append(("varlen fwd fp32 vs nested", shape, ours, theirs, flops))


def bench_window(reps, rows):
    """Sliding-window (local) causal attention, each query over its W most recent keys (Mistral's
    layers): mha's window_size against what a PyTorch user runs on the CPU, its SDPA with the band
    as a bool mask [L, L] (built once, outside the timing), forward and forward+backward. FLOPs
    count the window's pairs (L W - W (W - 1) / 2 per head)."""
    B, H, L, d, W = 1, 16, 4096, 64, 512
    g = torch.Generator().manual_seed(4)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g) for _ in range(4))
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    band = (j <= i) & (j > i - W)
    flops = 4.0 * B * H * (L * W - W * (W - 1) / 2) * d
    shape = f"B={B} H={H} L={L} d={d} W={W}"
    ours, theirs = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                          window_size=(W - 1, -1)),
                                  lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band), reps)
    rows.append(("window fwd fp32 vs mask", shape, ours, theirs, flops))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    def ours_train():
        out = mha.scaled_dot_product_attention(qt, kt, vt, is_causal=True, window_size=(W - 1, -1))
        return torch.autograd.grad(out, (qt, kt, vt), go)

    def theirs_train():
        return torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, attn_mask=band), (qt, kt, vt), go)

    ours, theirs = paired_medians(ours_train, theirs_train, reps)
    rows.append(("window fwd+bwd fp32 vs mask", shape, ours, theirs, 3.5 * flops))


def bench_alibi(reps, rows):
    """ALiBi (BLOOM's, MPT's: slopes 2^(-8 h / H)): mha's alibi_slopes against what a PyTorch user
    runs on the CPU, its SDPA with the biases as a float mask [H, L, L] (built once, outside the
    timing), causal, forward and forward+backward."""
    B, H, L, d = 4, 16, 2048, 64
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g) for _ in range(4))
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    causal = j <= i
    biases = (-(slopes[:, None, None] * (i - j).abs())).masked_fill(~causal, float("-inf"))
    flops = 4.0 * B * H * L * (L + 1) / 2 * d
    shape = f"B={B} H={H} L={L} d={d} causal"
    ours, theirs = paired_medians(lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                          alibi_slopes=slopes),
                                  lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=biases), reps)
    rows.append(("alibi fwd fp32 vs mask", shape, ours, theirs, flops))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))

    def ours_train():
        out = mha.scaled_dot_product_attention(qt, kt, vt, is_causal=True, alibi_slopes=slopes)
        return torch.autograd.grad(out, (qt, kt, vt), go)

    def theirs_train():
        return torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, attn_mask=biases), (qt, kt, vt), go)

    ours, theirs = paired_medians(ours_train, theirs_train, reps)
    rows.append(("alibi fwd+bwd fp32 vs mask", shape, ours, theirs, 3.5 * flops))


def bench_sinks(reps, rows):
    """Attention sinks (gpt-oss's per-head logits): mha's sinks against the cheapest form of them
    a PyTorch CPU user has, its fused SDPA over the keys and values with one zero key and value
    appended and the sinks as that key's column of a float mask [H, L, L + 1] (causal -inf
    elsewhere; built once, outside the timing), forward and forward+backward of q, k and v."""
    B, H, L, d = 4, 16, 2048, 64
    g = torch.Generator().manual_seed(6)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g) for _ in range(4))
    sinks = torch.randn(H, generator=g)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mask = torch.zeros(H, L, L + 1).masked_fill(torch.cat([j > i, torch.zeros(L, 1, dtype=torch.bool)], 1),
                                                float("-inf"))
    mask[:, :, L] = sinks[:, None]
    zero = torch.zeros(B, H, 1, d)
    flops = 4.0 * B * H * L * (L + 1) / 2 * d
    shape = f"B={B} H={H} L={L} d={d} causal"
    ours, theirs = paired_medians(
        lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks),
        lambda: F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), attn_mask=mask),
        reps)
    rows.append(("sinks fwd fp32 vs mask", shape, ours, theirs, flops))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))

    def ours_train():
        out = mha.scaled_dot_product_attention(qt, kt, vt, is_causal=True, sinks=sinks)
        return torch.autograd.grad(out, (qt, kt, vt), go)

    def theirs_train():
        out = F.scaled_dot_product_attention(qt, torch.cat([kt, zero], 2), torch.cat([vt, zero], 2), attn_mask=mask)
        return torch.autograd.grad(out, (qt, kt, vt), go)

    ours, theirs = paired_medians(ours_train, theirs_train, reps)
    rows.append(("sinks fwd+bwd fp32 vs mask", shape, ours, theirs, 3.5 * flops))


def bench_softcap(reps, rows):
    """Logit soft-capping (Gemma 2's attn_logit_softcapping, 50) against what a PyTorch CPU user has:
    its SDPA takes no cap, so flex_attention with the cap as a score_mod and a causal block mask
    (compiled: inductor's CPU kernel), and the eager formulation of Hugging Face's Gemma 2
    (scores formed, divided, tanh, multiplied, masked, softmax, times V). Forward against both;
    forward and backward of q, k and v against the eager form (flex_attention has no CPU backward)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, L, d, cap = 4, 16, 2048, 64, 50.0
    g = torch.Generator().manual_seed(7)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g) for _ in range(4))
    flops = 4.0 * B * H * L * (L + 1) / 2 * d
    shape = f"B={B} H={H} L={L} d={d} causal"

    def softcap(score, b, h, i, j):
        return cap * torch.tanh(score / cap)

    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="cpu")
    flex = torch.compile(flex_attention)

    def theirs_flex(q, k, v):
        return flex(q, k, v, score_mod=softcap, block_mask=block_mask)

    hidden = torch.ones(L, L, dtype=torch.bool).triu(1)

    def theirs_eager(q, k, v):
        scores = q @ k.transpose(-1, -2) * d ** -0.5
        scores = torch.tanh(scores / cap) * cap
        return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v

    ours = (lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=cap))
    with torch.no_grad():
        assert (theirs_flex(q, k, v) - ours()).abs().max() < 1e-4  # (the same attention on both sides)
        mine, theirs = paired_medians(ours, lambda: theirs_flex(q, k, v), reps)
        rows.append(("softcap fwd fp32 vs flex", shape, mine, theirs, flops))
        mine, theirs = paired_medians(ours, lambda: theirs_eager(q, k, v), reps)
        rows.append(("softcap fwd fp32 vs eager", shape, mine, theirs, flops))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))

    def ours_train():
        out = mha.scaled_dot_product_attention(qt, kt, vt, is_causal=True, softcap=cap)
        return torch.autograd.grad(out, (qt, kt, vt), go)

    def theirs_train():
        return torch.autograd.grad(theirs_eager(qt, kt, vt), (qt, kt, vt), go)

    mine, theirs = paired_medians(ours_train, theirs_train, reps)
    rows.append(("softcap fwd+bwd fp32 vs eager", shape, mine, theirs, 3.5 * flops))


def bench_pooling(reps, rows):
    """Attention pooling in training: one learned query per head (a class token) over the 197
    tokens of a ViT-B/16 image, forward and backward through autograd on both sides, without and
    with dropout. FLOPs: the forward's, and 2.5x that for the backward."""
    B, H, Lk, d = 32, 12, 197, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 1, d, generator=g).requires_grad_()
    k, v = (torch.randn(B, H, Lk, d, generator=g).requires_grad_() for _ in range(2))
    go = torch.randn(B, H, 1, d, generator=g)

    def step(sdpa, p):
        return lambda: torch.autograd.grad(sdpa(q, k, v, dropout_p=p), (q, k, v), go)

    for p in (0.0, 0.1):
        ours, theirs = paired_medians(step(mha.scaled_dot_product_attention, p),
                                      step(F.scaled_dot_product_attention, p), reps * 3)
        op = "sdpa fwd+bwd fp32, 1 query" + (f", dropout {p}" if p else "")
        rows.append((op, f"B={B} H={H} Lk={Lk} d={d}", ours, theirs, 3.5 * 4.0 * B * H * Lk * d))


def bench_per_example_gradients(reps, rows):
    """Per-example gradients (torch.func.vmap of torch.func.grad, as DP-SGD takes them) of an
    SDPA loss over a batch of examples [H, L, d]: mha's vmap rule makes the batch one fused
    forward and backward; PyTorch's CPU SDPA has no batching rule and runs example by example.
    FLOPs: the forward's and 2.5x that for the backward."""
    import warnings
    B, H, L, d = 16, 8, 256, 64
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, L, d, generator=g) for _ in range(3))
    w = torch.randn(H, L, d, generator=g)

    def step(sdpa):
        per_example = torch.func.vmap(torch.func.grad(lambda q, k, v: (sdpa(q, k, v, is_causal=True) * w).sum(),
                                                      argnums=(0, 1, 2)))
        return lambda: per_example(q, k, v)

    with warnings.catch_warnings():  # (PyTorch's: "There is a performance drop because ... batching rule")
        warnings.simplefilter("ignore", UserWarning)
        ours, theirs = paired_medians(step(mha.scaled_dot_product_attention), step(F.scaled_dot_product_attention),
                                      reps)
    rows.append(("per-example grads fp32 causal", f"B={B} H={H} L={L} d={d}", ours, theirs,
                 3.5 * attention_flops(B, H, L, d, True)))


def bench_module(E, H, B, L, dtype, reps, rows, need_weights=False):
    """mha.nn.MultiheadAttention (the drop-in torch.nn.Module, its per-call copy of the parameters
    into the kernels included) against torch.nn.MultiheadAttention, both in `dtype`; with
    need_weights, PyTorch's default call (weights averaged over the heads, returned too)."""
    import mha.nn
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E).to(dtype)
    flops = attention_flops(B, H, L, E // H, False) + 4 * 2.0 * B * L * E * E
    with torch.no_grad():
        ours_t, torch_t = paired_medians(lambda: ours(x, x, x, need_weights=need_weights),
                                         lambda: ref(x, x, x, need_weights=need_weights), reps)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype] + (" +weights" if need_weights else "")
    rows.append((f"module fwd {name}", f"E={E} H={H} B={B} L={L}", ours_t, torch_t, flops))


def bench_module_training(E, H, B, L, reps, rows, frozen=False, dtype=torch.float32):
    """One training step of the module in `dtype`: forward, then backward into the input and every
    parameter. FLOPs: the forward's, plus 2.5x its attention and 2x its projections. `frozen`: the
    module's parameters need no gradient (fine-tuning around a fixed attention), so the backward
    has only the input's; FLOPs then count the projections' dX products alone."""
    import mha.nn
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).requires_grad_(not frozen)
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).requires_grad_(not frozen)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E).to(dtype).requires_grad_()
    g = torch.randn(B, L, E).to(dtype)

    def step(module):
        out, _ = module(x, x, x, need_weights=False)
        out.backward(g)

    flops = 3.5 * attention_flops(B, H, L, E // H, False) + (2 if frozen else 3) * 4 * 2.0 * B * L * E * E
    ours_t, torch_t = paired_medians(lambda: step(ours), lambda: step(ref), reps)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    rows.append((f"module train {name}" + (", frozen weights" if frozen else ""), f"E={E} H={H} B={B} L={L}", ours_t,
                 torch_t, flops))


FMA_PEAK_DEFAULT = Path(__file__).resolve().parent.parent / "build" / "bench" / "fma_peak"


def fma_ceiling(binary, threads, bf16_dot=False):
    """The float32 FMA ceiling of `threads` cores in GFLOP/s, measured by bench/fma_peak.cpp (with
    bf16_dot, the ceiling of AVX512-BF16's bfloat16 pair products); None where it is not built."""
    if not Path(binary).exists():
        return None
    out = subprocess.run([binary, "--threads", str(threads)] + (["--bf16-dot"] if bf16_dot else []),
                         capture_output=True, text=True, check=True).stdout
    fields = out.split()
    key = "bf16_dot_peak_gflops" if bf16_dot else "fma_peak_gflops"
    return float(fields[fields.index(key) + 1])


def peak_memory_mib(impl, L):
    """How much one forward raises the peak resident memory of a fresh process, over what the
    process already held with its inputs allocated (libraries, q/k/v)."""
    call = ("mha.scaled_dot_product_attention(q, q, q)" if impl == "mha"
            else "torch.nn.functional.scaled_dot_product_attention(q, q, q)")
    # VmHWM is the peak of this process's own address space; ru_maxrss is not: Linux carries the
    # parent's peak across fork and exec, and this script's own peak is far above the child's.
    code = f"""
import torch, mha
def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
torch.set_num_threads(2); mha.set_num_threads(2)
q = torch.randn(1, 16, {L}, 64)
q.add_(0)  # touch every page
before = peak_kib()
out = {call}
print(peak_kib() - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "this CPU"


def plot(rows, path, batch, heads):
    """One panel per operation; one colour per (d, causal); mha solid, PyTorch dashed. Only the
    sweep's rows (B=batch, H=heads, no mask or bias variants): the table's other rows (BERT-sized,
    decoding, masks) would add points of other shapes to its lines."""
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"--plot needs matplotlib ({sys.executable} -m pip install matplotlib; make bench installs it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    def fields_of(shape):
        return dict(f.split("=") for f in shape.replace(" causal", "").split() if "=" in f)

    def plotted(op, shape):
        f = fields_of(shape)
        return (op.startswith("sdpa") and "+" not in op and not any(w in op for w in ("decode", "query"))
                and f.get("B") == str(batch) and f.get("H") == str(heads) and "L" in f and "d" in f)

    ops = sorted({op for op, shape, *_ in rows if plotted(op, shape)})
    series = {}
    for op, shape, ours, theirs, flops in rows:
        if not plotted(op, shape):
            continue
        fields = fields_of(shape)
        variant = f"d={fields['d']}{', causal' if 'causal' in shape else ''}"
        L = int(fields["L"])
        series.setdefault((op, variant, "mha"), []).append((L, flops / ours / 1e9))
        series.setdefault((op, variant, "PyTorch"), []).append((L, flops / theirs / 1e9))
    variants = sorted({v for _, v, _ in series})
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for (o, variant, impl), points in sorted(series.items()):
            if o != op:
                continue
            points.sort()
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", color=colours[variant],
                    linestyle="-" if impl == "mha" else "--", label=f"{impl}, {variant}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"sequence length L (B={batch}, H={heads})")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, handlelength=4)  # (long enough to show the dashes)
    fig.suptitle(f"Attention on {mha.get_num_threads()} threads of {cpu_model()} ({mha.cpu_isa()} kernels): "
                 f"mha (solid) and PyTorch {torch.__version__} (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--dims", type=int, nargs="+", default=[64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                    help="SDPA dtypes to run (PyTorch's bf16 backward is slow on CPUs without AVX512-BF16)")
    ap.add_argument("--no-module", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true", help="only the module rows")
    ap.add_argument("--onednn", default=str(ONEDNN_DEFAULT),
                    help="oneDNN SDPA benchmark binary (make onednn-bench); its column is left out if absent")
    ap.add_argument("--fma-peak", default=str(FMA_PEAK_DEFAULT),
                    help="FMA ceiling benchmark binary (built with the benchmarks); its column is left out if absent")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--plot", help="also draw GFLOP/s against sequence length to this PNG (needs matplotlib)")
    ap.add_argument("--peak-memory", type=int, metavar="L",
                    help="also measure peak resident memory of one forward at this length (B=1, H=16, d=64)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    mha.set_num_threads(args.threads)
    print(f"threads={args.threads}  mha ISA={mha.cpu_isa()}  torch {torch.__version__} "
          f"(CPU capability {torch.backends.cpu.get_cpu_capability()})", flush=True)
    rows = Rows()
    onednn = {}  # (op, shape) -> seconds of oneDNN's SDPA, where it ran
    for L in [] if args.no_sdpa else args.lengths:
        for d in args.dims:
            for causal in (False, True):
                for name in args.dtypes:
                    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
                    bench_sdpa(args.batch, args.heads, L, d, causal, dtype, args.reps, rows)
                shape = f"B={args.batch} H={args.heads} L={L} d={d}{' causal' if causal else ''}"
                for op, dtype in (("sdpa fwd fp32", "f32"), ("sdpa fwd bf16", "bf16")):
                    if op.split()[-1] not in args.dtypes:
                        continue
                    onednn[(op, shape)] = onednn_seconds(args.onednn, args.batch, args.heads, L, d, causal, dtype,
                                                         args.threads, args.reps)
            if d == args.dims[0] and "fp32" in args.dtypes:
                bench_sdpa_masked(args.batch, args.heads, L, d, args.reps, rows)
    if not args.no_sdpa:
        # A BERT-base-sized batch of short sequences (its 50 MB of fp32 rows stream from memory).
        for name in args.dtypes:
            bench_sdpa(32, 12, 128, 64, False, {"fp32": torch.float32, "bf16": torch.bfloat16}[name], args.reps, rows)
        bench_decode(args.reps, rows, args.dtypes)
        if "fp32" in args.dtypes:
            bench_paged(args.reps, rows)
            bench_varlen(args.reps, rows)
            bench_window(args.reps, rows)
            bench_alibi(args.reps, rows)
            bench_sinks(args.reps, rows)
            bench_softcap(args.reps, rows)
            bench_pooling(args.reps, rows)
            bench_per_example_gradients(args.reps, rows)
    if not args.no_module:
        bench_module(1024, 16, 4, 512, torch.float32, args.reps, rows)
        bench_module(1024, 16, 4, 512, torch.bfloat16, args.reps, rows)
        bench_module(1024, 16, 4, 512, torch.float32, args.reps, rows, need_weights=True)
        bench_module(768, 12, 32, 128, torch.float32, args.reps, rows)  # BERT-base sized
        bench_module(768, 12, 32, 128, torch.bfloat16, args.reps, rows)
        bench_module_training(1024, 16, 4, 512, args.reps, rows)
        bench_module_training(1024, 16, 4, 512, args.reps, rows, frozen=True)
        bench_module_training(1024, 16, 4, 512, args.reps, rows, dtype=torch.bfloat16)
    ceiling = fma_ceiling(args.fma_peak, args.threads)
    # bf16 runs on AMX where the CPU has it (its rows left blank), in AVX512-BF16's pair products
    # on the avx512_bf16 ISA (its rows against their own ceiling), else in float32 arithmetic on
    # widened copies (against the FMA's).
    amx = "amx" in mha.cpu_isa()
    pairs = mha.cpu_isa() == "avx512_bf16"
    dot_ceiling = fma_ceiling(args.fma_peak, args.threads, bf16_dot=True) if pairs else None

    def of_ceiling(op, gflops):
        if ceiling is None or (amx and "bf16" in op):
            return f" {'':>6}"
        if pairs and "bf16" in op:
            return f" {100 * gflops / dot_ceiling:5.0f}%" if dot_ceiling else f" {'':>6}"
        return f" {100 * gflops / ceiling:5.0f}%"

    with_onednn = any(t is not None for t in onednn.values())
    if ceiling is not None:
        print(f"fp32 FMA ceiling of {args.threads} threads: {ceiling:.0f} GFLOP/s (bench/fma_peak.cpp); "
              "'of FMA' is mha's GFLOP/s as a fraction of it" + (" (bf16 rows run on AMX: left blank)" if amx else ""))
    if dot_ceiling:
        print(f"bf16 pair-product (vdpbf16ps) ceiling of {args.threads} threads: {dot_ceiling:.0f} GFLOP/s; "
              "bf16 rows' 'of FMA' is the fraction of this ceiling instead")
    print(f"{'op':<28} {'shape':<28} {'mha ms':>9} {'GFLOP/s':>8} {'of FMA':>6} {'torch ms':>9} {'GFLOP/s':>8} "
          f"{'speedup':>8}" + (f" {'oneDNN ms':>10} {'GFLOP/s':>8} {'speedup':>8}" if with_onednn else ""))
    for op, shape, ours, theirs, flops in rows:
        line = (f"{op:<28} {shape:<28} {ours * 1e3:9.1f} {flops / ours / 1e9:8.1f}{of_ceiling(op, flops / ours / 1e9)} "
                f"{theirs * 1e3:9.1f} {flops / theirs / 1e9:8.1f} {theirs / ours:7.2f}x")
        if with_onednn:
            t = onednn.get((op, shape))
            line += f" {t * 1e3:10.1f} {flops / t / 1e9:8.1f} {t / ours:7.2f}x" if t else f" {'n/a':>10}"
        print(line)
    if with_onednn:
        print("oneDNN: its Graph API SDPA (bench/onednn_sdpa.cpp), timed in its own process after ours and "
              "PyTorch's; n/a where it cannot run the case here or would not fit in memory.")
    if args.peak_memory:
        for impl in ("mha", "torch"):
            print(f"peak resident memory added by one {impl} fp32 SDPA forward at B=1 H=16 L={args.peak_memory} "
                  f"d=64: {peak_memory_mib(impl, args.peak_memory):.0f} MiB (its output alone: "
                  f"{16 * args.peak_memory * 64 * 4 / 2**20:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=op, shape=shape, mha_ms=o * 1e3, torch_ms=t * 1e3, flops=fl,
                            mha_gflops=fl / o / 1e9, torch_gflops=fl / t / 1e9, speedup=t / o,
                            fma_ceiling_gflops=ceiling, bf16_dot_ceiling_gflops=dot_ceiling,
                            onednn_ms=None if onednn.get((op, shape)) is None else onednn[(op, shape)] * 1e3)
                       for op, shape, o, t, fl in rows], f, indent=1)
    if args.plot:
        plot(rows, args.plot, args.batch, args.heads)


if __name__ == "__main__":
    main()
