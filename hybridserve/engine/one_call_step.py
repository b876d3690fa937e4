"""The one-call CPU step: a whole forward of up to 512 rows as one C call (layers/csrc/decode_step.c).

A step of up to 512 rows runs embeddings, every layer, the final norm and the LM head in C:
decode rows, and prompt chunks taken in the same step (a burst of short prompts, the few tokens a
long prompt adds per step while others decode, a warm request's suffix behind its cached prefix),
each chunk's rows stepping its sequence's state in order and attending to the rows before them.
It calls the same kernels as the module path in the same order; Python passes the step's ids,
positions, slots and kept buffers. It is what a captured CUDA graph is to a GPU engine: the
per-op dispatch of ~150 ops and ~40 module calls goes (for a 64-token warm suffix behind 4096
cached tokens, ~10 ms of ~31). Float32 models (float32 or int8 linears) get the module path's
decode math exactly; a chunk of 8 or more rows attends with the module path's chunk attention
kernel (prefill_attention.c; past 128 rows, as the linears' tile GEMM, in even pieces of at most
128), and its rows' GDN state is stepped token by token like decode rows,
where the module path's prefill uses its chunked kernel (the same recurrence, sums in another
order). As on the module path, the last layer's attention, output projection and MLP run for the
logit rows only. A bfloat16 model's weights, KV and conv state stay bfloat16 in memory and are
widened to float32 as they are read, so its activations are float32 where the module path rounds
each one to bfloat16: closer to a float32 model, not equal to the module path (on a CPU without
bf16 arithmetic this is also what makes bfloat16 fast); its chunk attention widens each block of
keys and values once, and its steps take up to 256 rows (see `_max_rows`). Steps of more rows, steps that want
prompt logprobs, CUDA and tensor parallelism keep the module path, as does everything with
`HYBRIDSERVE_ONE_CALL_STEP=0` or the C kernels off.

The step is transactional like the module path: GDN layers update their live slots in place and
hand the replaced state, one record per sequence, to `ForwardContext.state_undo`. A snapshot
captured inside a chunk is copied out by the C step as the chunk's rows pass it and written to
the snapshot sink afterwards; one at a chunk's end (or a decode row's) is read from the live slot.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, NamedTuple

import torch

from hybridserve import envs
from hybridserve.layers import native
from hybridserve.layers.gated_delta import L2_NORM_EPS
from hybridserve.layers.kernel_abi import (
    WEIGHT_FORMATS,
    DecodeLayer,
    DecodeModel,
    Linear,
)
from hybridserve.layers.linear import PackedLinear
from hybridserve.layers.norms import ZeroCenteredRMSNorm
from hybridserve.models.batch import ForwardBatch, StateWrite

if TYPE_CHECKING:
    from hybridserve.models.qwen3_5 import ForwardContext, Qwen3_5ForCausalLM

ONE_CALL_STEP_ENV = envs.ONE_CALL_STEP.name
MAX_ROWS = 512  # DECODE_STEP_MAX_ROWS in decode_step.c
PIECE_ROWS = 128  # GEMM_PIECE_ROWS and CHUNK_PIECE_ROWS there: the rows its kernels take at once
# A bfloat16 model's linears take AMX tiles 32 rows at a time, each piece a pass over the weights:
# warm suffixes behind 4096 cached tokens took 18.0 / 36.5 / 51.8 / 75.7 / 97.6 ms at 64 / 161 /
# 256 / 384 / 512 tokens against 30.8 / 49.9 / 61.6 / 79.0 / 93.7 ms on the module path (oneDNN).
BF16_MAX_ROWS = 256

def one_call_step_enabled() -> bool:
    """Not switched off by HYBRIDSERVE_ONE_CALL_STEP=0, and the C kernels are available."""
    return envs.one_call_step() and native.native_kernels_enabled()


class OneCallStep:
    """The whole forward of one model over one runner's KV and state tensors, in C."""

    def __init__(self, model: Qwen3_5ForCausalLM, ctx: ForwardContext) -> None:
        """Point the C structs at the model's weights and the context's storage (check
        `one_call_step_supported` first). The pointers stay valid while both live: packed weights and
        the pools are allocated once and never replaced, and the step belongs to the runner that
        owns the model and the storage."""
        library = native._library()
        if library is None:
            raise RuntimeError("OneCallStep: the C kernels are unavailable (check one_call_step_supported() first)")
        self._library = library
        config, text = model.config, model.model
        self.num_gdn_layers = len(config.gdn_layer_ids)
        self._float_copies: list[torch.Tensor] = []  # a bfloat16 model's small GDN weights, in float32
        self._buffers = _StepBuffers(self.num_gdn_layers, ctx)
        self._layers = (DecodeLayer * len(text.layers))(*[self._layer_struct(layer) for layer in text.layers])
        self.max_rows = _max_rows(model, ctx)
        attention = next((layer.self_attn for layer in text.layers if layer.is_attention), None)
        if model.head is None or text.norm.scale is None:
            raise ValueError("OneCallStep: the model needs an LM head and a final norm scale")
        self.model = DecodeModel(
            num_layers=len(text.layers), hidden=config.hidden_size, intermediate=config.intermediate_size,
            vocab=model.head.weight.shape[0], bf16_storage=int(ctx.kv_cache.keys.dtype == torch.bfloat16),
            rms_eps=text.norm.eps, gdn_norm_eps=_gdn_norm_eps(model),
            l2_eps=L2_NORM_EPS, embed=text.embed_tokens.weight.data_ptr(), final_norm=text.norm.scale.data_ptr(),
            head=_linear_struct(model.head), cos_table=text.rotary.cos_table.data_ptr(),
            sin_table=text.rotary.sin_table.data_ptr(), max_positions=text.rotary.cos_table.shape[0],
            rot=text.rotary.rotary_dim, num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads, head_k=config.linear_key_head_dim,
            head_v=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
            num_state_slots=ctx.live_states.num_slots, conv_live=ctx.live_states.conv.data_ptr(),
            rec_live=ctx.live_states.recurrent.data_ptr(), heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            attn_scale=attention.scale if attention is not None else 1.0, keys=ctx.kv_cache.keys.data_ptr(),
            values=ctx.kv_cache.values.data_ptr(), num_kv_slots=ctx.kv_cache.keys.shape[1], layers=self._layers)

    def _float32(self, tensor: torch.Tensor) -> int:
        """Pointer to `tensor` as float32 (a kept copy where it is bfloat16)."""
        if tensor.dtype != torch.float32:
            tensor = tensor.float().contiguous()
            self._float_copies.append(tensor)
        return tensor.data_ptr()

    def _layer_struct(self, layer: torch.nn.Module) -> DecodeLayer:
        mlp = layer.mlp
        struct = DecodeLayer(is_attention=int(layer.is_attention), input_norm=layer.input_layernorm.scale.data_ptr(),
                             post_norm=layer.post_attention_layernorm.scale.data_ptr(),
                             gate_up=_linear_struct(mlp.gate_up), down=_linear_struct(mlp.down))
        if layer.is_attention:
            attention = layer.self_attn
            struct.mixer_index = attention.kv_layer
            struct.mixer_in, struct.mixer_in_features = _linear_struct(attention.qkv), attention.qkv.weight.shape[0]
            struct.mixer_out = _linear_struct(attention.out)
            struct.q_norm, struct.k_norm = attention.q_norm.scale.data_ptr(), attention.k_norm.scale.data_ptr()
        else:
            gdn = layer.linear_attn
            struct.mixer_index = gdn.state_layer
            struct.mixer_in, struct.mixer_in_features = _linear_struct(gdn.in_proj), gdn.in_proj.weight.shape[0]
            struct.mixer_out = _linear_struct(gdn.out)
            struct.conv_weight = self._float32(gdn.conv1d.weight)
            struct.dt_bias, struct.neg_decay_rate = self._float32(gdn.dt_bias), gdn.neg_decay_rate.data_ptr()
            struct.gdn_norm = self._float32(gdn.norm.weight)
            struct.b_offset = gdn.in_proj.widths[0] + gdn.in_proj.widths[1]
        return struct

    @staticmethod
    def takes(batch: ForwardBatch) -> bool:
        """A step of 1..MAX_ROWS rows whose logits rows are sequence ends (no prompt logits): decode
        rows, and prompt chunks (with their block tables) whose snapshot captures, if any, fall
        after the chunk's first token (the step copies the state at a capture inside a chunk out
        as it passes; the one at a chunk's end is the live state it leaves). `fits` then checks
        the rows this model's step takes."""
        rows = int(batch.input_ids.shape[0])
        if not 0 < rows <= MAX_ROWS or not batch.logits_only_last_layer:
            return False
        if batch.prefills and batch.block_tables is None:
            return False
        return all(chunk.start_position < boundary <= chunk.start_position + chunk.length
                   for chunk in batch.prefills for boundary, _ in chunk.captures)

    def fits(self, batch: ForwardBatch) -> bool:
        """The batch's rows are within `max_rows`."""
        return int(batch.input_ids.shape[0]) <= self.max_rows

    def run(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] of the step (check `takes` and `fits` first);
        live GDN state is updated in place, each sequence's undo record appended to ctx.state_undo,
        captures written to the snapshot sink. A prompt chunk's rows are consecutive tokens of one
        sequence: the C step writes every row's KV before attending, so each row sees the rows
        before it, and steps the rows' GDN state in order."""
        rows = int(batch.input_ids.shape[0])
        tokens, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        write_slots, logit_rows = batch.kv_write_slots.contiguous(), batch.logits_rows.contiguous()
        step = _step_rows(batch)
        library, model, threads = self._library, ctypes.addressof(self.model), torch.get_num_threads()
        buffers = self._buffers
        workspace = buffers.workspace(library.decode_step_workspace_floats(model, rows, step.slots.data_ptr(),
                                                                           step.max_context, threads))
        undo = buffers.undo(int(step.sequences.shape[0]))  # one record per sequence and layer, as on the module path
        captures = buffers.captures(len(step.inner)) if step.inner else None
        capture_rows = torch.tensor([row for row, _ in step.inner], dtype=torch.long) if step.inner else None
        native.check_index_tensors("decode_step_f32", tokens=tokens, positions=positions, state_slots=step.slots,
                                   kv_write_slots=write_slots, block_tables=step.tables, logit_rows=logit_rows)
        logits = torch.empty(logit_rows.shape[0], self.model.vocab)
        failed = library.decode_step_f32(
            model, rows, tokens.data_ptr(), positions.data_ptr(), step.slots.data_ptr(), write_slots.data_ptr(),
            step.tables.data_ptr(), step.tables.shape[1], ctx.kv_cache.block_size, step.max_context,
            workspace.data_ptr(), undo.conv_pointers, undo.recurrent_pointers, logit_rows.shape[0],
            logit_rows.data_ptr(), logits.data_ptr(), len(step.inner),
            capture_rows.data_ptr() if capture_rows is not None else None,
            captures.conv_pointers if captures else None, captures.recurrent_pointers if captures else None, threads)
        if failed:
            raise IndexError("one-call step: a token id, position or slot is out of range")
        ctx.state_undo.extend(StateWrite(layer, step.sequences, undo.conv[layer], undo.recurrent[layer])
                              for layer in range(self.num_gdn_layers))
        if ctx.snapshot_sink is not None:
            self._write_captures(batch, ctx, step.inner, captures)
        return logits

    def _write_captures(self, batch: ForwardBatch, ctx: ForwardContext, inner: list[tuple[int, int]],
                        captures: StateRecords | None) -> None:
        """Snapshots into the sink: those inside chunks from the records the C step filled, those at a
        chunk's end or after a decode row from the live slots the step left."""
        sink, layers = ctx.snapshot_sink, range(self.num_gdn_layers)
        if sink is None or (inner and captures is None):
            raise ValueError("one-call step: captures need a snapshot sink and the records the step filled")
        for index, (_, snapshot_slot) in enumerate(inner):
            for layer in layers:
                sink.write(layer, snapshot_slot, captures.conv[layer][index], captures.recurrent[layer][index])
        group = batch.decode
        ends = [(int(group.state_slots[row]), snapshot) for row, snapshot in group.captures] if group else []
        ends += [(chunk.state_slot, snapshot) for chunk in batch.prefills for boundary, snapshot in chunk.captures
                 if boundary == chunk.start_position + chunk.length]
        conv, recurrent = ctx.live_states.conv, ctx.live_states.recurrent
        for slot, snapshot_slot in ends:
            for layer in layers:
                sink.write(layer, snapshot_slot, conv[layer, slot], recurrent[layer, slot])


