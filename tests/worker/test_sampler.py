"""Sampler: each stage against its definition, seeded reproducibility, logprobs, and a mixed batch."""

from __future__ import annotations

import math

import pytest
import torch

from lmserve.sampling_params import SamplingParams
from lmserve.worker.sampler import (
    Sampler,
    apply_masks,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax_rows,
)
from lmserve.worker.sampling_metadata import SamplingMetadata

CPU = torch.device("cpu")
EOS = 2


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos_token_ids=[[EOS]] * n,
        vocab_size=vocab_size,
        device=CPU,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> torch.Tensor:
    return Sampler()(logits, build(params, logits.shape[1], **kw)).token_ids


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws from one distribution: the same row n times in one batch."""
    return sample(logits_row.expand(n, -1).clone(), [params] * n)


def assert_matches(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square over the support of `expected`; the bound is far in the tail for these dofs."""
    n = counts.sum().item()
    exp = expected * n
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = (((counts[support] - exp[support]) ** 2) / exp[support]).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < 10 + 4 * dof, (chi2, counts.tolist(), exp.tolist())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def test_greedy_is_argmax_for_any_dtype() -> None:
    logits = torch.randn(8, 1000)
    md = build([SamplingParams(temperature=0.0)] * 8, 1000)
    assert md.all_greedy and not md.any_penalties and not md.any_masks
    assert md.temperature is None and md.top_k is None and md.top_p is None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = Sampler()(x, md).token_ids
        assert out.dtype == torch.int64
        assert torch.equal(out, x.float().argmax(-1))
    # Top-k/p settings do not affect greedy rows.
    out = sample(logits, [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)] * 8)
    assert torch.equal(out, logits.argmax(-1))


def test_sampler_does_not_modify_caller_logits() -> None:
    logits = torch.randn(4, 50)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, logit_bias={1: 5.0})] * 4)
    assert torch.equal(logits, before)


def test_top_k_never_samples_outside_top_k() -> None:
    logits = torch.randn(200)
    top5 = set(logits.topk(5).indices.tolist())
    out = draws(logits, SamplingParams(temperature=1.5, top_k=5), 4000)
    assert set(out.tolist()) == top5  # only the top 5, and all of them
    # A row with top_k disabled next to one with top_k=1: each keeps its own setting.
    x = torch.stack([logits, logits])
    kept = apply_top_k_top_p(x.clone(), torch.tensor([1, 200]), None, max_top_k=1)
    assert torch.isfinite(kept[0]).sum() == 1 and torch.isfinite(kept[1]).all()


def test_top_k_is_the_same_with_or_without_top_p_in_the_batch() -> None:
    x = torch.randn(2, 100)
    k = torch.tensor([7, 7])
    alone = apply_top_k_top_p(x.clone(), k, None, max_top_k=7)
    with_p = apply_top_k_top_p(x.clone(), k, torch.tensor([1.0, 1.0]))
    assert torch.equal(torch.isfinite(alone), torch.isfinite(with_p))
    assert torch.isfinite(alone).sum(-1).tolist() == [7, 7]


def test_top_p_keeps_smallest_nucleus_and_renormalizes() -> None:
    probs = torch.tensor([0.07, 0.35, 0.08, 0.25, 0.10, 0.15])
    logits = probs.log()
    # Sorted: .35 .25 .15 | .10 .08 .07 -> the first two hold .60 < .7, the first three .75 >= .7.
    nucleus = torch.tensor([False, True, False, True, False, True])
    kept = apply_top_k_top_p(logits.clone().unsqueeze(0), None, torch.tensor([0.7]))[0]
    assert torch.equal(torch.isfinite(kept), nucleus)
    # The most likely token always survives, even for a tiny p.
    tiny = apply_top_k_top_p(logits.clone().unsqueeze(0), None, torch.tensor([0.01]))[0]
    assert torch.isfinite(tiny).tolist() == [False, True, False, False, False, False]

    out = draws(logits, SamplingParams(temperature=1.0, top_p=0.7), 20000)
    counts = torch.bincount(out, minlength=6).double()
    expected = torch.where(nucleus, probs, 0.0).double()
    assert_matches(counts, expected / expected.sum())


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.40, 0.30, 0.20, 0.10])
    # top_k=2 leaves .4/.3 -> renormalized .571/.429; top_p=.5 then keeps only the first.
    kept = apply_top_k_top_p(probs.log().unsqueeze(0), torch.tensor([2]), torch.tensor([0.5]))[0]
    assert torch.isfinite(kept).tolist() == [True, False, False, False]


