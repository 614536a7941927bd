"""Paged key/value caches (vLLM's PagedAttention layout, FlashAttention's flash_attn_with_kvcache
with a block_table): attention of new queries over each sequence's cached keys, and the write of
new keys and values into the pages. Inference only: no gradients flow through these."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _mha
from ._softcap import check_softcap
from ._window import check_window, sides


def _integers(x: Any, name: str, dtype, ndim: int):
    """A C-contiguous numpy array of `dtype` with `ndim` dimensions from an integer torch tensor,
    numpy array or nested list (a view where it already is one)."""
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor
        if x.is_floating_point() or x.is_complex() or str(x.dtype) == "torch.bool":
            raise TypeError(f"{name}: expected an integer tensor, got one of {x.dtype}")
        if not x.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got one on device '{x.device}'")
        x = x.detach().numpy()
    elif isinstance(x, (list, tuple)):
        x = np.asarray(x)
        if x.size == 0:
            x = x.astype(dtype)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected an integer tensor, array or list, got {type(x).__name__}")
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got an array of {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension{'s' if ndim > 1 else ''}, got shape {list(x.shape)}")
    if x.dtype != dtype:
        info = np.iinfo(dtype)
        if x.size and (x.min() < info.min or x.max() > info.max):
            raise ValueError(f"{name}: values outside the range of {np.dtype(dtype).name}")
        x = x.astype(dtype)
    return np.ascontiguousarray(x)


def _table_and_lengths(block_table: Any, cache_seqlens: Any, batch: int):
    """The table (None: one contiguous cache per sequence, sequence b's page being b) and the
    lengths (an int: the same for every sequence) as the extension reads them."""
    if block_table is None:
        table = np.arange(batch, dtype=np.int32).reshape(batch, 1)
    else:
        table = _integers(block_table, "block_table", np.int32, 2)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        lens = np.full(batch, int(cache_seqlens), dtype=np.int64)
    else:
        lens = _integers(cache_seqlens, "cache_seqlens", np.int64, 1)
    if table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(f"block_table/cache_seqlens: expected one row and one length per sequence (B = {batch}), "
                         f"got block_table of shape {list(table.shape)} and {lens.shape[0]} lengths")
    return table, lens


def _table_and_lengths_tensors(block_table: Any, cache_seqlens: Any, batch: int):
    """The same as tensor operands of the compiled operators."""
    import torch  # noqa: PLC0415

    table = (torch.arange(batch, dtype=torch.int32).unsqueeze(1) if block_table is None
             else torch.as_tensor(block_table))
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        return table, torch.full((batch,), int(cache_seqlens), dtype=torch.int64)
    return table, torch.as_tensor(cache_seqlens)


def _sequences(query: Any, cu_seqlens_q: Any) -> int:
    """How many sequences a call has: query's B, or one fewer than the offsets."""
    if cu_seqlens_q is None:
        return int(query.shape[0])
    return max(int(getattr(cu_seqlens_q, "shape", [len(cu_seqlens_q)])[0]) - 1, 0)


def _offsets(cu: Any, name: str, total: int) -> np.ndarray:
    """Offsets of packed rows, checked (from 0, non-decreasing, ending at `total`) before a write
    that takes them under another name."""
    cu = _integers(cu, name, np.int64, 1)
    if cu.shape[0] == 0 or cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != total:
        raise ValueError(f"{name}: expected offsets from 0, non-decreasing, ending at the {total} query rows, "
                         f"got {cu.tolist()}")
    return cu


def _check_new_rows(k: Any, v: Any, query: Any, packed: bool) -> None:
    """k and v, when given, are one step's keys and values: both or neither, [B, Lnew, Hkv, E] (packed:
    [Tq, Hkv, E], one per query row)."""
    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both or neither, got k {'None' if k is None else 'given'} and v "
                         f"{'None' if v is None else 'given'}")
    if k is None:
        return
    if packed:
        for name, x in (("k", k), ("v", v)):
            shape = list(getattr(x, "shape", []))
            if len(shape) != 3 or shape[0] != query.shape[0]:
                raise ValueError(f"{name}: expected packed [Tq, Hkv, E] rows, one per query row (Tq = "
                                 f"{query.shape[0]}), got shape {shape}")
    else:
        _rank4(k, "k", "[B, Lnew, Hkv, E]")
        _rank4(v, "v", "[B, Lnew, Hkv, Ev]")


