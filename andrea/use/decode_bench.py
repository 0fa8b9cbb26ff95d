"""`andrea generate --bench`: tokens per second of the BatchDecoder, and of HF transformers beside it.

    andrea generate ANDREA-120M --bench --random-init --backend cuda --precision fp16 --temperature 0 --anchor

Prints, for one model (a checkpoint's, or a conf/model/ shape with random weights and random
prompt ids):
- prefill: one request's prompt of min(1000, window - 1) tokens admitted (one pass through the
  training forward kernels, the cache filled, the first token sampled), ms and tokens/s;
- single stream: a 16-token prompt, then --bench-tokens new tokens on a decoder of one slot:
  decode tokens/s (the steps) and end to end (admit + steps);
- batched: 1, 8 and 64 requests at once on decoders of as many slots, tokens/s in total of the
  steps (decode) and of the admits and steps (with the prefills, which run eagerly from Python);
- with --anchor: HF transformers' GPT2LMHeadModel of the same shape (random weights, the same
  dtype), generate() greedy with cache_implementation="static" on the same 16-token prompt and
  the same number of new tokens, and the ratio of ours (end to end) to it.
Each figure is the median of REPS timed runs after one untimed run (compiles, plans, graphs).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from ..core.model import count_params
from .batch import BatchDecoder, Request

PROMPT = 16  # the single-stream and batched prompts' length: the anchor's measurement in the issue
PREFILL = 1000  # the prefill prompt (at most the window less one)
STREAMS = "1,8,64"  # --bench-streams' default
REPS = 3


def timed(fn, sync, reps: int = REPS) -> float:
    """Median seconds of fn() (after one untimed call), the device synchronised around each."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def drain(bd) -> int:
    """Step until every slot is free; the tokens made."""
    n = 0
    while bd.free() < bd.slots:
        n += len(bd.step())
    return n


