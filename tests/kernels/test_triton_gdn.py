"""The GDN GPU path's Triton kernels under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU, at tiny
shapes against the PyTorch recurrence (marked `triton`); fla's chunked prefill, which the
interpreter cannot run, against the same reference on CUDA (marked `cuda`)."""

from __future__ import annotations

import os

# Before triton is imported: kernels decorated after this point run on the interpreter. A kernel
# module imported earlier in the session keeps its compiled form, so the CPU cases skip then.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridserve.layers.gated_delta import L2_NORM_EPS, l2_normalize, recurrent_gated_delta_step  # noqa: E402
from tests.helpers.targets import requires_cuda  # noqa: E402

kernels = pytest.importorskip("hybridserve.layers.gdn_triton_kernels", reason="triton is not installed")

pytestmark = [pytest.mark.triton, pytest.mark.timeout(120)]
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="TRITON_INTERPRET was unset when triton was imported")

HK, HV, DK, DV = 2, 4, 24, 40  # GQA groups of 2; head dims that are not powers of two exercise the masks


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Token-by-token gated delta rule of one sequence (q, k normalised, q scaled): outputs [T, Hv, Dv],
    the state after each token, and each token's corrected value beta * (v - k^T decayed state)."""
    group = HV // HK
    states, outputs, deltas = [], [], []
    for t in range(q.shape[0]):
        kt, qt = k[t].repeat_interleave(group, 0), q[t].repeat_interleave(group, 0)   # [Hv, Dk]
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", kt, state))
        state = state + kt[:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", qt, state))
        states.append(state)
        deltas.append(delta)
    return torch.stack(outputs), states, torch.stack(deltas)


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(num_tokens, HK, DK, generator=gen), scale=DK ** -0.5)
    k = l2_normalize(torch.randn(num_tokens, HK, DK, generator=gen))
    v = torch.randn(num_tokens, HV, DV, generator=gen)
    g = -torch.rand(num_tokens, HV, generator=gen) * 0.3
    beta = torch.rand(num_tokens, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen) * 0.1
    return q, k, v, g, beta, state


@interpreted
def test_decode_kernel_reads_slots_and_matches_recurrent_step() -> None:
    """Rows read their states from scattered pool slots; output and new state match
    `recurrent_gated_delta_step`, and the pool is left as it was."""
    gen = torch.Generator().manual_seed(0)
    batch, num_slots = 3, 7
    conv_width = 2 * HK * DK + HV * DV
    # a wider projection row, sliced: the kernel reads strided rows in place
    projection = torch.randn(batch, conv_width + 5, generator=gen)
    conv_out = projection[:, :conv_width]
    g, beta = -torch.rand(batch, HV, generator=gen), torch.rand(batch, HV, generator=gen)
    pool = torch.randn(num_slots, HV, DK, DV, generator=gen)
    before = pool.clone()
    slots = torch.tensor([5, 0, 3])
    out, new_state = kernels.decode_step(conv_out, g, beta, pool, slots, num_k_heads=HK, eps=L2_NORM_EPS)
    qk, v = conv_out.split([2 * HK * DK, HV * DV], dim=-1)
    want_out, want_state = recurrent_gated_delta_step(qk.reshape(batch, 2 * HK, DK), v.reshape(batch, HV, DV),
                                                      g, beta, pool[slots])
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, before)


@interpreted
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_capture_kernel_matches_recurrent_states_at_any_boundary(chunk_size: int) -> None:
    """Two packed sequences; captures inside chunks, on chunk edges, after one token and at each end
    equal the recurrent state after that many tokens."""
    lengths = [2 * chunk_size + 7, chunk_size]
    sequences = [_inputs(n, seed) for seed, n in enumerate(lengths)]
    per_sequence = []
    for q, k, v, g, beta, state in sequences:
        _, states, deltas = _recurrence(q, k, v, g, beta, state)
        starts = [state] + [states[c - 1] for c in range(chunk_size, q.shape[0], chunk_size)]
        per_sequence.append((states, deltas, torch.stack(starts)))
    chunk_states = torch.cat([starts for _, _, starts in per_sequence])
    k_all = torch.cat([s[1] for s in sequences])
    deltas_all = torch.cat([d for _, d, _ in per_sequence])
    g_cum = torch.cat([_chunk_local_cumsum(s[3], chunk_size) for s in sequences]) * kernels.RCP_LN2
    captures = [(0, 1), (0, 5), (0, chunk_size), (0, chunk_size + 1), (0, 2 * chunk_size), (0, lengths[0]),
                (1, chunk_size - 3), (1, lengths[1])]
    rows, firsts, counts = kernels.capture_positions(lengths, captures, chunk_size)
    captured = kernels.capture_states(chunk_states, k_all, deltas_all, g_cum, torch.tensor(rows),
                                      torch.tensor(firsts), torch.tensor(counts), chunk_size=chunk_size)
    for index, (sequence, consumed) in enumerate(captures):
        want = per_sequence[sequence][0][consumed - 1]
        torch.testing.assert_close(captured[index], want, atol=1e-5, rtol=1e-5, msg=f"capture {index}")