def _rank4(x: Any, name: str, layout: str):
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
        raise ValueError(f"{name}: expected a {layout} tensor (rank 4), got shape "
                         f"{None if shape is None else list(shape)}")


def _no_grad(*tensors: Any):
    for t in tensors:
        if getattr(t, "requires_grad", False):
            import torch  # noqa: PLC0415 - a tensor that requires grad means torch is loaded

            if torch.is_grad_enabled():
                raise ValueError("paged_attention: inference only (no backward); call it under torch.no_grad() "
                                 "or pass tensors that do not require grad")


def paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, *, k=None, v=None,
                    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                    causal_alignment: str = "bottom_right", window_size: Optional[Tuple[int, int]] = None,
                    alibi_slopes=None, num_threads: int = 0, cu_seqlens_q=None, return_softmax_lse: bool = False,
                    sinks=None, softcap: float = 0.0, k_descale=None, v_descale=None):
    """Attention of new queries over a paged key/value cache, in FlashAttention's layout
    (its flash_attn_with_kvcache).

    query [B, Lq, Hq, E], key_cache [pages, page_size, Hkv, E], value_cache [pages, page_size, Hkv, Ev]
    -> [B, Lq, Hq, Ev]. block_table [B, pages_per_sequence] (integers) lists each sequence's pages
    in order; cache_seqlens [B] (or one int for all) is how many keys each holds: key j of sequence
    b is row j % page_size of page block_table[b, j // page_size]. Entries past a sequence's last
    page are not read (-1 padding is fine). block_table=None takes a contiguous cache
    [B, S, Hkv, E], one sequence per batch entry. Each sequence's rows are
    mha.scaled_dot_product_attention of its queries over its keys gathered in order, bit for bit;
    a sequence with no key gives zeros.

    k [B, Lnew, Hkv, E] and v [B, Lnew, Hkv, Ev], when given, are first written into the caches
    (in place) at positions cache_seqlens[b] onwards, and the queries then attend over
    cache_seqlens[b] + Lnew keys; cache_seqlens itself is not advanced (add Lnew afterwards).

    is_causal aligns bottom-right by default (the queries are the last Lq positions, so the last
    query sees every key: FlashAttention's kvcache rule; causal_alignment="top_left" for PyTorch's).
    window_size, alibi_slopes ([Hq] or [B, Hq]), sinks ([Hq], gpt-oss's), softcap (Gemma 2's logit
    soft-capping), scale and enable_gqa as in mha.scaled_dot_product_attention. float32, bfloat16,
    float16 or float64, or float8 caches (torch.float8_e4m3fn, torch.float8_e5m2) under a float32,
    bfloat16 or float16 query (k and v are then rounded into them as they are written, unless
    already float8); torch tensors or numpy arrays, on the CPU. k_descale and v_descale (float32
    [], [Hkv] or [B, Hkv]; FlashAttention 3's descales, vLLM's k_scale and v_scale) dequantise
    float8 caches: the call attends over key_cache * k_descale and value_cache * v_descale, per
    sequence and key/value head, and k and v, when given, are divided by them as they are written. Up to 32 queries per head read the pages where they lie; longer query
    blocks too in bfloat16 on a CPU with bfloat16 products (and no AMX), else they gather each
    sequence's pages first. Inference only: inputs that require grad are an
    error while grad mode is on.

    With cu_seqlens_q (B + 1 integer offsets from 0 to Tq), query is packed [Tq, Hq, E], sequence b's
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (a different count per sequence: a continuous-batching
    step of prompt chunks and single tokens), and the output [Tq, Hq, Ev]; k and v are then packed
    [Tq, Hkv, E] too, each query row's own key and value.

    With return_softmax_lse, returns (output, lse): each query row's log-sum-exp of its scaled
    scores, float32 (float64 for float64 inputs), [B, Hq, Lq] ([Hq, Tq] packed), +inf for a row that
    sees no key (the head's sink with sinks). Results over two disjoint parts of a cache (a shared
    prefix, each sequence's own rest) merge with it: reading +inf as -inf, m = max(lse_a, lse_b),
    w = exp(lse - m),
    out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + log(w_a + w_b) (with sinks, give them to
    one part only).
    """
    from . import _compiling  # noqa: PLC0415 - the package is loaded

    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}")
    packed = cu_seqlens_q is not None
    if not packed:
        _rank4(query, "query", "[B, Lq, Hq, E]")
    elif len(getattr(query, "shape", ())) != 3:
        raise ValueError(f"query: expected a packed [Tq, Hq, E] tensor (rank 3) with cu_seqlens_q, got shape "
                         f"{list(getattr(query, 'shape', []))}")
    _rank4(key_cache, "key_cache", "[pages, page_size, Hkv, E]")
    _rank4(value_cache, "value_cache", "[pages, page_size, Hkv, Ev]")
    _check_new_rows(k, v, query, packed)
    from . import _sinks_operand  # noqa: PLC0415

    sinks = _sinks_operand(query, sinks)
    _no_grad(query, key_cache, value_cache, k, v, sinks)
    k_descale, v_descale = _descales(query, k_descale, v_descale)
    batch = _sequences(query, cu_seqlens_q)
    if block_table is None and key_cache.shape[0] != batch:
        raise ValueError(f"key_cache: without a block_table, expected one contiguous cache [B, S, Hkv, E] per "
                         f"sequence (B = {batch}), got shape {list(key_cache.shape)}")
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    options = (bool(is_causal), None if scale is None else float(scale), bool(enable_gqa),
               causal_alignment == "bottom_right", *sides(window))
    if _compiling():  # mha::write_paged_cache (when k, v) and mha::paged_attention, tensor operands
        import torch  # noqa: PLC0415

        from . import ops  # noqa: PLC0415, F401 - registers the operators

        table, lens = _table_and_lengths_tensors(block_table, cache_seqlens, batch)
        cu = None if cu_seqlens_q is None else torch.as_tensor(cu_seqlens_q)
        if k is not None:
            torch.ops.mha.write_paged_cache(k, v, key_cache, value_cache, table, lens, cu, k_descale, v_descale)
            lens = lens + (k.shape[1] if cu is None else cu[1:] - cu[:-1])
        out, lse = torch.ops.mha.paged_attention(query, key_cache, value_cache, table, lens, *options,
                                                 None if alibi_slopes is None else torch.as_tensor(alibi_slopes),
                                                 int(num_threads), cu, bool(return_softmax_lse), softcap,
                                                 None if sinks is None else torch.as_tensor(sinks), k_descale, v_descale)
        return (out, lse) if return_softmax_lse else out
    table, lens = _table_and_lengths(block_table, cache_seqlens, batch)
    if k is not None:
        cu = None if not packed else _offsets(cu_seqlens_q, "cu_seqlens_q", int(query.shape[0]))
        run_write_paged_cache(k, v, key_cache, value_cache, table, lens, cu, k_descale, v_descale)
        lens = lens + (int(k.shape[1]) if cu is None else np.diff(cu))
    out, lse = run_paged_attention(query, key_cache, value_cache, table, lens, *options, alibi_slopes,
                                   int(num_threads), cu_seqlens_q, bool(return_softmax_lse), softcap, sinks, k_descale,
                                   v_descale)
    return (out, lse) if return_softmax_lse else out


