"""The decode hot path and weight-only int8: exactness, quality bounds, no weight-sized allocations."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers import linear as linear_module
from hybridserve.layers.attention import prefill_attention
from hybridserve.layers.gated_delta import recurrent_gated_delta_step
from hybridserve.layers.linear import (
    GEMV_MAX_ROWS,
    INT8_DEQUANT_ROWS,
    SPLIT_GEMM_ROWS,
    PackedLinear,
    gemv_splits,
    quantize_int8,
)

# Documented int8 tolerances (built-in model, prompt logits against float32; docs/benchmarks.md has
# the measured figures): the error comes from per-channel int8 weights and bf16 GEMM inputs.
INT8_MEAN_ABS_LOGIT_ERROR = 0.1
INT8_TOP1_AGREEMENT = 0.6


def _engine(dtype: str = "float32", quantization: str | None = None, model: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quantization,
                                  cache=CacheConfig(kv_cache_mib=8, prefix_cache_mib=0)))


def _reference_step(q, k, v, g, beta, state):  # the textbook gated delta rule, value heads expanded
    repeat = v.shape[1] // q.shape[1]
    q = torch.nn.functional.normalize(q, dim=-1, eps=1e-6).repeat_interleave(repeat, 1) * q.shape[-1] ** -0.5
    k = torch.nn.functional.normalize(k, dim=-1, eps=1e-6).repeat_interleave(repeat, 1)
    state = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def test_grouped_recurrent_step_matches_the_expanded_rule() -> None:
    torch.manual_seed(0)
    batch, hk, hv, dk, dv = 3, 2, 6, 16, 8
    q, k = torch.randn(batch, hk, dk), torch.randn(batch, hk, dk)
    v, g, beta = torch.randn(batch, hv, dv), -torch.rand(batch, hv), torch.rand(batch, hv)
    state = torch.randn(batch, hv, dk, dv)
    out, new_state = recurrent_gated_delta_step(torch.cat([q, k], 1), v, g, beta, state.clone())
    ref_out, ref_state = _reference_step(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state, atol=1e-5, rtol=1e-5)


def test_decoded_tokens_are_the_argmax_of_a_full_prefill() -> None:
    """Token by token decode (recurrent GDN, paged attention) gives the logits a full prefill of
    the same tokens gives at each position (chunked GDN), so the fast path changes nothing."""
    engine = _engine()
    prompt = list(range(300, 340))
    llm_ids = _greedy(engine, prompt, 12)
    full = engine.prompt_logits(prompt + llm_ids[:-1], cache_salt="full")
    decoded_positions = full[len(prompt) - 1:]
    assert decoded_positions.argmax(-1).tolist() == llm_ids
    engine.check_integrity()


def _greedy(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


def test_int8_quantization_round_trip_is_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    weight[3] = 0.0  # an all-zero channel must not divide by zero
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    error = (q.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    assert bool((q[3] == 0).all())


def test_int8_linear_matches_its_dequantized_weight() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 96, bias=True)
    packed = PackedLinear([linear], quantization="int8")
    x = torch.randn(5, 64)
    q, scales = quantize_int8(linear.weight.detach())
    expected = x @ (q.float() * scales[:, None]).T + linear.bias.detach()
    # the GEMM input is rounded to bfloat16: relative error ~2^-8 of each product
    torch.testing.assert_close(packed(x), expected, atol=0.03, rtol=0.02)
    # prefill-sized batches dequantize the weight and keep float32 activations
    rows = torch.randn(INT8_DEQUANT_ROWS + 16, 64)
    expected = rows @ (q.float() * scales[:, None]).T + linear.bias.detach()
    torch.testing.assert_close(packed(rows), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unsupported quantization"):
        PackedLinear([linear], quantization="int4")


@pytest.mark.parametrize("split_bmm", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_gemv_matches_f_linear_for_every_row_count(threads: int, split_bmm: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32 CPU kernels picked by row count (C GEMV, split GEMV, split GEMM or MKL's GEMM as
    the host prefers, oneDNN) all compute x @ W.T (+ b) on the one plain weight, and the fused
    MLP's silu(gate) * up, for out sizes a thread count divides or not."""
    monkeypatch.setattr(linear_module, "split_bmm_preferred", lambda: split_bmm)
    torch.manual_seed(2)
    # 194 rows: 3 threads do not divide it
    gate, up = torch.nn.Linear(64, 97, bias=True), torch.nn.Linear(64, 97, bias=True)
    down = torch.nn.Linear(97, 64, bias=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gate_up, plain = PackedLinear([gate, up]), PackedLinear([down])
        assert plain.split_gemv and plain.weight.data_ptr() == down.weight.data_ptr()  # no copy
        for rows in (1, 3, SPLIT_GEMM_ROWS - 1, SPLIT_GEMM_ROWS, 17, 33, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 300):
            x, hidden = torch.randn(rows, 64), torch.randn(rows, 97)
            expected = torch.nn.functional.silu(gate(x)) * up(x)
            torch.testing.assert_close(gate_up.silu_mul(x), expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gate_up(x), torch.cat([gate(x), up(x)], -1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(plain(hidden), down(hidden), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(previous)
    assert gemv_splits(194, 3) == 2 and gemv_splits(194, 8) == 2 and gemv_splits(97, 4) == 1


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="needs a CPU with native bf16 instructions (AVX512-BF16/AMX)")
def test_bfloat16_linears_keep_the_plain_weight_with_native_bf16() -> None:
    """bfloat16 on a CPU with native bf16: the weight stays the plain matrix (no copy of a single
    linear, so the C GEMV and the one-call decode step can read it); decode rows are the float32
    product rounded to bf16, prefill rows PyTorch's bf16 GEMM."""
    torch.manual_seed(3)
    gate, up = torch.nn.Linear(64, 96).bfloat16(), torch.nn.Linear(64, 96).bfloat16()
    gate_up, single = PackedLinear([gate, up]), PackedLinear([gate])
    assert gate_up.native_bf16 and single.weight.data_ptr() == gate.weight.data_ptr()
    assert gate_up.weight.is_contiguous() and gate_up.weight.dtype == torch.bfloat16
    for rows in (1, 16, 40):
        x = torch.randn(rows, 64).bfloat16()
        expected = (torch.nn.functional.silu(gate(x).float()) * up(x).float())
        torch.testing.assert_close(gate_up.silu_mul(x).float(), expected, atol=0.05, rtol=0.02)
        if rows <= 16:
            exact = (x.float() @ gate.weight.float().t() + gate.bias.float()).bfloat16()
            torch.testing.assert_close(single(x), exact, atol=0.02, rtol=0.01)
        else:
            torch.testing.assert_close(single(x), gate(x))


@pytest.mark.skipif(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="for CPUs without native bf16 instructions (those keep oneDNN's bf16 GEMM)")
def test_bfloat16_linears_compute_in_float32_without_native_bf16() -> None:
    """Decode rows (the C GEMV, or F.linear without a compiler) and prefill rows (a widened copy of
    the weight) give the float32 product of the bf16 values, rounded to bf16; the bias is added."""
    torch.manual_seed(4)
    linear = torch.nn.Linear(64, 96).bfloat16()
    packed = PackedLinear([linear])
    assert packed.bf16_cpu and not packed.native_bf16 and not packed.onednn
    for rows in (1, 16, 40):
        x = torch.randn(rows, 64).bfloat16()
        expected = (x.float() @ linear.weight.float().t() + linear.bias.float()).bfloat16()
        y = packed(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, expected, atol=0.02, rtol=0.01)


@pytest.mark.parametrize("fixture", [None, "text_checkpoint"])
def test_int8_engine_is_close_to_float32(fixture: str | None, request: pytest.FixtureRequest) -> None:
    model = None if fixture is None else str(request.getfixturevalue(fixture))
    reference, int8 = _engine(model=model), _engine(quantization="int8", model=model)
    assert _quantized_linear_bytes(int8) < 0.3 * _quantized_linear_bytes(reference)  # 1 byte + scales
    prompt = list(range(200, 264))
    ref_logits, logits = reference.prompt_logits(prompt), int8.prompt_logits(prompt)
    assert float((logits - ref_logits).abs().mean()) < INT8_MEAN_ABS_LOGIT_ERROR
    top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    assert top1 >= INT8_TOP1_AGREEMENT
    assert len(_greedy(int8, prompt, 8)) == 8
    int8.check_integrity()


def _quantized_linear_bytes(engine: LLMEngine) -> int:
    """Bytes of the linears that int8 quantizes (every packed linear but the LM head)."""
    model = engine.runner.model
    return sum(sum(t.numel() * t.element_size() for t in v.tensors())
               for m in model.model.layers.modules() for v in vars(m).values() if isinstance(v, PackedLinear))


def test_bad_quantization_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int4")


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor an op creates that does not alias one of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.layout == torch.strided}
        for tensor in _tensors(out):
            if tensor.layout != torch.strided or tensor.untyped_storage().data_ptr() in inputs:
                continue
            size = tensor.untyped_storage().nbytes()
            if size > self.largest[0]:
                self.largest = (size, str(func))
        return out


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_decode_step_allocates_no_weight_sized_buffer(quantization: str | None) -> None:
    engine = _engine(quantization=quantization)
    model = engine.runner.model
    weights = [t for m in model.modules() for v in vars(m).values() if isinstance(v, PackedLinear)
               for t in v.tensors()]
    smallest = min(t.numel() * t.element_size() for t in weights if t.dim() == 2)
    engine.add_request("r", list(range(100, 164)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()  # now decoding
    probe = _LargestAllocation()
    with probe:
        engine.step()
    assert probe.largest[0] < smallest, (probe.largest, smallest)  # e.g. a per-call dequantized weight
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def _attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_prefix: int,
                         scale: float) -> torch.Tensor:
    """Plain causal attention with every KV head repeated for its query group."""
    num_new, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= (num_prefix + torch.arange(num_new))[:, None]
    return torch.einsum("htl,lhd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("num_new, num_prefix", [(1, 0), (1, 37), (6, 0), (6, 37), (64, 300)])
def test_prefill_attention_matches_plain_causal_attention(num_new: int, num_prefix: int) -> None:
    """New queries behind a prefix (the lower-right causal mask), without one, and one query alone,
    each KV head shared by a group of 4 query heads."""
    generator = torch.Generator().manual_seed(num_new * 1000 + num_prefix)
    q = torch.randn(num_new, 8, 16, generator=generator)
    keys, values = (torch.randn(num_prefix + num_new, 2, 16, generator=generator) for _ in range(2))
    out = prefill_attention(q, keys, values, num_prefix, 0.25)
    torch.testing.assert_close(out, _attention_reference(q, keys, values, num_prefix, 0.25), rtol=1e-5, atol=1e-5)
