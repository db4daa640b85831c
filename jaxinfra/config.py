"""One typed run configuration: YAML preset + dotted overrides -> frozen, validated Config.

Every section is a frozen dataclass. Loading is strict: unknown keys (with the
closest known key suggested), wrong types and inconsistent values raise
`ConfigError` with a one-line message that names the key, the value and what is
allowed. Nothing here touches jax, so a bad config fails before any compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

# Only jax-free modules (tests/test_layout.py): a bad config fails before jax loads.
from jaxinfra import storage
from jaxinfra.config_sections import (
    DistillConfig,
    DpoConfig,
    EvalTasksConfig,
    GrpoConfig,
    MlflowConfig,
    SftConfig,
    WandbConfig,
    prompt_data,
)
from jaxinfra.data.config import DataConfig
from models.config import REMAT_POLICIES, ModelConfig
from models.lora_config import LoraConfig, model_problems
from models.quant_config import QuantConfig, group_size_problem
from sharding.config import (
    MESH_AXES,
    ContextImpl,
    MeshConfig,
    MeshError,
    PipelineSettings,
    Schedule,
    Strategy,
    resolve_mesh_sizes,
)
from sharding.ranges import range_problems, ranged


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the key."""


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """How logical axes map onto the mesh (see sharding/rules.py for the tables)."""

    # dp: replicated params and optimizer state; zero1: optimizer state sharded over
    # data+fsdp (ZeRO-1); fsdp: params, grads and optimizer state sharded over fsdp (ZeRO-3).
    # Tensor parallelism (heads, MLP, vocab on `tensor`) applies in every strategy.
    strategy: Strategy = "fsdp"
    sequence_parallel: bool = False  # residual stream split over `tensor` along the sequence
    context_impl: ContextImpl = "allgather"  # when mesh.context > 1
    load_balance: bool = True  # ring: reorder sequence chunks so causal work is even
    # Logical axis -> mesh axes overrides, applied to the param, optimizer and activation tables.
    rules: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Pipeline parallelism over mesh.stage (sharding/pipeline.py): schedule, microbatches per
    # step (per gradient-accumulation step; 0 = one per stage), and for `circular` the layer
    # groups per stage (stage s holds chunks s, s+S, ...). Bubble: (S-1)/(repeats*M + S-1).
    pipeline_schedule: Schedule = "gpipe"
    microbatches: int = ranged(0, 0, note="0: one per stage")
    pipeline_repeats: int = ranged(1, 1)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay and global-norm clipping."""

    name: Literal["adamw"] = "adamw"
    lr: float = ranged(3e-3, 0, lo_open=True)
    beta1: float = ranged(0.9, 0, 1, hi_open=True)  # moment decay rates: 1 would never forget
    beta2: float = ranged(0.95, 0, 1, hi_open=True)
    eps: float = ranged(1e-8, 0, lo_open=True)  # 0: 0/0 = NaN for a parameter whose gradient is all zero
    weight_decay: float = ranged(0.1, 0)  # < 0 would grow the weights
    # Norm scales and embeddings are not decayed unless asked (common practice, e.g. nanoGPT).
    decay_norms: bool = False
    decay_embeddings: bool = False
    clip_grad_norm: float | None = ranged(1.0, 0, lo_open=True, note="null: no clipping")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then the named decay to lr * min_lr_ratio."""

    name: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    warmup_steps: int = ranged(10, 0)
    min_lr_ratio: float = ranged(0.1, 0, 1)
    # wsd (warmup-stable-decay): the last decay_fraction of steps decay linearly.
    decay_fraction: float = ranged(0.2, 0, 1, lo_open=True)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = ranged(200, 1)
    batch_size: int = ranged(16, 1)  # global, in sequences
    seq_len: int = ranged(128, 1)
    seed: int = ranged(0, -2**63, 2**63 - 1)  # any 64-bit integer (jax.random.key takes no more)
    grad_accum_steps: int = ranged(1, 1)  # microbatches per step; batch_size must divide evenly
    eval_every: int = ranged(50, 0, note="0: evaluate only at the end")
    # A step whose loss or gradients are not finite leaves the state unchanged. The run stops (exit 3,
    # the last good checkpoint kept) at the first log step (every log.every steps) at which at least
    # this many consecutive steps were bad: flags are read only there, to avoid a host sync per step.
    max_bad_steps: int = ranged(10, 1)  # 0 would stop like 1: at the first bad step
    # Watchdog: a process that makes no progress for this long (after the first step) dumps its
    # Python stacks, names the step and phase it is stuck in, and exits. 0 disables it.
    step_timeout_s: float = ranged(1800.0, 0, note="0: no watchdog")
    # XLA's persistent compilation cache: a directory, off (false), or null for the default
    # ($XDG_CACHE_HOME/jaxinfra/xla; the JAX_COMPILATION_CACHE_DIR environment variable wins).
    compile_cache: str | bool | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every: int = ranged(0, 0, note="0: only at the end and on preemption")  # steps between checkpoints
    # Newest checkpoints kept; 0 would delete the end-of-run save too (Orbax LatestN), losing the weights.
    keep: int = ranged(3, 1)
    keep_best: bool = False  # also keep the one with the lowest eval loss
    async_save: bool = True
    # What `jaxinfra train --restore PATH` takes: the whole state (and data position), or
    # only the parameters (fresh optimizer, step 0, e.g. for fine-tuning).
    restore: Literal["full", "params"] = "full"


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = ranged(10, 1)  # steps between metric lines (the only host syncs of the loop)
    tensorboard: bool = True
    progress: bool = True
    peak_tflops: float | None = ranged(None, 0, lo_open=True)  # per-device peak for MFU; None: table or CPU probe
    wandb: WandbConfig = WandbConfig()  # W&B run (offline by default); off unless log.wandb.project
    mlflow: MlflowConfig = MlflowConfig()  # MLflow run; off unless log.mlflow.experiment or tracking_uri
    # [start, stop): a jax.profiler trace of these steps into RUN/profile (`jaxinfra profile RUN`).
    profile_steps: tuple[int, ...] = ranged((), 0)


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    parallelism: ParallelismConfig = ParallelismConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    quant: QuantConfig = QuantConfig()  # matmul, weight and KV-cache quantization (docs/quantization.md)
    distill: DistillConfig = DistillConfig()  # off unless distill.teacher or distill.logits
    sft: SftConfig = SftConfig()  # which tokens train when data.source=chat (jaxinfra/sft/)
    lora: LoraConfig = LoraConfig()  # low-rank adapters over a frozen base; off unless lora.rank > 0
    dpo: DpoConfig = DpoConfig()  # preference tuning when data.source=preference (jaxinfra/dpo/)
    grpo: GrpoConfig = GrpoConfig()  # rollouts and rewards when data.source=prompts (jaxinfra/grpo/)
    eval: EvalTasksConfig = EvalTasksConfig()  # lm-eval tasks during training (jaxinfra/harness/)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- loading


