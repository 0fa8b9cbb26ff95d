"""The hub converters of SIQA, AGIEval LSAT-AR, SQuAD and CoQA (andrea/tasks/hub.py) on rows written here
in the layout of their hub datasets, each item checked field by field and by data._check (the check
hub_items applies); hub_items on a stand-in `datasets` module (no network)."""
import json
import sys
import types
from pathlib import Path

import pytest

from andrea.tasks.data import TaskDataError, _check
from andrea.tasks.hub import HUB, coqa, hub_items, lsat_ar, siqa, squad
from andrea.tasks.suites import LM, MC

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "eval-data"

# allenai/social_i_qa's dataset card example (validation)
SIQA_ROW = {"context": "Sydney walked past a homeless woman asking for change but did not have any money they "
                       "could give to her. Sydney felt bad afterwards.", "question": "How would you describe Sydney?",
            "answerA": "sympathetic", "answerB": "like a person who was unable to help", "answerC": "incredulous",
            "label": "1"}


def lsat_row(passage, question, options, gold):
    """A hails/agieval-lsat-ar row: AGIEval's zero-shot prompt as query, the "(A)..." options as choices."""
    query = (passage + "Q: " + question + " Answer Choices: " + " ".join(options) + "\n"
             + "A: Among A through E, the answer is")
    return {"query": query, "choices": list(options), "gold": [gold]}


def test_siqa_row_in_the_local_files_text():
    item = siqa(SIQA_ROW)
    assert item["query"] == ("Context: " + SIQA_ROW["context"] + "\nQuestion: How would you describe Sydney?\nChoices:"
                             "\nA. sympathetic\nB. like a person who was unable to help\nC. incredulous\nAnswer:")
    assert item["choices"] == ["A", "B", "C"] and item["gold"] == 0
    assert _check(item, MC, "siqa") is item
    assert siqa({**SIQA_ROW, "label": "3"})["gold"] == 2


def test_lsat_ar_row_in_the_local_files_text():
    options = ["(A)Kyle, Lenore", "(B)Nina", "(C)George, Helen", "(D)Olivia", "(E)Robert, Irving"]
    row = lsat_row("Exactly six students give reports. George reports on Tuesday.",
                   "Which one of the following could be true?", options, 3)
    item = lsat_ar(row)
    assert item["query"] == ("Passage: Exactly six students give reports. George reports on Tuesday.\n"
                             "Q: Which one of the following could be true?\nChoices:\nA.) Kyle, Lenore\nB.) Nina\n"
                             "C.) George, Helen\nD.) Olivia\nE.) Robert, Irving\nAnswer:")
    assert item["choices"] == ["A", "B", "C", "D", "E"] and item["gold"] == 3
    assert _check(item, MC, "lsat") is item
    with pytest.raises(ValueError):  # a query that is not AGIEval's prompt
        lsat_ar({**row, "query": "Which one of the following could be true?"})
    with pytest.raises(ValueError):
        lsat_ar({**row, "gold": [1, 2]})


def test_squad_row_passage_and_question_then_the_first_answer():
    row = {"id": "56be4db0acb8001400a502ec", "title": "Super_Bowl_50",
           "context": "The AFC champion Denver Broncos defeated the NFC champion Carolina Panthers 24-10.",
           "question": "Which NFL team represented the AFC at Super Bowl 50?",
           "answers": {"text": ["Denver Broncos", "the Denver Broncos"], "answer_start": [17, 13]}}
    item = squad(row)
    assert item == {"context": row["context"] + "\nQuestion: Which NFL team represented the AFC at Super Bowl 50?"
                               "\nAnswer:", "continuation": "Denver Broncos"}
    assert _check(item, LM, "squad") is item
    with pytest.raises(TaskDataError, match="continuation is empty"):  # _check refuses a conversion with no answer
        _check(squad({**row, "answers": {"text": [""], "answer_start": [0]}}), LM, "squad")


COQA_ROW = {"source": "mctest", "story": "Cotton was a white kitten. She lived in a barn.",
            "questions": ["What color was Cotton?", "Where did she live?", "Was she alone?"],
            "answers": {"input_text": ["white", "in a barn", "unknown"], "answer_start": [11, 34, -1],
                        "answer_end": [16, 47, -1]}}


