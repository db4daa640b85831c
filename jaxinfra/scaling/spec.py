"""Sweep specs: a YAML file -> a validated `SweepSpec` -> one `RunPlan` (with its Config) per run.

A spec is a base config plus the runs to derive from it:

    name: cpu-isoflop
    base: tiny                      # preset, YAML path (relative to the spec file) or inline mapping
    overrides: [train.eval_every=0] # dotted overrides applied to the base, as on `jaxinfra train`
    sizes:                          # exactly one of depths / params / models
      rule: {aspect_ratio: 32, head_dim: 32, mlp_ratio: 3, multiple_of: 32, gqa_group: 1}
      depths: [1, 2, 3]             # or params: [1e5, 3e5, 1e6] (target non-embedding N)
      # models: [{name: s, d_model: 64, num_layers: 2, num_heads: 2, mlp_dim: 192, lr: 3e-3}]
    isoflop: {compute: [1e13, 3e13], min_steps: 10}   # or grid: {tokens: [2e5, 4e5]}
                                                      #    or grid: {tokens_per_param: [10, 20]}
    lr: {base: 3e-3, reference_d_model: 128, width_exponent: 1.0}
    schedule: {warmup_fraction: 0.1}
    launcher: {slurm: {...}, k8s: {...}, jobset: {...}, retries: 2}  # runner.py, jaxinfra/cluster/
    fit: {metric: eval/hellaswag/acc, higher_is_better: true}  # fit a task metric (default: final eval loss)

Budgets become steps with the base config's global batch and sequence length
(tokens per step = train.batch_size x train.seq_len), rounded to whole steps; the table
reports the realised D = steps x tokens per step and C = flops_per_token(N) x D, with
flops_per_token from `jaxinfra.metrics.flops` (6N + attention, the same count MFU uses).

* grid: every size x every token budget D (or D = tokens_per_param x N, N = all parameters).
* isoflop: for each compute budget C and each size, D = C / flops_per_token(N): the
  IsoFLOP profiles of Hoffmann et al. 2022 ("Training Compute-Optimal Large Language
  Models"), approach 2. Runs shorter than `min_steps` are dropped (and listed).
* lr rule: lr = base x (reference_d_model / d_model) ^ width_exponent (0: one lr for all;
  1: the muP-style 1/width rule for Adam on hidden matrices); a size may set its own lr.
* schedule rule: every run decays over its own length (train.steps is set per run, and
  the base schedule -- cosine by default -- decays to it, as Hoffmann et al. 2022 found
  necessary, section 3.1); warmup_fraction sets warmup_steps = round(fraction x steps).

Every run's trackers are grouped under the sweep's name: `log.wandb.group` and `log.mlflow.group`
default to it (and `log.mlflow.experiment`, when MLflow is on); explicit settings win.
`fit.metric` names a metric of the runs' metrics.jsonl (e.g. an lm-eval score `eval/<task>/<metric>`
logged during training) to fit in place of the final eval loss (jaxinfra/scaling/results.py).

Every mistake raises `ConfigError` with one line naming the spec key.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
from typing import Any

import yaml

from jaxinfra.cluster.jobset import JobSetSpec, check_spec
from jaxinfra.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_tree,
    from_dict,
    load_yaml,
    require_file,
    validate,
)
from jaxinfra.metrics.flops import flops_per_token, param_counts
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.scaling.sizes import (
    ModelSize,
    SizeRule,
    sizes_from_depths,
    sizes_from_list,
    sizes_from_targets,
)
from jaxinfra.storage import as_path, check_bucket, is_url
from models.config import ModelConfig

# ---------------------------------------------------------------- the spec's sections


@dataclasses.dataclass(frozen=True)
class SizesSpec:
    rule: SizeRule = SizeRule()
    depths: tuple[int, ...] = ()
    params: tuple[float, ...] = ()  # target non-embedding parameter counts


@dataclasses.dataclass(frozen=True)
class GridSpec:
    tokens: tuple[float, ...] = ()  # token budgets D
    tokens_per_param: tuple[float, ...] = ()  # D = ratio x N (all parameters)


@dataclasses.dataclass(frozen=True)
class IsoflopSpec:
    compute: tuple[float, ...] = ()  # compute budgets C in FLOPs
    min_steps: int = 1  # runs that would be shorter are dropped


@dataclasses.dataclass(frozen=True)
class FitSpec:
    metric: str | None = None  # a metrics.jsonl key (its last value per run); None: the final eval loss
    higher_is_better: bool = False  # an accuracy-like score in [0, 1]: the fit is on 1 - metric (the error)


@dataclasses.dataclass(frozen=True)
class LrRule:
    base: float | None = None  # None: the base config's optimizer.lr
    reference_d_model: int | None = None  # None: the base config's model.d_model
    width_exponent: float = 0.0


@dataclasses.dataclass(frozen=True)
class ScheduleRule:
    warmup_fraction: float | None = None  # None: keep the base config's schedule.warmup_steps


@dataclasses.dataclass(frozen=True)
class SlurmSpec:
    """`#SBATCH` settings of the job-array script (runner.write_slurm)."""

    job_name: str | None = None  # None: the sweep's name
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    max_parallel: int | None = None  # array throttle (`--array=0-N%max_parallel`)
    setup: tuple[str, ...] = ()  # shell lines run before the command (module load, source venv)
    extra: tuple[str, ...] = ()  # further `#SBATCH` options, e.g. "--mem=64G"


@dataclasses.dataclass(frozen=True)
class K8sSpec:
    """The Indexed Job's pod settings (runner.write_k8s)."""

    job_name: str | None = None  # None: the sweep's name (lower-cased, DNS-safe)
    namespace: str | None = None
    image: str = "jaxinfra:latest"
    workdir: str = "/workspace"  # commands run here; the out dir must be on a volume under it
    pvc: str | None = None  # PersistentVolumeClaim mounted at workdir
    gpus: int = 0  # nvidia.com/gpu per pod
    cpu: str | None = None
    memory: str | None = None
    parallelism: int | None = None  # pods at once; None: all
    backoff_limit_per_index: int = 1
    setup: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LauncherSpec:
    slurm: SlurmSpec = SlurmSpec()
    k8s: K8sSpec = K8sSpec()
    jobset: JobSetSpec = JobSetSpec()  # one JobSet per run (--launcher jobset): image, hosts, accelerator, ...
    # resubmissions of a run whose attempt ended 75 (preempted) or 70 (hung, peer lost) or
    # vanished (node lost), by `sweep --submit --wait`; 2, 3 and 74 are never retried
    retries: int = 2


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A parsed, validated spec; `base` is the resolved base config tree (overrides applied)."""

    name: str
    base: dict[str, Any]
    base_config: Config
    sizes: tuple[ModelSize, ...]
    grid: GridSpec | None
    isoflop: IsoflopSpec | None
    lr: LrRule
    schedule: ScheduleRule
    launcher: LauncherSpec
    out: str | None
    source: str | None = None
    fit: FitSpec = FitSpec()

    @property
    def mode(self) -> str:
        return "isoflop" if self.isoflop is not None else "grid"


@dataclasses.dataclass(frozen=True)
class _Top:  # the keys of a spec file other than base/sizes/grid/isoflop (parsed apart)
    name: str = "sweep"
    overrides: tuple[str, ...] = ()
    lr: LrRule = LrRule()
    schedule: ScheduleRule = ScheduleRule()
    launcher: LauncherSpec = LauncherSpec()
    out: str | None = None
    fit: FitSpec = FitSpec()


_SPECIAL = ("base", "sizes", "grid", "isoflop")
TOP_KEYS = (*_SPECIAL, *(f.name for f in dataclasses.fields(_Top)))


# ---------------------------------------------------------------- loading


def load_spec(source: str | pathlib.Path | dict[str, Any], overrides: list[str] | None = None) -> SweepSpec:
    """A spec file path (or an already-parsed mapping) -> SweepSpec; `overrides` go onto the base."""
    where = None
    if isinstance(source, dict):
        data, spec_dir = source, pathlib.Path.cwd()
    else:
        path = pathlib.Path(source)
        require_file(path, "sweep spec", str(source))
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: invalid YAML ({str(e).splitlines()[0]})") from None
        where, spec_dir = str(source), path.parent
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'sweep spec'}: top level must be a mapping (keys: {', '.join(TOP_KEYS)})")
    try:
        return _parse(dict(data), spec_dir, list(overrides or []), where)
    except ConfigError as e:
        raise ConfigError(f"sweep spec{' ' + where if where else ''}: {e}") from None


def _parse(data: dict[str, Any], spec_dir: pathlib.Path, cli_overrides: list[str], where: str | None) -> SweepSpec:
    for key in data:
        if key not in TOP_KEYS:
            close = difflib.get_close_matches(str(key), TOP_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{key}'{hint}; allowed: {', '.join(TOP_KEYS)}")
    special = {k: data.pop(k) for k in _SPECIAL if k in data}
    top = from_dict(_Top, data, "")
    if not top.name or "/" in top.name:
        raise ConfigError(f"name={top.name!r} is invalid: must be a non-empty name without '/'")
    base_tree = _base_tree(special.get("base", "tiny"), spec_dir)
    base_tree = apply_overrides(base_tree, [*top.overrides, *cli_overrides])
    try:
        base_config = config_from_tree(base_tree)  # as `jaxinfra train` loads it (vocabulary from the data)
        validate(base_config)
    except ConfigError as e:
        raise ConfigError(f"base config: {e}") from None
    sizes = _sizes(special.get("sizes"), base_config)
    grid = isoflop = None
    if ("grid" in special) == ("isoflop" in special):
        raise ConfigError("give exactly one of 'grid' (sizes x token budgets) or 'isoflop' (compute budgets)")
    if "grid" in special:
        grid = from_dict(GridSpec, special["grid"], "grid")
        if bool(grid.tokens) == bool(grid.tokens_per_param):
            raise ConfigError("grid: give exactly one of 'grid.tokens' or 'grid.tokens_per_param' (a list)")
        _positive_unique("grid.tokens" if grid.tokens else "grid.tokens_per_param",
                         grid.tokens or grid.tokens_per_param)
    else:
        isoflop = from_dict(IsoflopSpec, special["isoflop"], "isoflop")
        if not isoflop.compute:
            raise ConfigError("isoflop.compute: give a list of compute budgets in FLOPs, e.g. [1e13, 3e13]")
        _positive_unique("isoflop.compute", isoflop.compute)
        if isoflop.min_steps < 1:
            raise ConfigError(f"isoflop.min_steps={isoflop.min_steps} is invalid: must be a positive integer")
    _check_rules(top, base_config)
    return SweepSpec(name=top.name, base=base_tree, base_config=base_config, sizes=tuple(sizes), grid=grid,
                     isoflop=isoflop, lr=top.lr, schedule=top.schedule, launcher=top.launcher, out=top.out,
                     source=where, fit=top.fit)


def _base_tree(base: Any, spec_dir: pathlib.Path) -> dict[str, Any]:
    if isinstance(base, dict):
        return base
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base: expected a preset name, a YAML path or a mapping, got {base!r}")
    local = spec_dir / base
    try:
        return load_yaml(str(local) if base.endswith((".yaml", ".yml")) and local.is_file() else base)
    except ConfigError as e:
        raise ConfigError(f"base: {e}") from None


def _sizes(raw: Any, base: Config) -> list[ModelSize]:
    if raw is None:
        raise ConfigError("sizes: missing; give sizes.depths, sizes.params or sizes.models")
    if not isinstance(raw, dict):
        raise ConfigError(f"sizes: expected a mapping, got {raw!r}")
    raw = dict(raw)
    models = raw.pop("models", None)
    spec = from_dict(SizesSpec, raw, "sizes")
    for key, value, allowed in spec.rule.problems():
        raise ConfigError(f"sizes.rule.{key}={value!r} is invalid: must be {allowed}")
    given = [k for k, v in (("depths", spec.depths), ("params", spec.params), ("models", models)) if v]
    if len(given) != 1:
        raise ConfigError("sizes: give exactly one (non-empty) of 'sizes.depths', 'sizes.params' or "
                          f"'sizes.models'{' (got ' + ', '.join(given) + ')' if given else ''}")
    if spec.depths:
        if len(set(spec.depths)) != len(spec.depths):
            raise ConfigError(f"sizes.depths: values must be unique, got {list(spec.depths)}")
        return sizes_from_depths(spec.rule, spec.depths)
    if spec.params:
        return sizes_from_targets(spec.rule, spec.params, base.model)
    return sizes_from_list(models)


def _positive_unique(key: str, values: tuple[float, ...]) -> None:
    if any(not v > 0 for v in values):
        raise ConfigError(f"{key}: values must be positive, got {list(values)}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{key}: values must be unique, got {list(values)}")


def _check_rules(top: _Top, base: Config) -> None:
    if top.lr.base is not None and top.lr.base <= 0:
        raise ConfigError(f"lr.base={top.lr.base} is invalid: must be > 0")
    if top.lr.reference_d_model is not None and top.lr.reference_d_model < 1:
        raise ConfigError(f"lr.reference_d_model={top.lr.reference_d_model} is invalid: must be a positive integer")
    f = top.schedule.warmup_fraction
    if f is not None and not 0 <= f < 1:
        raise ConfigError(f"schedule.warmup_fraction={f} is invalid: must be in [0, 1)")
    s, k = top.launcher.slurm, top.launcher.k8s
    for key, value in (("launcher.slurm.nodes", s.nodes), ("launcher.slurm.gpus_per_node", s.gpus_per_node),
                       ("launcher.slurm.cpus_per_task", s.cpus_per_task),
                       ("launcher.slurm.max_parallel", s.max_parallel), ("launcher.k8s.parallelism", k.parallelism)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} is invalid: must be a positive integer or null")
    if k.gpus < 0:
        raise ConfigError(f"launcher.k8s.gpus={k.gpus} is invalid: must be >= 0")
    check_spec(top.launcher.jobset, "launcher.jobset.")
    if top.fit.metric is not None and not top.fit.metric.strip():
        raise ConfigError("fit.metric: give a metrics.jsonl key such as eval/<task>/<metric>, or leave it out "
                          "(the final eval loss)")
    if top.launcher.retries < 0:
        raise ConfigError(f"launcher.retries={top.launcher.retries} is invalid: must be >= 0")


# ---------------------------------------------------------------- expansion


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run of a sweep: its resolved config and the numbers the results table carries."""

    name: str
    run_dir: pathlib.Path
    config: Config
    size: str
    N: int  # all parameters
    N_nonemb: int  # non-embedding parameters
    D: int  # training tokens (steps x batch x seq_len)
    C: float  # training FLOPs: flops_per_token x D
    steps: int
    batch_size: int
    seq_len: int
    flops_per_token: float
    lr: float
    budget: float  # the grid's token budget (or tokens per parameter) or the IsoFLOP compute budget
    C_budget: float | None  # the IsoFLOP compute budget (profile label); None in a grid

    @property
    def config_path(self) -> pathlib.Path:
        return self.run_dir / "config.yaml"

    @property
    def command(self) -> list[str]:
        """The exact command that trains this run (after its config.yaml is written)."""
        return ["jaxinfra", "train", str(self.config_path), "--run-dir", str(self.run_dir)]

    def row(self) -> dict[str, Any]:
        """The planned numbers, as written to plan.jsonl."""
        return {"run": self.name, "size": self.size, "N": self.N, "N_nonemb": self.N_nonemb, "D": self.D,
                "C": self.C, "steps": self.steps, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "flops_per_token": self.flops_per_token, "lr": self.lr, "budget": self.budget,
                "C_budget": self.C_budget,
                "d_model": self.config.model.d_model, "num_layers": self.config.model.num_layers,
                "run_dir": str(self.run_dir), "command": " ".join(self.command)}


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: SweepSpec
    out: pathlib.Path
    runs: tuple[RunPlan, ...]
    dropped: tuple[str, ...] = ()  # one line per IsoFLOP run left out for being too short


