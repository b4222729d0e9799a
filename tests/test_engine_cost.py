"""The verify-cost curve and the budget it picks."""

import pytest

from ace_mw.engine import cost
from ace_mw.engine.cost import CostCurve, tree_expected_accepted
from ace_mw.engine.engine import _ChainTuner
from ace_mw.engine.model import ModelConfig, Transformer

# Measured ms per forward of q tokens: the fixture on the 2-core CPU (2 threads, then 1 thread) and
# an 8B-shaped model on an H200 in bf16 (q=4 smoothed), 2026-11-29.
CPU_LIKE = CostCurve({1: 6.6, 2: 5.7, 4: 7.2, 8: 24.2, 16: 18.0, 32: 24.3, 64: 27.2})
THIS_CPU = CostCurve({1: 4.26, 2: 6.89, 4: 8.52, 8: 10.2, 16: 13.61, 32: 20.49, 64: 34.31})
GPU_LIKE = CostCurve({1: 21.9, 2: 24.4, 4: 25.0, 8: 25.7, 16: 24.6, 32: 32.6, 64: 34.1})


def test_cost_interpolates_between_measured_sizes():
    curve = CostCurve({1: 10.0, 4: 16.0})
    assert (curve(1), curve(2), curve(4)) == (10.0, 12.0, 16.0)


def test_cost_beyond_the_table_grows_linearly():
    assert CostCurve({1: 1.0, 64: 32.0})(128) == 64.0


def test_a_confident_drafter_spends_a_small_budget_on_a_chain():
    assert tree_expected_accepted(0.9, 3) == pytest.approx(0.9 + 0.81 + 0.729)


def test_an_unsure_drafter_spends_it_on_siblings():
    # 0.5 (top guess), then its child and the second guess tie at 0.25 each.
    assert tree_expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.25)


def test_more_tree_nodes_never_expect_fewer_accepted_tokens():
    values = [tree_expected_accepted(0.6, b) for b in range(1, 40)]
    assert values == sorted(values)


def test_a_flat_gpu_curve_affords_a_larger_tree_than_a_steep_cpu_curve():
    expect = lambda b: tree_expected_accepted(0.6, b)  # noqa: E731
    assert CPU_LIKE.best_budget(expect) < GPU_LIKE.best_budget(expect)


def test_measured_curve_is_cached_on_disk_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    model = Transformer(
        ModelConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    model.setup_cache(256)
    first = CostCurve.load_or_measure(model)
    assert len(list(tmp_path.glob("cost-*.json"))) == 1 and first.sizes == list(cost.SIZES)
    monkeypatch.setattr(CostCurve, "measure", classmethod(lambda cls, m: pytest.fail("measured twice")))
    assert CostCurve.load_or_measure(model).ms == first.ms


def test_rarely_accepted_chains_are_not_worth_verifying_on_a_steep_curve():
    assert THIS_CPU.best_chain_length(0.2, 10) == 0


def test_a_flat_curve_verifies_the_whole_chain():
    assert GPU_LIKE.best_chain_length(0.5, 10) == 10


def test_chain_tuner_counts_agreement_up_to_the_first_difference():
    tuner = _ChainTuner(THIS_CPU, agreed=0.0, missed=0.0)
    tuner.observe([1, 2, 3, 4], [1, 2, 9])  # two accepted, then a different bonus token
    tuner.observe([5, 6], [5])  # a plain step whose token the unverified lookup had right
    assert (tuner.agreed, tuner.missed) == (3, 1)


def test_chain_tuner_verifies_more_once_lookups_keep_agreeing():
    tuner = _ChainTuner(THIS_CPU)
    before = tuner.length(10)
    for _ in range(10):
        tuner.observe(list(range(10)), list(range(10)) + [99])
    assert tuner.length(10) > before
