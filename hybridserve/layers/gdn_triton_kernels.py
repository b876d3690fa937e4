"""Triton kernels of the GDN layers' GPU path (slot-indexed `decode_step`, in-chunk `capture_states`) and
`chunked_prefill`, fla's chunked forward run by its stages; why each exists and where it runs:
docs/cpu-kernels.md, "On CUDA: the Triton GDN path".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# fla's chunk kernels keep the cumulative log-decay in base 2 (exp2 is one instruction).
RCP_LN2 = 1.4426950408889634


@triton.jit
def _decode_kernel(x, x_row_stride, g, beta, pool, slots, out, new_state, eps, scale,
                   HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):
    """One program per (sequence, value head, block of BV value columns): the columns of the
    state are independent in the delta rule, so each program owns a [K, BV] tile of one state."""
    i_b = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_hv // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    row = x + i_b * x_row_stride  # conv output row: q heads, k heads, then v heads
    b_q = tl.load(row + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(row + HK * K + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(row + 2 * HK * K + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_q = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q) + eps))
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + eps)
    b_g = tl.load(g + i_b * HV + i_hv)
    b_beta = tl.load(beta + i_b * HV + i_hv)
    slot = tl.load(slots + i_b).to(tl.int64)
    tile = (o_k[:, None] * V + o_v[None, :])
    b_s = tl.load(pool + (slot * HV + i_hv) * K * V + tile, mask=m_kv, other=0.0).to(tl.float32)
    b_s = b_s * tl.exp(b_g)
    delta = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
    b_s = b_s + b_k[:, None] * delta[None, :]
    tl.store(out + (i_b * HV + i_hv) * V + o_v, tl.sum(b_s * b_q[:, None], 0), mask=m_v)
    tl.store(new_state + (i_b * HV + i_hv) * K * V + tile, b_s, mask=m_kv)


def decode_step(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor,
                slots: torch.Tensor, *, num_k_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row. conv_out [B, 2*Hk*Dk + Hv*Dv] (q, k not yet normalised; rows may
    be strided, the last dim contiguous); g, beta [B, Hv] float32; pool [S, Hv, Dk, Dv] float32,
    read at `slots` [B]. Returns (output [B, Hv, Dv], new states [B, Hv, Dk, Dv]), float32; the
    pool is only read (the runner commits new states after the forward succeeds)."""
    batch = conv_out.shape[0]
    num_v_heads, head_k, head_v = pool.shape[1:]
    assert conv_out.stride(-1) == 1 and pool.is_contiguous()
    out = torch.empty(batch, num_v_heads, head_v, dtype=torch.float32, device=conv_out.device)
    new_state = torch.empty(batch, num_v_heads, head_k, head_v, dtype=torch.float32, device=conv_out.device)
    block_v = min(triton.next_power_of_2(head_v), 32)
    grid = (batch, num_v_heads, triton.cdiv(head_v, block_v))
    _decode_kernel[grid](conv_out, conv_out.stride(0), g.float().contiguous(), beta.float().contiguous(), pool,
                         slots, out, new_state, eps, head_k ** -0.5, HK=num_k_heads, HV=num_v_heads, K=head_k,
                         V=head_v, BK=triton.next_power_of_2(head_k), BV=block_v)
    return out, new_state


