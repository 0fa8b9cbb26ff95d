# Helpers of the workflow: experiment configs, stage configs, input functions. No rules here.
#
# The workflow's own settings are config/config.yaml (exp: the default target's experiment;
# overrides: a list of Hydra overrides for every experiment), checked against
# workflow/schemas/config.schema.yaml; `--config overrides='[train.lr=1e-3]'` changes them.
# Every experiment's config is composed with Hydra exactly as `python -m andrea.train` does
# (the installed package's conf/, see andrea/paths.py, + the overrides). A run with overrides that
# change what is trained lives in its own folder, results/<EXP>+<overrides> (andrea/pipeline/runs.py), so
# the pinned run in results/<EXP> is never overwritten; {exp} in the rules is that run name. Each
# step gets the part of that config it depends on as a small YAML "stage file" (rules/config.smk
# writes them). A stage file's text is also a param of the rule that writes it, so Snakemake's
# params trigger rewrites it when, and only when, that part of the config changes; the steps that read it then re-run because their
# input is newer. Changing train.lr re-runs train -> archive -> evaluate; changing eval.* re-runs
# evaluate; a second run with the same config does nothing.

import os
import re
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf
from snakemake.utils import validate

import andrea.config as andrea_config
from andrea.pipeline import runs
from andrea.pipeline.compose import ConfigError, compose_config
from andrea.config import to_dict
from andrea.data.sizing import DataSizeError, synthetic_conversations
from andrea.paths import experiments