def preset_names() -> list[str]:
    root = importlib.resources.files("jaxinfra") / "presets"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_yaml(source: str) -> dict[str, Any]:
    """A preset name (`tiny`) or a path to a YAML file (or a gs:// / s3:// URL of one) -> nested dict."""
    if storage.is_url(source):  # a sweep on a bucket trains OUT/RUN/config.yaml from there
        try:
            text = storage.read_text(source)
        except (FileNotFoundError, IsADirectoryError):
            storage.check_bucket(source, "config")  # names a missing bucket before a missing file
            if storage.as_path(source).is_dir():  # a prefix: e.g. a run dir on the bucket
                raise ConfigError(_directory_as_config(storage.as_path(source), source)) from None
            raise ConfigError(f"config file not found: {source}") from None
        return _parse_yaml(text, source)
    path = pathlib.Path(source)
    resource = importlib.resources.files("jaxinfra") / "presets" / f"{pathlib.PurePath(source).name}.yaml"
    preset = "/" not in source and resource.is_file()  # a preset name wins over a directory of that name
    if path.is_dir() and not preset:
        raise ConfigError(_directory_as_config(path, source))
    if source.endswith((".yaml", ".yml")) or (path.exists() and not path.is_dir()):
        if not path.is_file():
            raise ConfigError(f"config file not found: {source}")
        text = path.read_text()
    else:
        if not preset:
            raise ConfigError(f"unknown preset '{source}': choose one of {preset_names()} or give a YAML path")
        text = resource.read_text()
    return _parse_yaml(text, source)


