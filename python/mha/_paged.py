"""Paged key/value caches (vLLM's PagedAttention layout, FlashAttention's flash_attn_with_kvcache
with a block_table): attention of new queries over each sequence's cached keys, and the write of
new keys and values into the pages. Inference only: no gradients flow through these."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _mha
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
    table = _integers(block_table, "block_table", np.int32, 2)
    lens = _integers(cache_seqlens, "cache_seqlens", np.int64, 1)
    if table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(f"block_table/cache_seqlens: expected one row and one length per sequence (B = {batch}), "
                         f"got block_table of shape {list(table.shape)} and {lens.shape[0]} lengths")
    return table, lens


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


def paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, *, is_causal: bool = False,
                    scale: Optional[float] = None, enable_gqa: bool = False, causal_alignment: str = "bottom_right",
                    window_size: Optional[Tuple[int, int]] = None, alibi_slopes=None, num_threads: int = 0,
                    cu_seqlens_q=None):
    """Attention of new queries over a paged key/value cache, in FlashAttention's layout.

    query [B, Lq, Hq, E], key_cache [pages, page_size, Hkv, E], value_cache [pages, page_size, Hkv, Ev]
    -> [B, Lq, Hq, Ev]. block_table [B, pages_per_sequence] (integers) lists each sequence's pages
    in order; cache_seqlens [B] is how many keys each holds: key j of sequence b is row j % page_size
    of page block_table[b, j // page_size]. Entries past a sequence's last page are not read (-1
    padding is fine). Each sequence's rows are mha.scaled_dot_product_attention of its queries over
    its keys gathered in order, bit for bit; a sequence with no key gives zeros.

    is_causal aligns bottom-right by default (the queries are the last Lq positions, so the last
    query sees every key: FlashAttention's kvcache rule; causal_alignment="top_left" for PyTorch's).
    window_size, alibi_slopes ([Hq] or [B, Hq]), scale and enable_gqa as in
    mha.scaled_dot_product_attention. float32, bfloat16, float16 or float64; torch tensors or numpy
    arrays, on the CPU. Up to 32 queries per head read the pages where they lie; longer query
    blocks gather each sequence's pages first. Inference only: inputs that require grad are an
    error while grad mode is on.

    With cu_seqlens_q (B + 1 integer offsets from 0 to Tq), query is packed [Tq, Hq, E], sequence b's
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (a different count per sequence: a continuous-batching
    step of prompt chunks and single tokens), and the output [Tq, Hq, Ev].
    """
    from . import _compiling  # noqa: PLC0415 - the package is loaded

    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}")
    if cu_seqlens_q is None:
        _rank4(query, "query", "[B, Lq, Hq, E]")
    elif len(getattr(query, "shape", ())) != 3:
        raise ValueError(f"query: expected a packed [Tq, Hq, E] tensor (rank 3) with cu_seqlens_q, got shape "
                         f"{list(getattr(query, 'shape', []))}")
    _rank4(key_cache, "key_cache", "[pages, page_size, Hkv, E]")
    _rank4(value_cache, "value_cache", "[pages, page_size, Hkv, Ev]")
    _no_grad(query, key_cache, value_cache)
    window = check_window(window_size)
    options = (bool(is_causal), None if scale is None else float(scale), bool(enable_gqa),
               causal_alignment == "bottom_right", *sides(window))
    if _compiling():  # one node of the graph, mha::paged_attention, the table and lengths tensor operands
        import torch  # noqa: PLC0415

        from . import ops  # noqa: PLC0415, F401 - registers the operators

        return torch.ops.mha.paged_attention(query, key_cache, value_cache, torch.as_tensor(block_table),
                                             torch.as_tensor(cache_seqlens), *options,
                                             None if alibi_slopes is None else torch.as_tensor(alibi_slopes),
                                             int(num_threads),
                                             None if cu_seqlens_q is None else torch.as_tensor(cu_seqlens_q))
    return run_paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, *options, alibi_slopes,
                               int(num_threads), cu_seqlens_q)


def run_paged_attention(query, key_cache, value_cache, block_table, cache_seqlens, is_causal, scale, enable_gqa,
                        bottom_right, window_left, window_right, alibi_slopes, num_threads, cu_seqlens_q=None):
    """paged_attention's work once its options are checked (the eager call and the operator's body)."""
    from . import _as_array, _like  # noqa: PLC0415

    k, v = (_transposed(_as_array(x, name)) for x, name in ((key_cache, "key_cache"), (value_cache, "value_cache")))
    slopes = _as_array(alibi_slopes, "alibi_slopes", allow_none=True)
    if cu_seqlens_q is not None:  # packed rows [Tq, Hq, E], read as they are
        cu = _integers(cu_seqlens_q, "cu_seqlens_q", np.int64, 1)
        table, lens = _table_and_lengths(block_table, cache_seqlens, max(cu.shape[0] - 1, 0))
        out = _mha.paged_attention(_as_array(query, "query"), k, v, table, lens, is_causal, scale, enable_gqa,
                                   bottom_right, window_left, window_right, slopes, num_threads, cu)
        return _like(query, out)
    table, lens = _table_and_lengths(block_table, cache_seqlens, query.shape[0])
    q = _transposed(_as_array(query, "query"))
    out = _mha.paged_attention(q, k, v, table, lens, is_causal, scale, enable_gqa, bottom_right, window_left,
                               window_right, slopes, num_threads, None)
    result = _like(query, out)  # [B, Hq, Lq, Ev]
    if isinstance(result, np.ndarray):
        return np.ascontiguousarray(result.swapaxes(1, 2))
    return result.transpose(1, 2).contiguous()


def _transposed(array: Any):
    """Dimensions 1 and 2 swapped, as a view (FlashAttention's [.., L, H, E] to the extension's
    [.., H, L, E]): numpy's swapaxes, or torch's transpose for a bfloat16 tensor handed over as it is."""
    return array.swapaxes(1, 2) if isinstance(array, np.ndarray) else array.transpose(1, 2)


def write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens) -> None:
    """Writes new keys and values into a paged cache in place, as a decoding step does before its
    attention: key [B, Lnew, Hkv, E] and value [B, Lnew, Hkv, Ev] (FlashAttention's layout), row t of
    sequence b to position cache_seqlens[b] + t of its pages. The caches (key_cache
    [pages, page_size, Hkv, E], value_cache [pages, page_size, Hkv, Ev]) are written, of the same
    dtype as key and value; every position written must lie in a listed page. cache_seqlens is not
    advanced (add Lnew to it afterwards)."""
    from . import _compiling  # noqa: PLC0415

    _rank4(key, "key", "[B, Lnew, Hkv, E]")
    _rank4(value, "value", "[B, Lnew, Hkv, Ev]")
    _rank4(key_cache, "key_cache", "[pages, page_size, Hkv, E]")
    _rank4(value_cache, "value_cache", "[pages, page_size, Hkv, Ev]")
    if _compiling():  # one node of the graph, mha::write_paged_cache, which mutates the caches
        import torch  # noqa: PLC0415

        from . import ops  # noqa: PLC0415, F401 - registers the operators

        torch.ops.mha.write_paged_cache(key, value, key_cache, value_cache, torch.as_tensor(block_table),
                                        torch.as_tensor(cache_seqlens))
        return
    run_write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens)


def run_write_paged_cache(key, value, key_cache, value_cache, block_table, cache_seqlens) -> None:
    """write_paged_cache's work (the eager call and the operator's body)."""
    from . import _as_array  # noqa: PLC0415

    table, lens = _table_and_lengths(block_table, cache_seqlens, key.shape[0])
    k, v, kc, vc = (_transposed(_as_array(x, name)) for x, name in
                    ((key, "key"), (value, "value"), (key_cache, "key_cache"), (value_cache, "value_cache")))
    _mha.write_paged_cache(k, v, kc, vc, table, lens)
