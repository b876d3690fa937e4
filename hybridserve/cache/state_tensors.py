"""Physical GDN state storage, one layout for live slots and snapshot slots: per layer and slot the conv
window [conv_dim, kernel - 1] (model dtype) and the recurrent state [Hv, Dk, Dv] (float32: low
precision accumulation drifts)."""

from __future__ import annotations

import torch

from hybridserve.config import ModelConfig
from hybridserve.layers.huge_pages import zeros_touched_as_used


class GDNStateTensors:
    """Conv + recurrent state tensors for `num_slots` slots across every GDN layer."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        layers = len(config.gdn_layer_ids)
        self.num_slots = num_slots
        # zeros committed as used: a pool sized for the worst case costs only the slots written so far
        self.conv = zeros_touched_as_used((layers, num_slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1),
                                          dtype, device)
        self.recurrent = zeros_touched_as_used((layers, num_slots, config.linear_num_value_heads,
                                                config.linear_key_head_dim, config.linear_value_head_dim),
                                               torch.float32, device)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one slot (all GDN layers, conv + recurrent) occupies."""
        layers = len(config.gdn_layer_ids)
        conv = config.gdn_conv_dim * (config.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return layers * (conv + recurrent)

    def reset(self, slot: int) -> None:
        """Zero a slot: the state of an empty prefix."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy_slot(self, dst_slot: int, src: GDNStateTensors, src_slot: int) -> None:
        """Copy every layer's state of `src[src_slot]` into `self[dst_slot]`; on CPU layer by layer
        (each contiguous), as one strided copy is a parallel region that waits on a sleeping worker."""
        if self.recurrent.device.type != "cpu":
            self.conv[:, dst_slot].copy_(src.conv[:, src_slot])
            self.recurrent[:, dst_slot].copy_(src.recurrent[:, src_slot])
            return
        for layer in range(self.conv.shape[0]):
            self.conv[layer, dst_slot].copy_(src.conv[layer, src_slot])
            self.recurrent[layer, dst_slot].copy_(src.recurrent[layer, src_slot])

    def write_layer(self, layer: int, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store one layer's state of one slot."""
        self.conv[layer, slot].copy_(conv)
        self.recurrent[layer, slot].copy_(recurrent)
