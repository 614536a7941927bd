"""Logit soft-capping (Gemma 2's attn_logit_softcapping, FlashAttention's softcap): each scaled score
s becomes softcap * tanh(s / softcap) before the masks and the softmax; 0 leaves it as it is."""
from typing import Any


def check_softcap(softcap: Any) -> float:
    """softcap as a float: 0 (no soft-capping) or in [1e-30, 1e30], as the kernels take it."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) and not hasattr(softcap, "__float__"):
        raise TypeError(f"softcap: expected a float >= 0, got {type(softcap).__name__}")
    value = float(softcap)
    if value != 0 and not 1e-30 <= value <= 1e30:
        raise ValueError(f"softcap: expected 0 (no soft-capping) or a value in [1e-30, 1e30], got {value}")
    return value


def capped(scores, softcap: float):
    """softcap * tanh(scores / softcap) (torch operators, differentiable), or the scores without a cap."""
    return scores if softcap == 0 else softcap * (scores / softcap).tanh()


def slope(scores, softcap: float):
    """The derivative of capped() at the scaled scores: 1 - tanh^2(scores / softcap)."""
    return 1 - (scores / softcap).tanh().square()