@triton.jit
def _capture_kernel(h, k, v_new, g, chunk_rows, first_tokens, used, out,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One program per (capture, value head, block of BV value columns):
    S = h * 2^G[n-1] + sum_{j<n} k_j (x) v_new_j * 2^(G[n-1] - G[j]) over the chunk's first n tokens."""
    i_m = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_hv // (HV // H)
    chunk = tl.load(chunk_rows + i_m).to(tl.int64)
    t0 = tl.load(first_tokens + i_m).to(tl.int64)
    n = tl.load(used + i_m)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < n
    m_k = o_k < K
    m_v = o_v < V
    rows = t0 + o_t
    g_last = tl.load(g + (t0 + n - 1) * HV + i_hv).to(tl.float32)
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    weight = tl.where(m_t, tl.exp2(g_last - b_g), 0.0)
    b_k = tl.load(k + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_v = tl.load(v_new + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.0).to(tl.float32)
    tile = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    b_h = tl.load(h + (chunk * HV + i_hv) * K * V + tile, mask=m_kv, other=0.0).to(tl.float32)
    b_s = b_h * tl.exp2(g_last) + tl.dot(tl.trans(b_k), b_v * weight[:, None], input_precision="ieee")
    tl.store(out + (i_m * HV + i_hv) * K * V + tile, b_s, mask=m_kv)


def capture_states(chunk_states: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, g_cum_log2: torch.Tensor,
                   chunk_rows: torch.Tensor, first_tokens: torch.Tensor, used: torch.Tensor, *,
                   chunk_size: int) -> torch.Tensor:
    """States inside chunks. chunk_states [NT, Hv, Dk, Dv] (each chunk's start state); k [T, Hk, Dk]
    (normalised); v_new [T, Hv, Dv] (the chunk's corrected values); g_cum_log2 [T, Hv] (log-decay
    summed from each chunk's start, base 2); per capture i: `chunk_rows[i]` its chunk, `first_tokens[i]`
    that chunk's first row in k, `used[i]` in [1, chunk_size] tokens of it. Returns [M, Hv, Dk, Dv] float32."""
    num_captures = chunk_rows.shape[0]
    num_v_heads, head_k, head_v = chunk_states.shape[1:]
    out = torch.empty(num_captures, num_v_heads, head_k, head_v, dtype=torch.float32, device=k.device)
    if num_captures == 0:
        return out
    assert all(t.is_contiguous() for t in (chunk_states, k, v_new, g_cum_log2))
    block_v = min(triton.next_power_of_2(head_v), 64)
    grid = (num_captures, num_v_heads, triton.cdiv(head_v, block_v))
    _capture_kernel[grid](chunk_states, k, v_new, g_cum_log2, chunk_rows, first_tokens, used, out,
                          H=k.shape[1], HV=num_v_heads, K=head_k, V=head_v, BT=chunk_size,
                          BK=max(16, triton.next_power_of_2(head_k)), BV=max(16, block_v))
    return out


class PrefillResult(NamedTuple):
    """`chunked_prefill`'s output [T, Hv, Dv], final states [N, Hv, Dk, Dv] (float32), captures."""

    output: torch.Tensor
    final_states: torch.Tensor
    captured: torch.Tensor        # [M, Hv, Dk, Dv] float32, in the order of the capture lists


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_states: torch.Tensor, lengths: list[int], captures: list[tuple[int, int]], *,
                    chunk_size: int = 64) -> PrefillResult:
    """Several sequences' prefill chunks packed in one varlen forward (fla, CUDA only).

    q, k [T, Hk, Dk] (normalised; q carries the attention scale); v [T, Hv, Dv]; g [T, Hv] log-decay;
    beta [T, Hv]; initial_states [N, Hv, Dk, Dv] float32; `lengths` the N sequences' token counts in
    order; `captures` (sequence index, tokens of it consumed) pairs, each in [1, length].
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.index import prepare_chunk_indices

    device = q.device
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long, device=device)
    chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    q, k, v, g, beta = (t.unsqueeze(0).contiguous() for t in (q, k, v, g, beta))
    g_cum = chunk_local_cumsum(g.float(), chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                               chunk_indices=chunk_indices)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices, chunk_size=chunk_size)
    h, v_new, final_states = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_cum, initial_state=initial_states,
                                                          output_final_state=True, cu_seqlens=cu_seqlens,
                                                          chunk_indices=chunk_indices, chunk_size=chunk_size)
    output = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=1.0, cu_seqlens=cu_seqlens,
                         chunk_indices=chunk_indices, chunk_size=chunk_size)
    rows, firsts, counts = capture_positions(lengths, captures, chunk_size)
    captured = capture_states(h[0], k[0], v_new[0], g_cum[0], torch.tensor(rows, device=device),
                              torch.tensor(firsts, device=device), torch.tensor(counts, device=device),
                              chunk_size=chunk_size)
    return PrefillResult(output[0], final_states, captured)


def capture_positions(lengths: list[int], captures: list[tuple[int, int]], chunk_size: int
                      ) -> tuple[list[int], list[int], list[int]]:
    """(chunk row, chunk's first token row, tokens used) of each (sequence, consumed) capture, with
    chunks counted from each sequence's start and numbered across the packed sequences, as fla's
    varlen chunk states are."""
    first_chunk, first_token = [0], [0]
    for length in lengths:
        first_chunk.append(first_chunk[-1] + -(-length // chunk_size))
        first_token.append(first_token[-1] + length)
    rows, firsts, counts = [], [], []
    for sequence, consumed in captures:
        if not 0 < consumed <= lengths[sequence]:
            raise ValueError(f"capture after {consumed} tokens is outside a chunk of {lengths[sequence]}")
        chunk = (consumed - 1) // chunk_size
        rows.append(first_chunk[sequence] + chunk)
        firsts.append(first_token[sequence] + chunk * chunk_size)
        counts.append(consumed - chunk * chunk_size)
    return rows, firsts, counts