def _descales(template, k_descale, v_descale):
    """The scales as the operators take them: torch tensors beside a torch template (numpy arrays
    and Python floats as float32 tensors), numpy arrays (or None) beside numpy inputs."""
    if isinstance(template, np.ndarray):
        return tuple(None if x is None else np.asarray(x, dtype=np.float32) if not isinstance(x, np.ndarray) else x
                     for x in (k_descale, v_descale))
    import torch  # noqa: PLC0415 - a non-numpy input is a torch tensor

    return tuple(None if x is None else x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float32)
                 for x in (k_descale, v_descale))


def run_paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, enable_gqa,
                        bottom_right, window_left, window_right, alibi_slopes, num_threads, cu_seqlens_q=None,
                        return_lse=False, softcap=0.0, sinks=None, k_descale=None, v_descale=None):
    """paged_attention's work once its options are checked (the eager call and the operator's
    body): (output, lse), lse None unless return_lse."""
    from . import _as_array, _like  # noqa: PLC0415

    k, v = (_transposed(_as_array(x, name)) for x, name in ((key_cache, "key_cache"), (value_cache, "value_cache")))
    slopes = _as_array(alibi_slopes, "alibi_slopes", allow_none=True)
    sink_array = _as_array(sinks, "sinks", allow_none=True)
    scales = (_as_array(k_descale, "k_descale", allow_none=True), _as_array(v_descale, "v_descale", allow_none=True))
    if cu_seqlens_q is not None:  # packed rows [Tq, Hq, E], read as they are
        cu = _integers(cu_seqlens_q, "cu_seqlens_q", np.int64, 1)
        table, lens = _table_and_lengths(block_table, cache_seqlens, max(cu.shape[0] - 1, 0))
        out, lse = _mha.paged_attention(_as_array(query, "query"), k, v, table, lens, is_causal, scale, softcap,
                                        enable_gqa,
                                        bottom_right, window_left, window_right, slopes, num_threads, cu, return_lse,
                                        sink_array, *scales)
        return _like(query, out), _statistics_like(query, lse)
    table, lens = _table_and_lengths(block_table, cache_seqlens, query.shape[0])
    q = _transposed(_as_array(query, "query"))
    out, lse = _mha.paged_attention(q, k, v, table, lens, is_causal, scale, softcap, enable_gqa, bottom_right, window_left,
                                    window_right, slopes, num_threads, None, return_lse, sink_array, *scales)
    result = _like(query, out)  # [B, Hq, Lq, Ev]
    if isinstance(result, np.ndarray):
        return np.ascontiguousarray(result.swapaxes(1, 2)), lse
    return result.transpose(1, 2).contiguous(), _statistics_like(query, lse)