def test_coqa_row_becomes_one_item_per_question_after_the_conversation_so_far():
    items = coqa(COQA_ROW)
    story = COQA_ROW["story"]
    assert [it["context"] for it in items] == [
        story + "\nQuestion: What color was Cotton?\nAnswer:",
        story + "\nQuestion: What color was Cotton?\nAnswer: white\nQuestion: Where did she live?\nAnswer:",
        story + "\nQuestion: What color was Cotton?\nAnswer: white\nQuestion: Where did she live?\nAnswer: in a barn"
                "\nQuestion: Was she alone?\nAnswer:"]
    assert [it["continuation"] for it in items] == ["white", "in a barn", "unknown"]
    assert all(_check(it, LM, "coqa") is it for it in items)
    with pytest.raises(ValueError, match="3 questions and 2 answers"):
        coqa({**COQA_ROW, "answers": {"input_text": ["white", "in a barn"], "answer_start": [11, 34],
                                      "answer_end": [16, 47]}})


@pytest.fixture
def fake_hub(monkeypatch):
    """A stand-in `datasets` module whose load_dataset returns the rows given for (dataset, config, split)."""
    tables, asked = {}, []

    def load_dataset(path, name=None, split=None):
        asked.append((path, name, split))
        return tables[(path, name, split)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return tables, asked


def test_hub_items_converts_and_checks_mc_lm_and_several_items_a_row(fake_hub):
    tables, asked = fake_hub
    tables[("allenai/social_i_qa", None, "validation")] = [SIQA_ROW, {**SIQA_ROW, "label": "2"}]
    tables[("rajpurkar/squad", None, "validation")] = [
        {"id": "1", "title": "T", "context": "Paris is in France.", "question": "Where is Paris?",
         "answers": {"text": ["France"], "answer_start": [12]}}]
    tables[("stanfordnlp/coqa", None, "validation")] = [COQA_ROW, {**COQA_ROW, "story": "Another story."}]
    s = hub_items("siqa")
    assert [it["gold"] for it in s] == [0, 1] and s[0] == siqa(SIQA_ROW)
    q = hub_items("squad")
    assert q == [{"context": "Paris is in France.\nQuestion: Where is Paris?\nAnswer:", "continuation": "France"}]
    c = hub_items("coqa")
    assert len(c) == 6 and c[3]["context"].startswith("Another story.\nQuestion:") and c[5]["continuation"] == "unknown"
    assert asked == [(HUB[n].dataset, HUB[n].config, HUB[n].split) for n in ("siqa", "squad", "coqa")]

    # a malformed row: one line naming the row (and the item of the row), never a traceback of the converter
    bad = {**COQA_ROW, "answers": {**COQA_ROW["answers"], "input_text": ["white", "", "unknown"]}}
    tables[("stanfordnlp/coqa", None, "validation")] = [COQA_ROW, bad]
    with pytest.raises(TaskDataError, match=r"stanfordnlp/coqa:validation\[1\]\.1: field continuation is empty"):
        hub_items("coqa")
    tables[("allenai/social_i_qa", None, "validation")] = [SIQA_ROW, {"context": "c", "question": "q"}]
    with pytest.raises(TaskDataError, match=r"allenai/social_i_qa:validation\[1\]: not in the layout .*answerA"):
        hub_items("siqa")


@pytest.mark.skipif(not (SHARED / "commonsense_reasoning" / "siqa.jsonl").exists(), reason="needs ../shared/eval-data")
def test_siqa_and_lsat_ar_text_as_the_local_files_up_to_the_options_they_dropped():
    """The card's SIQA row is the local file's second line less the answer the gauntlet dropped (C);
    a hub-shaped LSAT-AR row made of the local file's first question (a fifth option added, as the hub
    has five) converts to that line plus the fifth option."""
    lines = (SHARED / "commonsense_reasoning" / "siqa.jsonl").read_text().splitlines()
    local = json.loads(lines[1])
    item = siqa(SIQA_ROW)
    assert item["query"].replace("\nC. incredulous", "") == local["query"] and item["gold"] == local["gold"]

    first = json.loads((SHARED / "symbolic_problem_solving" / "agi_eval_lsat_ar.jsonl").read_text().splitlines()[0])
    head, listing = first["query"].split("\nChoices:\n")
    passage, question = head[len("Passage: "):].split("\nQ: ")
    texts = [ln[len("A.) "):] for ln in listing.split("\n")[:-1]]
    row = lsat_row(passage, question, [f"({L}){t}" for L, t in zip("ABCDE", texts + ["an added fifth option"])],
                   first["gold"])
    assert lsat_ar(row)["query"] == first["query"].replace("\nAnswer:", "\nE.) an added fifth option\nAnswer:")
