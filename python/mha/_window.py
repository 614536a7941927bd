"""Sliding-window (local) attention: the window_size argument, FlashAttention's (left, right)."""
from typing import Any, Optional, Tuple


def check_window(window_size: Any) -> Optional[Tuple[int, int]]:
    """(left, right) from window_size: None (no window), or two ints, each -1 (unbounded on that
    side) or a key count >= 0."""
    if window_size is None:
        return None
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise TypeError(f"window_size: expected None or a pair (left, right) of ints, got {window_size!r}")
    left, right = window_size
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, int) and not hasattr(x, "__index__"):
            raise TypeError(f"window_size: expected a pair (left, right) of ints, got {window_size!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected -1 (unbounded) or a key count >= 0 on each side, "
                         f"got ({left}, {right})")
    return left, right


def window_in_mask(query, key, attn_mask, window: Tuple[int, int], bottom_right: bool):
    """attn_mask with the window written into it: query i keeps keys from `left` before to `right`
    after its diagonal (key i, or key i + S - L bottom-right); a bool mask is and-ed with the band,
    a float one gets -inf outside it (its gradient is then 0 there, as the output does not depend
    on those entries). Torch tensors or numpy arrays, like the query; the band is [L, S] and
    broadcasts as an attn_mask does."""
    left, right = window
    L, S = query.shape[-2], key.shape[-2]
    offset = S - L if bottom_right else 0
    if hasattr(query, "is_nested"):  # a torch tensor
        import torch  # noqa: PLC0415

        distance = (torch.arange(S, device=query.device)[None, :] - torch.arange(L, device=query.device)[:, None]
                    - offset)
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device)
        if left >= 0:
            keep = keep & (distance >= -left)
        if right >= 0:
            keep = keep & (distance <= right)
        if attn_mask is None:
            return keep
        if attn_mask.dtype == torch.bool:
            return attn_mask & keep
        return attn_mask.masked_fill(~keep, float("-inf"))
    import numpy as np  # noqa: PLC0415

    distance = np.arange(S)[None, :] - np.arange(L)[:, None] - offset
    keep = np.ones((L, S), dtype=bool)
    if left >= 0:
        keep &= distance >= -left
    if right >= 0:
        keep &= distance <= right
    if attn_mask is None:
        return keep
    mask = np.asarray(attn_mask)
    if mask.dtype == np.bool_:
        return mask & keep
    return np.where(keep, mask, np.array(-np.inf, dtype=mask.dtype))