def _statistics_like(template: Any, array: Optional[np.ndarray]):
    """A float32/float64 result (the lse) in the kind of the input: a torch tensor sharing memory
    for a torch input (of any dtype), else the numpy array."""
    if array is None or isinstance(template, np.ndarray):
        return array
    import torch  # noqa: PLC0415 - a non-numpy input is a torch tensor

    return torch.from_numpy(array)


def _transposed(array: Any):
    """Dimensions 1 and 2 swapped, as a view (FlashAttention's [.., L, H, E] to the extension's
    [.., H, L, E]): numpy's swapaxes, or torch's transpose for a bfloat16 tensor handed over as it is."""
    return array.swapaxes(1, 2) if isinstance(array, np.ndarray) else array.transpose(1, 2)


def write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens, *, cu_seqlens_new=None,
                      k_descale=None, v_descale=None) -> None:
    """Writes new keys and values into a paged cache in place, as a decoding step does before its
    attention: key [B, Lnew, Hkv, E] and value [B, Lnew, Hkv, Ev] (FlashAttention's layout), row t of
    sequence b to position cache_seqlens[b] + t of its pages. The caches (key_cache
    [pages, page_size, Hkv, E], value_cache [pages, page_size, Hkv, Ev]) are written, of the same
    dtype as key and value (float8 caches also take float32, bfloat16 or float16 rows, rounded to
    nearest even as torch's .to() rounds into them); every position written
    must lie in a listed page. block_table=None and
    an int cache_seqlens as in paged_attention. cache_seqlens is not advanced (add Lnew afterwards).

    With cu_seqlens_new (B + 1 integer offsets from 0 to Tnew), key [Tnew, Hkv, E] and value
    [Tnew, Hkv, Ev] are packed rows, sequence b's cu_seqlens_new[b]:cu_seqlens_new[b+1] (a different
    count per sequence).

    k_descale and v_descale (float32 [], [Hkv] or [B, Hkv], positive: vLLM's k_scale and v_scale)
    quantise the rows written into float8 caches: each is divided by its sequence and head's
    scale in float32 before it is rounded, as (key.float() / k_descale).to(float8) would; pass the
    same tensors to paged_attention to read them back."""
    from . import _compiling  # noqa: PLC0415

    packed = cu_seqlens_new is not None
    for name, x, layout in (("key", key, "[B, Lnew, Hkv, E]"), ("value", value, "[B, Lnew, Hkv, Ev]")):
        if not packed:
            _rank4(x, name, layout)
        elif len(getattr(x, "shape", ())) != 3:
            raise ValueError(f"{name}: expected packed [Tnew, Hkv, E] rows (rank 3) with cu_seqlens_new, got shape "
                             f"{list(getattr(x, 'shape', []))}")
    _rank4(key_cache, "key_cache", "[pages, page_size, Hkv, E]")
    _rank4(value_cache, "value_cache", "[pages, page_size, Hkv, Ev]")
    batch = _sequences(key, cu_seqlens_new)
    k_descale, v_descale = _descales(key, k_descale, v_descale)
    if _compiling():  # one node of the graph, mha::write_paged_cache, which mutates the caches
        import torch  # noqa: PLC0415

        from . import ops  # noqa: PLC0415, F401 - registers the operators

        table, lens = _table_and_lengths_tensors(block_table, cache_seqlens, batch)
        torch.ops.mha.write_paged_cache(key, value, key_cache, value_cache, table, lens,
                                        None if cu_seqlens_new is None else torch.as_tensor(cu_seqlens_new),
                                        k_descale, v_descale)
        return
    run_write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens, cu_seqlens_new, k_descale,
                          v_descale)


