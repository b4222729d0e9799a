"""What a step's parts cost: the interpolated curves, and measuring them once per machine."""

import pytest
import torch

from ace_mw.engine.drafting.eagle3_head import Eagle3Head
from ace_mw.engine.drafting.eagle_head import EagleHead
from ace_mw.engine.model.transformer import ModelConfig, Transformer
from ace_mw.engine.planning import cost
from ace_mw.engine.planning.cost import CostCurve, EngineCosts

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def test_cost_interpolates_between_measured_sizes():
    curve = CostCurve({1: 10.0, 4: 16.0})
    assert (curve(1), curve(2), curve(4)) == (10.0, 12.0, 16.0)


def test_cost_beyond_the_table_grows_linearly():
    assert CostCurve({1: 1.0, 64: 32.0})(128) == 64.0


def tiny_parts():
    target, draft = Transformer(TINY), Transformer(TINY)
    target.setup_cache(256)
    draft.setup_cache(256)
    return target, EagleHead.for_target(TINY), draft


def test_every_loaded_part_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, head, draft = tiny_parts()
    costs = EngineCosts.load_or_measure(target, head, draft)
    assert costs.verify.sizes == list(cost.SIZES)
    curves = (costs.draft_model, costs.head_level, costs.head_commit)
    assert all(curve.sizes == list(cost.DRAFT_SIZES) for curve in curves)
    assert all(ms > 0 for curve in (costs.verify, *curves) for ms in curve.ms)
    plain = EngineCosts.load_or_measure(target)
    assert plain.draft_model is None and plain.head_level is None and plain.head_commit is None


def test_measured_costs_are_cached_on_disk_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, head, draft = tiny_parts()
    first = EngineCosts.load_or_measure(target, head, draft)
    assert len(list(tmp_path.glob("costs-*.json"))) == 1
    monkeypatch.setattr(EngineCosts, "measure", classmethod(lambda cls, *a: pytest.fail("measured twice")))
    again = EngineCosts.load_or_measure(target, head, draft)
    assert again.to_json() == first.to_json()


def test_measuring_says_what_it_does_round_by_round_and_a_cached_start_says_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, _, _ = tiny_parts()
    with caplog.at_level("INFO", logger=cost.__name__):
        EngineCosts.load_or_measure(target)
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("measuring this machine's step costs once (cached in " + str(tmp_path))
    assert [m for m in said if m.startswith("measuring step costs: round ")][-1].startswith(
        "measuring step costs: round 16 of 16"
    )
    assert said[-1].startswith("step costs measured in ")
    caplog.clear()
    with caplog.at_level("INFO", logger=cost.__name__):
        EngineCosts.load_or_measure(target)
    assert caplog.records == []


def test_a_different_set_of_drafters_is_measured_afresh(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, head, draft = tiny_parts()
    EngineCosts.load_or_measure(target, head, draft)
    EngineCosts.load_or_measure(target, None, draft)
    assert len(list(tmp_path.glob("costs-*.json"))) == 2


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, _, _ = tiny_parts()
    EngineCosts.load_or_measure(target)
    (path,) = tmp_path.glob("costs-*.json")
    path.write_text('{"verify": "garbage", "lookup": {"1": 0.1}}')
    assert EngineCosts.load_or_measure(target).verify.sizes == list(cost.SIZES)


def test_an_eagle3_head_is_measured_on_its_own_curves_against_the_same_verify_curve(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    target, head, _ = tiny_parts()
    config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    head3 = Eagle3Head.for_target(config, torch.arange(0, 64, 4), taps=(0, 1, 1))  # fc reads 3 x 32 features
    first, third = EngineCosts.load_or_measure(target, head), EngineCosts.load_or_measure(target, head3)
    assert len(list(tmp_path.glob("costs-*.json"))) == 2  # the heads are told apart in the cache
    both = first.with_head(third)
    assert both.verify is first.verify
    assert (both.head_level, both.head_commit) == (third.head_level, third.head_commit)
    assert both.head_level is not None and all(ms > 0 for ms in both.head_level.ms)
