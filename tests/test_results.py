"""The results layer (workbench.results) against hand-computed values, and one KL on every surface."""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import pytest
import torch

from workbench import results
from workbench.errors import WorkbenchError
from workbench.hooks import Trace
from workbench.mcp_server import schemas


class Vocab:
    """A tokenizer stand-in: token i reads 't{i}'."""

    def token_text(self, i: int) -> str:
        return f"t{i}"


def direct_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) term by term in float64 Python floats, summed exactly (math.fsum)."""
    p_row, q_row = p_logits.double().tolist(), q_logits.double().tolist()
    p_max, q_max = max(p_row), max(q_row)
    p_norm = p_max + math.log(math.fsum(math.exp(x - p_max) for x in p_row))
    q_norm = q_max + math.log(math.fsum(math.exp(x - q_max) for x in q_row))
    return math.fsum(math.exp(x - p_norm) * ((x - p_norm) - (y - q_norm)) for x, y in zip(p_row, q_row))


def clamped_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """The dashboard's former KL: float32 probabilities clamped at 1e-12 before the log."""
    p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
    return float((p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum())


def logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def peaked_pair(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) of one row where q gives p's favourite token a probability far below 1e-12: clamping probabilities
    misses that."""
    q = base.clone()
    q[int(base.argmax())] -= 60.0
    return base, q


# ------------------------------------------------------------------------------------------------ distributions


def test_log_probs_probs_and_entropy_against_float64_sums():
    x = logits(3, 500)
    lp = results.log_probs(x)
    assert lp.dtype == torch.float64 and lp.shape == (3, 500)
    for row, out in zip(x, lp):
        values = row.double().tolist()
        norm = max(values) + math.log(math.fsum(math.exp(v - max(values)) for v in values))
        assert out.tolist() == pytest.approx([v - norm for v in values], abs=1e-12)
    torch.testing.assert_close(results.probs(x).sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-12, rtol=0)
    expected = [-math.fsum(math.exp(v) * v for v in row.tolist()) for row in lp]
    assert results.entropy(x).tolist() == pytest.approx(expected, abs=1e-12)
    assert float(results.entropy(torch.tensor([0.0, float("-inf")]))) == 0.0  # a zero probability adds nothing
    assert float(results.entropy(torch.zeros(8))) == pytest.approx(math.log(8), abs=1e-15)


def test_kl_against_a_direct_float64_sum():
    p, q = logits(400, seed=1), logits(400, seed=2)
    assert float(results.kl_divergence(p, q)) == pytest.approx(direct_kl(p, q), rel=1e-12)
    assert float(results.kl_divergence(p, p)) == 0.0
    shifted = q.double() + 7.0  # exact in float64: the same distribution
    assert float(results.kl_divergence(p, shifted)) == pytest.approx(direct_kl(p, q), rel=1e-12)

    # q gives p's favourite about e^-60: the KL is large; clamping probabilities at 1e-12 understated it.
    p, q = peaked_pair(logits(400, seed=3))
    kl = float(results.kl_divergence(p, q))
    assert kl == pytest.approx(direct_kl(p, q), rel=1e-12)
    assert kl - clamped_kl(p, q) > 1.0

    rows_p, rows_q = logits(5, 300, seed=4), logits(5, 300, seed=5)
    per_row = results.kl_divergence(rows_p, rows_q)
    assert per_row.shape == (5,) and per_row.dtype == torch.float64
    assert per_row.tolist() == pytest.approx([direct_kl(a, b) for a, b in zip(rows_p, rows_q)], rel=1e-12)


def test_kl_edge_cases(monkeypatch):
    inf, nan = float("inf"), float("nan")
    p = torch.tensor([1.0, 2.0, -inf, 0.5])
    q = torch.tensor([1.5, 0.0, 3.0, -1.0])
    # p gives token 2 no probability: it adds 0 (not NaN), however likely q finds it (the next test has the value).
    finite = float(results.kl_divergence(p, q))
    assert math.isfinite(finite) and finite > 0
    assert float(results.kl_divergence(q, p)) == inf  # q likes a token p rules out
    assert math.isnan(float(results.kl_divergence(torch.tensor([0.0, nan]), q[:2])))
    with pytest.raises(WorkbenchError, match="one shape"):
        results.kl_divergence(torch.zeros(3), torch.zeros(4))
    rows_p, rows_q = logits(7, 50, seed=6), logits(7, 50, seed=7)
    whole = results.kl_divergence(rows_p, rows_q)
    monkeypatch.setattr(results, "_CHUNK_VALUES", 120)  # two rows at a time
    torch.testing.assert_close(results.kl_divergence(rows_p, rows_q), whole, atol=0, rtol=0)
    assert results.kl_divergence(rows_p.reshape(7, 1, 50), rows_q.reshape(7, 1, 50)).shape == (7, 1)


def test_kl_over_the_row_that_p_leaves_at_zero_is_the_sum_without_it():
    p = torch.tensor([1.0, 2.0, float("-inf"), 0.5])
    q = torch.tensor([1.5, 0.0, 3.0, -1.0])
    lq = q.double().log_softmax(-1)
    lp = p.double().log_softmax(-1)
    expected = math.fsum(math.exp(lp[i]) * (lp[i] - lq[i]) for i in (0, 1, 3))
    assert float(results.kl_divergence(p, q)) == pytest.approx(expected, rel=1e-12)


def test_top_k_matches_torch_topk():
    x = logits(2, 1000, seed=8)
    for k in (1, 5, 37):
        top = results.top_k(x[0], k, Vocab())
        expected = torch.topk(x[0], k)
        assert [t.id for t in top] == expected.indices.tolist()
        lp = x[0].double().log_softmax(-1)
        assert [t.logprob for t in top] == pytest.approx(lp[expected.indices].tolist(), abs=1e-12)
        assert [t.prob for t in top] == pytest.approx(lp[expected.indices].exp().tolist(), rel=1e-12)
        assert [t.token for t in top] == [f"t{i}" for i in expected.indices.tolist()]
    # [positions, vocab]: the last row; a model (anything with .tokenizer) names tokens too; no vocab: empty names.
    model_like = type("M", (), {"tokenizer": Vocab()})()
    assert results.top_k(x, 3, model_like) == results.top_k(x[-1], 3, Vocab())
    assert [t.token for t in results.top_k(x[0], 2)] == ["", ""]
    assert results.top_k(x[0], 0) == []
    with pytest.raises(WorkbenchError, match="between 0 and"):
        results.top_k(x[0], 1001)
    with pytest.raises(WorkbenchError, match="expected logits"):
        results.top_k(torch.zeros(2, 2, 2), 1)

    dist = results.next_token(x, 4, Vocab())
    assert dist.top == results.top_k(x[-1], 4, Vocab())
    assert dist.entropy == pytest.approx(float(results.entropy(x[-1])), abs=0)
    assert json.loads(json.dumps(dist.to_dict())) == {
        "top": [{"id": t.id, "token": t.token, "logprob": t.logprob, "prob": t.prob} for t in dist.top],
        "entropy": dist.entropy}


# ------------------------------------------------------------------------------------------------- comparisons


def test_compare_next_token_by_hand():
    log = math.log
    # Probabilities chosen by hand (logits are their logs): baseline favours 0, the edit moves mass to 3.
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    q = [0.1, 0.2, 0.15, 0.5, 0.05]
    cmp = results.compare_next_token(torch.tensor([log(v) for v in p]), torch.tensor([log(v) for v in q]), Vocab(),
                                     k=2, targets=[4, 1])
    assert [t.id for t in cmp.baseline.top] == [0, 1] and [t.id for t in cmp.edited.top] == [3, 1]
    assert cmp.baseline.top[0].prob == pytest.approx(0.5, abs=1e-7)
    assert cmp.kl == pytest.approx(math.fsum(a * log(a / b) for a, b in zip(p, q)), abs=1e-7)
    assert cmp.top1_changed
    # Tokens of either top-2 (0, 1, 3), largest |delta| first, at most 2: 0 and 3 moved by log 5, 1 not at all.
    assert [c.id for c in cmp.changes] == [0, 3]
    assert cmp.changes[0].delta == pytest.approx(log(0.1 / 0.5), abs=1e-6)
    assert cmp.changes[1].delta == pytest.approx(log(0.5 / 0.1), abs=1e-6)
    assert [c.id for c in cmp.targets] == [4, 1] and [c.delta for c in cmp.targets] == pytest.approx([0, 0], abs=1e-6)
    top1 = cmp.baseline_top1
    assert (top1.id, top1.token) == (0, "t0")
    assert (top1.baseline_prob, top1.edited_prob, top1.prob_delta) == pytest.approx((0.5, 0.1, -0.4), abs=1e-7)
    data = json.loads(json.dumps(cmp.to_dict()))
    assert data["kl"] == cmp.kl and data["changes"][0]["id"] == 0 and data["baseline_top1"]["edited_logprob"] < 0


def trace(ids, logits_, **activations) -> Trace:
    return Trace(prompt="x", ids=list(ids), tokens=[str(i) for i in ids], logits=logits_, activations=activations)


def test_compare_traces_by_hand():
    a_logits = logits(4, 60, seed=9)
    b_logits = a_logits.clone()
    b_logits[1, int(a_logits[1].argmax())] -= 20.0  # position 1's favourite falls
    b_logits[3] += 0.25 * logits(60, seed=10)
    resid = torch.ones(4, 3)
    other = resid.clone()
    other[2, 0] = 3.0
    pattern = torch.tensor([[[1.0, float("-inf")], [0.5, 0.5]]])
    a = trace([1, 2, 3, 4], a_logits, **{"blocks.0.hook_resid_post": resid, "blocks.0.attn.hook_attn_scores": pattern,
                                          "only_a": resid})
    b = trace([1, 2, 3, 4], b_logits, **{"blocks.0.hook_resid_post": other, "blocks.0.attn.hook_attn_scores": pattern})
    cmp = results.compare_traces(a, b, Vocab())
    assert cmp.same_tokens
    assert cmp.kl == pytest.approx(direct_kl(a_logits[3], b_logits[3]), rel=1e-12)
    assert cmp.kl_per_position == pytest.approx([direct_kl(x, y) for x, y in zip(a_logits, b_logits)], rel=1e-12,
                                                abs=1e-15)
    assert cmp.kl_per_position[0] == 0.0 and cmp.kl_per_position[2] == 0.0
    expected_changes = [p for p in range(4) if int(a_logits[p].argmax()) != int(b_logits[p].argmax())]
    assert cmp.top1_changes == expected_changes and 1 in expected_changes
    assert cmp.top1_a == results.top_k(a_logits[3], 1, Vocab())[0]
    assert cmp.top1_b == results.top_k(b_logits[3], 1, Vocab())[0]
    assert cmp.max_abs_logit_diff == pytest.approx(20.0, abs=1e-5)
    # Hooks both recorded, sorted; the -inf attention score is left out of the difference.
    assert [d.hook for d in cmp.activations] == ["blocks.0.attn.hook_attn_scores", "blocks.0.hook_resid_post"]
    assert cmp.activations[0] == results.HookDiff("blocks.0.attn.hook_attn_scores", 0.0, 0.0)
    resid_diff = cmp.activations[1]
    assert resid_diff.max_abs_diff == 2.0 and resid_diff.relative_diff == pytest.approx(2.0 / math.sqrt(12))
    assert (cmp.max_abs_deviation, cmp.worst_tensor) == (pytest.approx(20.0, abs=1e-5), "logits")
    assert a.compare(b, Vocab()) == cmp

    skipped = results.compare_traces(a, b, Vocab(), per_position=False)
    assert skipped.kl_per_position is None and skipped.top1_changes is None and skipped.kl == cmp.kl

    c = trace([1, 2, 9], b_logits[1:], **{"blocks.0.hook_resid_post": torch.zeros(3, 3)})
    different = results.compare_traces(a, c)
    assert not different.same_tokens and different.kl_per_position is None
    assert different.max_abs_logit_diff == pytest.approx(float((a_logits[-1] - b_logits[-1]).abs().max()))
    assert different.activations == []  # shapes differ: not compared
    with pytest.raises(WorkbenchError, match="vocabularies differ"):
        results.compare_traces(a, trace([1], logits(1, 61)))
    json.dumps(cmp.to_dict())


def test_a_token_both_traces_ban_is_no_difference_and_an_activation_from_zero_is_an_infinite_change():
    """-inf logits in both traces differ by 0 (not NaN, which hid every activation's difference), -inf in one alone
    by inf; a change from an all-zero activation is infinitely large relative to it, not 0."""
    banned = logits(3, 40, seed=2)
    banned[:, 7] = float("-inf")
    edited = banned.clone()
    edited[2, 3] += 1.5
    a = trace([1, 2, 3], banned, **{"blocks.0.hook_mlp_out": torch.zeros(3, 4)})
    b = trace([1, 2, 3], edited, **{"blocks.0.hook_mlp_out": torch.full((3, 4), 2.0)})
    same = results.compare_traces(a, trace([1, 2, 3], banned.clone(), **{"blocks.0.hook_mlp_out": torch.zeros(3, 4)}))
    assert (same.max_abs_logit_diff, same.max_abs_deviation) == (0.0, 0.0)
    cmp = results.compare_traces(a, b)
    assert cmp.max_abs_logit_diff == pytest.approx(1.5) and (cmp.max_abs_deviation, cmp.worst_tensor) == (
        2.0, "blocks.0.hook_mlp_out")
    assert cmp.activations[0].relative_diff == math.inf
    unbanned = edited.clone()
    unbanned[0, 7] = 0.0
    assert results.compare_traces(a, trace([1, 2, 3], unbanned)).max_abs_logit_diff == math.inf


def test_bad_targets_k_and_logits_are_refused_in_one_line():
    a, b = logits(50, seed=1), logits(50, seed=2)
    for targets, message in (([-1], "target token id -1 is outside the vocabulary"), ([50], "id 50 is outside"),
                             ([3.7], "a target token id must be an integer"), ([True], "must be an integer")):
        with pytest.raises(WorkbenchError, match=message):
            results.compare_next_token(a, b, k=3, targets=targets)
    for k in (None, 2.0, True):
        with pytest.raises(WorkbenchError, match="top_k must be an integer"):
            results.top_k(a, k)
    with pytest.raises(WorkbenchError, match="no positions"):
        results.next_token(torch.zeros(0, 50), 3)


def test_compare_traces_of_integer_and_half_precision_activations():
    """An MoE's chosen experts (int64) and activations recorded in float16 compare as float32 numbers: no crash on the
    integers, and no float16 norm overflowing to inf (which made every relative difference 0)."""
    experts = torch.tensor([[0, 1], [2, 3]])
    rerouted = torch.tensor([[0, 1], [2, 0]])
    big = torch.full((100, 64), 1000.0, dtype=torch.float16)  # norm 80000, past float16's largest 65504
    edited = big.clone()
    edited[0, 0] = 900.0
    a = trace([1, 2], logits(2, 60, seed=3), **{"blocks.0.mlp.hook_expert_indices": experts,
                                                 "blocks.0.hook_resid_post": big})
    b = trace([1, 2], logits(2, 60, seed=3), **{"blocks.0.mlp.hook_expert_indices": rerouted,
                                                 "blocks.0.hook_resid_post": edited})
    by_hook = {d.hook: d for d in results.compare_traces(a, b).activations}
    chosen = by_hook["blocks.0.mlp.hook_expert_indices"]
    assert chosen.max_abs_diff == 3.0 and chosen.relative_diff == pytest.approx(3 / math.sqrt(14))
    resid = by_hook["blocks.0.hook_resid_post"]
    assert resid.max_abs_diff == 100.0 and resid.relative_diff == pytest.approx(100 / 80000)


def test_trace_methods_use_the_results_layer():
    t = trace([1, 2], logits(2, 80, seed=11))
    expected = torch.topk(t.logits[0].softmax(-1), 5)
    top = t.top_tokens(position=0, k=5)
    assert [i for i, _ in top] == expected.indices.tolist()
    assert [p for _, p in top] == pytest.approx(expected.values.tolist(), rel=1e-6)
    assert t.next_token(3, Vocab()) == results.next_token(t.logits[-1], 3, Vocab())
    assert t.next_token(3, Vocab(), position=0).top[0].id == expected.indices[0]


def test_relative_change_and_activation_summaries():
    base = trace([1, 2], logits(2, 5), **{"blocks.0.hook_resid_post": torch.tensor([[3.0, 4.0], [1.0, 0.0]])})
    other = trace([1, 2], logits(2, 5), **{"blocks.0.hook_resid_post": torch.tensor([[3.0, 4.0], [1.0, 1.0]])})
    change = results.relative_change(base, other, ["blocks.0.hook_resid_post"])
    assert change.tolist() == [[0.0, 1.0]]
    with pytest.raises(WorkbenchError, match="must record"):
        results.relative_change(base, other, ["blocks.1.hook_resid_post"])
    with pytest.raises(WorkbenchError, match="different prompts"):
        results.relative_change(base, trace([1, 3], logits(2, 5), **other.activations), ["blocks.0.hook_resid_post"])
    q = torch.ones(2, 3, 4)  # [T, heads, d_head]: each position's change over all its heads' values
    edited_q = q.clone()
    edited_q[1, 0] = 2.0
    both = results.relative_change(trace([1, 2], logits(2, 5), **base.activations, **{"blocks.0.attn.hook_q": q}),
                                   trace([1, 2], logits(2, 5), **other.activations,
                                         **{"blocks.0.attn.hook_q": edited_q}),
                                   ["blocks.0.hook_resid_post", "blocks.0.attn.hook_q"])
    assert both.tolist() == [[0.0, 1.0], [0.0, pytest.approx(2 / math.sqrt(12))]]
    pattern = {"blocks.0.attn.hook_pattern": torch.ones(1, 2, 2)}
    with pytest.raises(WorkbenchError, match="not token-major"):
        results.relative_change(trace([1, 2], logits(2, 5), **pattern), trace([1, 2], logits(2, 5), **pattern),
                                ["blocks.0.attn.hook_pattern"])

    scores = torch.tensor([[[1.0, float("-inf")], [2.0, 2.0]], [[0.0, float("-inf")], [-5.0, 1.0]]])  # [heads, T, S]
    summary = results.summarize_activation("blocks.0.attn.hook_attn_scores", scores)
    assert summary.shape == [2, 2, 2] and summary.max_abs == 5.0
    # Token axis 1: position 0 holds 1 and 0 (the -inf counts 0), position 1 holds 2, 2, -5, 1.
    assert summary.position_norms == pytest.approx([1.0, math.sqrt(34)])
    assert summary.norm == pytest.approx(math.sqrt(35))
    brief = results.summarize_activation("blocks.0.attn.hook_attn_scores", scores, per_position=False)
    assert brief.position_norms == [] and brief.norm == summary.norm
    assert [s.hook for s in results.summarize_activations(base)] == ["blocks.0.hook_resid_post"]


# ---------------------------------------------------------------------------------------------- MCP schemas


def test_mcp_schemas_are_derived_from_the_result_types():
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert list(schemas.Distribution.model_fields) == names(results.Distribution)
    assert list(schemas.TokenProb.model_fields) == names(results.TokenProb)
    assert list(schemas.EditResult.model_fields) == ["trace_id", "baseline_trace_id", "interventions",
                                                     *[n for n in names(results.NextTokenComparison)
                                                       if n != "baseline_top1"]]
    assert list(schemas.Comparison.model_fields) == ["a", "b", "same_tokens", "top1_a", "top1_b", "kl",
                                                     "max_abs_logit_diff", "activations"]
    assert schemas.EditResult.model_fields["kl"].description.startswith("KL(baseline || edited)")
    assert schemas.Distribution.model_fields["top"].annotation == list[schemas.TokenProb]
    assert "size limit" in schemas.ActivationSummary.model_fields["position_norms"].description
    cmp = results.compare_next_token(logits(30, seed=12), logits(30, seed=13), Vocab(), k=3, targets=[7])
    out = schemas.EditResult(trace_id="t", baseline_trace_id="u", interventions=[], **cmp.to_dict())
    expected = {k: v for k, v in cmp.to_dict().items() if k != "baseline_top1"}
    assert out.model_dump(exclude={"trace_id", "baseline_trace_id", "interventions"}) == expected


# ------------------------------------------------------------------------------------ one KL on every surface


def test_the_app_and_the_mcp_server_give_one_kl_for_one_pair(model, tmp_path):
    """The same two traces compared on the dashboard's Artifacts page and by the MCP compare_traces tool."""
    streamlit_testing = pytest.importorskip("streamlit.testing.v1")
    from workbench.app import common
    from workbench.mcp_server import Workbench
    from workbench.mcp_server.tools import Call

    a = model.run(common.DEFAULT_PROMPT, record=["blocks.*.hook_resid_post"])
    edited = a.logits.clone()
    edited[-1, int(a.logits[-1].argmax())] -= 60.0  # the favourite drops below 1e-12: clamping would matter
    b = dataclasses.replace(a, logits=edited)

    bench = Workbench(model, tmp_path)
    with bench.sessions.using("kl") as session:
        call = Call(session, threading.Event())
        a_id, b_id = session.put("trace", a), session.put("trace", b)
        mcp_kl = bench.compare_traces(call, a=a_id, b=b_id).kl
    assert mcp_kl == common.next_token_comparison(model, a.logits[-1], b.logits[-1]).kl
    assert mcp_kl == pytest.approx(direct_kl(a.logits[-1], b.logits[-1]), rel=1e-12)
    assert mcp_kl - clamped_kl(a.logits[-1], b.logits[-1]) > 0.1  # what the page showed before

    main = str(Path(common.__file__).with_name("main.py"))
    at = streamlit_testing.AppTest.from_file(main, default_timeout=240)
    at.session_state["traces"] = {"A": a, "B": b}
    at.session_state["ar_compare_a"], at.session_state["ar_compare_b"] = "A", "B"
    at.run()
    at.switch_page("page_artifacts.py").run()
    assert not at.exception, [e.message for e in at.exception]
    shown = next(m.value for m in at.metric if m.label.startswith("KL(A"))
    assert shown == f"{mcp_kl:.3f} nats"