def test_capture_positions_refuses_a_boundary_outside_the_chunk() -> None:
    with pytest.raises(ValueError, match="outside"):
        kernels.capture_positions([10], [(0, 11)], 16)


def _chunk_local_cumsum(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Log-decay [T, Hv] summed from the start of each chunk (chunks from the sequence's start)."""
    return torch.cat([part.cumsum(0) for part in g.split(chunk_size)])


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="fla's chunk kernels do not run under "
                    "Triton's interpreter (autotuning needs a GPU driver; chunk_delta_h calls .to() on a loop index)")
def test_chunked_prefill_on_cuda_matches_recurrence() -> None:
    """fla's chunked forward by stages: outputs, final states and captures inside and at chunk
    edges against the recurrence, two packed sequences from nonzero states (float32 inputs)."""
    lengths = [150, 64]
    sequences = [_inputs(n, seed) for seed, n in enumerate(lengths)]
    captures = [(0, 1), (0, 64), (0, 100), (0, 150), (1, 30)]
    q, k, v, g, beta = (torch.cat([s[i] for s in sequences]).cuda() for i in range(5))
    initial = torch.stack([s[5] for s in sequences]).cuda()
    result = kernels.chunked_prefill(q, k, v, g, beta, initial, lengths, captures)
    references = [_recurrence(*s) for s in sequences]
    torch.testing.assert_close(result.output.cpu(), torch.cat([r[0] for r in references]), atol=2e-3, rtol=2e-3)
    for index, reference in enumerate(references):
        torch.testing.assert_close(result.final_states[index].cpu(), reference[1][-1], atol=2e-3, rtol=2e-3)
    for index, (sequence, consumed) in enumerate(captures):
        torch.testing.assert_close(result.captured[index].cpu(), references[sequence][1][consumed - 1],
                                   atol=2e-3, rtol=2e-3)


def test_runner_keeps_the_pytorch_path_off_cuda_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    from hybridserve.layers.gdn_triton import enable_triton_gdn

    model = torch.nn.Sequential()
    with caplog.at_level("INFO", logger="hybridserve.layers.gdn_triton"):
        assert not enable_triton_gdn(model, torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == ["GDN layers on the PyTorch path: the device is cpu, not cuda"]


@pytest.mark.cuda
@requires_cuda
@pytest.mark.timeout(300)
def test_triton_gdn_greedy_equals_the_pytorch_gpu_path(text_checkpoint: object, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Greedy tokens with the Triton GDN path equal the PyTorch GPU path's, cache on (snapshots taken
    inside the chunked forward, then restored) and off."""
    from hybridserve import LLM, SamplingParams
    from tests.helpers.prefix_cache import multi_turn_workload
    from tests.helpers.targets import CUDA

    prompts = [p for batch in multi_turn_workload(0) for p in batch][:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HYBRIDSERVE_GDN_KERNELS", backend)
        for cache_mib in (4, 0):
            llm = LLM(model=str(text_checkpoint), **CUDA.engine_kwargs(), kv_cache_mib=8, prefix_cache_mib=cache_mib,
                      snapshot_interval=32, max_num_batched_tokens=160, max_num_seqs=4)
            # one prompt at a time, so later prompts restore what earlier ones captured
            runs[backend, cache_mib] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
            if cache_mib:
                assert llm.prefix_cache_stats().hits > 0
    assert runs["triton", 4] == runs["triton", 0] == runs["torch", 0]
