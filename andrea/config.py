"""Config schemas: one dataclass per Hydra config group, registered in Hydra's ConfigStore.

The dataclasses hold every default and type; YAML files under conf/ hold only what changes. Hydra
validates each YAML against these schemas, so a typo or a wrong type fails with the key's name.
The engine reads the same resolved config (as a plain dict or YAML file) through `load_run_config`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import II, OmegaConf


@dataclass
class ModelConfig:
    name: str = "ANDREA-tiny"  # family member, for reports
    n_layer: int = 2  # L, transformer blocks
    d_model: int = 64  # C, residual stream width
    n_head: int = 4  # NH, attention heads; d_model % n_head == 0
    context: int = 64  # maximum sequence length (rows of wpe)
    vocab_size: int = 512  # V, tokenizer vocabulary (rows of wte)


# Where the data steps write and the engine reads: one definition, used by DataConfig's defaults
# and, through data_root / default_data_paths, by the workflow.
DATA_ROOT = "${data.dir}/${data.source}"
# train.* settings of an fp8 run that become backend switches of the same names (engine
# apply_fp8_settings); left None they are in neither the backend nor the run's config hash
FP8_RUN_SETTINGS = ("fp8_classifier", "fp8_dlogits", "fp8_dlogits_rounding", "fp8_scaling")
TOKENIZED = DATA_ROOT + "/tok${data.tokenizer_vocab}"
DATA_FILES = ("tokenizer", "train_shards", "val_shards")


@dataclass
class GroupConfig:
    name: str = ""  # a group of the data mix (docs/FIREHOSE-BANDIT.md)
    train_shards: str = ""  # glob of the group's training token shards
    val_shards: str = ""  # optional glob of its held-out shards (per-group validation loss)


# data.mixer's allowed values (andrea/data/mixer.py makes the mixers)
MIXER_KINDS = ("uniform", "fixed", "bandit")
MIXER_REWARDS = ("loss", "progress")


@dataclass
class MixerConfig:
    kind: str = "uniform"  # uniform | fixed | bandit (MIXER_KINDS): which group each step is drawn from
    reward: str = "loss"  # bandit reward: loss (Online Data Mixing) | progress (smoothed-loss decrease)
    alpha: float = 0.99  # bandit: decay of the importance-weighted rewards per step (1 = plain EXP3)
    beta: float = 0.9  # smoothing of each group's training loss over its visits
    reward_scale: float = 1.0  # bandit: multiplies the reward before the update
    weights: List[float] = field(default_factory=list)  # fixed: one non-negative weight per group


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | local | hub
    hub_repo: str = "NousResearch/Hermes-3-Dataset"  # used when source=hub
    revision: str = "main"  # pinned dataset revision (commit sha) for source=hub
    local_path: str = ""  # parquet or jsonl mirror, for source=local
    n_synthetic: int = 4000  # conversations generated when source=synthetic
    max_conversations: int = 0  # cap on pulled conversations (0 = all)
    val_fraction: float = 0.05  # share of conversations held out, by hash
    seed: int = 1234  # synthetic generation seed
    dir: str = "data"  # where pulled and prepared data lives
    # BPE entries the tokenizer is trained to; the embedding keeps model.vocab_size rows (>= this)
    tokenizer_vocab: int = II("model.vocab_size")
    # what the engine reads; the workflow writes them (token shards: andrea/data/shards.py)
    tokenizer: str = TOKENIZED + "/tokenizer.json"
    train_shards: str = TOKENIZED + "/train_*.bin"
    val_shards: str = TOKENIZED + "/val_*.bin"
    # the data mix: with groups, each step is drawn from the group the mixer picks; without
    # (the default) train_shards is read as one stream and the mixer is not used
    groups: List[GroupConfig] = field(default_factory=list)
    mixer: MixerConfig = field(default_factory=MixerConfig)


LOSS_ON = ("all", "assistant")  # train.phases[].loss_on


@dataclass
class PhaseConfig:
    name: str = "pretrain"  # phase name, used in archive/<phase>-<step>/
    start_step: int = 0  # first step of this phase
    lr: Optional[float] = None  # peak lr of the phase (None: train.lr)
    # which targets the phase's loss counts: all | assistant (the tokens of the chat template's
    # assistant turns, the others ignored; docs/ARCHITECTURE.md "The ignore index")
    loss_on: str = "all"


@dataclass
class TrainConfig:
    seed: int = 1337  # weight init and data order
    steps: int = 300  # optimizer steps
    batch_size: int = 8  # B, sequences per microbatch
    seq_len: int = 64  # T, tokens per sequence (<= model.context)
    grad_accum: int = 1  # microbatches per optimizer step
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine schedule
    warmup_steps: int = 20  # linear warm-up from 0 to lr
    weight_decay: float = 0.1  # decoupled, matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip (0 = off)
    precision: str = "fp32"  # fp32 | fp16 | bf16 | fp8 (all but fp32 on the GPU only; fp8 on cc >= 8.9)
    # fp8 only: the classifier's products in FP8 too, 0 none | 1 dX and dW | 2 the logits as well
    # (None: the backend's default, 2; docs/FP8.md "The classifier in FP8"), and the format of its
    # dlogits, e4m3 | e5m2 (None: e4m3), and how dlogits are rounded onto the FP8 grid, nearest |
    # stochastic (None: stochastic), and how the MLP's act and dact are scaled, current | delayed
    # (None: delayed; docs/FP8.md "Delayed scaling"). Left None they are not part of the run's
    # config hash.
    fp8_classifier: Optional[int] = None
    fp8_dlogits: Optional[str] = None
    fp8_dlogits_rounding: Optional[str] = None
    fp8_scaling: Optional[str] = None
    init_std: float = 0.02  # normal init of matrices and embeddings
    ckpt_every: int = 100  # steps between checkpoints (0 = only at the end)
    keep_last: int = 3  # checkpoints kept; the newest good one is never deleted
    eval_every: int = 100  # steps between validation losses (0 = never)
    eval_batches: int = 4  # microbatches per validation loss
    sample_every: int = 0  # steps between samples from fixed prompts (0 = never)
    log_every: int = 1  # steps between records
    max_bad_steps: int = 5  # consecutive NaN/Inf steps before aborting
    loss_scale: float = 65536.0  # initial dynamic loss scale (fp16)
    phases: List[PhaseConfig] = field(default_factory=list)  # optional pretrain -> polish pivot


@dataclass
class BackendConfig:
    name: str = "auto"  # auto | numpy | cuda (the current CUDA device: set CUDA_VISIBLE_DEVICES to pick one)


@dataclass
class EvalConfig:
    batches: int = 16  # validation microbatches for the final report
    prompts: List[str] = field(default_factory=lambda: ["What is 12 + 7?", "Sort: 5 3 9 1"])
    max_new_tokens: int = 48
    temperature: float = 0.0  # 0 = greedy
    seed: int = 7
    n_tasks: int = 200  # held-out synthetic tasks for exact-match accuracy
    tolerance: float = 0.05  # allowed |val_loss - published| for PASS
    log_scale: bool = False  # report's loss plot on a logarithmic axis
    # standard in-context tasks scored for the report (andrea/tasks, docs/EVALUATION.md): task names
    # or a suite (core, gauntlet), comma-separated; "" none
    tasks: str = ""
    task_data: str = ""  # folder of their JSONL files; "" skips them (the report says so)
    task_limit: int = 0  # score the first N items of each task (0: all)


TRACKERS = ("tensorboard", "mlflow", "wandb")  # proxy.trackers' allowed values
OBJECTIVES = ("val_loss", "loss", "tokens_per_s", "grad_norm", "wall_s")  # objective's allowed values


@dataclass
class ProxyConfig:
    max_restarts: int = 5  # engine crashes in a row (no new checkpoint between) before giving up
    restart_backoff_s: float = 2.0  # first wait before a restart; doubles per failure in a row
    restart_backoff_max_s: float = 60.0  # ceiling of that wait
    record_flush_s: float = 1.0  # least seconds between rewrites of <exp>.loss.json
    # experiment trackers fed from the records, offline, under <run>/trackers/ (opt-in, any subset of
    # TRACKERS; a missing package is one warning line, andrea/run/proxy/trackers.py)
    trackers: List[str] = field(default_factory=list)


@dataclass
class AndreaConfig:
    exp: str = "ANDREA-tiny"  # run name = results/<exp>: the experiment, + its overrides (andrea/pipeline/runs.py)
    results_dir: str = "results"
    overrides: List[str] = field(default_factory=list)  # command-line overrides of the run (set by andrea.train)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    # what a sweep's task returns (Optuna, Nevergrad, Ax sweepers minimise or maximise it): the last
    # value of this field of the loss history (OBJECTIVES); it never names a run
    objective: str = "val_loss"


def register_configs() -> None:
    """Put the root schema in Hydra's ConfigStore; it types every group through its fields, so no
    group needs a schema option of its own (which --help would list beside the real options)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="andrea_schema", node=AndreaConfig)


