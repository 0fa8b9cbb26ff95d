"""Byte-level BPE tokenizer (Hugging Face `tokenizers`) with the chat template's special tokens.

Training reserves the special tokens of andrea/data/chat.py as ids 0..5, starts from the 256-byte
alphabet (so any text encodes, nothing is ever unknown) and learns merges up to the vocabulary
size. The result is one JSON file that `load_tokenizer` reads back:

    from andrea.data.tokenizer import train_tokenizer, load_tokenizer
    train_tokenizer(texts, vocab_size=512, path="tokenizer.json")
    tok = load_tokenizer("tokenizer.json")
    ids = tok.encode("<|user|>hi<|end|>"); tok.decode(ids); tok.eot_id
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np

from ..util.atomic import replace_synced, tmp_path
from .chat import DOC, END, SPECIAL_TOKENS

MAX_VOCAB = 65535  # token shards store uint16 ids (andrea/data/shards.py)


class TokenizerError(ValueError):
    """A tokenizer file that is missing, unreadable or lacks the chat special tokens."""


def train_tokenizer(texts: Iterable[str], vocab_size: int, path, length: Optional[int] = None,
                    min_frequency: int = 2, progress: bool = True):
    """Train a byte-level BPE on texts and save it as JSON at path (atomically); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = len(SPECIAL_TOKENS) + 256
    if not floor <= vocab_size <= MAX_VOCAB:
        raise TokenizerError(f"model.vocab_size={vocab_size}: expected {floor}..{MAX_VOCAB} (256 bytes + "
                             f"{len(SPECIAL_TOKENS)} special tokens at least; uint16 shards at most)")
    tok = Tokenizer(models.BPE())
    # No prefix space: turns start right after a special token, and "19" should stay "19".
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    tok.save(str(tmp))
    replace_synced(tmp, path)
    return load_tokenizer(path)


class AndreaTokenizer:
    """The trained tokenizer with the chat ids the engine and evaluation need."""

    def __init__(self, tok, path: Path):
        self.tok, self.path = tok, path
        ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
        missing = [s for s, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"tokenizer {path}: special tokens {missing} are not in its vocabulary; "
                                 "it was not trained by andrea.data.tokenizer (re-run train_tokenizer)")
        self.special_ids = ids
        self.eot_id = ids[END]  # end of turn: generation stops here
        self.doc_id = ids[DOC]
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        """Encodes in parallel on the Rust side (RAYON_NUM_THREADS caps the threads); without the
        character offsets where the library can leave them out (encode_batch_fast)."""
        fast = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    @property
    def cuts_at_whitespace(self) -> bool:
        """Whether the text may be encoded in pieces cut at whitespace (andrea/tasks/prompts.py,
        safe_cut): a BPE model after the byte-level pre-tokenizer's regex, no prefix space, no
        normalizer, and added tokens that hold no whitespace and strip none around them. True for
        every tokenizer train_tokenizer writes."""
        from tokenizers import models, pre_tokenizers

        t, pre = self.tok, self.tok.pre_tokenizer
        added = t.get_added_tokens_decoder().values()
        return (t.normalizer is None and isinstance(t.model, models.BPE) and isinstance(pre, pre_tokenizers.ByteLevel)
                and not pre.add_prefix_space and pre.use_regex
                and all(not (a.lstrip or a.rstrip or any(c.isspace() for c in a.content)) for a in added))

    def decode(self, ids) -> str:
        """Text of ids, special tokens included, so decode(encode(t)) == t."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, n: int) -> np.ndarray:
        """UTF-8 bytes each of the ids 0..n-1 stands for (0 for ids past the vocabulary).

        A byte-level token's string uses one printable character per byte; a special token
        counts its literal text, since that is what it replaces in the rendered conversation.
        """
        out = np.zeros(n, dtype=np.int64)
        specials = set(self.special_ids.values())
        for i in range(min(n, self.vocab_size)):
            s = self.tok.id_to_token(i)
            if s is None:
                continue
            out[i] = len(s.encode("utf-8")) if i in specials else len(s)
        return out


def load_tokenizer(path) -> AndreaTokenizer:
    """The tokenizer saved at path, checked for the chat special tokens."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer {path}: no such file; run the workflow's train_tokenizer step "
                             "(snakemake) or set data.tokenizer")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"tokenizer {path}: cannot be read ({e})") from e
    return AndreaTokenizer(tok, path)


def describe(tok: AndreaTokenizer) -> dict:
    """Small summary for reports."""
    return {"path": str(tok.path), "vocab_size": tok.vocab_size, "special_ids": tok.special_ids,
            "eot_id": tok.eot_id}


if __name__ == "__main__":
    import sys
    print(json.dumps(describe(load_tokenizer(sys.argv[1])), indent=1))
