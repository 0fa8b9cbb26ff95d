"""What the host copies between a step's two CUDA graphs cost the device, by the form they take.

    python dev/step_copies.py --exp ANDREA-12M --precision fp16 --batch 32 --steps 100 --rounds 9

An engine is warmed up with Engine.train_step; then its step's two graphs (passes P, optimizer O)
are replayed back to back with the step's copies between them in one form or another, each form
for --steps steps between CUDA events, the forms taking turns round by round (as in
dev/ab_settings.py). The copies write the warm-up's last tokens, targets, lr and step again, each
of the size the step's own copies have.

    graphs      P, O: the device's time alone
    memcpy      what Engine.train_step queues: lr and step (16 bytes), tokens and targets copied
                host to device from pinned buffers, P, O, then optim_state (the step's record)
                copied device to host
    kernel      the same copies made by copy kernels that read (or write) the pinned host buffers
                through unified addressing: kernels between the graphs instead of copy-engine work
    side        the host-to-device copies on a second stream, started once the last reader of
                their destination is done; the step's stream waits for each by an event
    train_step  Engine.train_step itself

Needs a CUDA GPU and CuPy; elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COPY = r'''
extern "C" __global__ void copy_words(unsigned int* dst, const unsigned int* src, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}'''
FORMS = ("graphs", "memcpy", "kernel", "side", "train_step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/step_copies.py", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-12M")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100, help="steps a form times in a round")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    from andrea.backends import cuda_available
    if not cuda_available():
        print("dev/step_copies.py: needs a CUDA GPU and CuPy; none here", file=sys.stderr)
        return 2
    import cupy as cp
    import cupyx
    import pandas as pd

    from andrea.backends.interface import S_LR, S_STEP
    from andrea.bench.step import warmed_engine
    eng, train_step, last_graphs = warmed_engine(a.exp, a.precision, a.batch, 8 + a.rounds * a.steps, warmup=6)
    P, O = (last_graphs()[k] for k in ("passes", "optimizer"))
    main_s = cp.cuda.get_current_stream()
    side = cp.cuda.Stream(non_blocking=True)
    tokens, targets, state = eng.g["tokens"], eng.g["targets"], eng.optim_state
    lr = state[S_LR:S_STEP + 1]
    host = {k: cupyx.empty_pinned(v.shape, v.dtype) for k, v in
            (("tokens", tokens), ("targets", targets), ("lr", lr), ("state", state))}
    for k, v in (("tokens", tokens), ("targets", targets), ("lr", lr)):
        host[k][...] = v.get()  # the bytes already there
    copy = cp.RawKernel(COPY, "copy_words")

    def h2d(dst, k, stream):
        dst.data.copy_from_host_async(host[k].ctypes.data, dst.nbytes, stream)

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def kcopy(dst_ptr, src_ptr, nbytes):  # host pointers work in kernels under unified addressing
        words = nbytes // 4
        copy((min(sms, -(-words // 256)),), (256,), (np.uint64(dst_ptr), np.uint64(src_ptr), np.int64(words)))

    def graphs():
        P.launch(stream=main_s)
        O.launch(stream=main_s)

    def memcpy():
        h2d(lr, "lr", main_s)
        h2d(tokens, "tokens", main_s)
        h2d(targets, "targets", main_s)
        graphs()
        state.data.copy_to_host_async(host["state"].ctypes.data, state.nbytes, main_s)

    def kernel():
        kcopy(lr.data.ptr, host["lr"].ctypes.data, lr.nbytes)
        kcopy(tokens.data.ptr, host["tokens"].ctypes.data, tokens.nbytes)
        kcopy(targets.data.ptr, host["targets"].ctypes.data, targets.nbytes)
        graphs()
        kcopy(host["state"].ctypes.data, state.data.ptr, state.nbytes)

    marks = {}

    def side_copy(dst, k, after):
        if after in marks:
            side.wait_event(marks[after])
        h2d(dst, k, side)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(side)
        main_s.wait_event(ev)

    def side_form():
        side_copy(tokens, "tokens", "passes")
        side_copy(targets, "targets", "passes")
        P.launch(stream=main_s)
        marks["passes"] = cp.cuda.Event(block=False, disable_timing=True)
        marks["passes"].record(main_s)
        side_copy(lr, "lr", "record")
        O.launch(stream=main_s)
        state.data.copy_to_host_async(host["state"].ctypes.data, state.nbytes, main_s)
        marks["record"] = cp.cuda.Event(block=False, disable_timing=True)
        marks["record"].record(main_s)

    forms = {"graphs": graphs, "memcpy": memcpy, "kernel": kernel, "side": side_form, "train_step": train_step}
    for f in forms.values():  # warm: compiled, pinned, captured
        f()
    main_s.synchronize()
    rows = []
    for r in range(a.rounds):
        order = FORMS[r % len(FORMS):] + FORMS[:r % len(FORMS)]
        for name in order:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(main_s)
            for _ in range(a.steps):
                forms[name]()
            end.record(main_s)
            end.synchronize()
            rows.append({"round": r, "form": name, "ms": cp.cuda.get_elapsed_time(start, end) / a.steps})
    wide = pd.DataFrame(rows).pivot(index="round", columns="form", values="ms")[list(FORMS)]
    diff = wide.sub(wide["graphs"], axis=0) * 1000
    tab = pd.DataFrame({"median ms": wide.median(), "min": wide.min(), "max": wide.max(),
                        "over graphs (us), median": diff.median(), "min us": diff.min(), "max us": diff.max()})
    with pd.option_context("display.width", 200, "display.precision", 3):
        print(tab)
    print(f"({a.rounds} rounds of {a.steps} steps, {a.exp} {a.precision} B={a.batch}; 'over graphs' is the "
          f"median (min, max) of the paired per-round differences from the graphs alone)")
    rec = train_step()  # the state the timed steps left: a skipped or non-finite step runs other work
    print("the next step's record:", {k: rec[k] for k in rec.KEYS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
