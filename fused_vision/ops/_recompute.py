"""Backward by recomputation: the gradients of autograd through an op's PyTorch reference, for the ops whose
backward has no kernel yet. The reference is stock's formulation, so these are stock autograd's gradients,
rounding included."""

import torch


def reference_grads(reference_fn, ctx, inputs: tuple, grad_outputs: tuple) -> tuple:
    """The gradients of ``reference_fn(*inputs)``'s outputs (a tuple, entries may be None) against ``inputs``
    (None where ``ctx.needs_input_grad`` says none is needed), given ``grad_outputs``. Differentiable in turn
    when autograd asks for a graph (double backward)."""
    create_graph = torch.is_grad_enabled()
    wanted = [t is not None and need for t, need in zip(inputs, ctx.needs_input_grad)]
    with torch.enable_grad():
        # Fresh leaves unless a graph is asked for: the recomputation must not reach into the forward's
        # graph, whose saved tensors a grad call without a graph would free (a clamp's, say).
        leaves = [
            t if t is None or create_graph and t.requires_grad else t.detach().requires_grad_(want)
            for t, want in zip(inputs, wanted)
        ]
        # An output that depends on no input wanted here (v, for gradients in the norm weights alone) adds none.
        outputs = zip(reference_fn(*leaves), grad_outputs)
        pairs = [(o, g) for o, g in outputs if o is not None and g is not None and o.requires_grad]
        found = torch.autograd.grad(
            [o for o, _ in pairs],
            [t for t, want in zip(leaves, wanted) if want],
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=create_graph,
        )
    found = iter(found)
    return tuple(next(found) if want else None for want in wanted)
