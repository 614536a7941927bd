"""torch.func.vmap rules for the fused kernels' autograd Functions.

The kernels already take any number of batch dimensions (up to six dimensions in all), so a
vmapped call is one call: each input's vmapped dimension moves to the front, where it is one
more batch dimension, and inputs of lower rank get ones after it, so that their batch dimensions
broadcast against the others' as they did per example. Where that would pass six dimensions, or
where every example must draw the same dropout mask (randomness="same"), the examples run one by
one instead and their results are stacked.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

MAX_RANK = 6  # the kernels' limit on the number of dimensions


def example_rank(x: Optional[torch.Tensor], dim: Optional[int]) -> int:
    """The rank of one example of x (x itself where it is not vmapped); 0 for None."""
    if x is None:
        return 0
    return x.dim() - (dim is not None)


def example_shape(x: torch.Tensor, dim: Optional[int]) -> Tuple[int, ...]:
    shape = list(x.shape)
    if dim is not None:
        del shape[dim]
    return tuple(shape)


def foldable(rank: int) -> bool:
    """Whether examples of this rank can be batched as one call (the vmapped dimension added)."""
    return rank + 1 <= MAX_RANK


def folded(batch_size: int, in_dims: Sequence[Optional[int]], tensors: Sequence[Optional[torch.Tensor]],
           ranks: Sequence[int], expanded: Sequence[bool]) -> list:
    """Each tensor (None stays None) with its vmapped dimension first and ones inserted after it up
    to its rank in `ranks` + 1 dimensions. One that is not vmapped gets a leading dimension of size
    1, which broadcasts; with `expanded` it is expanded to batch_size instead (a view, no copy), so
    that a backward gives each example its own gradient rather than their sum."""
    result = []
    for x, dim, rank, expand in zip(tensors, in_dims, ranks, expanded):
        if x is None:
            result.append(None)
            continue
        x = x.unsqueeze(0) if dim is None else x.movedim(dim, 0)
        ones = rank + 1 - x.dim()
        if ones > 0:  # (a mask of higher rank than the inputs is left for the kernel's error)
            x = x[(slice(None),) + (None,) * ones]
        if expand and dim is None:
            x = x.expand(batch_size, *x.shape[1:])
        result.append(x)
    return result


def looped(batch_size: int, in_dims: Sequence[Optional[int]], tensors: Sequence[Optional[torch.Tensor]],
           call: Callable) -> tuple:
    """call() on each example in turn, its outputs stacked along a new first dimension (an output
    that is None for every example stays None)."""
    results = []
    for i in range(batch_size):
        example = [x if x is None or dim is None else x.select(dim, i) for x, dim in zip(tensors, in_dims)]
        results.append(call(*example))
    return tuple(None if outs[0] is None else torch.stack(outs) for outs in zip(*results))


def check_randomness(info, dropout_p: float) -> None:
    """vmap's contract for random operations: with randomness="error" (its default) a call that
    draws a dropout mask is an error, as PyTorch's dropout is."""
    if dropout_p > 0 and info.randomness == "error":
        raise RuntimeError("vmap: called random operation while in randomness error mode. Please either use the "
                           "'same' or 'different' randomness flags on vmap or perform the randomness operation out "
                           "of vmap (mha: dropout_p > 0 draws a dropout mask)")


def per_example(info, dropout_p: float, rank: int) -> bool:
    """Whether the examples run one by one: every one drawing the same dropout mask, or too many
    dimensions to add one."""
    return (dropout_p > 0 and info.randomness == "same") or not foldable(rank)


def forward_rule(info, in_dims, tensors, dropout_p: float, call: Callable) -> tuple:
    """The vmap rule of a forward whose tensors are (query, key, value, attn_mask): call()'s
    outputs (a tuple), each with the vmapped dimension first."""
    check_randomness(info, dropout_p)
    if any(d is not None for d in in_dims[4:]):  # (options: the slopes at 12, the sinks at 15)
        if len(in_dims) > 15 and in_dims[15] is not None:
            raise ValueError("sinks: vmap over the sinks is not supported; pass sinks shared by every example")
        raise ValueError("alibi_slopes: vmap over the slopes is not supported; pass slopes shared by every example "
                         "(or per example, as a batch dimension [B, Hq] of the call)")
    dims = in_dims[:4]
    rank = max(example_rank(x, d) for x, d in zip(tensors[:3], dims))
    if per_example(info, dropout_p, rank):
        return looped(info.batch_size, dims, tensors, call)
    # (the query expanded: the output has the vmapped dimension even where only the mask has it)
    return tuple(call(*folded(info.batch_size, dims, tensors, (rank,) * 4, (True, False, False, False))))


def backward_rule(info, in_dims, tensors, dropout_p: float, mask_grad: bool, call: Callable) -> tuple:
    """The vmap rule of the backward whose tensors are (query, key, value, attn_mask, out, lse,
    grad_output): call()'s gradients (dQ, dK, dV, dMask), each with the vmapped dimension first;
    one that was not computed (None, or an empty placeholder) is returned as call() gave it."""
    check_randomness(info, dropout_p)
    rank = max(example_rank(x, d) for x, d in zip(tensors[:3], in_dims))
    if per_example(info, dropout_p, rank):
        return looped(info.batch_size, in_dims, tensors, call)
    # Inputs expanded to the batch: one example's gradient is not the sum over the others, as it
    # would be for a dimension that broadcasts (the output, its log-sum-exp and its gradient have
    # the output's shape already: nothing inserted after their first).
    ranks = (rank, rank, rank, rank, 0, 0, 0)
    expanded = (True, True, True, mask_grad, True, True, True)
    grads = call(*folded(info.batch_size, in_dims, tensors, ranks, expanded))
    # (back to each example's shape: the ones inserted after the vmapped dimension dropped)
    return tuple(g if g is None or g.numel() == 0 else g.reshape((info.batch_size,) + example_shape(x, d))
                 for g, x, d in zip(grads, tensors, in_dims))


def out_dims(outputs) -> tuple:
    """0 for each batched output, None for one left out (None, or an empty placeholder)."""
    return tuple(None if x is None or x.dim() == 1 and x.numel() == 0 else 0 for x in outputs)