def require_file(path: Any, what: str, shown: str | None = None) -> None:
    """ConfigError unless `path` (a pathlib or epath Path) is a file: `{what} not found: X`, or for a
    directory `{what} X is a directory, not a file` (a directory is never reported as missing)."""
    shown = str(path) if shown is None else shown
    if path.is_dir():
        raise ConfigError(f"{what} {shown} is a directory, not a file")
    if not path.is_file():
        raise ConfigError(f"{what} not found: {shown}")


def _directory_as_config(path: Any, source: str) -> str:
    """The one line for a directory given where a config file goes; a run dir's own config is pointed to.
    `path`: a pathlib or epath Path; `source` as the user wrote it (pathlib would turn s3://b into s3:/b)."""
    line = f"config {source} is a directory, not a YAML file or a preset name"
    if (path / "config.yaml").is_file():
        run_config = f"{source.rstrip('/')}/config.yaml"
        return (f"{line}; it is a run directory: give its {run_config} (to resume that run: jaxinfra train "
                f"{run_config} --run-dir {source})")
    return line


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML ({str(e).splitlines()[0]})") from None
    if data is None:  # an empty file would silently mean "all defaults": most likely a mistake
        raise ConfigError(f"{source}: the config file is empty (write `{{}}` to mean all defaults)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections")
    return data


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML scalars) to a nested dict."""
    tree = _deep_copy(tree)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override key '{key}' must name a section and a field, e.g. model.num_layers")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = tree
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{key}': '{p}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def load_config(source: str | None = "tiny", overrides: list[str] | None = None) -> Config:
    """Preset or YAML path, then overrides, then type checks and consistency checks."""
    tree = load_yaml(source) if source else {}
    tree = _drop_retired(apply_overrides(tree, overrides or []))
    cfg = config_from_tree(tree)
    validate(cfg)
    return cfg


def config_from_tree(tree: dict[str, Any]) -> Config:
    """The typed Config of a YAML tree (not validated), with `model.vocab_size` from the data when
    the tree leaves it unset (`vocab_left_unset`, `fit_vocab`)."""
    cfg = from_dict(Config, tree, "")
    if not vocab_left_unset(tree):
        return cfg
    from jaxinfra.data import DataError, vocab_size_of

    try:
        return fit_vocab(cfg, vocab_size_of(cfg.data))
    except DataError:
        return cfg  # validate() reports it, in its order


def vocab_left_unset(tree: dict[str, Any]) -> bool:
    model = tree.get("model")
    return not isinstance(model, dict) or "vocab_size" not in model


def fit_vocab(cfg: Config, data_vocab: int) -> Config:
    """An unset model.vocab_size: ModelConfig's default (256, byte-level) raised to the data's
    vocabulary when that is larger, so the byte presets train `data prepare --bytes` output (257
    ids: 256 ends documents) and tokenizer data as they are. Never lowered: a config that loaded
    before (the text source's 256 ids, a 64-id synthetic language) keeps its model exactly."""
    if data_vocab <= cfg.model.vocab_size:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data_vocab))


def _drop_retired(tree: dict[str, Any]) -> dict[str, Any]:
    """Keys earlier versions wrote into every run's config.yaml: accepted while they hold their old
    default (so those runs still load), refused in one line otherwise."""
    train = tree.get("train")
    if isinstance(train, dict) and "nan_steps" in train:
        if train["nan_steps"] not in (None, [], ()):
            raise ConfigError("train.nan_steps was removed: NaN injection is a test-only step extension now "
                              "(tests/nan_steps.py)")
        tree = {**tree, "train": {k: v for k, v in train.items() if k != "nan_steps"}}
    return tree