def test_min_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    # Threshold 0.15 * 0.5 = 0.075.
    kept = apply_min_p(logits.clone().unsqueeze(0), torch.tensor([0.15]))[0]
    assert torch.isfinite(kept).tolist() == [True, True, True, False, False]
    out = draws(logits, SamplingParams(min_p=0.15), 20000)
    counts = torch.bincount(out, minlength=5).double()
    expected = torch.tensor([0.5, 0.3, 0.1, 0.0, 0.0], dtype=torch.float64)
    assert_matches(counts, expected / expected.sum())


def test_min_p_in_logit_space_keeps_what_the_softmax_keeps() -> None:
    """p_i < min_p * p_max compared as logits: the same kept set as the softmax version (issue 22) on random rows,
    and min_p 0 keeps everything, -inf included."""
    x = torch.cat([torch.randn(64, 3000) * s for s in (0.1, 1.0, 4.0, 10.0)])
    x[::7, ::5] = float("-inf")
    min_p = torch.rand(x.shape[0]) * 0.3
    min_p[::9] = 0.0
    probs = x.softmax(-1)
    want = probs >= probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    assert torch.equal(torch.isfinite(apply_min_p(x.clone(), min_p)), want & torch.isfinite(x))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    out = draws(logits, SamplingParams(temperature=temperature), 20000)
    counts = torch.bincount(out, minlength=5).double()
    assert_matches(counts, (logits.double() / temperature).softmax(-1))


def test_lower_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    share = {
        t: (draws(logits, SamplingParams(temperature=t), 8000) == 0).float().mean().item() for t in (0.3, 3.0)
    }
    assert share[0.3] > 0.75
    assert share[3.0] < 0.4


def seeded_run(seed: int, position: int, others: list[SamplingParams], steps: int = 12) -> list[int]:
    """Decode `steps` tokens for a seeded request placed at `position` among `others`."""
    target = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    other_gens = [
        torch.Generator().manual_seed(1000 + i) if p.seed is not None else None for i, p in enumerate(others)
    ]
    params = others[:position] + [target] + others[position:]
    gens = other_gens[:position] + [gen] + other_gens[position:]
    logits_gen = torch.Generator().manual_seed(7)
    tokens = []
    for _ in range(steps):
        base = torch.randn(1, 500, generator=logits_gen)  # the target's logits: same every run
        noise = torch.randn(len(params), 500)  # everyone else's: different every run
        logits = torch.where(torch.arange(len(params)).unsqueeze(1) == position, base, noise)
        out = Sampler()(logits, build(params, 500, generators=gens)).token_ids
        tokens.append(int(out[position]))
    return tokens


def test_seed_reproducible_across_batch_composition_and_position() -> None:
    alone = seeded_run(42, 0, [])
    torch.manual_seed(99)  # the global RNG state must not matter either
    mixed = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=1.2, top_p=0.5, presence_penalty=1.0),
    ]
    assert seeded_run(42, 2, mixed) == alone
    assert seeded_run(42, 4, mixed) == alone
    assert seeded_run(42, 1, mixed[:1] * 7) == alone
    assert seeded_run(43, 0, []) != alone