def measure(m, make_backend, dtype: str, params, context: int, new: int, settings: dict, seed: int, streams,
            out) -> dict:
    """The prefill, single-stream and batched figures of one model (see the module docstring)."""
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(0, m.vocab_size, PROMPT))) for _ in range(max(streams))]
    be = make_backend()
    res = {"backend": be.name}
    bd = BatchDecoder(m, be, 1, context, dtype)
    bd.load(params)
    n_pf = min(PREFILL, context - 1)
    long_prompt = list(map(int, rng.integers(0, m.vocab_size, n_pf)))

    def prefill():
        bd.release(bd.admit(Request(long_prompt, 1, **settings)))
    t = timed(prefill, be.synchronize)
    res["prefill_tokens"], res["prefill_ms"], res["prefill_tok_s"] = n_pf, 1e3 * t, n_pf / t
    print(f"prefill {n_pf} tokens: {1e3 * t:.2f} ms, {n_pf / t:,.0f} tokens/s", file=out, flush=True)

    steps = []

    def single():
        bd.admit(Request(prompts[0], new, seed=seed, **settings))
        be.synchronize()
        t0 = time.perf_counter()
        made = drain(bd)
        steps.append((made, time.perf_counter() - t0))
    t = timed(single, be.synchronize)
    made, t_steps = sorted(steps[1:], key=lambda x: x[1])[len(steps[1:]) // 2]
    res["new_tokens"], res["decode_tok_s"], res["e2e_tok_s"] = made, made / t_steps, made / t
    print(f"single stream: {PROMPT}-token prompt, {made} new tokens: decode {made / t_steps:,.0f} tokens/s "
          f"({1e3 * t_steps / made:.3f} ms/token), end to end {made / t:,.0f} tokens/s", file=out, flush=True)
    del bd
    for n in streams:
        be = make_backend()
        bd = BatchDecoder(m, be, n, context, dtype)
        bd.load(params)

        parts = []

        def batch():
            t0 = time.perf_counter()
            for i in range(n):
                bd.admit(Request(prompts[i], new, seed=seed + i, **settings))
            be.synchronize()
            t1 = time.perf_counter()
            drain(bd)
            parts.append(time.perf_counter() - t1)
        t = timed(batch, be.synchronize)
        t_steps = sorted(parts[1:])[len(parts[1:]) // 2]
        res[f"batch{n}_tok_s"], res[f"batch{n}_decode_tok_s"] = n * made / t, n * made / t_steps
        print(f"{n} streams: {n} x {made} tokens: decode {n * made / t_steps:,.0f} tokens/s in total (the steps), "
              f"{n * made / t:,.0f} with the {n} prefills", file=out, flush=True)
        del bd
    return res


def hf_anchor(m, dtype: str, new: int, seed: int, out) -> float:
    """Tokens/s of HF transformers' generate (greedy, static cache) on GPT2LMHeadModel of shape m
    with random weights, one 16-token prompt, `new` tokens; 0.0 where it cannot run (said why)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"anchor: HF transformers not available ({e})", file=out, flush=True)
        return 0.0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    cfg = transformers.GPT2Config(n_layer=m.n_layer, n_embd=m.d_model, n_head=m.n_head, n_positions=m.context,
                                  vocab_size=m.vocab_size, activation_function="gelu_new",
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).to(dev, tdt).eval()
    ids = torch.randint(0, m.vocab_size, (1, PROMPT), device=dev)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
              pad_token_id=0, attention_mask=torch.ones_like(ids))

    def run():
        with torch.no_grad():
            model.generate(ids, **kw)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    try:
        run()  # the static cache's compile
        t = timed(run, sync)
    except Exception as e:  # a transformers version without the static cache for GPT-2, say
        print(f"anchor: HF generate failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=out, flush=True)
        return 0.0
    print(f"anchor: HF transformers {transformers.__version__} generate, static cache, {dtype}: "
          f"{new / t:,.0f} tokens/s end to end", file=out, flush=True)
    return new / t


def report(name: str, n_params: int, dtype: str, res: dict, streams, anchor: float, out) -> None:
    print(f"decode bench: {name} ({n_params:,} params) backend={res['backend']} dtype={dtype}", file=out)
    rows = [("prefill %d tokens (ms)" % res["prefill_tokens"], f"{res['prefill_ms']:.2f}"),
            ("prefill tokens/s", f"{res['prefill_tok_s']:,.0f}"),
            ("single stream decode tokens/s", f"{res['decode_tok_s']:,.0f}"),
            ("single stream end-to-end tokens/s", f"{res['e2e_tok_s']:,.0f}")]
    for n in streams:
        rows += [(f"{n} streams decode tokens/s (total)", f"{res[f'batch{n}_decode_tok_s']:,.0f}"),
                 (f"{n} streams with prefills tokens/s", f"{res[f'batch{n}_tok_s']:,.0f}")]
    if anchor:
        rows += [("HF static cache tokens/s", f"{anchor:,.0f}"),
                 ("ratio (ours end to end / HF)", f"{res['e2e_tok_s'] / anchor:.2f}x")]
    for k, v in rows:
        print(f"| {k:<36} | {v:>12} |", file=out)
    out.flush()


def run_bench(m, make_backend, dtype: str, params, context: int, a, out=None) -> int:
    out = out or sys.stderr
    new = min(a.bench_tokens, context - PROMPT)
    if new < 1:
        raise ValueError(f"--bench-tokens {a.bench_tokens}: expected at least 1 (the window holds {context})")
    streams = bench_streams(a.bench_streams)
    settings = {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
    res = measure(m, make_backend, dtype, params, context, new, settings, a.seed, streams, out)
    anchor = hf_anchor(m, dtype, res["new_tokens"], a.seed, out) if a.anchor else 0.0
    report(m.name, count_params(m), dtype, res, streams, anchor, out)
    return 0


def bench_streams(text: str) -> tuple:
    """--bench-streams "1,8,64" as a tuple of positive ints, or a ValueError naming the flag."""
    try:
        streams = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        streams = ()
    if not streams or min(streams) < 1:
        raise ValueError(f"--bench-streams {text!r}: expected stream counts separated by commas, e.g. 1,8,64")
    return streams


def bench_random_init(a) -> int:
    """--bench --random-init: a model shape of conf/model/ with random weights, random prompt ids."""
    from omegaconf import OmegaConf

    from ..backends import get_backend
    from ..config import ModelConfig
    from ..core.plan import compute_dtype
    from ..paths import model_config

    path = model_config(a.path)
    if not path.is_file():
        raise ValueError(f"--random-init: {a.path} is not a model of {path.parent} ({path} does not exist)")
    m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    rng = np.random.default_rng(a.seed)
    params = rng.normal(0, 0.02, count_params(m)).astype(np.float32)
    dtype = compute_dtype(a.precision or "fp32", "float32")
    return run_bench(m, lambda: get_backend(a.backend), dtype, params, m.context, a)
