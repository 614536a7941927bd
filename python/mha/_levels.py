"""Which torch.func levels (vmap, grad, jvp) are active around a call, and which of them track
its tensors: what decides whether the kernels' autograd Functions take the fused path, a vmap
rule, or the backward in torch operators that a further derivative can differentiate."""

from __future__ import annotations

import torch


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is tracing the call: its tensors are
    wrappers that only torch operators and the autograd Functions (through their vmap rules and
    setup_context) can take, not the extension."""
    return torch._C._are_functorch_transforms_active()


def differentiated_again(ctx, grad_output) -> bool:
    """Whether the backward now running will itself be differentiated: backward(create_graph=True)
    in eager autograd; under torch.func, a grad or jvp level outside the one running it tracks
    one of its tensors (grad of grad, jvp of grad, jacrev of jacrev: Hessians), where vmap of grad
    (per-example gradients) keeps the fused kernels."""
    if not transforms_active():
        return torch.is_grad_enabled()
    return any(tracked_outside(x) for x in (*ctx.saved_tensors[:4], grad_output) if x is not None)


def forward_levels() -> int:
    """How many torch.func jvp transforms are active (forward mode, nested)."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:
        return 0
    return sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def tracked_outside(x) -> bool:
    """Whether a live grad-tracking wrapper (torch.func's grad and jvp levels) wraps x beyond the
    outermost one, which is the level running this backward (dead after vjp returned)."""
    from torch._C import _functorch
    own = True
    while _functorch.is_functorch_wrapped_tensor(x):
        if _functorch.is_gradtrackingtensor(x):
            if not own and _functorch.maybe_get_level(x) > 0:
                return True
            own = False
        x = _functorch.get_unwrapped(x)
    return False