def test_seeded_greedy_row_does_not_consume_its_generator() -> None:
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    sample(
        torch.randn(2, 30),
        [SamplingParams(temperature=0.0, seed=3), SamplingParams()],
        generators=[gen, None],
    )
    assert torch.equal(gen.get_state(), state)


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    md = build(params, 6, prompts=[[0, 1, 1], [0, 1]], outputs=[[3, 5], [2]])
    assert md.any_penalties and md.frequency_penalty is None and md.presence_penalty is None
    out = apply_penalties(logits.clone(), md)
    # Row 0: tokens {0, 1, 3, 5} seen (prompt or output), positive / 2, negative * 2, zero stays 0.
    assert out[0].tolist() == [1.0, -2.0, 0.5, -6.0, 1.0, 0.0]
    assert torch.equal(out[1], logits[1])


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.zeros(2, 5)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.5),
        SamplingParams(presence_penalty=-1.0),
    ]
    # Prompt tokens do not count for these two.
    md = build(params, 5, prompts=[[4, 4, 4], [4]], outputs=[[1, 1, 1, 3], [0, 0]])
    out = apply_penalties(logits.clone(), md)
    assert out[0].tolist() == [0.0, -(0.5 * 3 + 1.5), 0.0, -(0.5 * 1 + 1.5), 0.0]
    assert out[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_all_penalties_together_match_reference() -> None:
    V = 40
    logits = torch.randn(3, V)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (10, 3, 0)]
    outputs = [torch.randint(0, V, (n,)).tolist() for n in (5, 12, 7)]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.7),
        SamplingParams(presence_penalty=0.9),
    ]
    got = apply_penalties(logits.clone(), build(params, V, prompts=prompts, outputs=outputs))
    want = logits.clone()
    for i, p in enumerate(params):
        for t in set(prompts[i]) | set(outputs[i]):
            x = want[i, t].item()
            want[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(outputs[i]):
            c = outputs[i].count(t)
            want[i, t] -= p.frequency_penalty * c + p.presence_penalty
    torch.testing.assert_close(got, want)


def test_penalties_apply_to_greedy_rows() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=1.0)], outputs=[[0]])
    assert out.tolist() == [1]


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.zeros(3, 6)
    params = [
        SamplingParams(logit_bias={1: 2.5, 4: -1.0, 99: 3.0}),  # 99 is outside the vocabulary: ignored
        SamplingParams(allowed_token_ids=[0, 5]),
        SamplingParams(allowed_token_ids=[3], logit_bias={3: 1.0, 2: 9.0}),
    ]
    out = apply_masks(logits.clone(), build(params, 6))
    inf = float("-inf")
    assert out[0].tolist() == [0.0, 2.5, 0.0, 0.0, -1.0, 0.0]
    assert out[1].tolist() == [0.0, inf, inf, inf, inf, 0.0]
    assert out[2].tolist() == [inf, inf, inf, 1.0, inf, inf]
    # Sampling honours them: row 1 draws only 0 or 5, row 2 only 3.
    many = sample(torch.randn(300, 6), params[1:2] * 300)
    assert set(many.tolist()) == {0, 5}
    assert sample(torch.randn(1, 6), params[2:3]).tolist() == [3]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, 8)
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5, 6]),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),  # already has 3 outputs: no mask
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[7]),  # EOS is an ordinary token
        SamplingParams(stop_token_ids=[5]),
    ]
    md = build(params, 8, outputs=[[1, 1], [1, 1, 1], [], []])
    out = apply_masks(logits.clone(), md)
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [EOS, 5, 6]
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[3]).all()
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [7]
    # Greedy would pick EOS; while min_tokens is not reached it picks the next best.
    peaked = torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0, 8.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[5])
    assert sample(peaked, [p]).tolist() == [1]
    assert sample(peaked, [p], outputs=[[3]]).tolist() == [EOS]


def test_logprobs_values_and_ranks() -> None:
    V = 64
    logits = torch.randn(4, V) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),  # no logprobs
        # A penalty makes greedy pick a token that is not the raw argmax: its raw rank is > 1.
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={int(logits[3].argmin()): 100.0}),
    ]
    out = Sampler()(logits.to(torch.bfloat16).float(), build(params, V))
    ref = logits.to(torch.bfloat16).float().log_softmax(-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        tok = int(out.token_ids[i])
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, ref[i, tok].item(), abs_tol=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        k = params[i].logprobs
        assert len(lp.top) == k
        if k:
            top_lp, top_ids = ref[i].topk(k)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            for (_, got), want in zip(lp.top, top_lp.tolist()):
                assert math.isclose(got, want, abs_tol=1e-5)
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1
    assert out.logprobs[3] is not None and out.logprobs[3].rank > V // 2


def test_logprob_rank_counts_only_strictly_greater() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(allowed_token_ids=[1], logprobs=0)]
    out = Sampler()(logits, build(params, 3))
    assert out.token_ids.tolist() == [0, 1]
    assert [lp.rank for lp in out.logprobs if lp is not None] == [1, 1]


