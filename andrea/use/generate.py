"""Sampling, and the `generate` and `chat` commands on a trained model.

    andrea generate RUN_OR_CHECKPOINT --prompt "What is 12 + 7?" [--temperature 0.8] [--top-k 40]
                    [--top-p 0.95] [--seed 0] [--max-tokens 128] [--raw] [--backend auto|numpy|cuda]
    andrea generate RUN_OR_CHECKPOINT --bench     # prefill, single-stream and batched tokens/s
    andrea generate ANDREA-120M --bench --random-init [--backend cuda] [--anchor]   # a model shape,
                                                  # random weights; --anchor: HF transformers beside
    andrea chat RUN_OR_CHECKPOINT [--system "You are terse."]   # /reset, /quit, or end of input

The prompt goes through the chat template the model was trained on (andrea/data/chat.py) unless
--raw; the answer streams as it is sampled and ends at the end of the turn (any special token, or
--max-tokens). Special tokens are never printed. Decoding runs through batch.BatchDecoder with one
slot (the prompt prefilled in one pass, then one step a token; memory planned at start-up) and its
per-request sampler, so an answer for a seed is the one `andrea serve` gives for that seed;
`--temperature 0` is greedy. (Sampler and complete below are the one-position Decoder's path, which
the training samples and the report take.)
"""
from __future__ import annotations

import sys
from typing import Iterable, Iterator, List

import numpy as np

STOP_HELP = "the answer ends at the first special token (end of turn) or after --max-tokens"