def load_run_config(source: Any) -> AndreaConfig:
    """A typed AndreaConfig from a YAML path, a dict or an OmegaConf node; unknown keys fail."""
    schema = OmegaConf.structured(AndreaConfig)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"config {path}: no such file")
        data = OmegaConf.load(path)
    else:
        data = OmegaConf.create(source) if isinstance(source, dict) else source
    merged = OmegaConf.merge(schema, data)
    cfg = OmegaConf.to_object(merged)
    try:
        validate(cfg)
    except ValueError as e:
        if isinstance(source, (str, Path)):
            raise ValueError(f"config {source}: {e}") from None
        raise
    return cfg


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# (field, test, what is expected); every numeric setting is checked before anything runs, so a
# NaN learning rate or a zero batch never reaches the engine
_RULES = [
    ("model.n_layer", lambda x: x >= 1, "an integer >= 1"),
    ("model.d_model", lambda x: x >= 1, "an integer >= 1"),
    ("model.n_head", lambda x: x >= 1, "an integer >= 1"),
    ("model.context", lambda x: x >= 1, "an integer >= 1"),
    ("model.vocab_size", lambda x: 2 <= x <= 65535, "an integer from 2 to 65535 (shards store uint16 tokens)"),
    ("data.n_synthetic", lambda x: x >= 1, "an integer >= 1"),
    ("data.max_conversations", lambda x: x >= 0, "an integer >= 0 (0 = all)"),
    ("data.val_fraction", lambda x: _finite(x) and 0 < x < 1, "a number between 0 and 1 (exclusive)"),
    ("data.seed", lambda x: x >= 0, "an integer >= 0"),
    ("train.seed", lambda x: x >= 0, "an integer >= 0"),
    ("train.steps", lambda x: x >= 1, "an integer >= 1"),
    ("train.batch_size", lambda x: x >= 1, "an integer >= 1"),
    ("train.seq_len", lambda x: x >= 1, "an integer >= 1"),
    ("train.grad_accum", lambda x: x >= 1, "an integer >= 1"),
    ("train.lr", lambda x: _finite(x) and x > 0, "a finite number > 0"),
    ("train.min_lr", lambda x: _finite(x) and x >= 0, "a finite number >= 0"),
    ("train.warmup_steps", lambda x: x >= 0, "an integer >= 0"),
    ("train.weight_decay", lambda x: _finite(x) and x >= 0, "a finite number >= 0"),
    ("train.beta1", lambda x: _finite(x) and 0 <= x < 1, "a number in [0, 1)"),
    ("train.beta2", lambda x: _finite(x) and 0 <= x < 1, "a number in [0, 1)"),
    ("train.eps", lambda x: _finite(x) and x > 0, "a finite number > 0"),
    ("train.grad_clip", lambda x: _finite(x) and x >= 0, "a finite number >= 0 (0 = off)"),
    ("train.init_std", lambda x: _finite(x) and x > 0, "a finite number > 0"),
    ("train.ckpt_every", lambda x: x >= 0, "an integer >= 0 (0 = only at the end)"),
    ("train.keep_last", lambda x: x >= 1, "an integer >= 1"),
    ("train.eval_every", lambda x: x >= 0, "an integer >= 0 (0 = never)"),
    ("train.eval_batches", lambda x: x >= 0, "an integer >= 0"),
    ("train.sample_every", lambda x: x >= 0, "an integer >= 0 (0 = never)"),
    ("train.log_every", lambda x: x >= 1, "an integer >= 1"),
    ("train.max_bad_steps", lambda x: x >= 1, "an integer >= 1"),
    ("train.loss_scale", lambda x: _finite(x) and x >= 1, "a finite number >= 1"),
    ("eval.batches", lambda x: x >= 1, "an integer >= 1"),
    ("eval.max_new_tokens", lambda x: x >= 0, "an integer >= 0"),
    ("eval.temperature", lambda x: _finite(x) and x >= 0, "a finite number >= 0 (0 = greedy)"),
    ("eval.seed", lambda x: x >= 0, "an integer >= 0"),
    ("eval.n_tasks", lambda x: x >= 0, "an integer >= 0"),
    ("eval.tolerance", lambda x: _finite(x) and x >= 0, "a finite number >= 0"),
    ("eval.task_limit", lambda x: x >= 0, "an integer >= 0 (0: every item)"),
    ("proxy.max_restarts", lambda x: x >= 0, "an integer >= 0"),
    ("proxy.restart_backoff_s", lambda x: _finite(x) and x >= 0, "a finite number of seconds >= 0"),
    ("proxy.restart_backoff_max_s", lambda x: _finite(x) and x >= 0, "a finite number of seconds >= 0"),
    ("proxy.record_flush_s", lambda x: _finite(x) and x >= 0, "a finite number of seconds >= 0"),
]


