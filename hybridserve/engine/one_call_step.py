"""The one-call CPU step: a whole forward of up to 512 rows as one C call (`csrc/decode_step.c`;
docs/cpu-kernels.md). Live GDN slots are updated in place, the replaced state goes to `state_undo`."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from hybridserve import envs
from hybridserve.layers import native
from hybridserve.layers.gated_delta import L2_NORM_EPS
from hybridserve.layers.kernel_abi import WEIGHT_FORMATS, DecodeLayer, DecodeModel, Linear
from hybridserve.layers.linear import PackedLinear
from hybridserve.layers.norms import ZeroCenteredRMSNorm
from hybridserve.models.batch import ForwardBatch, StateWrite

if TYPE_CHECKING:
    from hybridserve.models.qwen3_5 import DecoderLayer, ForwardContext, Qwen3_5ForCausalLM

ONE_CALL_STEP_ENV = envs.ONE_CALL_STEP.name
MAX_ROWS = 512  # DECODE_STEP_MAX_ROWS in decode_step.c
PIECE_ROWS = 128  # GEMM_PIECE_ROWS and CHUNK_PIECE_ROWS there: the rows its kernels take at once
BF16_MAX_ROWS = 256  # past this many rows a bfloat16 model's module path (oneDNN) is faster (docs/decisions.md)


def one_call_step_enabled() -> bool:
    """Not switched off by HYBRIDSERVE_ONE_CALL_STEP=0, and the C kernels are available."""
    return envs.one_call_step() and native.native_kernels_enabled()


class OneCallStep:
    """The whole forward of one model over one runner's KV and state tensors, in C."""

    def __init__(self, model: Qwen3_5ForCausalLM, ctx: ForwardContext) -> None:
        """Point the C structs at the model's weights and the context's storage (check support first)."""
        library = native._library()
        if library is None:
            raise RuntimeError("OneCallStep: the C kernels are unavailable (check one_call_step_supported() first)")
        self._library = library
        config, text = model.config, model.model
        self.num_gdn_layers = len(config.gdn_layer_ids)
        self._float_copies: list[torch.Tensor] = []  # a bfloat16 model's small GDN weights, in float32
        self._buffers = _StepBuffers(self.num_gdn_layers, ctx)
        layers = _decoder_layers(model)
        self._layers = (DecodeLayer * len(layers))(*[self._layer_struct(layer) for layer in layers])
        self.max_rows = _max_rows(model, ctx)
        attention = next((layer.self_attn for layer in layers if layer.is_attention), None)
        gdns = [layer.linear_attn for layer in layers if not layer.is_attention]
        if model.head is None or text.norm.scale is None:
            raise ValueError("OneCallStep: the model needs an LM head and a final norm scale")
        self.model = DecodeModel(
            num_layers=len(text.layers), hidden=config.hidden_size, intermediate=config.intermediate_size,
            vocab=_packed(model.head).weight.shape[0], bf16_storage=int(ctx.kv_cache.keys.dtype == torch.bfloat16),
            rms_eps=text.norm.eps, gdn_norm_eps=gdns[0].norm.eps if gdns else 0.0,
            l2_eps=L2_NORM_EPS, embed=text.embed_tokens.weight.data_ptr(), final_norm=_pointer(text.norm.scale),
            head=_linear_struct(model.head), cos_table=_pointer(text.rotary.cos_table),
            sin_table=_pointer(text.rotary.sin_table), max_positions=_tensor(text.rotary.cos_table).shape[0],
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

    def _layer_struct(self, layer: DecoderLayer) -> DecodeLayer:
        mlp = layer.mlp
        struct = DecodeLayer(is_attention=int(layer.is_attention), input_norm=_pointer(layer.input_layernorm.scale),
                             post_norm=_pointer(layer.post_attention_layernorm.scale),
                             gate_up=_linear_struct(mlp.gate_up), down=_linear_struct(mlp.down))
        if layer.is_attention:
            attention = layer.self_attn
            struct.mixer_index = attention.kv_layer
            qkv = _packed(attention.qkv)
            struct.mixer_in, struct.mixer_in_features = _linear_struct(qkv), qkv.weight.shape[0]
            struct.mixer_out = _linear_struct(attention.out)
            struct.q_norm, struct.k_norm = _pointer(attention.q_norm.scale), _pointer(attention.k_norm.scale)
        else:
            gdn = layer.linear_attn
            struct.mixer_index = gdn.state_layer
            in_proj = _packed(gdn.in_proj)
            struct.mixer_in, struct.mixer_in_features = _linear_struct(in_proj), in_proj.weight.shape[0]
            struct.mixer_out = _linear_struct(gdn.out)
            struct.conv_weight = self._float32(gdn.conv1d.weight)
            struct.dt_bias, struct.neg_decay_rate = self._float32(gdn.dt_bias), _pointer(gdn.neg_decay_rate)
            struct.gdn_norm = self._float32(gdn.norm.weight)
            struct.b_offset = in_proj.widths[0] + in_proj.widths[1]
        return struct

    @staticmethod
    def takes(batch: ForwardBatch) -> bool:
        """A step of 1..MAX_ROWS rows with logits at sequence ends only: decode rows, and prompt
        chunks (with block tables) whose captures fall after their first token."""
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
        """Logits [len(logits_rows), vocab] of the step (check `takes` and `fits` first)."""
        rows = int(batch.input_ids.shape[0])
        tokens, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        write_slots, logit_rows = batch.kv_write_slots.contiguous(), batch.logits_rows.contiguous()
        step = _step_rows(batch)
        library, model, threads = self._library, ctypes.addressof(self.model), torch.get_num_threads()
        buffers = self._buffers
        workspace = buffers.workspace(library.decode_step_workspace_floats(model, rows, step.slots.data_ptr(),
                                                                           step.max_context, threads))
        undo = buffers.records("undo", int(step.sequences.shape[0]))  # one per sequence and layer
        captures = buffers.records("captures", len(step.inner)) if step.inner else None
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
        """Snapshots into the sink: inside chunks from the step's records, else from the live slots."""
        sink, layers = ctx.snapshot_sink, range(self.num_gdn_layers)
        if sink is None or (inner and captures is None):
            raise ValueError("one-call step: captures need a snapshot sink and the records the step filled")
        if captures is not None:
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
    """Per-row tables and slots (a chunk's repeated for its rows) and the rows of captures inside chunks."""
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
    """Each GDN layer's conv and recurrent state for some sequences of a step, and their addresses."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]
    conv_pointers: ctypes.Array[ctypes.c_void_p]
    recurrent_pointers: ctypes.Array[ctypes.c_void_p]


class _StepBuffers:
    """The C step's workspace and state records, kept from step to step (up to KEPT_BYTES) against page faults."""

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

    def records(self, kind: str, count: int) -> StateRecords:
        """`kind` ("undo" or "captures") records for `count` sequences (kept ones where large enough)."""
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
    text, layers = model.model, _decoder_layers(model)
    if any(layer.all_reduce is not None for layer in layers):
        return False
    gdns = [layer.linear_attn for layer in layers if not layer.is_attention]
    norms = [module for module in model.modules() if isinstance(module, ZeroCenteredRMSNorm)]
    storage = _all_tensors([text.embed_tokens.weight, text.rotary.cos_table, text.rotary.sin_table,
                            ctx.kv_cache.keys, ctx.kv_cache.values, ctx.live_states.conv])
    float32 = _all_tensors([ctx.live_states.recurrent, *(norm.scale for norm in norms),
                            *(gdn.neg_decay_rate for gdn in gdns)])
    model_dtype = _all_tensors([t for gdn in gdns for t in (gdn.conv1d.weight, gdn.dt_bias, gdn.norm.weight)])
    if storage is None or float32 is None or model_dtype is None:
        return False
    dtype = storage[0].dtype
    model_dtype += storage
    return (dtype in (torch.float32, torch.bfloat16) and all(t.dtype == dtype for t in model_dtype)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in [*float32, *model_dtype])
            and all(t.dtype == torch.float32 for t in float32)
            and all(_plain_linear(linear, dtype) for linear in _linears(model))
            and text.embed_tokens.weight.shape[0] == model.head.weight.shape[0]
            and len({norm.eps for norm in norms}) == 1)