class StepRows(NamedTuple):
    """Per-row inputs of a C step beyond the batch's own tensors."""

    tables: torch.Tensor        # [rows, blocks] each row's block table
    slots: torch.Tensor         # [rows] each row's live state slot
    max_context: int
    sequences: torch.Tensor     # [sequences] the state slot of each run of rows, in order
    inner: list[tuple[int, int]]  # (row after which the state is captured, snapshot slot) inside chunks


def _step_rows(batch: ForwardBatch) -> StepRows:
    """A decode-only batch's tensors as they are; with prompt chunks, each chunk's table and slot
    repeated for its rows and the rows of its captures inside it."""
    group = batch.decode
    if not batch.prefills:
        if group is None:
            raise ValueError("one-call step: a step without prompt chunks needs decode rows")
        slots = group.state_slots.contiguous()
        return StepRows(group.block_tables.contiguous(), slots, group.max_length, slots, [])
    if batch.block_tables is None:
        raise ValueError("one-call step: prompt chunks need their block tables")
    counts = [1] * batch.num_decode + [chunk.length for chunk in batch.prefills]
    tables = batch.block_tables.index_select(0, torch.repeat_interleave(torch.arange(len(counts)),
                                                                        torch.tensor(counts)))
    decode_slots = group.state_slots.tolist() if group is not None else []
    slot_list, sequence_slots, inner = list(decode_slots), list(decode_slots), []
    for chunk in batch.prefills:
        first, end = len(slot_list), chunk.start_position + chunk.length
        inner += [(first + boundary - chunk.start_position - 1, snapshot)
                  for boundary, snapshot in chunk.captures if boundary < end]
        slot_list += [chunk.state_slot] * chunk.length
        sequence_slots.append(chunk.state_slot)
    return StepRows(tables, torch.tensor(slot_list, dtype=torch.long), int(batch.positions.max()) + 1,
                    torch.tensor(sequence_slots, dtype=torch.long), inner)


