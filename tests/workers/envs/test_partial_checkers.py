"""Config-only partial-credit checkers (lcs_ratio, edit_distance, numeric, json_field, regex
with several patterns, weighted), each against values computed by hand, and their params
refused at registration with a message naming the param."""

from __future__ import annotations

from typing import Any

import pytest

from workers.envs import load_environment
from workers.envs.spec import EnvSpecError, parse_environment_spec


def _env(checker: str, answer: str | None, params: dict[str, Any] | None = None,
         extra: list[dict[str, Any]] | None = None):
    components = [{"name": "c", "checker": checker, "params": params or {}}, *(extra or [])]
    return load_environment({"source": "tasks",
                             "tasks": [{"id": "t", "prompt": "p", "answer": answer}],
                             "rubric": {"components": components}})


def _scores(env, completions: list[str]) -> list[float]:
    return [s.total for s in env.score(env.tasks * len(completions), completions)]


def test_lcs_ratio_is_twice_the_common_subsequence_over_both_lengths() -> None:
    env = _env("lcs_ratio", "sitting")
    # LCS(kitten, sitting) = "ittn" (4): 2*4 / (6+7) = 8/13. Exact: 1. Empty: 0.
    assert _scores(env, ["kitten", "sitting", "", "   "]) == pytest.approx([8 / 13, 1, 0, 0])
    # Compared like exact_match: case and whitespace runs do not count by default.
    assert _scores(env, ["SITTING", "  sitting  "]) == [1.0, 1.0]
    reverse = _env("lcs_ratio", "edcba")
    assert _scores(reverse, ["abcde"]) == pytest.approx([2 * 1 / 10])  # LCS of a reversal: 1
    strict = _env("lcs_ratio", "abc", {"case_sensitive": True})
    assert _scores(strict, ["ABC", "aBc"]) == pytest.approx([0.0, 2 * 2 / 6])


def test_edit_distance_is_one_minus_levenshtein_over_the_longer_length() -> None:
    env = _env("edit_distance", "sitting")
    # kitten -> sitting: 3 edits (k->s, e->i, +g); 1 - 3/7 = 4/7.
    assert _scores(env, ["kitten", "sitting", ""]) == pytest.approx([4 / 7, 1, 0])
    lawn = _env("edit_distance", "lawn")
    assert _scores(lawn, ["flaw"]) == pytest.approx([1 - 2 / 4])  # -f, +n


def test_answers_are_read_from_the_extracted_answer_or_a_pattern() -> None:
    env = _env("lcs_ratio", "sitting")
    # The default extraction (as exact_match): the last line, an "Answer:" line, \boxed{}.
    assert _scores(env, ["thinking...\nsitting", "Answer: sitting", "\\boxed{sitting}"]) \
        == [1.0, 1.0, 1.0]
    # The whole completion: "a\nb" is read as "a b" (whitespace runs collapse); LCS with
    # "ab" is 2 -> 2*2 / (3+2) = 0.8. The default extraction would take the last line, "b".
    raw = _env("lcs_ratio", "ab", {"extract": "raw"})
    assert _scores(raw, ["a\nb"]) == pytest.approx([0.8])
    assert _scores(_env("lcs_ratio", "ab"), ["a\nb"]) == pytest.approx([2 * 1 / 3])
    patterned = _env("lcs_ratio", "sitting", {"pattern": r"<out>(?P<answer>.*?)</out>"})
    assert _scores(patterned, ["<out>x</out> then <out>sitting</out>", "no tags"]) == [1.0, 0.0]


def test_numeric_tolerances_absolute_relative_and_falloff() -> None:
    abs_env = _env("numeric", "100", {"abs_tol": 0.5})
    assert _scores(abs_env, ["100.4", "99.5", "100.6", "It is 100.", "none"]) == \
        [1.0, 1.0, 0.0, 1.0, 0.0]
    rel_env = _env("numeric", "200", {"rel_tol": 0.01})  # tolerance 2
    assert _scores(rel_env, ["202", "202.5", "-200"]) == [1.0, 0.0, 0.0]
    # Falloff: 1 inside abs_tol 1, then linear to 0 over scale 4 beyond it.
    fall = _env("numeric", "10", {"abs_tol": 1, "scale": 4})
    assert _scores(fall, ["11", "12", "13", "15", "20"]) == pytest.approx([1, 0.75, 0.5, 0, 0])
    exact = _env("numeric", "0.75")
    assert _scores(exact, ["3/4", "0.750", "7.5e-1", "0.7500001"]) == [1.0, 1.0, 1.0, 0.0]
    commas = _env("numeric", "1234")
    assert _scores(commas, ["The total is 1,234."]) == [1.0]
    with pytest.raises(ValueError, match="task 't' has answer 'twelve', which is not a number"):
        _env("numeric", "twelve")