class Sampler:
    """Next-token choice from logits: greedy at temperature 0, else softmax(logits / temperature)
    restricted to the top_k most likely tokens (0: all) and to the smallest set whose probability
    reaches top_p (1: all), drawn with a NumPy generator seeded once."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"--temperature {temperature}: expected 0 (greedy) or more")
        if top_k < 0:
            raise ValueError(f"--top-k {top_k}: expected 0 (off) or a positive number of tokens")
        if not 0 < top_p <= 1:
            raise ValueError(f"--top-p {top_p}: expected a probability in (0, 1]")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    def pick(self, logits) -> int:
        logits = np.asarray(logits, dtype=np.float64)
        if self.temperature <= 0:
            return int(np.argmax(logits))
        z = logits / self.temperature
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        z -= z.max()
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[:int(np.searchsorted(cum, self.top_p)) + 1]
            mask = np.zeros(p.size, dtype=bool)
            mask[keep] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))


def complete(dec, feed_ids: Iterable[int], max_new: int, sampler: Sampler, stop_ids=()) -> Iterator[int]:
    """Feed feed_ids into the decoder (after what it holds), then yield up to max_new sampled ids;
    a stop id is yielded and ends the answer. The last id yielded is not fed."""
    logits = dec.feed(feed_ids)
    stop = set(stop_ids)
    for n in range(max_new):
        nxt = sampler.pick(logits)
        yield nxt
        if nxt in stop or n == max_new - 1:
            return
        logits = dec.step(nxt)


class TextStream:
    """Incremental text of generated ids: special tokens dropped, and a multi-byte character split
    over several byte-level tokens held back until it is whole."""

    def __init__(self, tok):
        self.tok = tok
        self.special = set(tok.special_ids.values())
        self.ids: List[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        if token in self.special:
            return ""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def text(self) -> str:
        return self.tok.decode(self.ids)


def prepare(path, backend: str = "auto", tokenizer=None, precision: str = "", prog: str = "andrea generate"):
    """(cfg, tokenizer, backend, compute dtype, window, host weights, checkpoint path) for a run
    folder, an archive or a checkpoint; a damaged checkpoint passed over for an older one is named
    on stderr with its reason (one line each, prefixed with prog)."""
    from ..backends import get_backend
    from ..core.plan import compute_dtype
    from .locate import load_tokenizer_for, locate

    located = locate(path, tokenizer, prog=prog)
    cfg, params = located.load()
    tok = load_tokenizer_for(located, cfg)
    be = get_backend(backend)
    precision = precision or (cfg.train.precision if cfg.train.precision in be.precisions else "fp32")
    if precision not in be.precisions:
        raise ValueError(f"--precision {precision} needs the CUDA backend; backend {be.name} decodes in "
                         f"{', '.join(be.precisions)}")
    context = min(cfg.model.context, cfg.train.seq_len)  # positions past seq_len were never trained
    return cfg, tok, be, compute_dtype(precision, "float32"), context, params, located.checkpoint


def load(path, backend: str = "auto", tokenizer=None, precision: str = "", prog: str = "andrea generate"):
    """(cfg, tokenizer, one-position Decoder with the weights loaded, checkpoint path)."""
    from .inference import Decoder

    cfg, tok, be, dtype, context, params, ckpt = prepare(path, backend, tokenizer, precision, prog)
    dec = Decoder(cfg.model, be, context, dtype)
    dec.load(params)
    return cfg, tok, dec, ckpt


def load_batch(path, backend: str = "auto", tokenizer=None, precision: str = "", prog: str = "andrea generate",
               slots: int = 1):
    """(cfg, tokenizer, BatchDecoder of `slots` slots with the weights loaded, checkpoint path)."""
    from .batch import BatchDecoder

    cfg, tok, be, dtype, context, params, ckpt = prepare(path, backend, tokenizer, precision, prog)
    bd = BatchDecoder(cfg.model, be, slots, context, dtype)
    bd.load(params)
    return cfg, tok, bd, ckpt


def request(a, ids, max_new: int, stop_ids):
    """The batch.Request of the command's sampling flags (checked with the flags' names first)."""
    from .batch import Request

    _sampler(a)  # --temperature, --top-k, --top-p checked under their own names
    return Request(list(ids), max_new, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                   stop_ids=frozenset(stop_ids))


def decode(bd, req) -> Iterator[int]:
    """The tokens of one request on a BatchDecoder (a free slot needed): admitted, then stepped
    until it finishes; a stop id is yielded last. Closing the iterator early releases the slot."""
    slot = bd.admit(req)
    done = False
    try:
        while not done:
            for s, t, finished in bd.step():
                if s == slot:
                    done = finished
                    yield t
    finally:
        if not done:
            bd.release(slot)


def _sampler(a) -> Sampler:
    return Sampler(a.temperature, a.top_k, a.top_p, a.seed)


def _emit(text: str, out) -> None:
    out.write(text)
    out.flush()


def cmd_generate(a, out=None) -> int:
    from ..backends import get_backend
    from ..data.chat import render_prompt
    from .decode_bench import bench_random_init, run_bench

    _sampler(a)  # the sampling flags checked under their own names before anything is loaded
    if a.random_init:
        if not a.bench:
            raise ValueError("--random-init is for --bench only (random weights say nothing)")
        return bench_random_init(a)
    if a.anchor and not a.bench:
        raise ValueError("--anchor is for --bench only")
    out = out or sys.stdout
    if a.max_tokens < 1:
        raise ValueError(f"--max-tokens {a.max_tokens}: expected at least 1")
    if a.bench:  # the checkpoint's weights, random prompt ids
        cfg, _, _, dtype, context, params, _ = prepare(a.path, a.backend, a.tokenizer, a.precision)
        return run_bench(cfg.model, lambda: get_backend(a.backend), dtype, params, context, a)
    cfg, tok, bd, _ = load_batch(a.path, a.backend, a.tokenizer, a.precision)
    text = a.prompt if a.raw else render_prompt(a.prompt, a.system)
    ids = tok.encode(text)
    if not ids:
        raise ValueError("--prompt is empty and --raw leaves nothing to start from")
    if len(ids) > bd.context:
        raise ValueError(f"--prompt: {len(ids)} tokens, the model's window holds {bd.context}")
    stream = TextStream(tok)
    for t in decode(bd, request(a, ids, a.max_tokens, tok.special_ids.values())):
        _emit(stream.push(t), out)
    _emit("\n", out)
    return 0


def fit_conversation(prefix: List[int], exchanges: List[List[int]], window: int, reserve: int) -> List[int]:
    """prefix + the latest exchanges that fit in window with reserve tokens left for the answer
    (the newest one is always kept, however long)."""
    keep = len(exchanges) - 1
    total = len(prefix) + len(exchanges[-1])
    while keep > 0 and total + len(exchanges[keep - 1]) + reserve <= window:
        keep -= 1
        total += len(exchanges[keep])
    return prefix + [i for e in exchanges[keep:] for i in e]


def cmd_chat(a, inp=None, out=None) -> int:
    from ..data.chat import ASSISTANT, DOC, END, SYSTEM, USER, sanitize

    inp, out = inp or sys.stdin, out or sys.stdout
    if a.max_tokens < 1:
        raise ValueError(f"--max-tokens {a.max_tokens}: expected at least 1")
    request(a, [0], 1, ())  # the sampling flags checked before the model is loaded
    cfg, tok, bd, ckpt = load_batch(a.path, a.backend, a.tokenizer, a.precision, prog="andrea chat")
    end_id = tok.eot_id
    stops = set(tok.special_ids.values())
    prefix = tok.encode(DOC + (SYSTEM + sanitize(a.system) + END if a.system.strip() else ""))
    reserve = min(a.max_tokens, bd.context // 2)
    exchanges: List[List[int]] = []
    tty = inp.isatty() and out.isatty()
    if tty:
        print(f"{cfg.exp} ({ckpt}), window {bd.context} tokens; "
              "/reset starts over, /quit or Ctrl-D ends", file=sys.stderr)
    while True:
        if tty:
            _emit("> ", out)
        line = inp.readline()
        if not line:
            break
        line = line.strip()
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            exchanges = []
            continue
        if not line:
            continue
        exchanges.append(tok.encode(USER + sanitize(line) + END + ASSISTANT))
        # the conversation is prefilled again each turn (one pass); the newest part of it fits
        ids = fit_conversation(prefix, exchanges, bd.context, reserve)[-bd.context:]
        stream, reply = TextStream(tok), []
        for t in decode(bd, request(a, ids, a.max_tokens, stops)):
            reply.append(t)
            _emit(stream.push(t), out)
        _emit("\n", out)
        if reply[-1] in stops:
            reply.pop()
        exchanges[-1] = exchanges[-1] + reply + [end_id]
    return 0


def add_arguments(p, chat: bool) -> None:
    p.add_argument("path", help="run folder (results/<exp>), archive folder or step_XXXXXXXX.bin checkpoint")
    if not chat:
        p.add_argument("--prompt", default="", help="the question (or text, with --raw)")
        p.add_argument("--raw", action="store_true", help="feed --prompt as it is, without the chat template")
        p.add_argument("--bench", action="store_true",
                       help="print prefill, single-stream and batched (1, 8, 64 streams) tokens/s instead")
        p.add_argument("--bench-tokens", type=int, default=200,
                       help="tokens --bench generates per request (at most the window less its 16-token prompt)")
        p.add_argument("--bench-streams", default="1,8,64", help="--bench's batched stream counts (default 1,8,64)")
        p.add_argument("--anchor", action="store_true",
                       help="--bench also runs HF transformers' generate (static cache) on the same shape")
        p.add_argument("--random-init", action="store_true",
                       help="--bench a model shape (path = ANDREA-tiny, ANDREA-12M, ANDREA-120M) with random weights")
    p.add_argument("--system", default="", help="system turn of the chat template")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer; " + STOP_HELP)
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    p.add_argument("--precision", default="", choices=("", "fp32", "fp16", "bf16"),
                   help="compute dtype (default: fp32 on NumPy, the training precision on CUDA)")
    p.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (default: the archive's, else the "
                   "config's data.tokenizer)")
    p.set_defaults(fn=cmd_chat if chat else cmd_generate)