def run_write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens, cu_seqlens_new=None,
                          k_descale=None, v_descale=None) -> None:
    """write_paged_cache's work (the eager call and the operator's body)."""
    from . import _as_array  # noqa: PLC0415

    scales = (_as_array(k_descale, "k_descale", allow_none=True), _as_array(v_descale, "v_descale", allow_none=True))

    kc, vc = (_transposed(_as_array(x, name)) for x, name in ((key_cache, "key_cache"), (value_cache, "value_cache")))
    if cu_seqlens_new is not None:  # packed rows [Tnew, Hkv, E], read as they are
        cu = _integers(cu_seqlens_new, "cu_seqlens_new", np.int64, 1)
        table, lens = _table_and_lengths(block_table, cache_seqlens, max(cu.shape[0] - 1, 0))
        _mha.write_paged_cache(_as_array(key, "key"), _as_array(value, "value"), kc, vc, table, lens, cu, *scales)
        return
    table, lens = _table_and_lengths(block_table, cache_seqlens, key.shape[0])
    k, v = (_transposed(_as_array(x, name)) for x, name in ((key, "key"), (value, "value")))
    _mha.write_paged_cache(k, v, kc, vc, table, lens, None, *scales)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """The attention over the union of two disjoint sets of keys from each set's own result and
    log-sum-exp (paged_attention's return_softmax_lse): a prefix shared by many sequences and each
    one's own rest (cascade attention), or one cache split across workers. out [..., L, H, Ev]
    (FlashAttention's layout; packed [T, H, Ev]) with lse [..., H, L] ([H, T]); returns
    (out, lse) of the union, in the outputs' and lses' dtypes. An lse of +inf (a row that saw no
    key) carries no weight. Computed in float32 (float64 for float64 lses): with m the larger lse,
    w = exp(lse - m), out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + log(w_a + w_b).
    torch tensors (differentiable) or numpy arrays; with sinks, give them to one part only."""
    import torch  # noqa: PLC0415

    arrays = isinstance(out_a, np.ndarray)
    tensors = [torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
               for x in (out_a, lse_a, out_b, lse_b)]
    out_a, lse_a, out_b, lse_b = tensors
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"out_a/out_b, lse_a/lse_b: expected the same shapes, got {list(out_a.shape)} and "
                         f"{list(out_b.shape)}, {list(lse_a.shape)} and {list(lse_b.shape)}")
    if out_a.dim() < 2 or lse_a.shape != (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]):
        raise ValueError(f"lse_a: expected [..., H, L] for out [..., L, H, Ev] = {list(out_a.shape)}, got "
                         f"{list(lse_a.shape)}")
    wide = torch.float64 if lse_a.dtype == torch.float64 else torch.float32
    la, lb = (torch.where(x == float("inf"), float("-inf"), x.to(wide)) for x in (lse_a, lse_b))
    top = torch.maximum(la, lb)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # (neither saw a key)
    wa, wb = torch.exp(la - top), torch.exp(lb - top)
    total = wa + wb
    lse = torch.where(total == 0, float("inf"), top + torch.log(total))
    weight_a = (wa / total.clamp_min(torch.finfo(wide).tiny)).transpose(-1, -2)[..., None]
    weight_b = (wb / total.clamp_min(torch.finfo(wide).tiny)).transpose(-1, -2)[..., None]
    out = (weight_a * out_a.to(wide) + weight_b * out_b.to(wide)).to(out_a.dtype)
    lse = lse.to(lse_a.dtype)
    return (out.numpy(), lse.numpy()) if arrays else (out, lse)