def test_json_field_scores_the_share_of_matching_fields() -> None:
    gold = '{"name": "Ada", "age": 36, "langs": ["en"], "address": {"city": "London"}}'
    env = _env("json_field", gold)
    # All four top-level fields by default: name and age right (36 == 36.0), langs wrong,
    # address right -> 3/4.
    assert _scores(env, ['Here: {"name": "Ada", "age": 36.0, "langs": ["fr"], '
                         '"address": {"city": "London"}}']) == [0.75]
    assert _scores(env, ["no json here", '["a", "list"]']) == [0.0, 0.0]
    picked = _env("json_field", gold, {"fields": ["name", "address.city"],
                                      "case_sensitive": False})
    fenced = '```json\n{"name": "ADA", "address": {"city": "Paris"}}\n```'
    assert _scores(picked, [fenced]) == [0.5]
    flags = _env("json_field", '{"ok": true, "n": 1}')
    assert _scores(flags, ['{"ok": 1, "n": true}', '{"ok": true, "n": 1}']) == [0.0, 1.0]
    with pytest.raises(ValueError, match="has no field 'zip'"):
        _env("json_field", gold, {"fields": ["zip"]})
    with pytest.raises(ValueError, match="not a non-empty JSON object"):
        _env("json_field", "[1, 2]")


def test_regex_with_several_patterns_gives_the_share_matched() -> None:
    env = _env("regex", None, {"patterns": [r"^Answer:", r"\d+", r"\.$"]})
    assert _scores(env, ["Answer: 42.", "Answer: forty-two", "nothing"]) == \
        pytest.approx([1.0, 1 / 3, 0.0])
    single = _env("regex", None, {"pattern": r"\d"})
    assert _scores(single, ["a1", "a"]) == [1.0, 0.0]
    full = _env("regex", None, {"pattern": r"\d+", "fullmatch": True})
    assert _scores(full, [" 42 ", "42 apples"]) == [1.0, 0.0]


def test_weighted_is_the_weighted_mean_of_its_parts() -> None:
    env = _env("weighted", "sitting", {"checkers": [
        {"checker": "lcs_ratio", "weight": 3},
        {"checker": "exact_match", "weight": 1}]})
    # "sittin": LCS 6 -> 2*6/13 = 12/13; exact 0 -> (3 * 12/13 + 0) / 4 = 9/13.
    [score] = env.score(env.tasks, ["sittin"])
    assert score.total == pytest.approx(9 / 13)
    assert score.info["parts"] == {"part0_lcs_ratio": pytest.approx(12 / 13),
                                   "part1_exact_match": 0.0}
    assert _scores(env, ["sitting", ""]) == [1.0, 0.0]
    assert env.rubric.components[0].graded and env.rubric.graded_total == 1.0


def test_which_components_count_as_partial_credit() -> None:
    def graded(checker: str, params: dict[str, Any] | None = None,
               answer: str | None = "1") -> bool:
        return _env(checker, answer, params).rubric.components[0].graded

    assert graded("lcs_ratio") and graded("edit_distance")
    assert not graded("numeric") and graded("numeric", {"scale": 1.0})
    assert graded("json_field", answer='{"a": 1, "b": 2}')
    assert not graded("json_field", {"fields": ["a"]}, answer='{"a": 1}')
    assert not graded("regex", {"pattern": "x"}) and graded("regex", {"patterns": ["x", "y"]})
    assert not graded("exact_match")


@pytest.mark.parametrize(("component", "message"), [
    ({"checker": "numeric", "params": {"abs_tol": -1}}, "params.abs_tol"),
    ({"checker": "numeric", "params": {"tolerance": 1}}, "params.tolerance"),
    ({"checker": "lcs_ratio", "params": {"pattern": "("}}, "bad pattern"),
    ({"checker": "regex", "params": {}}, "exactly one of params.pattern"),
    ({"checker": "regex", "params": {"pattern": "a", "patterns": ["b"]}}, "exactly one of"),
    ({"checker": "json_field", "params": {"fields": ["a..b"]}}, "dotted keys"),
    ({"checker": "weighted", "params": {"checkers": []}}, "params.checkers"),
    ({"checker": "weighted", "params": {"checkers": [{"checker": "vibes"}]}},
     "params.checkers.0: unknown checker 'vibes'"),
    ({"checker": "weighted", "params": {"checkers": [{"checker": "weighted", "params": {}}]}},
     "cannot itself be weighted"),
    ({"checker": "weighted", "params": {"checkers": [{"checker": "lcs_ratio", "weight": 0}]}},
     "positive weight"),
    ({"checker": "weighted", "params": {"checkers": [
        {"checker": "numeric", "params": {"rel_tol": "x"}}]}}, "params.checkers.0"),
])
def test_bad_params_are_refused_at_registration(component: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvSpecError, match="rubric.components.0") as info:
        parse_environment_spec({"source": "tasks",
                                "tasks": [{"id": "t", "prompt": "p", "answer": "1"}],
                                "rubric": {"components": [{"name": "c", **component}]}})
    assert message in str(info.value)


def test_a_rubric_missing_the_answer_names_the_tasks() -> None:
    with pytest.raises(ValueError, match=r"\(lcs_ratio\) reads each task's 'answer'"):
        load_environment({"source": "tasks", "tasks": [{"id": "t", "prompt": "p"}],
                          "rubric": {"components": [
                              {"name": "w", "checker": "weighted", "params": {"checkers": [
                                  {"checker": "lcs_ratio"}]}}]}})
