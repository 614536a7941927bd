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
    return min(left, 1 << 62), min(right, 1 << 62)  # (wider than any sequence: int64 for the extension)


def band(L: int, S: int, window: Tuple[int, int], bottom_right: bool, device=None):
    """The keys [L, S] (bool, torch) a sliding window keeps: query i keeps keys from `left` before
    to `right` after its diagonal (key i, or key i + S - L bottom-right); the kernels' rule, for
    the paths formed in torch operators (weights with derivatives, second derivatives, jvp)."""
    import torch  # noqa: PLC0415

    left, right = window
    distance = (torch.arange(S, device=device)[None, :] - torch.arange(L, device=device)[:, None]
                - (S - L if bottom_right else 0))
    keep = torch.ones(L, S, dtype=torch.bool, device=device)
    if left >= 0:
        keep = keep & (distance >= -left)
    if right >= 0:
        keep = keep & (distance <= right)
    return keep


def sides(window: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """(window_left, window_right) as the extension takes them: -1 for an unbounded side."""
    return (-1, -1) if window is None else window