def budget_label(x: float) -> str:
    """A short, file-name-safe label: 1e13, 2.5e5, 20."""
    text = f"{x:.3g}"
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    return text


def expand(spec: SweepSpec, out: str | pathlib.Path | None = None) -> Plan:
    """Every run of the sweep with its resolved, validated Config (nothing is written)."""
    out_dir = as_path(out or spec.out or f"sweeps/{spec.name}")  # an epath.Path for gs:// / s3://
    if is_url(out_dir):
        check_bucket(str(out_dir), "--out")
    base = _grouped(spec.base_config, spec.name)
    t = base.train
    tokens_per_step = t.batch_size * t.seq_len
    runs: list[RunPlan] = []
    dropped: list[str] = []
    budgets = spec.isoflop.compute if spec.isoflop else (spec.grid.tokens or spec.grid.tokens_per_param)
    for budget in budgets:
        for size in spec.sizes:
            model_cfg = _model_config(base, size)
            counts = param_counts(model_cfg)
            fpt = flops_per_token(model_cfg, t.seq_len)
            if spec.isoflop:
                target_tokens = budget / fpt
                name = f"C{budget_label(budget)}-{size.name}"
            elif spec.grid.tokens:
                target_tokens = budget
                name = f"{size.name}-D{budget_label(budget)}"
            else:
                target_tokens = budget * counts["total"]
                name = f"{size.name}-r{budget_label(budget)}"
            steps = max(1, round(target_tokens / tokens_per_step))
            if spec.isoflop and steps < spec.isoflop.min_steps:
                dropped.append(f"{name}: {steps} steps < isoflop.min_steps={spec.isoflop.min_steps}")
                continue
            lr = _lr_for(spec, size, model_cfg.d_model)
            cfg = _run_config(base, model_cfg, steps, lr, spec.schedule, name)
            tokens = steps * tokens_per_step
            runs.append(RunPlan(
                name=name, run_dir=out_dir / name, config=cfg, size=size.name, N=counts["total"],
                N_nonemb=counts["non_embedding"], D=tokens, C=fpt * tokens, steps=steps,
                batch_size=t.batch_size, seq_len=t.seq_len, flops_per_token=fpt, lr=lr, budget=float(budget),
                C_budget=float(budget) if spec.isoflop else None))
    if not runs:
        raise ConfigError("the sweep has no runs" + (f" ({len(dropped)} dropped for isoflop.min_steps)"
                                                     if dropped else ""))
    return Plan(spec=spec, out=out_dir, runs=tuple(runs), dropped=tuple(dropped))


