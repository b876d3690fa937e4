"""Qwen3.5 hybrid text decoder: Gated DeltaNet layers interleaved with gated full attention.

Names equal the Hugging Face `Qwen3_5ForCausalLM` ones, so checkpoints load by name. The forward runs a
flat `ForwardBatch` (decodes + prefill chunks) over paged KV and slot-indexed GDN state; new GDN states
are `StateWrite`s the runner commits after the forward succeeds (the C decode kernel updates live slots
in place and returns undo records instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.state_tensors import GDNStateTensors
from hybridserve.config import FULL_ATTENTION, ModelConfig
from hybridserve.layers.attention import PagedKVCache, decode_attention, prefill_attention
from hybridserve.layers.gated_delta import (
    L2_NORM_EPS,
    ChunkedResult,
    causal_conv_decode,
    causal_conv_prefill,
    chunked_gated_delta,
    conv_state_after,
    recurrent_gated_delta_step,
)
from hybridserve.layers.huge_pages import move_to_huge_pages
from hybridserve.layers.linear import PackedLinear, pack_linears, union_bytes
from hybridserve.layers.native import (
    gdn_decode_f32,
    gdn_prefill_f32,
    native_kernels_enabled,
    norm_rope_applies,
    prefill_attention_applies,
    rms_norm_rope_f32,
)
from hybridserve.layers.native import prefill_attention as native_prefill_attention
from hybridserve.layers.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from hybridserve.layers.rotary import PartialRotaryEmbedding
from hybridserve.models.batch import DecodeGroup, ForwardBatch, PrefillChunk, StateWrite


class SnapshotSink(Protocol):
    """Receives GDN state captured at snapshot boundaries during a forward."""

    def write(self, layer: int, snapshot_slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None: ...


class ForwardContext(NamedTuple):
    """Storage a forward reads and writes besides the weights."""

    kv_cache: PagedKVCache
    live_states: GDNStateTensors
    snapshot_sink: SnapshotSink | None
    state_writes: list[StateWrite]
    state_undo: list[StateWrite]


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: PackedLinear | None = None
        self.down: PackedLinear | None = None

    def pack(self, quantization: str | None = None) -> None:
        """Repack the loaded weights, gate and up fused (`PackedLinear.silu_mul`)."""
        if self.gate_up is None:
            pack_linears(self, quantization, gate_up=["gate_proj", "up_proj"], down=["down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up is not None and self.down is not None, "call pack() first"
        return self.down(self.gate_up.silu_mul(x))


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, q/k RMSNorm and partial rotary, over paged KV."""

    def __init__(self, config: ModelConfig, kv_layer: int, rotary: PartialRotaryEmbedding) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.rotary = rotary
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv: PackedLinear | None = None
        self.out: PackedLinear | None = None

    def pack(self, quantization: str | None = None) -> None:
        """Repack the loaded weights, q (with its gate), k and v fused."""
        if self.qkv is None:
            pack_linears(self, quantization, qkv=["q_proj", "k_proj", "v_proj"], out=["o_proj"])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext,
                cos_sin: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Write every token's K/V; return the attention output of all rows, or only of `rows`
        (the logit rows, in the last layer, where no later layer needs the others)."""
        assert self.qkv is not None and self.out is not None, "call pack() after loading weights"
        num_tokens = x.shape[0]
        q, k, v = self.qkv.split(x)
        q, gate = q.reshape(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self._norm_rotate(q, self.q_norm, cos_sin), self._norm_rotate(k, self.k_norm, cos_sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        ctx.kv_cache.write(self.kv_layer, batch.kv_write_slots, k, v)
        out, out_rows = self._attend(q, k, v, batch, ctx, last_rows_only=rows is not None)
        if rows is not None:
            out = out.index_select(0, torch.searchsorted(out_rows, rows))
            gate = gate.index_select(0, rows)
        width = self.num_heads * self.head_dim
        out = out.reshape(out.shape[0], width) * torch.sigmoid(gate.reshape(out.shape[0], width))
        return self.out(out)

    def _norm_rotate(self, x: torch.Tensor, norm: ZeroCenteredRMSNorm, cos_sin: tuple[torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
        """RMSNorm then rotary of each head of x [T, heads, head_dim]: one C call for decode rows and
        short chunks."""
        if norm.scale is not None and norm_rope_applies(x, norm.scale) and cos_sin[0].dtype == torch.float32:
            return rms_norm_rope_f32(x, norm.scale, norm.eps, *cos_sin)
        return self.rotary.rotate(norm(x), *cos_sin)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext,
                last_rows_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention outputs and their (ascending) flat rows: every row, or each decode row plus
        the last row of each prefill chunk that produces logits."""
        parts, part_rows = [], []
        if batch.decode is not None:
            num = batch.num_decode
            keys, values = ctx.kv_cache.read(self.kv_layer, batch.decode.context_kv_slots)
            parts.append(decode_attention(q[:num], keys, values, batch.decode.context_valid, self.scale))
            part_rows.append(torch.arange(num, device=q.device))
        for chunk in batch.prefills:
            if last_rows_only and not chunk.emits_logits:
                continue
            end = chunk.token_offset + chunk.length
            first = end - 1 if last_rows_only else chunk.token_offset
            parts.append(self._attend_chunk(q[first:end], k, v, chunk, end, batch, ctx))
            part_rows.append(torch.arange(first, end, device=q.device))
        if not parts:  # a step of intermediate prefill chunks only: no row needs output
            return q.new_empty((0, *q.shape[1:])), torch.empty(0, dtype=torch.long, device=q.device)
        return torch.cat(parts), torch.cat(part_rows)

    def _attend_chunk(self, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, end: int,
                      batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Causal attention of a prefill chunk's last `len(queries)` rows (its rows end at flat row
        `end`). The chunk's own K/V are in the cache already, so on CPU (AVX-512) a chunk is attended
        over the paged cache in place (`native.prefill_attention`); otherwise the sequence's keys
        are gathered in one read behind a prefix, or taken from this step's k/v without one."""
        chunk_slots = batch.kv_write_slots[chunk.token_offset:end]
        slots = chunk_slots if chunk.prefix_kv_slots is None else torch.cat([chunk.prefix_kv_slots, chunk_slots])
        cache_keys, cache_values = ctx.kv_cache.keys[self.kv_layer], ctx.kv_cache.values[self.kv_layer]
        if prefill_attention_applies(queries, cache_keys, slots):
            return native_prefill_attention(queries, cache_keys, cache_values, slots, self.scale)
        num_prefix = slots.shape[0] - queries.shape[0]
        if chunk.prefix_kv_slots is not None:
            keys, values = ctx.kv_cache.read(self.kv_layer, slots)
        else:
            keys, values = k[chunk.token_offset:end], v[chunk.token_offset:end]
        return prefill_attention(queries, keys, values, num_prefix, self.scale)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention with a depthwise causal conv and slot-indexed state."""

    def __init__(self, config: ModelConfig, state_layer: int, chunk_size: int) -> None:
        super().__init__()
        self.state_layer = state_layer
        self.chunk_size = chunk_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.gdn_key_dim, config.gdn_value_dim
        conv_dim, kernel = config.gdn_conv_dim, config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj: PackedLinear | None = None
        self.out: PackedLinear | None = None
        self.neg_decay_rate: torch.Tensor | None = None  # -exp(A_log), float32, set by pack()
        # the core on Triton kernels (layers/gdn_triton.gdn_forward), set by the runner on CUDA
        self.triton_forward: Callable[..., torch.Tensor] | None = None

    def pack(self, quantization: str | None = None) -> None:
        """Repack the loaded weights, the four input projections (qkv, z, b, a) fused; A_log
        replaced by the per-head decay rate -exp(A_log)."""
        if self.in_proj is not None:
            return
        self.neg_decay_rate = -self.A_log.detach().float().exp()
        del self.A_log  # the precomputed rate replaces it (one copy)
        pack_linears(self, quantization, in_proj=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
                     out=["out_proj"])

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(n, self.num_k_heads, self.head_k_dim), k.reshape(n, self.num_k_heads, self.head_k_dim),
                v.reshape(n, self.num_v_heads, self.head_v_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Advance every sequence's state over its tokens; return the output of all rows or of `rows`."""
        assert self.in_proj is not None and self.out is not None, "call pack() after loading weights"
        num_tokens = x.shape[0]
        projection = self.in_proj(x)
        weight = self.conv1d.weight.squeeze(1)
        live_conv = ctx.live_states.conv[self.state_layer]
        if not batch.prefills and self._native_applies(projection, live_conv, weight):
            assert batch.decode is not None  # decode only: the kernel's output is normed and gated too
            out = self._decode_native(projection, weight, batch.decode, ctx, gated_norm=True)
            out = out.reshape(num_tokens, self.value_dim)
            return self.out(out if rows is None else out.index_select(0, rows))
        mixed, z, b, a = torch.split(projection, self.in_proj.widths, dim=-1)
        if self.triton_forward is not None:
            core = self.triton_forward(self, projection, weight, batch, ctx)
        elif not batch.prefills:  # decode only: the step's output is the whole core, no scatter
            core = self._decode(projection, weight, batch, ctx)
        else:
            core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)
            if batch.decode is not None:
                core[:batch.num_decode] = self._decode(projection, weight, batch, ctx)
            beta, g = self._beta_and_decay(a, b)
            for chunk in batch.prefills:
                self._prefill(chunk, mixed, g, beta, weight, ctx, core)
        if rows is not None:
            core, z = core.index_select(0, rows), z.index_select(0, rows)
        if core.dtype != x.dtype:
            core = core.to(x.dtype)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out(out.reshape(core.shape[0], self.value_dim))

    def _beta_and_decay(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and log-decay g = -exp(A_log) * softplus(a + dt_bias), float32 [T, Hv]."""
        assert self.neg_decay_rate is not None
        if a.dtype != torch.float32:
            a, b = a.float(), b.float()
        dt_bias = self.dt_bias if self.dt_bias.dtype == torch.float32 else self.dt_bias.float()
        return torch.sigmoid(b), self.neg_decay_rate * F.softplus(a + dt_bias)

    def _decode(self, projection: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext
                ) -> torch.Tensor:
        """Advance the decode group's state by one token; return its output [B, Hv, Dv] float32.
        `projection` holds the in_proj output rows (conv inputs, z, b, a). Off the C kernel, PyTorch
        ops (any device and dtype) compute the new states, written when the forward succeeds."""
        group, layer, rows = batch.decode, self.state_layer, batch.num_decode
        assert group is not None and self.in_proj is not None
        conv_live, recurrent_live = ctx.live_states.conv[layer], ctx.live_states.recurrent[layer]
        if self._native_applies(projection, conv_live, weight):
            return self._decode_native(projection[:rows], weight, group, ctx, gated_norm=False)
        mixed, _, b, a = torch.split(projection[:rows], self.in_proj.widths, dim=-1)
        beta, g = self._beta_and_decay(a, b)
        conv_out, new_conv = causal_conv_decode(mixed, conv_live.index_select(0, group.state_slots), weight)
        qk, v = torch.split(conv_out, [2 * self.key_dim, self.value_dim], dim=-1)
        core, new_state = recurrent_gated_delta_step(
            qk.view(rows, 2 * self.num_k_heads, self.head_k_dim), v.view(rows, self.num_v_heads, self.head_v_dim),
            g, beta, recurrent_live.index_select(0, group.state_slots))
        ctx.state_writes.append(StateWrite(layer, group.state_slots, new_conv, new_state))
        if ctx.snapshot_sink is not None:
            for row, snapshot_slot in group.captures:
                ctx.snapshot_sink.write(layer, snapshot_slot, new_conv[row], new_state[row])
        return core

    def _decode_native(self, projection: torch.Tensor, weight: torch.Tensor, group: DecodeGroup,
                      ctx: ForwardContext, gated_norm: bool) -> torch.Tensor:
        """The C kernel: one pass over each state, updated in its live slot; the state it replaced
        becomes the step's undo record. With `gated_norm` the output has the output norm applied."""
        assert self.neg_decay_rate is not None and self.in_proj is not None
        layer, b_offset = self.state_layer, self.in_proj.widths[0] + self.in_proj.widths[1]
        conv_live, recurrent_live = ctx.live_states.conv[layer], ctx.live_states.recurrent[layer]
        core, old_conv, old_state = gdn_decode_f32(
            projection, b_offset, b_offset + self.num_v_heads, group.state_slots, conv_live, recurrent_live,
            weight, self.dt_bias, self.neg_decay_rate, self.num_k_heads, L2_NORM_EPS, in_place=True,
            norm_weight=self.norm.weight if gated_norm else None, norm_eps=self.norm.eps)
        ctx.state_undo.append(StateWrite(layer, group.state_slots, old_conv, old_state))
        if ctx.snapshot_sink is not None:
            for row, snapshot_slot in group.captures:
                slot = int(group.state_slots[row])
                ctx.snapshot_sink.write(layer, snapshot_slot, conv_live[slot], recurrent_live[slot])
        return core

    def _native_applies(self, projection: torch.Tensor, conv_live: torch.Tensor, weight: torch.Tensor) -> bool:
        """The C kernels (decode, and prefill token by token) take float32 CPU inputs; the eager and
        chunked ops cover every other case."""
        float32 = torch.float32
        return (projection.device.type == "cpu" and projection.dtype == float32 and conv_live.dtype == float32
                and weight.dtype == float32 and self.dt_bias.dtype == float32 and self.norm.weight.dtype == float32
                and weight.is_contiguous() and native_kernels_enabled())

    def _prefill(self, chunk: PrefillChunk, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 weight: torch.Tensor, ctx: ForwardContext, core: torch.Tensor) -> None:
        layer, slot = self.state_layer, chunk.state_slot
        rows = slice(chunk.token_offset, chunk.token_offset + chunk.length)
        conv_state, initial_state = ctx.live_states.conv[layer, slot], ctx.live_states.recurrent[layer, slot]
        boundaries = [b for b, _ in chunk.captures]
        x, dtypes = mixed[rows], (torch.float32, torch.bfloat16)
        if mixed.device.type == "cpu" and mixed.dtype in dtypes and weight.dtype in dtypes and native_kernels_enabled():
            # the C kernel on CPU: a bfloat16 model's inputs are widened for it (float32 arithmetic, as the
            # chunked form accumulates; faster than it); its live conv state keeps bfloat16 (conv_state_after)
            result = ChunkedResult(*gdn_prefill_f32(x.float(), conv_state.float(), g[rows].contiguous(),
                                                    beta[rows].contiguous(), initial_state, weight.float(),
                                                    self.num_k_heads, L2_NORM_EPS,
                                                    [b - chunk.start_position for b in boundaries]))
        else:
            conv_out, _ = causal_conv_prefill(x, conv_state, weight)
            q, k, v = self._split_qkv(conv_out)
            result = chunked_gated_delta(q, k, v, g[rows], beta[rows], initial_state, chunk_size=self.chunk_size,
                                         start_position=chunk.start_position, capture_at=boundaries)
        core[rows] = result.output
        slots = torch.tensor([slot], device=mixed.device)
        # a copy of the K-1 columns, not a view: the write waits for the forward's end, and a view
        # would keep the layer's whole projection alive until then
        new_conv = conv_state_after(conv_state, x, chunk.length).contiguous()
        ctx.state_writes.append(StateWrite(layer, slots, new_conv.unsqueeze(0), result.final_state.unsqueeze(0)))
        if ctx.snapshot_sink is not None:
            for (boundary, snapshot_slot), state in zip(chunk.captures, result.captured):
                conv = conv_state_after(conv_state, x, boundary - chunk.start_position)
                ctx.snapshot_sink.write(layer, snapshot_slot, conv, state)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or attention) then MLP."""

    def __init__(self, config: ModelConfig, layer_id: int, mixer_index: int, rotary: PartialRotaryEmbedding,
                 chunk_size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        # Tensor parallel: the mixer's output projection and the MLP's down projection are
        # row-parallel, so their partial sums are all-reduced over the ranks.
        self.all_reduce = all_reduce
        self.is_attention = config.layer_types[layer_id] == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config, mixer_index, rotary)
        else:
            self.linear_attn = GatedDeltaNet(config, mixer_index, chunk_size)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext,
                cos_sin: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block; with `rows`, the mixer still consumes every token (KV / state) but
        only those rows are carried through the output projection and the MLP."""
        h = self.input_layernorm(x)
        if self.is_attention:
            h = self.self_attn(h, batch, ctx, cos_sin, rows)
        else:
            h = self.linear_attn(h, batch, ctx, rows)
        if self.all_reduce is not None:
            h = self.all_reduce(h)
        x = (x if rows is None else x.index_select(0, rows)) + h
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.all_reduce is None else self.all_reduce(h))


