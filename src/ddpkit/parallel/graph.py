"""Which parameters will a backward pass reach? A walk over the autograd graph after forward."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def reachable_params(outputs: Sequence[Tensor]) -> set[int]:
    """The ``id`` of every leaf tensor (parameter) that backward from ``outputs`` will reach.

    A walk over ``grad_fn.next_functions``; an ``AccumulateGrad`` node holds its leaf in
    ``.variable``. Parameters it does not reach will get no gradient in this pass.

    Args:
        outputs: every tensor in the forward's output.
    """
    found = {id(t) for t in outputs if t.grad_fn is None and t.requires_grad}
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found