def from_dict(cls: type, data: Any, path: str) -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{path + '.' if path else ''}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{full}'{hint}; allowed: {', '.join(fields)}")
        kwargs[key] = _coerce(hints[key], value, full)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        allowed = " or ".join(_describe(a) for a in args)
        raise ConfigError(f"{key}: expected {allowed}, got {_show(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {_show(value)} is not allowed; choose one of {list(args)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_show(value)}")
        return {str(k): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_show(value)}")
        return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_show(value)}")
    raise TypeError(f"config field {key} has unsupported type {tp}")  # a bug in a dataclass


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return f"one of {list(typing.get_args(tp))}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _show(value: Any) -> str:
    if value is None:  # `key=` or `key:` with nothing after it: YAML's null, never Python's "None"
        return "an empty value (null)"
    return repr(value) if not isinstance(value, dict) else "a mapping"


def _deep_copy(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------- consistency


def _non_finite(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose value (or any list element) is a NaN or infinite number."""
    bad = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        values = value if isinstance(value, list) else [value]
        if isinstance(value, dict):
            bad += _non_finite(value, name + ".")
        elif any(isinstance(v, float) and not math.isfinite(v) for v in values):
            bad.append(f"{name}={value}")
    return bad


def validate(cfg: Config, device_count: int | None = None) -> None:
    """Cross-field checks; with device_count also the mesh checks."""
    bad = _non_finite(cfg.to_dict())  # every section, new ones included: NaN or inf is never a setting
    if bad:
        raise ConfigError(f"{bad[0]} is invalid: numbers in the config must be finite")
    # Every numeric key's declared range (sharding/ranges.py), first: the checks below may then rely on them.
    for key, value, allowed in range_problems(cfg):
        raise ConfigError(f"{key}={value!r} is invalid: must be {allowed}")
    for section, problems in (("model", cfg.model.problems()), ("data", cfg.data.problems()),
                              ("quant", cfg.quant.problems() + group_size_problem(cfg.model, cfg.quant)),
                              ("distill", cfg.distill.problems(cfg.model.vocab_size)),
                              ("lora", cfg.lora.problems() or model_problems(cfg.model, cfg.lora)),
                              ("dpo", cfg.dpo.problems()), ("grpo", cfg.grpo.problems()),
                              ("eval", cfg.eval.problems()), ("log", _log_problems(cfg))):
        for key, value, allowed in problems:
            raise ConfigError(f"{section}.{key}={value!r} is invalid: must be {allowed}")
    _validate_post_training(cfg)
    t = cfg.train
    chunk = cfg.model.loss_chunk_size
    if chunk and chunk < t.seq_len and t.seq_len % chunk:
        raise ConfigError(f"model.loss_chunk_size={chunk} does not divide train.seq_len={t.seq_len}")
    if cfg.model.remat_policy not in REMAT_POLICIES:  # pragma: no cover - Literal already checks
        raise ConfigError(f"model.remat_policy: choose one of {REMAT_POLICIES}")
    from jaxinfra.data import vocab_size_of  # the data section knows its vocabulary

    data_vocab = vocab_size_of(cfg.data)
    if data_vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary "
            f"({data_vocab} ids from data.source={cfg.data.source}); set model.vocab_size>={data_vocab}")
    validate_layout(cfg, device_count)


def _log_problems(cfg: Config) -> list[tuple[str, object, str]]:
    """log.profile_steps: [start, stop) inside the run (a window past the last step would never be written)."""
    window = cfg.log.profile_steps
    if window and (len(window) != 2 or not 0 <= window[0] < window[1] <= cfg.train.steps):
        steps = cfg.train.steps
        return [("profile_steps", list(window), f"[start, stop] with 0 <= start < stop <= train.steps={steps}")]
    return []


def _validate_post_training(cfg: Config) -> None:
    """DPO pairs and GRPO groups against the batch (a pair or a group is never split over steps)."""
    t = cfg.train
    if prompt_data(cfg):
        g = cfg.grpo
        if not g.reward:
            raise ConfigError("grpo.reward is empty: data.source=prompts (GRPO) needs at least one reward "
                              "function, e.g. grpo.reward=my_rewards.py:exact_match")
        if t.batch_size % g.group_size:
            raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by grpo.group_size={g.group_size} "
                              f"(a rollout's rows are prompts x group_size)")
        if (t.batch_size // t.grad_accum_steps) % g.group_size:
            raise ConfigError(f"train.batch_size / train.grad_accum_steps = {t.batch_size // t.grad_accum_steps} "
                              f"rows per microbatch is not divisible by grpo.group_size={g.group_size}")
        if g.max_new_tokens >= t.seq_len:
            raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for the prompt in "
                              f"train.seq_len={t.seq_len}")


def validate_layout(cfg: Config, device_count: int | None) -> None:
    """The checks a change of layout (mesh, parallelism, remat, accumulation) can fail, for a config
    whose other sections `validate` already accepted (jaxinfra plan --search prices thousands)."""
    t = cfg.train
    if t.batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.grad_accum_steps={t.grad_accum_steps}")
    validate_mesh(cfg, device_count)


def validate_mesh(cfg: Config, device_count: int | None) -> None:
    """Axis sizes against the device count and against the dimensions they shard."""
    _validate_pipeline(cfg, cfg.mesh.stage * cfg.mesh.dcn_stage if cfg.mesh.stage > 0 else None)
    for name, axes in cfg.parallelism.rules.items():
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(f"parallelism.rules.{name}: unknown mesh axis {axis!r}; "
                                  f"choose from {list(MESH_AXES)}")
    if device_count is None:
        return
    try:
        sizes = resolve_mesh_sizes(cfg.mesh, device_count)
    except MeshError as e:
        raise ConfigError(str(e)) from None
    _validate_pipeline(cfg, sizes["stage"], sizes["context"])
    if sizes["stage"] > 1 and cfg.lora.enabled and cfg.lora.dropout:
        raise ConfigError(f"lora.dropout={cfg.lora.dropout} with mesh.stage={sizes['stage']} is not supported (the "
                          f"pipeline passes no per-layer dropout keys); use lora.dropout=0")
    if sizes["stage"] > 1 and cfg.quant.train == "fp8" and cfg.quant.scaling == "delayed":
        raise ConfigError(f"quant.scaling=delayed with mesh.stage={sizes['stage']} is not supported (the pipeline "
                          f"sums each microbatch's amax observation); use quant.scaling=current")
    ep = sizes["expert"]
    if cfg.model.is_moe and cfg.model.moe_num_experts % ep:
        raise ConfigError(f"model.moe_num_experts={cfg.model.moe_num_experts} is not divisible by mesh.expert={ep}")
    if cfg.model.is_moe and cfg.model.expert_dim % sizes["tensor"]:
        raise ConfigError(f"model.moe_mlp_dim={cfg.model.expert_dim} is not divisible by mesh.tensor={sizes['tensor']}")
    # The batch is sharded over `expert` as well (sharding/rules.py: expert parallelism).
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    micro = cfg.train.batch_size // cfg.train.grad_accum_steps
    if sizes["stage"] > 1:  # rows of one pipeline microbatch
        micro //= pipeline_sizes(cfg, sizes["stage"])[0]
    if micro % batch_shards:
        axes = "mesh.data x mesh.fsdp" + (" x mesh.expert" if sizes["expert"] > 1 else "")
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} (microbatch {micro}) is not divisible by the "
            f"data-parallel size {axes} = {batch_shards}")
    m, tp = cfg.model, sizes["tensor"]
    # KV heads are not checked: fewer KV heads than `tensor` are replicated (usual GQA practice).
    for key, value in (("num_heads", m.num_heads), ("mlp_dim", m.mlp_dim), ("vocab_size", m.vocab_size)):
        if value % tp:
            raise ConfigError(f"model.{key}={value} is not divisible by mesh.tensor={tp}")
    if m.d_model % sizes["fsdp"]:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by mesh.fsdp={sizes['fsdp']}")
    cp = sizes["context"]
    if cp > 1:
        need = 2 * cp if cfg.parallelism.context_impl == "ring" and cfg.parallelism.load_balance else cp
        if m.sliding_window is not None and cfg.parallelism.context_impl == "ring" and cfg.parallelism.load_balance:
            raise ConfigError(f"model.sliding_window={m.sliding_window} with parallelism.context_impl=ring needs "
                              "parallelism.load_balance=false (or context_impl=allgather)")
        if cfg.train.seq_len % need:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by {need} "
                              f"({'2 x ' if need != cp else ''}mesh.context={cp})")


def pipeline_settings(p: ParallelismConfig) -> PipelineSettings:
    """The parallelism section's pipeline keys, as sharding/pipeline.py takes them."""
    return PipelineSettings(p.pipeline_schedule, p.microbatches, p.pipeline_repeats)


def pipeline_sizes(cfg: Config, stages: int) -> tuple[int, int]:
    """(microbatches, repeats) of the pipeline over `stages` stages."""
    return pipeline_settings(cfg.parallelism).resolved(stages)


def _validate_pipeline_layers(m: ModelConfig, stages: int, repeats: int) -> None:
    """The pipeline's layers (the layer periods, models/stack.py; the dense prefix runs before it)
    divide into stages x repeats."""
    period, prefix = m.layer_period(), m.moe_first_dense_layers if m.is_moe else 0
    windows = f"model.sliding_window_pattern={m.sliding_window_pattern}" + (f", model.moe_every={m.moe_every}"
                                                                            if m.is_moe else "")
    if (m.num_layers - prefix) % period:  # layers after the last whole period (window patterns)
        raise ConfigError(f"model.num_layers={m.num_layers} is not a whole number of layer periods of {period} "
                          f"({windows}) after {prefix} prefix layers: the pipeline (mesh.stage={stages}) runs "
                          f"whole periods only")
    periods = (m.num_layers - prefix) // period
    if not periods % (stages * repeats):
        return
    split = f"not divisible by mesh.stage={stages} x parallelism.pipeline_repeats={repeats} = {stages * repeats}"
    if period > (m.moe_every if m.is_moe else 1):
        raise ConfigError(f"model.num_layers={m.num_layers} gives {periods} layer periods of {period} ({windows}), "
                          + split)
    if m.is_moe:
        raise ConfigError(f"model.num_layers={m.num_layers} gives {periods} MoE periods (after "
                          f"model.moe_first_dense_layers={m.moe_first_dense_layers}, model.moe_every="
                          f"{m.moe_every}), " + split)
    raise ConfigError(f"model.num_layers={m.num_layers} is " + split)


def _validate_pipeline(cfg: Config, stages: int | None, context: int = 1) -> None:
    """Pipeline keys: layers divide into stages x repeats, the batch into microbatches, ..."""
    p = cfg.parallelism
    if p.pipeline_repeats > 1 and p.pipeline_schedule != "circular":
        raise ConfigError(f"parallelism.pipeline_repeats={p.pipeline_repeats} needs "
                          f"parallelism.pipeline_schedule=circular, got {p.pipeline_schedule}")
    if stages is None or stages == 1:
        return
    m, t = cfg.model, cfg.train
    micro, repeats = pipeline_sizes(cfg, stages)
    if context != 1:
        raise ConfigError(f"mesh.stage={stages} with mesh.context={context} is not supported yet")
    _validate_pipeline_layers(m, stages, repeats)
    if repeats > 1 and micro % stages:
        raise ConfigError(f"parallelism.microbatches={micro} is not divisible by mesh.stage={stages} "
                          f"(circular schedule with parallelism.pipeline_repeats={repeats})")
    per_step = t.batch_size // t.grad_accum_steps
    if per_step % micro:
        raise ConfigError(f"train.batch_size={t.batch_size} (per accumulation step {per_step}, "
                          f"train.grad_accum_steps={t.grad_accum_steps}) is not divisible by "
                          f"parallelism.microbatches={micro}")