class Qwen3_5TextModel(nn.Module):
    """Embeddings, decoder stack and final norm."""

    def __init__(self, config: ModelConfig, chunk_size: int, max_positions: int,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = PartialRotaryEmbedding(config.head_dim, config.rotary_dim, config.rope_theta, max_positions)
        attention_ids, gdn_ids = config.attention_layer_ids, config.gdn_layer_ids
        self.layers = nn.ModuleList([
            DecoderLayer(config, i, attention_ids.index(i) if i in attention_ids else gdn_ids.index(i),
                         self.rotary, chunk_size, all_reduce)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """The full causal LM; `forward` returns logits only for `batch.logits_rows`."""

    def __init__(self, config: ModelConfig, *, chunk_size: int = 64, max_positions: int | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`config` is the shape this model holds: one tensor-parallel rank's (see
        `distributed.sharding.local_config`) with `all_reduce` summing row-parallel outputs."""
        super().__init__()
        self.config = config
        self.model = Qwen3_5TextModel(config, chunk_size, max_positions or config.max_position_embeddings,
                                      all_reduce)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head: PackedLinear | None = None

    def pack(self, quantization: str | None = None) -> None:
        """Repack the loaded weights once: fused projections, int8 with `quantization="int8"` (the LM
        head and embeddings keep the model dtype), Hugging Face-named linears and norm weights
        dropped so every weight is held once (tied embeddings: one matrix for lookup and head)."""
        if self.head is not None:
            return
        # listing only what packs: a list of every module would keep each replaced linear alive
        # until the loop ends, so all of the model's weights would exist twice at once
        packs = (GatedAttention, GatedDeltaNet, MLP, ZeroCenteredRMSNorm)
        packing = [m for m in self.modules() if isinstance(m, packs)]
        for module in packing:
            if isinstance(module, ZeroCenteredRMSNorm):
                module.pack()
            else:
                module.pack(quantization)
        if self.config.tie_word_embeddings:
            self.head = PackedLinear([self.model.embed_tokens], allow_repack=False)
        else:
            pack_linears(self, None, head=["lm_head"])
        move_to_huge_pages(self.weight_slots())

    def weight_slots(self) -> Iterator[tuple[object, str, torch.Tensor]]:
        """Every weight the model holds, as (owner, attribute, tensor): parameters, packed linears'
        tensors, precomputed norm scales; position tables are not weights."""
        for module in self.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None:
                    yield module, name, parameter
            for name, value in list(vars(module).items()):
                if isinstance(value, PackedLinear):
                    yield from ((value, attribute, tensor) for attribute, tensor in value.named_tensors())
                elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    yield module, name, value

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds (see `weight_slots`), memory shared by several
        counted once (tied embeddings; weights copied into one huge-page region stay distinct)."""
        return union_bytes(tensor for _, _, tensor in self.weight_slots())

    def forward(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] float32, module by module."""
        x = self.model.embed_tokens(batch.input_ids)
        cos_sin = self.model.rotary.cos_sin(batch.positions, x.dtype)
        # The last layer's outputs feed nothing but the logits: compute it for those rows only.
        *body, last = self.model.layers
        for layer in body:
            x = layer(x, batch, ctx, cos_sin)
        if batch.logits_only_last_layer:
            x = self.model.norm(last(x, batch, ctx, cos_sin, batch.logits_rows))
        else:
            x = self.model.norm(last(x, batch, ctx, cos_sin).index_select(0, batch.logits_rows))
        assert self.head is not None, "call pack() after loading weights"
        return self.head(x).float()