def validate(cfg: AndreaConfig) -> None:
    """Every numeric setting in its range, and the cross-field checks the type system cannot
    express; the first problem found is a ValueError naming the field, its value and what was
    expected."""
    for name, ok, expected in _RULES:
        group, key = name.split(".")
        value = getattr(getattr(cfg, group), key)
        if not ok(value):
            raise ValueError(f"{name}={value!r}: expected {expected}")
    m, t = cfg.model, cfg.train
    if m.d_model % m.n_head:
        raise ValueError(f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}")
    if t.seq_len > m.context:
        raise ValueError(f"train.seq_len={t.seq_len} exceeds model.context={m.context}")
    if t.precision not in ("fp32", "fp16", "bf16", "fp8"):
        raise ValueError(f"train.precision={t.precision!r}: expected fp32, fp16, bf16 or fp8")
    if t.fp8_classifier not in (None, 0, 1, 2):
        raise ValueError(f"train.fp8_classifier={t.fp8_classifier!r}: expected 0 (bf16), 1 (dX and dW in FP8) "
                         "or 2 (the logits too)")
    if t.fp8_dlogits not in (None, "e4m3", "e5m2"):
        raise ValueError(f"train.fp8_dlogits={t.fp8_dlogits!r}: expected e4m3 or e5m2")
    if t.fp8_dlogits_rounding not in (None, "nearest", "stochastic"):
        raise ValueError(f"train.fp8_dlogits_rounding={t.fp8_dlogits_rounding!r}: expected nearest or stochastic")
    if t.fp8_scaling not in (None, "current", "delayed"):
        raise ValueError(f"train.fp8_scaling={t.fp8_scaling!r}: expected current or delayed")
    for key in FP8_RUN_SETTINGS:
        if getattr(t, key) is not None and t.precision != "fp8":
            raise ValueError(f"train.{key}={getattr(t, key)!r} applies to train.precision=fp8 only "
                             f"(this run's is {t.precision})")
    if cfg.backend.name not in ("auto", "numpy", "cuda"):
        raise ValueError(f"backend.name={cfg.backend.name!r}: expected auto, numpy or cuda")
    if cfg.data.tokenizer_vocab > m.vocab_size:
        raise ValueError(f"data.tokenizer_vocab={cfg.data.tokenizer_vocab} exceeds model.vocab_size={m.vocab_size}: "
                         "the embedding needs a row for every token id")
    if t.eval_every > 0 and t.eval_batches < 1:
        raise ValueError(f"train.eval_batches={t.eval_batches}: expected an integer >= 1 when "
                         f"train.eval_every={t.eval_every} > 0 (a validation loss needs a batch)")
    for name in cfg.proxy.trackers:
        if name not in TRACKERS:
            raise ValueError(f"proxy.trackers={list(cfg.proxy.trackers)}: {name!r} is no tracker; expected any of "
                             f"{', '.join(TRACKERS)}")
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"objective={cfg.objective!r}: expected one of {', '.join(OBJECTIVES)} (a field of the loss history)")
    if cfg.proxy.restart_backoff_max_s < cfg.proxy.restart_backoff_s:
        raise ValueError(f"proxy.restart_backoff_max_s={cfg.proxy.restart_backoff_max_s!r} is below "
                         f"proxy.restart_backoff_s={cfg.proxy.restart_backoff_s!r}: expected the ceiling >= the first wait")
    prev = -1
    for i, ph in enumerate(t.phases):
        where = f"train.phases[{i}]"
        if not (prev < ph.start_step < t.steps):
            raise ValueError(f"{where}.start_step={ph.start_step}: expected phases in increasing start_step "
                             f"order, each in [0, train.steps={t.steps})")
        if ph.lr is not None and not (_finite(ph.lr) and ph.lr > 0):
            raise ValueError(f"{where}.lr={ph.lr!r}: expected a finite number > 0 (or null for train.lr)")
        if not ph.name:
            raise ValueError(f"{where}.name is empty: expected a phase name")
        if ph.loss_on not in LOSS_ON:
            raise ValueError(f"{where}.loss_on={ph.loss_on!r}: expected one of {', '.join(LOSS_ON)}")
        prev = ph.start_step
    validate_mix(cfg.data)


