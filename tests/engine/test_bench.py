"""The benchmark's prompt split and table rendering (the timing itself is exercised by running it)."""

from __future__ import annotations

import json

import pytest

from ace_mw.engine.bench.methods import Method, Run
from ace_mw.engine.bench.run import gate_verdict, greedy_verdict, main, markdown_table, summarize
from ace_mw.engine.prompts import CATEGORIES, categorize, load_prompts


@pytest.mark.parametrize(
    "text, category",
    [
        ("Write a Python function that sorts a list", "code"),
        ("Solve for x: 3x + 1 = 10", "math"),
        ("Summarize this article in two sentences", "summarization"),
        ("What should I see in Paris?", "chat"),
    ],
)
def test_categorize_sorts_prompts_by_keywords(text, category):
    assert categorize(text) == category


def test_load_prompts_gives_every_category_the_same_number_of_distinct_prompts():
    prompts = load_prompts(5)
    assert set(prompts) == set(CATEGORIES)
    assert all(len(set(texts)) == 5 for texts in prompts.values())


def test_load_prompts_skips_prompts_that_do_not_fit():
    prompts = load_prompts(3, fits=lambda text: len(text) < 200)
    assert all(len(text) < 200 for texts in prompts.values() for text in texts)


def test_load_prompts_refuses_more_prompts_than_a_category_has():
    with pytest.raises(ValueError, match="usable"):
        load_prompts(3, fits=lambda text: False)


def method(name: str, tpot_s: float, tokens: list[int], drafted=None, accepted=None, steps=3) -> Method:
    m = Method(name, decode=lambda *a: None)
    m.runs = [Run("code", tokens, 0.01, tpot_s, steps, drafted, accepted)]
    return m


def test_summary_speedups_and_greedy_check_are_relative_to_baseline_and_hf_generate():
    rows = summarize(
        [
            method("baseline", 0.010, [1, 2, 3, 4]),
            method("hf generate", 0.020, [1, 2, 3, 4]),
            method("eagle_2", 0.005, [1, 2, 3, 9], drafted=8, accepted=2, steps=1),
        ],
        0.0,
        None,
    )
    eagle = rows[2]
    assert eagle["speedup_vs_baseline"] == pytest.approx(2.0)
    assert eagle["speedup_vs_hf_generate"] == pytest.approx(4.0)
    assert eagle["acceptance_rate"] == pytest.approx(0.25)
    assert eagle["accepted_per_step"] == pytest.approx(3.0)
    assert (rows[1]["greedy_equal_baseline"], eagle["greedy_equal_baseline"]) == ("1/1", "0/1")


def test_markdown_table_shows_missing_figures_as_na():
    rows = summarize([method("baseline", 0.01, [1, 2], steps=1)], 0.7, None)
    assert (
        markdown_table(rows).splitlines()[-1]
        == "| baseline | n/a | 1.00 | 10.00 | 1.00x | 1.00x | n/a | n/a | 0.0 | n/a |"
    )


def runs(name: str, tpots: list[float], plain_steps=None) -> Method:
    m = Method(name, decode=lambda *a: None)
    m.runs = [Run("code", [1, 2, 3, 4], 0.01, t, 3, plain_steps=plain_steps) for t in tpots]
    return m


def test_min_ratio_is_the_worst_prompt_against_baseline_on_that_same_prompt():
    rows = summarize(
        [
            runs("baseline", [0.010, 0.020, 0.010]),
            runs("eagle_2 self-gated", [0.005, 0.021, 0.0104], plain_steps=3),
        ],
        0.0,
        None,
    )
    gated = rows[1]
    assert gated["min_ratio_vs_baseline"] == pytest.approx(0.020 / 0.021)
    assert gated["speedup_vs_baseline"] == pytest.approx(0.010 / 0.0104)  # medians
    assert gated["plain_step_fraction"] == 1.0


def test_gate_verdict_names_self_gated_methods_below_the_floor():
    slow = [runs("baseline", [0.010, 0.010]), runs("ngram self-gated", [0.010, 0.0110]), runs("eagle", [0.02, 0.02])]
    assert gate_verdict(summarize(slow, 0.0, None)) == (
        "Self-gate check: below 0.95x of baseline on some prompt: ngram self-gated (0.91x)."
    )
    fine = [runs("baseline", [0.010, 0.010]), runs("ngram self-gated", [0.010, 0.0102]), runs("eagle", [0.02, 0.02])]
    assert gate_verdict(summarize(fine, 0.0, None)).startswith("Self-gate check: every self-gated method")


def test_greedy_verdict_names_the_methods_that_differ_from_baseline():
    rows = summarize(
        [method("baseline", 0.01, [1, 2]), method("ngram", 0.01, [1, 2]), method("eagle", 0.01, [1, 3])], 0.0, None
    )
    assert greedy_verdict(rows) == "Greedy check: outputs differ from baseline for eagle (0/1)."


@pytest.mark.slow
def test_bench_cli_writes_json_markdown_and_chart(tmp_path):
    main(
        [
            "--prompts-per-category",
            "1",
            "--max-new-tokens",
            "4",
            "--algorithms",
            "baseline",
            "ngram",
            "--eagle",
            "",
            "--out",
            str(tmp_path),
        ]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["algorithm"] for row in results["tables"]["overall"]] == [
        "baseline",
        "ngram",
        "ngram self-gated",
        "hf generate",
        "hf assisted (draft)",
        "hf prompt lookup",
    ]
    assert (tmp_path / "results.md").read_text().startswith("# Engine benchmark")
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
