"""Error measures shared by the parity suites."""


def relative(a, r, floor=0.0):
    """Normwise relative error max|a - r| / max(max|r|, floor) of a against the float64 reference r
    (0 for empty tensors)."""
    if r.numel() == 0:
        return 0.0
    scale = max(r.abs().max().item(), floor, 1e-30)
    return (a.double() - r).abs().max().item() / scale
