"""Physical GDN state storage: live per-request slots and prefix-cache snapshot slots share one layout.

Per GDN layer and slot: conv window [conv_dim, kernel - 1] (model dtype) and recurrent state
[Hv, Dk, Dv] (float32, as accumulation in low precision drifts). Layer is the leading dim so a
whole slot (every layer) moves with one indexed copy.
"""

from __future__ import annotations

import torch

from hybridserve.config import ModelConfig


class GDNStateTensors:
    """Conv + recurrent state tensors for `num_slots` slots across every GDN layer."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        layers = len(config.gdn_layer_ids)
        self.num_slots = num_slots
        # zeros, not empty: every page is touched now. Written a slot at a time while serving, memory
        # the kernel hands out lazily faulted on the first write to each 4 KiB page, which a warm
        # request paid on each snapshot saved to a fresh slot (the built-in model's 64-token warm
        # requests behind 4096 cached tokens took 1-2 ms longer, alternated in one run).
        self.conv = torch.zeros((layers, num_slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1),
                                dtype=dtype, device=device)
        self.recurrent = torch.zeros((layers, num_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                                      config.linear_value_head_dim), dtype=torch.float32, device=device)

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

    def copy_slot(self, dst_slot: int, src: "GDNStateTensors", src_slot: int) -> None:
        """Copy every layer's state of `src[src_slot]` into `self[dst_slot]`. On CPU layer by layer
        (each layer's slot is contiguous): one strided copy of all layers was a parallel region that
        waited for a sleeping OpenMP worker (83 against 40 us for the built-in model)."""
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