def validate_mix(d: DataConfig) -> None:
    """data.groups and data.mixer (docs/FIREHOSE-BANDIT.md)."""
    mx, names = d.mixer, [g.name for g in d.groups]
    if mx.kind not in MIXER_KINDS:
        raise ValueError(f"data.mixer.kind={mx.kind!r}: expected one of {', '.join(MIXER_KINDS)}")
    if mx.reward not in MIXER_REWARDS:
        raise ValueError(f"data.mixer.reward={mx.reward!r}: expected one of {', '.join(MIXER_REWARDS)}")
    if not 0.0 < mx.alpha <= 1.0:
        raise ValueError(f"data.mixer.alpha={mx.alpha}: expected a number in (0, 1]")
    if not 0.0 <= mx.beta < 1.0:
        raise ValueError(f"data.mixer.beta={mx.beta}: expected a number in [0, 1)")
    for i, g in enumerate(d.groups):
        if not g.name or not g.train_shards:
            raise ValueError(f"data.groups[{i}]: expected a name and a train_shards glob, got "
                             f"name={g.name!r} train_shards={g.train_shards!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"data.groups: names {names} repeat; each group needs its own name")
    if not d.groups and mx.kind != "uniform":
        raise ValueError(f"data.mixer.kind={mx.kind} needs data.groups (a name and a shard glob each); "
                         "without groups the train shards are one stream")
    if mx.kind == "fixed":
        w = mx.weights
        if len(w) != len(names) or any(not (x >= 0) for x in w) or not sum(w) > 0:
            raise ValueError(f"data.mixer.weights={list(w)}: kind=fixed needs {len(names)} non-negative "
                             f"weights (one per group of data.groups {names}), not all zero")


def _fill(template: str, cfg: AndreaConfig) -> str:
    node = OmegaConf.create({"data": {"dir": cfg.data.dir, "source": cfg.data.source,
                                      "tokenizer_vocab": cfg.data.tokenizer_vocab},
                             "model": {"vocab_size": cfg.model.vocab_size}, "path": template})
    return str(node.path)


def data_root(cfg: AndreaConfig) -> str:
    """<data.dir>/<data.source>: the folder the data steps of cfg write into."""
    return _fill(DATA_ROOT, cfg)


def default_data_paths(cfg: AndreaConfig) -> dict:
    """{tokenizer, train_shards, val_shards} as DataConfig's defaults give them for cfg's data.dir,
    data.source and data.tokenizer_vocab, whatever cfg itself sets them to."""
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.name in DATA_FILES}
    return {k: _fill(v, cfg) for k, v in defaults.items()}


def to_dict(cfg: AndreaConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: AndreaConfig) -> str:
    """sha256 of what determines the training trajectory (model + train + seed), for resume checks.

    Keys that do not change the numbers (checkpoint cadence, logging) are left out so a resumed run
    may change them.
    """
    d = to_dict(cfg)
    train = {k: v for k, v in d["train"].items()
             if k not in ("ckpt_every", "keep_last", "log_every", "sample_every", "eval_every",
                          "eval_batches")
             and not (k in FP8_RUN_SETTINGS and v is None)}  # unset: hashes as before
    # a phase's loss_on=all is the loss every run had before the field existed: hashes as before
    train["phases"] = [{k: v for k, v in ph.items() if not (k == "loss_on" and v == "all")}
                       for ph in train["phases"]]
    key = {"model": d["model"], "train": train}
    if d["data"]["groups"]:  # the data mix decides the trajectory too (absent: hashes as before)
        key["mix"] = {"groups": d["data"]["groups"], "mixer": d["data"]["mixer"]}
    blob = json.dumps(key, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
