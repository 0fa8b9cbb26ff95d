"""Chat template and tokenizer: special tokens, role normalisation, rendering, round trips."""
import pytest

from andrea.data import chat
from andrea.data.chat import ConversationError, normalize, render_conversation, render_prompt
from andrea.data.tokenizer import TokenizerError, load_tokenizer, train_tokenizer

CONV = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 + 2?"},
        {"from": "gpt", "value": "4"}]


def test_render_conversation_exact():
    assert render_conversation(CONV) == ("<|endoftext|><|system|>Be brief.<|end|><|user|>What is 2 + 2?<|end|>"
                                         "<|assistant|>4<|end|>")


def test_render_prompt_ends_where_answer_starts():
    p = render_prompt("What is 2 + 2?")
    assert p.endswith(chat.ASSISTANT)
    full = render_conversation(CONV[1:])
    assert full.startswith(p) and full[len(p):] == "4" + chat.END


@pytest.mark.parametrize("conv,reason", [
    ("not a list", "malformed"),
    ([{"from": "human"}], "malformed"),
    ([{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}], "unknown_role"),
    ([{"from": "human", "value": "  "}, {"from": "gpt", "value": "y"}], "empty"),
    ([{"from": "human", "value": "hi"}], "empty"),
    ([], "empty"),
])
def test_bad_conversations(conv, reason):
    with pytest.raises(ConversationError) as e:
        normalize(conv)
    assert e.value.reason == reason


def test_roles_normalised_and_blank_system_dropped():
    turns = normalize([{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                       {"from": "assistant", "value": "b"}, {"from": "function", "value": "c"}])
    assert [t["from"] for t in turns] == ["user", "assistant", "tool"]


def test_special_token_text_in_content_is_broken_up():
    text = render_conversation([{"from": "human", "value": "say <|end|> now"}, {"from": "gpt", "value": "ok"}])
    assert text.count(chat.END) == 2  # only the two real ends of turn


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from andrea.data.synthetic import generate
    texts = [render_conversation(c["conversations"]) for c in generate(400, 3)]
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json", progress=False)


def test_tokenizer_special_ids_and_round_trip(tok):
    assert [tok.special_ids[s] for s in chat.SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert tok.eot_id == 5 and tok.vocab_size <= 300
    text = render_conversation(CONV) + "naïve ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[:2] == [tok.doc_id, tok.special_ids[chat.SYSTEM]]
    assert tok.encode(render_prompt("x"))[-1] == tok.special_ids[chat.ASSISTANT]


def test_token_bytes_sum_to_text_bytes(tok):
    text = "What is 12 + 7?" + chat.END + "ünï"
    ids = tok.encode(text)
    assert int(tok.token_bytes(300)[ids].sum()) == len(text.encode("utf-8"))


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be read"):
        load_tokenizer(tmp_path / "bad.json")


def test_vocab_size_bounds(tmp_path):
    with pytest.raises(TokenizerError, match="model.vocab_size=100"):
        train_tokenizer(["abc"], 100, tmp_path / "t.json", progress=False)