def test_mixed_batch() -> None:
    V = 300
    logits = torch.randn(6, V) * 2
    gen = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=0.7, seed=11, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1e6),
        SamplingParams(temperature=1.0, allowed_token_ids=[10, 20], logprobs=1),
        SamplingParams(temperature=0.5, min_p=0.2, presence_penalty=2.0),
    ]
    outputs = [[], [], [], [int(logits[3].argmax())], [], [1, 2, 3]]
    gens: list[torch.Generator | None] = [None, None, gen, None, None, None]
    md = build(params, V, outputs=outputs, generators=gens)
    assert not md.all_greedy and not md.all_random and md.greedy_mask is not None
    out = Sampler()(logits, md)
    tok = out.token_ids.tolist()
    assert tok[0] == int(logits[0].argmax())
    assert tok[1] in logits[1].topk(3).indices.tolist()
    assert tok[3] == int(logits[3].topk(2).indices[1])  # the argmax was penalized away
    assert tok[4] in (10, 20)
    assert out.logprobs[4] is not None and len(out.logprobs[4].top) == 1
    assert [lp is None for lp in out.logprobs] == [True, True, True, True, False, True]
    # The seeded row alone gives the same token.
    alone = sample(logits[2:3], params[2:3], generators=[torch.Generator().manual_seed(11)])
    assert alone.tolist() == [tok[2]]


# Issue 22: top-k/top-p from a bounded topk instead of a sort of the whole vocabulary, and an inverse-CDF draw.


