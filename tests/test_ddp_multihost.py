"""A data-parallel run over 2 Slurm nodes, as far as one machine without Slurm can check it
(docs/DISTRIBUTED.md, "Several hosts"): the train job the workflow's Slurm profile submits (a dry
run: the srun command, the resources, the sbatch line the executor plugin builds from them), and
what each of the 8 ranks makes of the environment srun gives it (rank, world size, local rank,
GPU). Nothing here starts Slurm or a second host.
"""
import re
import sys
import types
from pathlib import Path

import pytest

from andrea.core import comm as comm_mod
from andrea.core.comm import launch_rank, local_device

sys.path.insert(0, str(Path(__file__).parent))
from test_workflow import copy_repo, smk  # noqa: E402

RUN = "results/ANDREA-120M+train.grad_accum=8"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("checkout"))


def train_job(checkout, *config):
    """The dry run's train job through profiles/slurm: (resources {name: value}, shell command)."""
    r = smk(checkout, "-n", "-p", "--workflow-profile", "profiles/slurm", "--config", *config,
            "overrides=[train.grad_accum=8]", "--", f"{RUN}/trained/final.bin")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    block = out[out.index("rule train:"):]
    line = next(x for x in block.splitlines() if x.strip().startswith("resources:"))
    res = dict(kv.split("=", 1) for kv in line.split(":", 1)[1].strip().split(", "))
    shell = re.search(r"^Shell command: (.*)$", block, re.M).group(1)
    return res, shell


def test_two_node_job_through_the_slurm_profile(checkout):
    """ranks=8 nodes=2 launcher=srun: the job asks Slurm for 2 nodes, 8 tasks of one GPU each and
    8 GPUs on the profile's gpu partition, and runs srun with 4 ranks on each node; the executor
    plugin turns those resources into that sbatch line. nodes > 1 without srun is refused."""
    res, shell = train_job(checkout, "ranks=8", "nodes=2", "launcher=srun", "zero1=True")
    assert shell.startswith("srun -n 8 --nodes=2 --ntasks-per-node=4 python3 -m andrea.train --zero1 "
                            "--new-run-on-change experiment=ANDREA-120M "), shell
    for k, v in {"gpu": "8", "tasks": "8", "tasks_per_gpu": "1", "mpi": "srun", "nodes": "2",
                 "slurm_partition": "gpu", "runtime": "2880", "cpus_per_task": "8"}.items():
        assert res[k] == v, (k, res)

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__
    ints = {k: int(v) for k, v in res.items() if v.isdigit()}
    job = types.SimpleNamespace(resources=Resources(res, **ints), threads=1)
    sbatch = get_submit_command(job, {"run_uuid": "ID", "slurm_logfile": "LOG", "comment_str": "rule_train",
                                      "account": "", "partition": "-p gpu", "workdir": "/w"}) + set_gres_string(job)
    for flag in ("--nodes=2", "--ntasks=8", "--ntasks-per-gpu=1", "--gpus=8", "--cpus-per-task=8",
                 f"--mem {res['mem_mb']}", "-t 2880"):
        assert flag in sbatch, (flag, sbatch)

    one, shell1 = train_job(checkout, "ranks=8", "launcher=srun")  # nodes=1: as before
    assert shell1.startswith("srun -n 8 python3 -m andrea.train --new-run-on-change") and one["nodes"] == "1"
    bad = smk(checkout, "-n", "--cores", "1", "--config", "ranks=2", "nodes=2")
    assert bad.returncode != 0 and "nodes=2 with ranks=2, launcher=''" in bad.stdout + bad.stderr


def srun_task_env(procid, ntasks=8, nodes=2):
    """The variables Slurm sets for task procid of `srun -n 8 --nodes=2 --ntasks-per-node=4` (block
    distribution: tasks 0-3 on the first node, 4-7 on the second)."""
    per = ntasks // nodes
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(procid // per), "SLURM_LOCALID": str(procid % per),
            "SLURM_STEP_TASKS_PER_NODE": f"{per}(x{nodes})"}


class FakeCupy(types.ModuleType):
    """cupy as select_gpu uses it: a device count, and the device made current."""

    def __init__(self, n):
        super().__init__("cupy")
        self.used = []
        fake = self

        class Device:
            def __init__(self, i):
                self.i = i

            def use(self):
                fake.used.append(self.i)
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: n), Device=Device)


@pytest.mark.parametrize("visible", [4, 1])
def test_each_rank_of_a_two_node_srun_finds_its_rank_and_gpu(monkeypatch, visible):
    """Every task of the 2-node srun: rank = SLURM_PROCID of 8 (rank 0 keeps the run folder, the
    others follow), local rank = SLURM_LOCALID, and the GPU is the local rank among the GPUs the
    task sees: GPU 0..3 where each task sees its node's 4 GPUs, GPU 0 where Slurm binds one GPU to
    each task (CUDA_VISIBLE_DEVICES of one)."""
    for procid in range(8):
        env = srun_task_env(procid)
        assert launch_rank(env) == (procid, 8)
        assert local_device(env) == procid % 4
        for k in list(comm_mod.os.environ):
            if k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCALRANKID")):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        fake = FakeCupy(visible)
        monkeypatch.setitem(sys.modules, "cupy", fake)

        class Eight:
            size, rank = 8, procid
        comm_mod.select_gpu("cuda", Eight())
        assert fake.used == [procid % 4 % visible]
        comm_mod.select_gpu("numpy", Eight())  # the NumPy engine takes no GPU
        assert fake.used == [procid % 4 % visible]


def test_mpirun_inside_an_allocation_wins_over_the_batch_steps_variables():
    """mpirun started inside a Slurm job (one batch task: SLURM_PROCID=0 of SLURM_NTASKS=1): the
    rank is Open MPI's, not the batch step's, and so is the local rank."""
    env = {**srun_task_env(0, ntasks=1, nodes=1), "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert launch_rank(env) == (6, 8) and local_device(env) == 2


def test_a_rank_whose_mpi_does_not_see_the_launch_is_refused(tmp_path):
    """A task that srun started as rank 5 of 8 but whose MPI is a world of one (mpi4py built for
    another MPI than srun's PMI, or srun --mpi=none): make_comm refuses instead of training alone."""
    import subprocess

    from test_ddp import ENV

    env = {k: v for k, v in ENV.items() if not k.startswith(("SLURM_", "OMPI_COMM", "PMI_"))}
    env.update(srun_task_env(5))
    r = subprocess.run([sys.executable, "-c", "from andrea.core.comm import make_comm\nmake_comm()"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "the launcher's environment says rank 5 of 8 but MPI says rank 0 of 1" in r.stderr, r.stderr[-2000:]