def _all_tensors(values: list[object]) -> list[torch.Tensor] | None:
    """`values` when every one is a tensor (None when one is unset)."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    return tensors if len(tensors) == len(values) else None


def _linears(model: Qwen3_5ForCausalLM) -> list[PackedLinear | None]:
    """Every linear the step runs: the LM head, then each layer's mixer in/out and MLP."""
    linears = [model.head]
    for layer in _decoder_layers(model):
        mixer = layer.self_attn.qkv if layer.is_attention else layer.linear_attn.in_proj
        out = layer.self_attn.out if layer.is_attention else layer.linear_attn.out
        linears += [mixer, out, layer.mlp.gate_up, layer.mlp.down]
    return linears


def _max_rows(model: Qwen3_5ForCausalLM, ctx: ForwardContext) -> int:
    """The rows a step takes: MAX_ROWS (BF16_MAX_ROWS) where chunks run fast, else GEMV_DECODE_ROWS."""
    config = model.config
    bf16 = ctx.kv_cache.keys.dtype == torch.bfloat16
    if (config.head_dim % 64 != 0 or config.head_dim > 256 or native.prefill_attention_max_tokens() < PIECE_ROWS
            or native.gemm_rows_bounds()[1] < PIECE_ROWS or (bf16 and not native.amx_available())):
        return native.GEMV_DECODE_ROWS
    return BF16_MAX_ROWS if bf16 else MAX_ROWS


def _plain_linear(linear: PackedLinear | None, model_dtype: torch.dtype) -> bool:
    """A row-major CPU weight without bias: the model's dtype, or int8 with float32 scales in a float32 model."""
    if linear is None or linear.bias is not None:
        return False
    weight = linear.weight
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return False
    if linear.scales is None:
        return weight.dtype == model_dtype
    return (model_dtype == torch.float32 and weight.dtype == torch.int8 and linear.scales.dtype == torch.float32
            and linear.scales.is_contiguous())


def _tensor(value: object) -> torch.Tensor:
    """A model tensor the step points at (`ValueError` when it is unset, e.g. before packing)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError("OneCallStep: a weight, norm scale or table of the model is not set (pack it first)")
    return value


def _pointer(value: object) -> int:
    return _tensor(value).data_ptr()


def _packed(linear: PackedLinear | None) -> PackedLinear:
    """A packed linear of the model (`ValueError` before packing)."""
    if linear is None:
        raise ValueError("OneCallStep: a linear of the model is not packed")
    return linear


def _linear_struct(linear: PackedLinear | None) -> Linear:
    linear = _packed(linear)
    scales = linear.scales.data_ptr() if linear.scales is not None else None
    return Linear(linear.weight.data_ptr(), scales, WEIGHT_FORMATS[linear.weight.dtype])


def _decoder_layers(model: Qwen3_5ForCausalLM) -> list[DecoderLayer]:
    """The model's decoder layers, typed (an `nn.ModuleList` yields plain modules)."""
    return cast("list[DecoderLayer]", list(model.model.layers))