def reference_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, stable: bool = True
) -> torch.Tensor:
    """apply_top_k_top_p before issue 22: sort the whole row. With stable=False it is exactly the old code, whose
    unstable sort decided which of several equal logits at the cut stay; stable=True ranks them by token id."""
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=stable)
    if top_k is not None:
        kth = sorted_logits.gather(1, (V - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def logit_rows(V: int) -> torch.Tensor:
    """Rows of every shape the cut must handle: peaked, model-like, near-flat, exactly flat, heavy ties, -inf."""
    rows = [
        torch.randn(V) * 8,  # peaked: the nucleus is a handful of tokens
        torch.randn(V) * 3,
        torch.randn(V),
        torch.randn(V) * 0.05,  # near flat: the nucleus is most of the vocabulary
        torch.zeros(V),  # flat: every token ties
        torch.randint(0, 3, (V,)).float(),  # three values, thousands of ties each
        torch.randint(0, 40, (V,)).float() * 0.5,
    ]
    few = torch.full((V,), float("-inf"))
    few[torch.randperm(V)[:5]] = torch.randn(5)  # an allowed_token_ids row: 5 finite logits
    sparse = torch.full((V,), float("-inf"))
    sparse[torch.randperm(V)[: V // 3]] = torch.randn(V // 3) * 2
    one_top = torch.zeros(V)
    one_top[7] = 12.0  # one token holds almost everything, the rest tie
    return torch.stack([*rows, few, sparse, one_top])


def kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def check_against_full_sort(base: torch.Tensor, ks: list[int | None], ps: list[float | None]) -> None:
    B, V = base.shape
    for k in ks:
        for p in ps:
            top_k = torch.full((B,), k, dtype=torch.int64) if k is not None else None
            top_p = torch.full((B,), p) if p is not None else None
            got = apply_top_k_top_p(base.clone(), top_k, top_p, max_top_k=k if k is not None and k < V else 0)
            want = reference_top_k_top_p(base.clone(), top_k, top_p)
            if p == 1.0:
                # The sort drops tokens whose probability underflows to 0 when p is 1; nothing else differs.
                live = base.softmax(-1) > 0
                assert torch.equal(kept(got) & live, kept(want) & live), (k, p)
            else:
                assert_same_nucleus(base, top_k, p, kept(got), kept(want))
            assert torch.equal(got[kept(got)], base[kept(got)])  # kept logits are untouched


def assert_same_nucleus(
    base: torch.Tensor, top_k: torch.Tensor | None, p: float | None, got: torch.Tensor, want: torch.Tensor
) -> None:
    """Equal kept sets, except where a row's mass lies within float32 rounding of p: both sum float32
    probabilities, in different orders, so one token exactly at the cut may go either way."""
    for row in (got != want).any(-1).nonzero().flatten().tolist():
        assert p is not None, (row, "top_k alone must match exactly")
        small, large = sorted([got[row], want[row]], key=lambda m: int(m.sum()))
        assert int(large.sum()) - int(small.sum()) == 1 and not (small & ~large).any(), row
        after_k = reference_top_k_top_p(base[row : row + 1].clone(), None if top_k is None else top_k[:1], None)
        mass_above_cut = after_k.double().softmax(-1)[0][small].sum().item()
        assert abs(mass_above_cut - p) < 1e-6, (row, mass_above_cut, p)


@pytest.fixture(params=["kernel", "torch"])
def top_p_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Top-p alone runs the C++ threshold search where the kernels load, else PyTorch's candidates: test both."""
    from lmserve.worker import sampler

    if request.param == "kernel":
        assert sampler.top_p_mask_op() is not None, "the kernels must build on the test machines"
    else:
        monkeypatch.setattr(sampler, "top_p_mask_op", lambda: None)
    return request.param


@pytest.mark.parametrize("V", [50, 300, 3000])
def test_top_k_top_p_keeps_what_the_full_sort_keeps(V: int, top_p_path: str) -> None:
    ks = [None, 1, 2, 5, 40, 127, 128, 129, 500, 1023, 1024, 1025, V - 1, V]
    ps = [None, 1e-4, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0]
    check_against_full_sort(logit_rows(V), [k for k in ks if k is None or k <= V], ps)


def test_top_k_top_p_keeps_what_the_full_sort_keeps_over_the_real_vocabulary(top_p_path: str) -> None:
    check_against_full_sort(logit_rows(49152), [None, 1, 40, 128, 1025], [None, 0.5, 0.95, 1.0])


def test_top_k_top_p_per_row_settings_match_the_full_sort(top_p_path: str) -> None:
    V = 3000
    x = torch.cat([logit_rows(V)] * 4)
    B = x.shape[0]
    top_k = torch.tensor([[V, 1, 40, 129, 1500, 2999][i % 6] for i in range(B)])
    top_p = torch.tensor([[1.0, 0.3, 0.9, 0.95, 0.999][i % 5] for i in range(B)])
    got = apply_top_k_top_p(x.clone(), top_k, top_p, max_top_k=2999)
    want = reference_top_k_top_p(x.clone(), top_k, top_p)
    live = x.softmax(-1) > 0
    assert torch.equal(kept(got) & live, kept(want) & live)


def test_only_ties_at_the_cut_can_differ_from_the_unstable_sort(top_p_path: str) -> None:
    """The old code sorted unstably, so which of several equal logits at the top-p cut stayed was up to the sort.
    The new cut keeps as many, and the same tokens above the tied value."""
    V = 5000
    x = torch.randint(0, 6, (4, V)).float()
    for p in (0.3, 0.5, 0.9):
        top_p = torch.full((4,), p)
        got = apply_top_k_top_p(x.clone(), None, top_p)
        old = reference_top_k_top_p(x.clone(), None, top_p, stable=False)
        assert torch.equal(kept(got).sum(-1), kept(old).sum(-1))
        cut = torch.where(kept(got), x, float("inf")).amin(-1, keepdim=True)
        differ = kept(got) != kept(old)
        assert torch.equal(differ & (x != cut), torch.zeros_like(differ))


def test_top_p_sorts_only_rows_whose_nucleus_is_not_among_the_candidates(
    monkeypatch: pytest.MonkeyPatch, top_p_path: str
) -> None:
    """The C++ threshold search sorts no row at all; PyTorch's path only rows whose nucleus is not among its
    candidates."""
    from lmserve.worker import sampler

    sorted_rows: list[int] = []
    full_sort = sampler._sorted_top_k_top_p

    def counting(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(logits.shape[0])
        return full_sort(logits, top_k, top_p)

    monkeypatch.setattr(sampler, "_sorted_top_k_top_p", counting)
    V = 49152
    peaked = torch.randn(3, V) * 6
    wide = torch.randn(1, V) * 0.5  # the 0.95 nucleus is most of the vocabulary
    x = torch.cat([peaked, wide])
    apply_top_k_top_p(x.clone(), None, torch.full((4,), 0.95))
    assert sorted_rows == ([] if top_p_path == "kernel" else [1])
    sorted_rows.clear()
    apply_top_k_top_p(x.clone(), torch.full((4,), 40), torch.full((4,), 0.95), max_top_k=40)
    assert sorted_rows == []


def test_random_sample_frequencies() -> None:
    from lmserve.worker.sampler import random_sample

    V = 12
    probs = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.2, 0.001, 0.149, 0.1, 0.1, 0.05, 0.05, 0.0])
    n = 40000
    out = random_sample(probs.expand(n, V).clone() * 3.0, {})  # unnormalized is fine
    counts = torch.bincount(out, minlength=V).double()
    assert_matches(counts, probs.double() / probs.sum())
    # A seeded row draws from its generator only: alone or among others, the same stream of tokens.
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    alone = [int(random_sample(probs.unsqueeze(0).clone(), {0: gen_a})[0]) for _ in range(50)]
    batch = [int(random_sample(probs.expand(3, V).clone(), {1: gen_b})[1]) for _ in range(50)]
    assert alone == batch and len(set(alone)) > 3


@pytest.mark.parametrize(("V", "scale"), [(49152, 6.0), (49152, 4.0), (4096, 0.3)])
def test_top_p_samples_the_nucleus(V: int, scale: float) -> None:
    """Frequencies of the whole Sampler with top_p 0.9: a nucleus of ~60 tokens (first candidate set), of ~300
    (second) and of ~3400 (full sort), bucketed so that every bucket expects plenty of draws."""
    logits = torch.randn(V) * scale
    params = SamplingParams(temperature=1.0, top_p=0.9)
    out = torch.cat([draws(logits, params, 500) for _ in range(4)])
    want = reference_top_k_top_p(logits.clone().unsqueeze(0), None, torch.tensor([0.9]))[0].softmax(-1).double()
    # 20 buckets of about 1/20 of the nucleus's mass each, in descending probability.
    order = want.argsort(descending=True)
    bucket = torch.empty(V, dtype=torch.int64)
    bucket[order] = (want[order].cumsum(0) * 20).clamp(max=19.999).long()
    counts = torch.bincount(bucket[out], minlength=20).double()
    expected = torch.zeros(20, dtype=torch.float64).index_add_(0, bucket, want)
    assert set(out.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert_matches(counts, expected)


def test_seeded_top_p_row_is_independent_of_neighbours_that_need_the_full_sort() -> None:
    V = 4000
    target = torch.randn(1, V) * 4
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=9)
    gen_alone, gen_mixed = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    alone: list[int] = []
    mixed: list[int] = []
    for _ in range(20):
        alone.append(int(sample(target.clone(), [params], generators=[gen_alone])[0]))
        flat = torch.randn(2, V) * 0.05  # their nucleus is most of the vocabulary: the full-sort path
        x = torch.cat([flat[:1], target, flat[1:]])
        others = SamplingParams(temperature=1.0, top_p=0.95)
        mixed.append(int(sample(x, [others, params, others], generators=[None, gen_mixed, None])[1]))
    assert alone == mixed and len(set(alone)) > 1


def test_a_row_with_no_allowed_token_still_gets_a_token_inside_the_vocabulary() -> None:
    # allowed_token_ids and a grammar can leave a row no finite logit; a drawn id past the vocabulary would crash
    # the next step's embedding lookup.
    vocab = 64
    logits = torch.randn(3, vocab)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5)]
    md = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, [None] * 3, [[0]] * 3, vocab, torch.device("cpu"))
    md.grammar_bitmask, md.grammar_rows = torch.zeros((3, 2), dtype=torch.int32), [0, 1, 2]  # nothing allowed
    out = Sampler()(logits, md)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_top_p_on_logits_with_nan_stays_inside_the_vocabulary() -> None:
    """A model that overflowed can hand the sampler NaN logits: the top-p search must not write outside its
    buckets, and the draw still gives an id inside the vocabulary."""
    V = 4096
    logits = torch.randn(4, V)
    logits[0, 7] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2] = float("nan")
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(4)])
    assert ((out >= 0) & (out < V)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (12, 500), generator=gen).to(dtype)  # many ties: the first index must win
    x[1, 7] = x[1, 300] = float("nan")  # NaN is the maximum, the first one wins
    x[2] = float("-inf")  # a row with no finite value
    x[3, 5] = float("inf")
    x[4, :] = 0.0
    x[4, 499] = float("inf")
    for rows in (x, x[:, ::3], x[:0]):  # strided, and no rows
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    assert argmax_rows(x).dtype == torch.int64
