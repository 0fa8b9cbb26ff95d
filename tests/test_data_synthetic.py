"""Synthetic tasks: deterministic, distinct, right answers computed independently here."""
import pytest

from andrea.data import synthetic


def test_deterministic_and_distinct():
    a, b = synthetic.generate(500, 11), synthetic.generate(500, 11)
    assert a == b
    assert synthetic.generate(500, 12) != a
    qs = [r["conversations"][0]["value"] for r in a]
    assert len(set(qs)) == 500
    assert {r["task"] for r in a} == set(synthetic.KINDS)


def _independent_answer(q):
    if q.startswith("What is "):
        x, y = q[len("What is "):-1].split(" + ")
        return str(int(x) + int(y))
    if q.startswith("Sort: "):
        return " ".join(sorted(q[len("Sort: "):].split(), key=int))
    if q.startswith("How many "):
        letter, word = q[len("How many "):-1].split(" in ")
        return str(sum(c == letter for c in word))
    return " ".join(q[len("Reverse: "):].split()[::-1])


def test_answers_are_right():
    for row in synthetic.generate(400, 5):
        q, a = (t["value"] for t in row["conversations"])
        assert a == _independent_answer(q), q
        assert synthetic.is_correct(q, f" {a}\n") and not synthetic.is_correct(q, a + "0")


def test_schema_is_hermes_like():
    row = synthetic.generate(1, 0)[0]
    assert [t["from"] for t in row["conversations"]] == ["human", "gpt"]


def test_chance():
    assert synthetic.chance("What is 1 + 2?") == pytest.approx(1 / 99)
    assert synthetic.chance("Sort: 1 1 2") == pytest.approx(1 / 3)
    assert synthetic.chance("How many a in abcd?") == pytest.approx(1 / 5)
    assert synthetic.chance("Reverse: a b c d") == pytest.approx(1 / 24)


def test_not_a_task():
    with pytest.raises(ValueError, match="not a synthetic task"):
        synthetic.kind_of("Tell me a story")


def test_large_n_fills_with_kinds_that_have_room():
    rows = synthetic.generate(12000, 2)
    kinds = [r["task"] for r in rows]
    assert len({r["conversations"][0]["value"] for r in rows}) == 12000
    assert kinds.count("add") <= 2500 and min(kinds.count(k) for k in ("sort", "count", "reverse")) > 3000
