"""The public Gemma 4 patch embedder: prescale, projection, lookup, padding mask and add in one kernel."""

import contextlib

import torch

from .. import reference
from .._dispatch import dispatch, route, untiled
from .._validation import (
    FLOAT_DTYPES,
    check_ids_and_padding,
    check_position_ids_range,
    check_same_device,
    check_shape,
    check_table,
    check_tensor,
)
from .position_embeddings import position_embeddings_backward


def _check_inputs(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None,
) -> None:
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    hidden, features = weight.shape
    check_table(table, (weight.dtype,))
    if table.shape[2] != hidden:
        raise ValueError(
            f"table: expected shape (2, P, D) with D = weight.shape[0] = {hidden}, got {tuple(table.shape)}"
        )
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    check_tensor("pixel_values", pixel_values, 3, FLOAT_DTYPES)
    check_shape("pixel_values", pixel_values, (batch, seq_len, pixel_values.shape[2]), "(B, N, K) like position_ids")
    # The pixels' width is the processor's (3 * patch_size**2); a weight of another width is the weight's fault.
    if features != pixel_values.shape[2]:
        raise ValueError(
            f"weight: expected shape (D, K) with K = pixel_values.shape[2] = {pixel_values.shape[2]}, "
            f"got {tuple(weight.shape)}"
        )
    check_same_device(
        pixel_values=pixel_values,
        weight=weight,
        table=table,
        position_ids=position_ids,
        padding_positions=padding_positions,
    )


def _triton(pixel_values, weight, table, position_ids, padding_positions):
    from ..kernels.patch_embed import patch_embed as launch

    out = launch(pixel_values, weight, table, position_ids, padding_positions)
    # Checked after the launch, which bad ids cannot lead astray: the device runs the kernel meanwhile.
    check_position_ids_range(position_ids, table.shape[1], guarded=True)
    return out


def _untiled(pixel_values, weight, table, position_ids, padding_positions):
    from ..kernels.patch_embed import gpu_configs

    return untiled(gpu_configs, weight.dtype, weight.device)


def _reference(pixel_values, weight, table, position_ids, padding_positions):
    check_position_ids_range(position_ids, table.shape[1])  # before: the reference indexes with the ids
    # The op projects in the weight's dtype on every backend: autocast must not recast the reference's linear.
    device_type = weight.device.type
    no_autocast = torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else None
    with no_autocast or contextlib.nullcontext():
        return reference.patch_embed(pixel_values, weight, table, position_ids, padding_positions)


def _forward(pixel_values, weight, table, position_ids, padding_positions, backend):
    return dispatch(
        "patch_embed",
        backend,
        weight.device,
        _triton,
        _reference,
        pixel_values,
        weight,
        table,
        position_ids,
        padding_positions,
        untiled_by=_untiled,
    )


@torch.library.custom_op("fused_vision::patch_embed", mutates_args=())
def _patch_embed_op(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _forward(pixel_values, weight, table, position_ids, padding_positions, backend)


@_patch_embed_op.register_fake
def _(pixel_values, weight, table, position_ids, padding_positions, backend):
    return weight.new_empty((*pixel_values.shape[:2], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    pixel_values, weight, table, position_ids, padding_positions, backend = inputs
    needs_pixels_grad, needs_weight_grad = ctx.needs_input_grad[:2]
    # Only what the requested gradients read: the pixels (as large as the output) for the weight's.
    ctx.save_for_backward(
        pixel_values if needs_weight_grad else None,
        weight if needs_pixels_grad else None,
        position_ids,
        padding_positions,
    )
    ctx.pixel_dtype, ctx.weight_dtype = pixel_values.dtype, weight.dtype
    ctx.num_positions, ctx.backend = table.shape[1], backend


def _backward(ctx, grad):
    """Stock autograd's formulas: the projection's input is recomputed rather than kept from the forward."""
    pixel_values, weight, position_ids, padding_positions = ctx.saved_tensors
    grad_pixels = grad_weight = grad_table = None
    if ctx.needs_input_grad[0]:
        grad_pixels = (grad @ weight).to(ctx.pixel_dtype) * 2
    if ctx.needs_input_grad[1]:
        projected = reference.prescale_pixels(pixel_values, ctx.weight_dtype)
        grad_weight = grad.flatten(0, 1).t() @ projected.flatten(0, 1)
    if ctx.needs_input_grad[2]:
        grad_table = position_embeddings_backward(
            grad, position_ids, padding_positions, ctx.num_positions, ctx.weight_dtype, ctx.backend
        )
    return grad_pixels, grad_weight, grad_table, None, None, None


_patch_embed_op.register_autograd(_backward, setup_context=_setup_context)


def patch_embed(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``Gemma4VisionPatchEmbedder.forward``: ``input_proj((2 * (pixels - 0.5)).to(W.dtype)) + pe``.

    Args:
        pixel_values: (B, N, K) float32, float16 or bfloat16, K = 3 * patch_size**2, features (py, px, c).
        weight: (D, K), the ``input_proj`` weight (no bias); its dtype is the output dtype.
        table: (2, P, D) in the weight's dtype. position_ids, padding_positions: as in
            ``fused_vision.position_embeddings``.

    Returns:
        (B, N, D) in the weight's dtype. Padding rows hold what stock writes there: the projection of
        their (prescaled) pixels, with no position embedding added. Differentiable in all three
        floating inputs; the pixels' gradient is computed only when they require one. A device with no
        kernel tile for the weight's dtype (a T4's bf16 and fp16: docs/compatibility.md) runs the reference under
        "auto", warned once; ``backend="triton"`` raises there.
    """
    _check_inputs(pixel_values, weight, table, position_ids, padding_positions)
    if padding_positions is None:
        padding_positions = reference.default_padding_positions(position_ids)
    args = (pixel_values, weight, table, position_ids, padding_positions)
    return route("patch_embed", backend, args, reference=_reference, registered=_patch_embed_op, direct=_forward)