REPO = Path(workflow.basedir).resolve().parent
# Steps run `python3` from the environment that runs Snakemake (a venv, conda or the system's),
# whatever else PATH holds.
shell.prefix(f"set -euo pipefail; export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"; ")


def workflow_overrides(cfg):
    """config["overrides"] as a list of Hydra overrides. The list is the form; one string (the
    older form, `--config overrides="a=1 b=2"`) is split as a shell would and still works."""
    ov = cfg.get("overrides") or []
    return shlex.split(ov) if isinstance(ov, str) else [str(o) for o in ov]


try:
    validate(config, schema=str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
except WorkflowError as e:
    raise WorkflowError(f"workflow config (config/config.yaml and --config): {e}") from None
OVERRIDES = workflow_overrides(config)
EXPERIMENTS = experiments()
DEFAULT_EXP = str(config["exp"])
if DEFAULT_EXP not in EXPERIMENTS:
    raise WorkflowError(f"config/config.yaml or --config: exp={DEFAULT_EXP!r}; expected one of {EXPERIMENTS}")
# run name of each experiment under OVERRIDES (= the experiment's name when there are none)
RUNS = {e: runs.run_name(e, OVERRIDES) for e in EXPERIMENTS}
EXP_OF_RUN = {r: e for e, r in RUNS.items()}
# What each data source's pull depends on (keys of data.*); other data keys do not re-pull.
PULL_KEYS = {
    "synthetic": ("source", "n_synthetic", "seed", "max_conversations"),
    "local": ("source", "local_path", "max_conversations"),
    "hub": ("source", "hub_repo", "revision", "max_conversations"),
}
PREP_KEYS = ("val_fraction",)
_CONFIGS = {}
TARGETS_ENV = "ANDREA_WORKFLOW_TARGETS"  # this invocation's targets, as first seen (requested_experiments)


def exp_config(name):
    """The resolved AndreaConfig of an experiment or of its run name (cached; its exp is the run
    name); an override it refuses ends the invocation with andrea.train's one line (exit 2)."""
    if name in OTHER_RUNS:
        return OTHER_RUNS[name]
    exp = EXP_OF_RUN.get(name, name)
    if exp not in _CONFIGS:
        if exp not in EXPERIMENTS:
            raise WorkflowError(f"experiment {exp!r}: no conf/experiment/{exp}.yaml (known: {EXPERIMENTS})")
        try:
            _CONFIGS[exp] = compose_config(exp, OVERRIDES)
        except ConfigError as e:
            error = e
        else:
            error = None
        if error is not None:  # outside the except: its line must not carry the error being handled
            refuse_overrides(exp, error, building_dag=True)
    return _CONFIGS[exp]


def refuse_overrides(exp, error, building_dag):
    """Print the one line `python -m andrea.train experiment=<exp> <overrides>` prints for these
    overrides and exit 2: no traceback, nothing started. While the DAG is built Snakemake wraps any
    exception (SystemExit too) in a traceback, so the process ends there at once: no job has run
    and no lock is taken yet."""
    from andrea.pipeline.compose import one_line
    from andrea.train import precheck

    line = precheck([f"experiment={exp}", *OVERRIDES]) or one_line(error)
    print(f"andrea.train: config error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if building_dag:
        os._exit(2)
    sys.exit(2)


def compose_all():
    """Every experiment's config under the overrides, at parse time; overrides that no experiment
    takes (a wrong type, an unknown key) end here with andrea.train's one line. Those only some
    experiments refuse end the invocation when one of those is needed (exp_config)."""
    errors = {}
    for exp in EXPERIMENTS:
        try:
            _CONFIGS[exp] = compose_config(exp, OVERRIDES)
        except ConfigError as e:
            errors[exp] = e
    if errors and not _CONFIGS:
        refuse_overrides(DEFAULT_EXP, errors[DEFAULT_EXP], building_dag=False)


compose_all()


def evaluated_runs():
    """{run name: AndreaConfig} of the runs under results/ evaluated with other overrides than
    this invocation's: a report.md beside the eval stage file the workflow wrote, whose experiment
    and overrides still compose to that run name (a run named with exp=NAME, or one its overrides
    no longer name, is left out, with a line saying why)."""
    found = {}
    for report in sorted(Path("results").glob("*/report.md")):
        run, stage = report.parent.name, report.parent / "resolved" / "eval.yaml"
        exp = runs.base_experiment(run)
        if run in EXP_OF_RUN or exp not in EXPERIMENTS or not stage.is_file():
            continue
        overrides = [str(o) for o in (OmegaConf.load(stage).get("overrides") or [])]
        try:
            cfg = compose_config(exp, overrides)
        except ConfigError as e:
            print(f"report: results/{run} left out: its overrides no longer compose ({e})", file=sys.stderr)
            continue
        if cfg.exp != run:
            print(f"report: results/{run} left out: its overrides now name the run {cfg.exp}", file=sys.stderr)
            continue
        found[run] = cfg
    return found


# `snakemake --report <file>`: the page holds every run evaluated under results/, not only the
# targets' (the default: this invocation's run of config exp). Only then do the other runs join
# the DAG, so a plain `snakemake` never rebuilds them.
REPORTING = any(a == "--report" or a.startswith("--report=") for a in sys.argv)
OTHER_RUNS = evaluated_runs() if REPORTING else {}
EXP_OF_RUN.update({r: runs.base_experiment(r) for r in OTHER_RUNS})


def buildable():
    """The experiments the overrides fit (an override that one refuses, such as train.steps below
    its phases, leaves it out: it is reported only if a target needs it) and, for a report, the
    other evaluated runs: those whose data folders the data steps may be asked for."""
    return [e for e in EXPERIMENTS if e in _CONFIGS] + list(OTHER_RUNS)


def all_targets():
    """Rule all's reports: config exp's run; for `--report`, every evaluated run (the default
    run's own only where it was evaluated, unless it is the only one)."""
    own = experiment_targets([DEFAULT_EXP])
    if not OTHER_RUNS:
        return own
    return [t for t in own if Path(t).is_file()] + [f"results/{r}/report.md" for r in OTHER_RUNS]


def data_root(cfg):
    """Where the data steps of cfg write: <data.dir>/<data.source>; checks the engine reads there."""
    d = cfg.data
    for key, path in andrea_config.default_data_paths(cfg).items():
        if getattr(d, key) != path:
            raise WorkflowError(f"experiment {cfg.exp}: data.{key}={getattr(d, key)!r} but the workflow writes "
                                f"{path!r}; change data.dir instead of the single paths")
    return andrea_config.data_root(cfg)


def _yaml(obj):
    return OmegaConf.to_yaml(OmegaConf.create(obj))


def _data_stage(cfg, stage):
    d = to_dict(cfg)["data"]
    if stage == "pull":
        if d["source"] not in PULL_KEYS:
            raise WorkflowError(f"experiment {cfg.exp}: data.source={d['source']!r}; expected one of "
                                f"{sorted(PULL_KEYS)}")
        keys = PULL_KEYS[d["source"]]
        if d["source"] == "synthetic":  # as many tasks as the experiment's batches need (a floor: n_synthetic)
            try:
                d["n_synthetic"] = synthetic_conversations(cfg)
            except DataSizeError as e:
                raise WorkflowError(f"experiment {cfg.exp}: {e}") from e
    else:
        keys = PREP_KEYS
    return {"data": {k: d[k] for k in keys}}


def requested_experiments():
    """Experiments named by this invocation's targets: `results/<EXP>`, a file of its run folder;
    `all` or targets that name none (a data file) stand for the default one (config exp).
    Only the main Snakemake process knows its targets: stage files are written there (shell jobs
    run in the main process), never in a job that re-parses the workflow without them."""
    ds = getattr(workflow, "dag_settings", None)  # set once the Snakefile is parsed
    if ds is not None and ds.targets and TARGETS_ENV not in os.environ:
        os.environ[TARGETS_ENV] = "\n".join(sorted(map(str, ds.targets)))
    # A local job with a Python body executes in a child Snakemake that has no targets and evaluates
    # the params again: the invocation's targets reach it through the environment (without them a
    # shared data folder got the default experiment's settings).
    targets = set(filter(None, os.environ.get(TARGETS_ENV, "").split("\n"))) or {"all"}
    found = set()
    for t in targets:
        t = str(t).rstrip("/")
        for e in EXPERIMENTS:
            if t in (f"results/{e}", f"results/{RUNS[e]}") or t.startswith(f"results/{RUNS[e]}/"):
                found.add(e)
    return found or {DEFAULT_EXP}


def data_stage_text(wildcards):
    """The pull or prep stage file of a data root. Experiments sharing the root must agree on it;
    where they do not, the one this invocation asks for decides (its data is rebuilt for it)."""
    found = {}
    for exp in buildable():
        cfg = exp_config(exp)
        if data_root(cfg) == wildcards.root:
            found[exp] = _yaml(_data_stage(cfg, wildcards.stage))
    if not found:
        raise WorkflowError(f"{wildcards.root}: no experiment reads data from there (experiments: {EXPERIMENTS})")
    texts = set(found.values())
    if len(texts) > 1 and REPORTING:  # nothing is built for a report: any of them describes the folder
        return sorted(texts)[0]
    if len(texts) > 1:
        texts = {t for e, t in found.items() if e in requested_experiments()}
    if len(texts) != 1:
        raise WorkflowError(f"{wildcards.root}: experiments {sorted(found)} share this data folder but pin "
                            f"different {wildcards.stage} settings: {found}; build them one at a time "
                            f"(snakemake results/<EXP>) or give one of them another data.dir")
    return texts.pop()


def exp_stage_text(wildcards):
    """train: everything but eval, proxy and objective (their settings and overrides never change
    the weights, so changing them never re-trains); eval: everything."""
    d = to_dict(exp_config(wildcards.exp))
    if wildcards.part == "train":
        d.pop("eval")
        d.pop("proxy")
        d.pop("objective")  # what a sweep's task returns: no sweep here, and never the weights
        d["overrides"] = [o for o in runs.training_overrides(d["overrides"])
                          if runs.override_key(o).split(".", 1)[0] not in ("proxy", "objective")]
    return _yaml(d)


def pull_inputs(wildcards):
    """The local mirror is an input of the pull, so a changed mirror re-pulls."""
    for exp in buildable():
        cfg = exp_config(exp)
        if data_root(cfg) == wildcards.root and cfg.data.source == "local":
            return [cfg.data.local_path]
    return []


def root_of(wildcards):
    return data_root(exp_config(wildcards.exp))


def tokenizer_of(wildcards):
    return exp_config(wildcards.exp).data.tokenizer


def shards_of(wildcards):
    """The token shards' manifests; with data groups, the grouped shards' too (tokenize_groups)."""
    cfg = exp_config(wildcards.exp)
    tok = Path(cfg.data.tokenizer)
    return [str(tok.with_name("shards.json"))] + ([str(tok.parent / "mix" / "groups.json")] if cfg.data.groups else [])


def split_of(name):
    def f(wildcards):
        return f"{root_of(wildcards)}/megachat/{name}.parquet"
    return f


def published_of(wildcards):
    """The experiment's published run; evaluate compares only a run without overrides with it."""
    p = REPO / "docs" / "published" / f"{EXP_OF_RUN.get(wildcards.exp, wildcards.exp)}.json"
    return [os.path.relpath(p)] if p.is_file() else []  # relative: reports name it as in the repo


def published_arg(wildcards, input):
    p = input.published  # a file name, or an empty list when nothing is published
    paths = [p] if isinstance(p, str) else list(p)
    return " ".join(f"--published {shlex.quote(str(x))}" for x in paths)


def train_args(wildcards):
    """Arguments of python -m andrea.train: the experiment, the run's name (exp=) and the overrides
    but eval.* ones, which only matter to evaluate (its stage file)."""
    name = wildcards.exp
    # a run name with overrides holds = and , which Hydra's override grammar would parse: quoted for
    # Hydra inside double quotes for the shell (run names hold only letters, digits and ._=,+-)
    exp = f"exp={name}" if re.fullmatch(r"[A-Za-z0-9._-]+", name) else f"\"exp='{name}'\""
    args = [f"experiment={EXP_OF_RUN[name]}", *runs.training_overrides(OVERRIDES)]
    return " ".join([args[0], exp, *(shlex.quote(a) for a in args[1:])])


RANKS = int(config["ranks"])
LAUNCHER = str(config["launcher"] or "")
ZERO1 = bool(config["zero1"])
NODES = int(config["nodes"])
if NODES > 1 and not (RANKS > 1 and LAUNCHER.split()[:1] == ["srun"] and RANKS % NODES == 0):
    raise WorkflowError(f"config/config.yaml or --config: nodes={NODES} with ranks={RANKS}, launcher={LAUNCHER!r}; "
                        "expected 1, or launcher=srun and ranks a multiple of nodes (ranks=8 nodes=2 launcher=srun)")


def train_resources(cfg):
    """(gpus, host MiB) of a training run: a GPU when it must run on CUDA (backend=cuda, or fp16 /
    bf16, which the NumPy engine does not run); the engine's own memory plan (every buffer it will
    allocate) plus 2 GiB for the interpreter, data loader and records. Both per rank, times the
    ranks (config ranks: every rank holds the whole plan, under ZeRO-1 with its shard of the Adam
    moments)."""
    from andrea.core.plan import make_plan

    gpus = 1 if cfg.backend.name == "cuda" or cfg.train.precision != "fp32" else 0
    plan = make_plan(cfg, shards=RANKS if ZERO1 and RANKS > 1 else 0)  # ZeRO-1: each rank its shard of Adam
    return gpus * RANKS, (plan.total() // 2**20 + 2048) * RANKS


def train_launch(wildcards):
    """The command that trains: python3 -m andrea.train (one rank); with config ranks = N > 1,
    python3 -m andrea.train --ranks N (mpirun on this machine), or, with a launcher, `<launcher>
    -n N python3 -m andrea.train` (srun inside a Slurm job: the ranks may span its nodes)."""
    if RANKS == 1:
        return "python3 -m andrea.train"
    zero1 = " --zero1" if ZERO1 else ""  # config zero1: the Adam state sharded over the ranks (ZeRO-1)
    if LAUNCHER and NODES > 1:  # srun (checked): the same number of ranks on every node of the job
        per_node = f"--nodes={NODES} --ntasks-per-node={RANKS // NODES}"
        return f"{LAUNCHER} -n {RANKS} {per_node} python3 -m andrea.train{zero1}"
    if LAUNCHER:
        return f"{LAUNCHER} -n {RANKS} python3 -m andrea.train{zero1}"
    return f"python3 -m andrea.train --ranks {RANKS}{zero1}"


def train_slurm_tasks(wildcards):
    """Slurm tasks of a train job (snakemake-executor-plugin-slurm's `tasks`): the ranks when a
    launcher starts them, else 0 (the plugin's default of one task)."""
    return RANKS if RANKS > 1 and LAUNCHER else 0


def train_slurm_tasks_per_gpu(wildcards):
    """One rank per GPU when a launcher starts several; 0 leaves the plugin's default."""
    return 1 if RANKS > 1 and LAUNCHER and train_gpus(wildcards) else 0


def train_slurm_nodes(wildcards):
    """Slurm nodes of a train job (the plugin's `nodes`, sbatch --nodes): config nodes when a
    launcher starts several ranks (checked where NODES is read), else 1."""
    return NODES


def train_mpi(wildcards):
    """The plugin's `mpi` resource: set (the launcher) only when it starts several ranks."""
    return LAUNCHER if RANKS > 1 else ""


def train_gpus(wildcards):
    return train_resources(exp_config(wildcards.exp))[0]


def train_mem_mb(wildcards):
    return train_resources(exp_config(wildcards.exp))[1]


def show_failed_logs(main_log, lines=25):
    """onerror: the last lines of each failed step's log, on the terminal under Snakemake's error."""
    logs = [main_log] if isinstance(main_log, (str, Path)) else list(main_log or [])  # Snakemake 9: a list
    text = ""
    for f in logs:
        try:
            text += Path(f).read_text(errors="replace")
        except (OSError, TypeError):
            pass
    seen = []
    for m in re.finditer(r"log: (.+?) \(check log file", text):
        for path in m.group(1).split(", "):
            if path not in seen and Path(path).is_file():
                seen.append(path)
    for path in seen:
        tail = Path(path).read_text(errors="replace").replace("\r", "\n").splitlines()[-lines:]
        print(f"--- last {len(tail)} lines of {path} ---", *tail, f"--- end of {path} ---", sep="\n",
              file=sys.stderr)


def parent_of_output(wildcards, output):
    return str(Path(output[0]).parent)


def run_dir(wildcards, output):
    return str(Path(output.report).parent)


def experiment_targets(exps):
    """The reports of these experiments' runs (under the workflow's overrides)."""
    return [f"results/{RUNS[e]}/report.md" for e in exps]


# The software of every step: a conda environment with the andrea package (pyproject.toml), used
# with --use-conda. Snakemake reads the file even without that flag, so it is named only when
# the checkout has it.
ENV = "../envs/andrea.yaml" if (REPO / "workflow" / "envs" / "andrea.yaml").is_file() else None
