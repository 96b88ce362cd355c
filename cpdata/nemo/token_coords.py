"""Token tensors between the caller's coordinates and a layout's padded stream (the sharder's token verbs).

Both functions are O(tensor) torch ops on the tensor's device.
"""

from __future__ import annotations

import torch

from cpdata.errors import NotAvailableYetError
from cpdata.gather import layout_tensor_on
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["to_padded_stream", "trim_to_caller"]


def to_padded_stream(
    layout: ShardLayout, tensor: torch.Tensor, seq_dim: int, fill: float | int | None
) -> tuple[torch.Tensor, int]:
    """``(tensor, seq_dim)`` on the layout's padded stream.

    Accepted, in order: ``[B, S_in]`` shaped like ``input_token_stream_positions`` (scattered into padded
    rows, ``fill`` in the gaps); leading dims equal to ``input_row_shape`` (flattened, sequence dim 0);
    ``original_seq_len`` on ``seq_dim`` with ``fill`` (right-padded); ``padded_seq_len``. Anything else, or a
    repositioned/right-padded tensor without ``fill``, raises ``ValueError``.
    """
    seq_dim = seq_dim % tensor.dim()
    positions = layout.input_token_stream_positions
    if positions is not None and tuple(tensor.shape) == tuple(positions.shape):
        if fill is None:
            raise ValueError(
                f"tensor of shape {tuple(tensor.shape)} is in input coordinates of a layout that repositions "
                "tokens; pass fill= for the padded slots no input token lands in"
            )
        pos = layout_tensor_on(layout, "input_token_stream_positions", tensor.device)
        padded = tensor.new_full((tensor.shape[0], layout.padded_seq_len), fill)
        valid = pos >= 0
        padded[valid.nonzero(as_tuple=True)[0], pos[valid]] = tensor[valid]
        tensor, seq_dim = padded, 1
    elif (rows := layout.input_row_shape) is not None and tuple(tensor.shape[: len(rows)]) == tuple(rows):
        tensor, seq_dim = tensor.flatten(0, len(rows) - 1), 0
    length = tensor.shape[seq_dim]
    if layout.padded_seq_len is not None and length != layout.padded_seq_len:
        if fill is not None and layout.original_seq_len is not None and length == layout.original_seq_len:
            pad_shape = list(tensor.shape)
            pad_shape[seq_dim] = layout.padded_seq_len - length
            tensor = torch.cat((tensor, tensor.new_full(pad_shape, fill)), dim=seq_dim)
        else:
            raise ValueError(
                f"the last sharded batch has padded_seq_len={layout.padded_seq_len} "
                f"(original_seq_len={layout.original_seq_len}), got a tensor of length {length} on dim "
                f"{seq_dim}; pass the original-length tensor with an explicit fill=, or pre-pad it to "
                f"padded_seq_len"
            )
    return tensor, seq_dim


def trim_to_caller(
    layout: ShardLayout | None, full: torch.Tensor, seq_dim: int, fill: float | int | None
) -> torch.Tensor:
    """A gathered padded stream back in the caller's coordinates: mapped through
    ``input_token_stream_positions`` (``fill`` for dropped input slots; required), reshaped to
    ``input_row_shape`` or narrowed to ``original_seq_len``; a packed row's stream (a worker batch) is the
    caller's own. ``layout`` None: nothing was sharded, so there is nothing to trim to."""
    if layout is None:
        raise NotAvailableYetError(
            "trim=True needs a shard layout (original_seq_len, input_row_shape or a position map) to restore the "
            "caller's coordinates: this sharder has no shard layout to trim to; call shard(batch) first or gather "
            "with trim=False"
        )
    if layout.padded_seq_len is not None and full.shape[seq_dim] != layout.padded_seq_len:
        raise ValueError(
            f"gathered length {full.shape[seq_dim]} on dim {seq_dim} != padded_seq_len "
            f"{layout.padded_seq_len} of the last sharded batch; gather the shard of that batch"
        )
    if layout.input_token_stream_positions is not None:
        if fill is None:
            raise ValueError("trim=True on a layout that repositions tokens needs fill= for dropped input "
                             "slots")  # fmt: skip
        pos = layout_tensor_on(layout, "input_token_stream_positions", full.device)
        moved = full.movedim(seq_dim, 1)
        shape = (*pos.shape, *([1] * (moved.dim() - 2)))  # pos [B, S_in] broadcast over the trailing dims
        index = pos.clamp(min=0).view(shape).expand(*pos.shape, *moved.shape[2:])
        mask = (pos < 0).view(shape)
        return moved.gather(1, index).masked_fill(mask, fill).movedim(1, seq_dim)
    if layout.input_row_shape is not None:
        return full.reshape(*full.shape[:seq_dim], *layout.input_row_shape, *full.shape[seq_dim + 1 :])
    if layout.original_seq_len is not None:
        return full.narrow(seq_dim, 0, layout.original_seq_len)
    return full