def _grouped(base: Config, sweep: str) -> Config:
    """The runs' trackers grouped under the sweep's name (W&B group, MLflow `group` tag and experiment
    when MLflow is on); what the spec or an override sets explicitly wins."""
    log = base.log
    wandb = dataclasses.replace(log.wandb, group=log.wandb.group or sweep)
    mlflow = dataclasses.replace(log.mlflow, group=log.mlflow.group or sweep)
    if mlflow.enabled and mlflow.experiment is None:
        mlflow = dataclasses.replace(mlflow, experiment=sweep)
    return dataclasses.replace(base, log=dataclasses.replace(log, wandb=wandb, mlflow=mlflow))


def _model_config(base: Config, size: ModelSize) -> ModelConfig:
    tree = dataclasses.asdict(base.model) | size.model
    try:
        model = from_dict(type(base.model), tree, "model")
    except ConfigError as e:
        raise ConfigError(f"size {size.name}: {e}") from None
    for key, value, allowed in model.problems():
        raise ConfigError(f"size {size.name}: model.{key}={value!r} is invalid: must be {allowed}")
    return model


def _lr_for(spec: SweepSpec, size: ModelSize, d_model: int) -> float:
    if size.lr is not None:
        return size.lr
    rule, base = spec.lr, spec.base_config
    lr = rule.base if rule.base is not None else base.optimizer.lr
    ref = rule.reference_d_model if rule.reference_d_model is not None else base.model.d_model
    return float(lr * (ref / d_model) ** rule.width_exponent)


