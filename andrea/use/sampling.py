"""Completions of chat prompts: the one sampling path of training's samples and the report's.

A prompt goes through the chat template (andrea.data.chat.render_prompt); a generator gives up to
max_new_tokens new ids (greedy at temperature 0, else drawn from softmax(logits / temperature) with
a NumPy generator seeded once) and stops at the end-of-turn token, which is not part of the
completion. Prompt i of eval.prompts is seeded with eval.seed + i.

A generator is `generate(ids, max_new, temperature, seed, stop_ids) -> [new ids]`: `Engine.generate`
during training (a full forward per token on the training backend), `decoder_generate(dec)` in the
report (the KV-cache decoder); both pick tokens the same way and give the same ids.
"""
from __future__ import annotations

from typing import Callable, List

from ..config import EvalConfig

Generate = Callable[..., List[int]]


def decoder_generate(dec) -> Generate:
    """A generator over an inference.Decoder (emptied before each prompt)."""
    from .generate import Sampler, complete

    def generate(ids, max_new, temperature, seed, stop_ids=()):
        dec.reset()
        return list(complete(dec, ids, max_new, Sampler(temperature, seed=seed), stop_ids))
    return generate


def complete(generate: Generate, tok, prompt: str, max_new: int, temperature: float, seed: int) -> str:
    """The completion of one prompt (the end-of-turn token removed)."""
    from ..data.chat import render_prompt

    new = generate(tok.encode(render_prompt(prompt)), max_new, temperature, seed, stop_ids=(tok.eot_id,))
    return tok.decode([i for i in new if i != tok.eot_id])


def sample_prompts(generate: Generate, tok, e: EvalConfig) -> list:
    """[{"prompt", "completion"}] for every prompt of eval.prompts, prompt i seeded with eval.seed + i."""
    return [{"prompt": p, "completion": complete(generate, tok, p, e.max_new_tokens, e.temperature, e.seed + i)}
            for i, p in enumerate(e.prompts)]