class StateRecords(NamedTuple):
    """Each GDN layer's conv and recurrent state for some sequences of a step (undo records, or
    states captured inside a chunk), and their addresses."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]
    conv_pointers: ctypes.Array
    recurrent_pointers: ctypes.Array


class _StepBuffers:
    """The C step's workspace and per-GDN-layer state records, kept from step to step (up to
    KEPT_BYTES; larger ones are the step's own) and grown when a step needs more: allocating them
    for each step (2 MB of undo record per layer at 16 sequences of the built-in model) cost page
    faults on every step. Steps run one at a time, and a step's undo record is used, if at all,
    before the step returns (`ModelRunner.execute_plan`); captured states are copied into the
    snapshot store before it returns."""

    KEPT_BYTES = 64 << 20

    def __init__(self, num_gdn_layers: int, ctx: ForwardContext) -> None:
        self.num_gdn_layers = num_gdn_layers
        self.conv_shape, self.conv_dtype = ctx.live_states.conv.shape[2:], ctx.live_states.conv.dtype
        self.rec_shape = ctx.live_states.recurrent.shape[2:]
        self._workspace = torch.empty(0)
        self._kept: dict[str, tuple[int, StateRecords]] = {}

    def workspace(self, floats: int) -> torch.Tensor:
        """At least `floats` float32 of scratch."""
        if self._workspace.numel() >= floats:
            return self._workspace
        workspace = torch.empty(floats)
        if 4 * floats <= self.KEPT_BYTES:
            self._workspace = workspace
        return workspace

    def undo(self, sequences: int) -> StateRecords:
        """Undo records for `sequences` sequences."""
        return self._records("undo", sequences)

    def captures(self, count: int) -> StateRecords:
        """Records for `count` states captured inside chunks."""
        return self._records("captures", count)

    def _records(self, kind: str, count: int) -> StateRecords:
        """Records for `count` sequences (the kept ones' leading rows where they are large enough)."""
        kept = self._kept.get(kind)
        if kept is not None and kept[0] >= count:
            records = kept[1]
            return records._replace(conv=[t[:count] for t in records.conv],
                                    recurrent=[t[:count] for t in records.recurrent])
        layers, rows = range(self.num_gdn_layers), max(count, 1)
        conv = [torch.empty(rows, *self.conv_shape, dtype=self.conv_dtype) for _ in layers]
        recurrent = [torch.empty(rows, *self.rec_shape) for _ in layers]
        pointers = ctypes.c_void_p * self.num_gdn_layers
        records = StateRecords(conv, recurrent, pointers(*[t.data_ptr() for t in conv]),
                               pointers(*[t.data_ptr() for t in recurrent]))
        if sum(t.numel() * t.element_size() for t in conv + recurrent) <= self.KEPT_BYTES:
            self._kept[kind] = (rows, records)
        return records._replace(conv=[t[:count] for t in conv], recurrent=[t[:count] for t in recurrent])


def one_call_step_supported(model: Qwen3_5ForCausalLM, ctx: ForwardContext) -> bool:
    """Whether the one-call step can run this model over this storage: on CPU, embeddings, rotary
    tables, KV and conv state all float32 or all bfloat16, float32 recurrent state and norm scales,
    row-major linears without bias (float32 or int8 in a float32 model, bfloat16 in a bfloat16 one),
    one tensor-parallel rank, one norm epsilon."""
    if not one_call_step_enabled() or model.head is None:
        return False
    text = model.model
    storage = [text.embed_tokens.weight, text.rotary.cos_table, text.rotary.sin_table, ctx.kv_cache.keys,
               ctx.kv_cache.values, ctx.live_states.conv]
    dtype = storage[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(t.dtype != dtype for t in storage):
        return False
    norms = [module for module in model.modules() if isinstance(module, ZeroCenteredRMSNorm)]
    float32 = [ctx.live_states.recurrent, *(norm.scale for norm in norms)]
    model_dtype = list(storage)
    for layer in text.layers:
        if layer.all_reduce is not None:
            return False
        mixer = layer.self_attn if layer.is_attention else layer.linear_attn
        if not layer.is_attention:
            float32.append(mixer.neg_decay_rate)
            model_dtype += [mixer.conv1d.weight, mixer.dt_bias, mixer.norm.weight]
    tensors = [*float32, *model_dtype]
    if any(t is None or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    if any(t.dtype != torch.float32 for t in float32) or any(t.dtype != dtype for t in model_dtype):
        return False
    if any(not _plain_linear(linear, dtype) for linear in _linears(model)):
        return False
    if text.embed_tokens.weight.shape[0] != model.head.weight.shape[0]:
        return False
    return len({norm.eps for norm in norms}) == 1


def _linears(model: Qwen3_5ForCausalLM) -> list[PackedLinear | None]:
    """Every linear the step runs: the LM head, then each layer's mixer in/out and MLP."""
    linears = [model.head]
    for layer in model.model.layers:
        mixer = layer.self_attn if layer.is_attention else layer.linear_attn
        linears += [mixer.qkv if layer.is_attention else mixer.in_proj, mixer.out, layer.mlp.gate_up, layer.mlp.down]
    return linears


def _max_rows(model: Qwen3_5ForCausalLM, ctx: ForwardContext) -> int:
    """The rows a step of this model takes: up to MAX_ROWS where a chunk of them runs fast (a head
    size the chunk attention takes; float32 or int8 linears on the tile GEMM, bfloat16 ones on AMX
    tiles 32 rows at a time), else GEMV_DECODE_ROWS: there a chunk's rows would attend one by one,
    or its linears run on the GEMV. With int8 linears a warm 64-token suffix took 26.4 ms against
    52.6 ms on the module path, whose int8 GEMM also rounds activations to bfloat16."""
    config = model.config
    bf16 = ctx.kv_cache.keys.dtype == torch.bfloat16
    if (config.head_dim % 64 != 0 or config.head_dim > 256 or native.prefill_attention_max_tokens() < PIECE_ROWS
            or native.gemm_rows_bounds()[1] < PIECE_ROWS or (bf16 and not native.amx_available())):
        return native.GEMV_DECODE_ROWS
    return BF16_MAX_ROWS if bf16 else MAX_ROWS


def _plain_linear(linear: PackedLinear | None, model_dtype: torch.dtype) -> bool:
    """A row-major CPU weight the C GEMV reads, without bias: the model's own dtype, or int8 with
    float32 scales in a float32 model."""
    if linear is None or linear.bias is not None:
        return False
    weight = linear.weight
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return False
    if linear.scales is None:
        return weight.dtype == model_dtype
    return (model_dtype == torch.float32 and weight.dtype == torch.int8 and linear.scales.dtype == torch.float32
            and linear.scales.is_contiguous())


def _linear_struct(linear: PackedLinear) -> Linear:
    scales = linear.scales.data_ptr() if linear.scales is not None else None
    return Linear(linear.weight.data_ptr(), scales, WEIGHT_FORMATS[linear.weight.dtype])


def _gdn_norm_eps(model: Qwen3_5ForCausalLM) -> float:
    gdn = next((layer.linear_attn for layer in model.model.layers if not layer.is_attention), None)
    return gdn.norm.eps if gdn is not None else 0.0