def _run_config(base: Config, model: ModelConfig, steps: int, lr: float, sched: ScheduleRule, name: str) -> Config:
    schedule = base.schedule
    if sched.warmup_fraction is not None:
        schedule = dataclasses.replace(schedule, warmup_steps=int(round(sched.warmup_fraction * steps)))
    cfg = dataclasses.replace(
        base, model=model, optimizer=dataclasses.replace(base.optimizer, lr=lr),
        schedule=schedule, train=dataclasses.replace(base.train, steps=steps))
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"run {name}: {e}") from None
    return cfg


# ---------------------------------------------------------------- the dry-run table


def si(x: float) -> str:
    """3 significant digits with an SI suffix: 1.23M, 4.5G."""
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def format_plan(plan: Plan) -> str:
    """The table `jaxinfra sweep --dry-run` prints: one line per run."""
    columns = [Column("run")] + [Column(name, align=">") for name in
                                 ("N", "N_nonemb", "D", "C", "steps", "batch", "seq", "lr", "L", "d_model")]
    rows = [[r.name, si(r.N), si(r.N_nonemb), si(r.D), f"{r.C:.3g}", str(r.steps), str(r.batch_size),
             str(r.seq_len), f"{r.lr:.3g}", str(r.config.model.num_layers), str(r.config.model.d_model)]
            for r in plan.runs]
    lines = [format_table(rows, columns)]
    total_c = sum(r.C for r in plan.runs)
    lines.append(f"{len(plan.runs)} runs ({plan.spec.mode}), total {total_c:.3g} FLOPs, "
                 f"{sum(r.steps for r in plan.runs)} steps, out {plan.out}")
    lines += [f"dropped {d}" for d in plan.dropped]
    return "\n".join(lines)
