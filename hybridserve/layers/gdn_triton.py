"""The GDN layers' GPU path: decode and prefill on Triton kernels (`gdn_triton_kernels`), chosen by the
runner on CUDA when `triton` and `fla-core` import; docs/cpu-kernels.md, "On CUDA: the Triton GDN path".
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from hybridserve import envs
from hybridserve.layers.gated_delta import (
    L2_NORM_EPS,
    causal_conv_decode,
    causal_conv_prefill,
    conv_state_after,
    l2_normalize,
)
from hybridserve.models.batch import ForwardBatch, StateWrite

if TYPE_CHECKING:
    from hybridserve.models.qwen3_5 import ForwardContext, GatedDeltaNet

logger = logging.getLogger(__name__)

BACKEND_ENV = envs.GDN_KERNELS.name


def triton_gdn_unavailable(device: torch.device) -> str | None:
    """Why the Triton GDN path cannot run on `device`, or None when it can."""
    if envs.read_str(envs.GDN_KERNELS).strip().lower() == "torch":
        return f"{BACKEND_ENV}=torch"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    missing = [name for name in ("triton", "fla") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'hybridserve[cuda]')"
    try:
        importlib.import_module("hybridserve.layers.gdn_triton_kernels")
    except Exception as error:  # noqa: BLE001 - any import failure means the fallback, said once
        return f"the Triton kernels failed to import: {error}"
    return None


def enable_triton_gdn(model: torch.nn.Module, device: torch.device) -> bool:
    """Route the model's GDN layers through the Triton path if it can run on `device`; log the choice once."""
    from hybridserve.models.qwen3_5 import GatedDeltaNet

    reason = triton_gdn_unavailable(device)
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if reason is not None:
        logger.info("GDN layers on the PyTorch path: %s", reason)
        return False
    for layer in layers:
        layer.triton_forward = gdn_forward
    logger.info("GDN layers on Triton kernels (flash-linear-attention chunked prefill, slot-indexed decode)")
    return True


def gdn_forward(layer: GatedDeltaNet, projection: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch,
                ctx: ForwardContext) -> torch.Tensor:
    """The mixer core [T, Hv, Dv] float32 of every row of the batch (decodes first, then prefill chunks)."""
    assert layer.in_proj is not None
    mixed, _, b, a = torch.split(projection, layer.in_proj.widths, dim=-1)
    beta, g = layer._beta_and_decay(a, b)
    num_decode = batch.num_decode
    if not batch.prefills:
        return _decode(layer, mixed, g, beta, weight, batch, ctx)
    core = torch.empty(projection.shape[0], layer.num_v_heads, layer.head_v_dim, dtype=torch.float32,
                       device=projection.device)
    if num_decode:
        core[:num_decode] = _decode(layer, mixed[:num_decode], g[:num_decode], beta[:num_decode], weight, batch, ctx)
    core[num_decode:] = _prefill(layer, mixed, g, beta, weight, batch, ctx)
    return core


def _decode(layer: GatedDeltaNet, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
            batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
    from hybridserve.layers.gdn_triton_kernels import decode_step

    group, index = batch.decode, layer.state_layer
    assert group is not None
    conv_live, recurrent_live = ctx.live_states.conv[index], ctx.live_states.recurrent[index]
    conv_out, new_conv = causal_conv_decode(mixed, conv_live.index_select(0, group.state_slots), weight)
    core, new_state = decode_step(conv_out, g, beta, recurrent_live, group.state_slots,
                                  num_k_heads=layer.num_k_heads, eps=L2_NORM_EPS)
    ctx.state_writes.append(StateWrite(index, group.state_slots, new_conv, new_state))
    if ctx.snapshot_sink is not None:
        for row, snapshot_slot in group.captures:
            ctx.snapshot_sink.write(index, snapshot_slot, new_conv[row], new_state[row])
    return core


def _prefill(layer: GatedDeltaNet, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
             batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
    """Every prefill chunk of the batch in one varlen forward; the core of the prefill rows."""
    from hybridserve.layers.gdn_triton_kernels import chunked_prefill

    index = layer.state_layer
    chunks = batch.prefills
    first_row = chunks[0].token_offset
    conv_states = [ctx.live_states.conv[index, chunk.state_slot] for chunk in chunks]
    conv_out = torch.cat([causal_conv_prefill(mixed[c.token_offset:c.token_offset + c.length], state, weight)[0]
                          for c, state in zip(chunks, conv_states)])
    q, k, v = layer._split_qkv(conv_out)
    slots = torch.tensor([chunk.state_slot for chunk in chunks], device=mixed.device)
    assert all(a.token_offset + a.length == b.token_offset for a, b in zip(chunks, chunks[1:]))  # rows packed
    captures = [(n, boundary - chunk.start_position)
                for n, chunk in enumerate(chunks) for boundary, _ in chunk.captures]
    result = chunked_prefill(l2_normalize(q, scale=layer.head_k_dim ** -0.5), l2_normalize(k), v,
                             g[first_row:], beta[first_row:],
                             ctx.live_states.recurrent[index].index_select(0, slots),
                             [chunk.length for chunk in chunks], captures, chunk_size=layer.chunk_size)
    capture_index = 0
    for n, (chunk, conv_state) in enumerate(zip(chunks, conv_states)):
        x = mixed[chunk.token_offset:chunk.token_offset + chunk.length]
        new_conv = conv_state_after(conv_state, x, chunk.length).contiguous()
        ctx.state_writes.append(StateWrite(index, slots[n:n + 1], new_conv.unsqueeze(0),
                                           result.final_states[n:n + 1]))
        for boundary, snapshot_slot in chunk.captures:
            if ctx.snapshot_sink is not None:
                conv = conv_state_after(conv_state, x, boundary - chunk.start_position)
                ctx.snapshot_sink.write(index, snapshot_slot, conv, result.captured[capture_index])
            capture_index += 1
    return result.output
