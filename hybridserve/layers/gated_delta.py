"""Gated delta rule (chunked for prefill, recurrent for decode) and the depthwise causal conv: the
PyTorch forms, used on CUDA, in bfloat16 and as the reference for the C kernels in `native.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ChunkedResult(NamedTuple):
    """Output of `chunked_gated_delta`: per-token output, final state, states at requested ends."""

    output: torch.Tensor          # [T, Hv, Dv] float32
    final_state: torch.Tensor     # [Hv, Dk, Dv] float32
    captured: list[torch.Tensor]  # one [Hv, Dk, Dv] per requested boundary, same order


L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum(x^2) + eps) over the last dim (the reference kernels' convention),
    as one fused rms_norm: rms_norm(x, eps / d) = sqrt(d) * x / sqrt(sum(x^2) + eps)."""
    dim = x.shape[-1]
    root: float = dim ** 0.5  # typeshed types int ** float as Any
    return F.rms_norm(x, (dim,), None, eps / dim) * (scale / root)


def causal_conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's chunk: x [T, C] conv inputs, conv_state [C, K-1]
    the inputs of the K-1 positions before the chunk, weight [C, K]. Returns (SiLU(conv) [T, C], window
    [C, T+K-1]), window column j being the input at position (start - (K-1) + j): the state at any
    boundary b is window[:, b-start : b-start+K-1]."""
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out[0].t()), window


def conv_state_after(conv_state: torch.Tensor, x: torch.Tensor, consumed: int) -> torch.Tensor:
    """The conv state [C, K-1] (in x's dtype) after the first `consumed` tokens of a chunk's conv
    inputs x [T, C], given the state before the chunk: the inputs of the last K-1 positions (a
    view of x when the chunk alone covers them)."""
    history = conv_state.shape[1]
    if consumed >= history:
        return x[consumed - history:consumed].t()
    return torch.cat([conv_state[:, consumed:].to(x.dtype), x[:consumed].t()], dim=1)


def causal_conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token causal conv + SiLU for a batch. x: [B, C]; conv_state: [B, C, K-1]; weight: [C, K].
    Returns (SiLU(conv) [B, C], new conv state [B, C, K-1])."""
    if conv_state.dtype != x.dtype:
        conv_state = conv_state.to(x.dtype)
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    out = (window * weight).sum(-1)
    return F.silu(out), window[..., 1:]


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, initial_state: torch.Tensor, *, chunk_size: int,
                        start_position: int, capture_at: list[int] | tuple[int, ...] = ()) -> ChunkedResult:
    """Gated delta rule over one sequence's chunk of T tokens, from `initial_state`.

    q, k: [T, Hk, Dk] (not yet normalised); v: [T, Hv, Dv]; g: [T, Hv] log-decay (<= 0); beta:
    [T, Hv]; initial_state: [Hv, Dk, Dv]; tokens at absolute positions [start_position, +T). Chunks
    align to absolute multiples of `chunk_size` by zero-padding the front (a padded token leaves the
    state unchanged). Returns the state after each of the absolute boundaries `capture_at` in
    (start, start + T]; one inside a chunk costs one small extra product.
    """
    num_tokens, num_v_heads, head_v = v.shape
    num_k_heads, head_k = q.shape[1], q.shape[2]
    group = num_v_heads // num_k_heads
    front = start_position % chunk_size
    back = (-(front + num_tokens)) % chunk_size
    num_chunks = (front + num_tokens + back) // chunk_size

    # Chunk-major layout [N, H, C, D]: chunk n is one contiguous block for the sequential scan.
    def chunked(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (front, back)) if front or back else t
        return t.reshape(num_chunks, chunk_size, *t.shape[1:]).transpose(1, 2).contiguous()

    def per_value_head(t: torch.Tensor) -> torch.Tensor:  # [N, Hk, ...] -> [N, Hk, 1, ...]
        return t.unsqueeze(2)

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [N, Hv, ...] -> [N, Hk, G, ...] (head j in group j // G)
        return t.view(num_chunks, num_k_heads, group, *t.shape[2:])

    q = chunked(l2_normalize(q.float(), scale=head_k ** -0.5))                # [N, Hk, C, Dk]
    k = chunked(l2_normalize(k.float()))
    v, g, beta = chunked(v.float()), chunked(g.float().unsqueeze(-1)), chunked(beta.float().unsqueeze(-1))
    cum = g.cumsum(2)                                                          # [N, Hv, C, 1]
    # exp(cum_i - cum_j) for j <= i (<= 1 since g <= 0); the upper triangle is clamped to 0
    # before exp (exp of -inf is several times slower on CPU) and zeroed after.
    decay = (cum - cum.transpose(-1, -2)).clamp_(max=0.0).exp_().tril_()
    # Key-key and query-key products depend on the key head only: compute them at Hk and let
    # the per-value-head decay and beta broadcast over each group.
    kk = per_value_head(k @ k.transpose(-1, -2))
    qk = per_value_head(q @ k.transpose(-1, -2))
    # (I + L) X = [v*beta, k*beta*exp(cum)] with L the strictly lower part of (k*beta) k^T * decay:
    # the UT transform that turns a chunk of delta-rule updates into matrix products.
    lower = (grouped(beta) * kk * grouped(decay)).view_as(decay).tril_(-1)
    lower.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    # Inverting once (identity right-hand side) then multiplying beats solving for both
    # right-hand sides on CPU LAPACK, and leaves both results contiguous for the scan.
    eye = torch.eye(chunk_size, dtype=lower.dtype, device=lower.device).expand_as(lower)
    inverse = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)
    new_values = inverse @ (v * beta)
    k_cumdecay = inverse @ (per_value_head(k) * grouped(beta * cum.exp())).view(*cum.shape[:3], head_k)
    intra = (qk * grouped(decay)).view_as(decay)
    q_decayed = (per_value_head(q) * grouped(cum.exp())).view(*cum.shape[:3], head_k)
    k_to_end = (per_value_head(k) * grouped((cum[:, :, -1:] - cum).exp())).view(*cum.shape[:3], head_k)
    k_to_end = k_to_end.transpose(-1, -2).contiguous()
    chunk_decay = cum[:, :, -1:].exp()                                         # [N, Hv, 1, 1]

    first_chunk_base = start_position - front
    captures_in_chunk: dict[int, list[tuple[int, int]]] = {}
    for index, boundary in enumerate(capture_at):
        if not start_position < boundary <= start_position + num_tokens:
            raise ValueError(f"capture boundary {boundary} is outside this forward "
                             f"({start_position}, {start_position + num_tokens}]")
        local = boundary - first_chunk_base
        captures_in_chunk.setdefault((local - 1) // chunk_size, []).append((index, (local - 1) % chunk_size + 1))
    captured: list[torch.Tensor | None] = [None] * len(capture_at)
    state = initial_state.float()
    outputs = []
    for n in range(num_chunks):
        v_new = new_values[n] - k_cumdecay[n] @ state
        outputs.append(torch.baddbmm(intra[n] @ v_new, q_decayed[n], state))
        for index, used in captures_in_chunk.get(n, ()):
            if used < chunk_size:
                captured[index] = _state_inside_chunk(state, k[n], v_new, cum[n], used, group)
        new_state = torch.baddbmm(state * chunk_decay[n], k_to_end[n], v_new)
        for index, used in captures_in_chunk.get(n, ()):
            if used == chunk_size:
                captured[index] = new_state
        state = new_state
    output = torch.stack(outputs).transpose(1, 2).reshape(num_chunks * chunk_size, num_v_heads, head_v)
    return ChunkedResult(output[front:front + num_tokens], state, captured)  # type: ignore[arg-type]


def _state_inside_chunk(state: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, cum: torch.Tensor,
                        used: int, group: int) -> torch.Tensor:
    """State after the first `used` (< chunk) tokens of a chunk that starts from `state` [Hv, Dk, Dv]
    (the same update as a chunk end, cut at `used`): k [Hk, C, Dk] normalised, v_new [Hv, C, Dv] the
    chunk's corrected values, cum [Hv, C, 1] the cumulative log-decay."""
    last = cum[:, used - 1:used]                                               # [Hv, 1, 1]
    keys = k[:, :used].repeat_interleave(group, dim=0) * (last - cum[:, :used]).exp()
    return torch.baddbmm(state * last.exp(), keys.transpose(-1, -2), v_new[:, :used])


def recurrent_gated_delta_step(qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch: qk [B, 2*Hk, Dk] (query heads, then key heads, not yet
    normalised); v [B, Hv, Dv]; g, beta [B, Hv] float32; state [B, Hv, Dk, Dv] float32. Returns
    (output [B, Hv, Dv] float32, new state). Value heads run as [Hk, G] groups, so q and k are never
    repeated, and q and k are normalised in one call: decode is bound by per-op dispatch."""
    batch, num_v_heads, head_v = v.shape
    num_k_heads, head_k = qk.shape[1] // 2, qk.shape[2]
    group = num_v_heads // num_k_heads
    # l2_normalize of both halves at once: q also takes the attention scale head_k ** -0.5.
    qk = F.rms_norm(qk.float(), (head_k,), None, L2_NORM_EPS / head_k)
    qk = qk * _qk_factors(num_k_heads, head_k, qk.device)
    q = qk[:, :num_k_heads, None, None, :]                              # [B, Hk, 1, 1, Dk]
    k = qk[:, num_k_heads:, None, None, :]
    grouped = (batch, num_k_heads, group, 1, head_v)
    state = (state * g.exp()[..., None, None]).view(batch, num_k_heads, group, head_k, head_v)
    delta = (v.float().view(grouped) - k @ state).mul_(beta.view(batch, num_k_heads, group, 1, 1))
    state.addcmul_(k.transpose(-1, -2), delta)
    out = (q @ state).view(batch, num_v_heads, head_v)
    return out, state.view(batch, num_v_heads, head_k, head_v)


_QK_FACTORS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _qk_factors(num_k_heads: int, head_k: int, device: torch.device) -> torch.Tensor:
    """[2*Hk, 1] factors turning rms_norm(x, eps/d) into l2_normalize: 1/d for q heads (which
    carry the d ** -0.5 attention scale), 1/sqrt(d) for k heads."""
    key = (num_k_heads, head_k, device)
    if key not in _QK_FACTORS:
        factors = [head_k ** -0.5 / head_k ** 0.5] * num_k_heads + [1.0 / head_k ** 0.5] * num_k_heads
        _QK_FACTORS[key] = torch.tensor(factors, dtype=torch.float32, device=device)[:, None]
    return _QK_FACTORS[key]
