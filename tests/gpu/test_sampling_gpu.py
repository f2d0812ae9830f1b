"""GPU parity of the Triton token sampler at real sizes (Qwen3's vocabulary), the sampler's entry point on
CUDA logits, and CUDA-graph capture of the kernel. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import sample_tokens
from skyrl_clora.kernels.reference import sample_tokens_ref
from tests.support.kernel_cases import check_samples, make_sampling_problem
from skyrl_clora.sampler.sampling import request_uniforms, sample_rows

pytestmark = pytest.mark.gpu
VOCAB = 151936


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [64, 512])
def test_triton_matches_reference(num_rows: int, dtype: torch.dtype) -> None:
    p = make_sampling_problem(num_rows, VOCAB, dtype, device="cuda", seed=num_rows)
    tokens, logprobs = sample_tokens(p.logits, p.temperature, p.uniform)
    want_tokens, want_logprobs = sample_tokens_ref(p.logits, p.temperature, p.uniform)
    assert len(set(want_tokens.tolist())) > num_rows // 2, "rows must draw different tokens"
    clear = check_samples(p, tokens, logprobs)
    assert int(clear.sum()) >= num_rows // 4 and torch.equal(tokens[clear], want_tokens[clear])
    greedy = p.temperature == 0.0
    assert torch.equal(tokens[greedy], want_tokens[greedy])
    assert int(tokens[2]) == VOCAB // 3 - 1, "greedy ties go to the first maximum"
    assert int(tokens[3]) == int(torch.isfinite(p.logits[3]).nonzero().max()), "u = 1: the last positive token"
    same = tokens == want_tokens
    assert torch.allclose(logprobs[same], want_logprobs[same], rtol=0.0, atol=1e-5)


def test_sample_rows_on_cuda() -> None:
    """Greedy, plain, tempered and top-p rows of bf16 logits: each row's log-probability is its token's under the
    distribution it was drawn from before top-p (``log_softmax(logits / T)``; greedy rows untempered), top-p rows
    lie inside their nucleus, and the kernel's rows (no top-p) are bit for bit the same alone as in the batch."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(48, VOCAB, generator=generator, device="cuda", dtype=torch.bfloat16) * 3
    temperature = [[0.0, 1.0, 0.6][i % 3] for i in range(48)]
    top_p = [[1.0, 0.9, 1.0, 0.5][i % 4] for i in range(48)]
    uniform = request_uniforms(range(48), [7] * 48)
    tokens, logprobs = sample_rows(logits, temperature, top_p, uniform)
    assert len(set(tokens)) > 40, "rows must draw different tokens"
    rows, chosen = torch.arange(48, device="cuda"), torch.tensor(tokens, device="cuda")
    scale = torch.tensor([t if t > 0.0 else 1.0 for t in temperature], dtype=torch.float64, device="cuda")
    want = torch.log_softmax(logits.double() / scale[:, None], dim=-1)[rows, chosen].cpu()
    untempered = torch.log_softmax(logits.double(), dim=-1)[rows, chosen].cpu()
    tempered_rows = torch.tensor([t not in (0.0, 1.0) for t in temperature])
    assert float((want - untempered)[tempered_rows].abs().min()) > 1e-2, "T=0.6 rows must tell the two apart"
    assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0.0)
    for row in range(48):
        if top_p[row] < 1.0 and temperature[row] > 0.0:
            probs = torch.softmax(logits[row].double() / temperature[row], dim=-1)
            mass_ahead = float(probs[probs > probs[tokens[row]]].sum())
            assert mass_ahead < top_p[row] + 1e-4, f"row {row} drew outside its nucleus"
        elif row % 5 == 0:
            alone = sample_rows(logits[row:row + 1], temperature[row:row + 1], top_p[row:row + 1], uniform[row:row + 1])
            assert alone == ([tokens[row]], [logprobs[row]])


def test_kernel_is_capturable_in_a_cuda_graph() -> None:
    """No host synchronisation: the launch replays from a CUDA graph, also with new inputs copied in."""
    p = make_sampling_problem(64, VOCAB, torch.bfloat16, device="cuda", seed=5)
    q = make_sampling_problem(64, VOCAB, torch.bfloat16, device="cuda", seed=6)
    wants = [sample_tokens(x.logits, x.temperature, x.uniform) for x in (p, q)]  # also compiles the kernel
    assert not torch.equal(wants[0][0], wants[1][0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = sample_tokens(p.logits, p.temperature, p.uniform)
    for source, (want_tokens, want_logprobs) in zip((p, q), wants):
        p.logits.copy_(source.logits)
        p.uniform.copy_(source.uniform)
        graph.replay()
        assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)
