"""The train step's extension seam: what a feature adds to the step without an `if` in it.

A `StepExtension` may add, each hook optional (the base class does nothing):

    host side (jaxinfra/train.py, once or per step)
        start(host, meta)        load what the steps need (a teacher's params), before the first step
        host_batch(local, step)  extra batch fields, host rows [rows, seq, ...] (saved logits, loss
                                 masks, weights, advantages, paired sequences); `batch_specs`
                                 gives their global shapes (the plan's --compile lowers with them)
        batches(host, first_step) with `feeds_batches = True`: the step's batches themselves, in
                                 place of the data pipeline (GRPO: rollouts of the current policy,
                                 `host.current_state()`); its data position goes in checkpoint_meta
        inputs() / input_shardings()
                                 frozen step inputs (a teacher's or reference policy's params, small
                                 knobs): step arguments, never differentiated, never checkpointed;
                                 `abstract_inputs()` the same as ShapeDtypeStructs (before `start`)
        eval_fields()            extra fields of each eval line
        host_metrics(host, step) after every completed step: {name: float} logged at that step to
                                 metrics.jsonl, TensorBoard and the trackers ({} at the other steps;
                                 lm-eval task scores: jaxinfra/harness/extension.py)
        checkpoint_meta()        what the checkpoint's meta records under the extension's name (e.g.
                                 which teacher); `start` gets that meta back on resume
        metric_names             the step metrics the train loop logs for it
    state (jaxinfra/state.py)
        init_state(params)       its own non-trainable state: `TrainState.ext[name]`, sharded by its
                                 variables' logical axes, checkpointed with the state, outside the optimizer
        trainable                an nnx filter of the params the optimizer trains (None: all; LoRA:
                                 the adapters, the frozen base then gets no gradient and no moments)
    traced, inside the jitted step (jaxinfra/step.py), each with a `StepContext`
        loss_mask(ctx)           bool [B, T] aligned with the targets, or None: the core ANDs it with
                                 `segment_ids > 0`, so masked targets add nothing to the loss, the
                                 `tokens` count or the gradient's normalisation; the eval step takes
                                 the extensions that define it and masks the same way (SFT: only
                                 the assistant's tokens train)
        per_token(ctx, hidden)   arrays [B, T, ...] cut into loss chunks beside the hidden states
        token_sums(ctx, logits, per_token, targets, mask)
                                 extra token sums of one chunk (its logits never exist whole)
        objective(ctx, sums)     rewrite the sums: `loss_sum` is what the step differentiates
        metrics(sums, tokens)    step metrics (they override the core's of the same name)
        post_update(new, old, sums, observed)
                                 after the optimizer: update stats or own state (`observed`: the
                                 cotangents of the model's Stats, e.g. fp8 amax observations)

The core step calls the hooks in list order. `ModelStats` (below) is the core's own extension:
the model's Stats (models/stat.py) moved after the optimizer. Feature extensions are found by
`extensions_for(cfg)` through the `jaxinfra.extensions` entry points (pyproject.toml: each names a
function `cfg -> StepExtension | None`), so the core never imports a feature package, and another
installed package can add its own extension the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from jaxinfra.config import Config, ConfigError
from jaxinfra.config_sections import FEATURE_SECTIONS, IMPLIED_EXTENSIONS
from models import ModelConfig
from models.project import roll_histories
from models.router import apply_bias_updates
from sharding.plan import SINGLE_DEVICE, ParallelPlan

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a traced hook sees: the model (params and stats merged), the device batch (with the
    extension fields), the steps completed before this one, this extension's frozen inputs and own
    state, and the parallel plan the step was made with (a second model's forward takes it too)."""

    model: nnx.Module
    batch: Batch
    step: jax.Array
    inputs: Any = ()
    state: Any = None
    plan: ParallelPlan = SINGLE_DEVICE


def _no_state() -> Any:
    return None


@dataclasses.dataclass(frozen=True)
class HostContext:
    """What the host-side hooks see: the runtime (jaxinfra/runtime.py), the held-out batches, this
    process's rows, the run directory, where the run was restored from (None: a fresh start or a
    resume of its own checkpoints), and `current_state()`, the TrainState the next step will update
    (the latest one: a rollout samples from the params in place, no copy)."""

    rt: Any
    eval_batches: list[dict[str, np.ndarray]]
    first_row: int
    rows: int
    run_dir: Any = None
    restore_from: Any = None
    current_state: Callable[[], Any] = _no_state


class StepExtension:
    """No-op defaults for every hook; a subclass overrides what it adds (see the module docstring)."""

    name: ClassVar[str] = "extension"
    metric_names: ClassVar[tuple[str, ...]] = ()
    trainable: Any = None

    def setup(self, rt: Any) -> None:
        """Called by build_runtime once the mesh, rules and graphdef exist, before the step is jitted."""

    # ---- host side
    def start(self, host: HostContext, meta: dict[str, Any]) -> list[str]:
        return []

    def host_batch(self, local: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        return {}

    feeds_batches: ClassVar[bool] = False  # True: `batches` replaces the data pipeline (GRPO's rollouts)

    def batches(self, host: HostContext, first_step: int) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of steps first_step, first_step + 1, ... (only when `feeds_batches`:
        the train loop then builds no data pipeline, and the extension keeps its own data position
        in `checkpoint_meta`, which `start` gets back on resume)."""
        raise NotImplementedError(f"{self.name}: feeds_batches is set but batches() is not defined")

    def inputs(self) -> Any:
        return ()

    def input_shardings(self) -> Any:
        return ()

    def abstract_inputs(self) -> Any:
        return self.inputs()

    def batch_specs(self, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
        """{field: global shape and dtype} of the extra batch fields, for a batch of `shape` (rows, seq)."""
        return {}

    def eval_fields(self) -> dict[str, float]:
        return {}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def host_metrics(self, host: HostContext, step: int) -> dict[str, float]:
        """Metrics computed on the host after completed step `step` (the Trainer calls it after every
        step): a non-empty dict is logged at that step to metrics.jsonl, TensorBoard and the trackers;
        {} (the default) at the steps where the extension has nothing to report."""
        return {}

    # ---- state
    def init_state(self, params: nnx.State) -> Any:
        return None

    # ---- traced
    def loss_mask(self, ctx: StepContext) -> jax.Array | None:
        return None

    def per_token(self, ctx: StepContext, hidden: jax.Array) -> tuple[jax.Array, ...]:
        return ()

    def token_sums(self, ctx: StepContext, logits: jax.Array, per_token: tuple[jax.Array, ...],
                   targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        return {}

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return sums

    def metrics(self, sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
        return {}

    def post_update(self, new: Any, old: Any, sums: dict[str, jax.Array], observed: nnx.State) -> Any:
        return new


class ModelStats(StepExtension):
    """The model's Stats after the optimizer: DeepSeek-V3's router bias moves by the step's expert loads
    (rate 0, a fixed imported bias: unchanged); fp8 amax histories roll in this step's observation."""

    name = "model_stats"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def post_update(self, new: Any, old: Any, sums: dict[str, jax.Array], observed: nnx.State) -> Any:
        stats = old.stats
        if self.cfg.moe_bias_update_rate:
            stats = apply_bias_updates(stats, sums["moe_counts"], self.cfg.moe_bias_update_rate)
        return new.replace(stats=roll_histories(stats, observed))


def batch_feeder(extensions: Sequence[StepExtension]) -> StepExtension | None:
    """The one extension that feeds the step's batches itself, if any (two would contradict each other)."""
    feeders = [e for e in extensions if e.feeds_batches]
    if len(feeders) > 1:
        raise ValueError(f"two step extensions feed the batches: {[e.name for e in feeders]}")
    return feeders[0] if feeders else None


def defines_loss_mask(extension: StepExtension) -> bool:
    """Whether `extension` overrides the loss_mask hook (the eval step takes exactly those)."""
    return type(extension).loss_mask is not StepExtension.loss_mask


def init_ext_fn(extensions: Sequence[StepExtension]):
    """params -> {name: state} of the extensions that keep state (None when none does)."""
    if not any(type(e).init_state is not StepExtension.init_state for e in extensions):
        return None

    def init_ext(params: nnx.State) -> dict[str, Any]:
        states = {e.name: e.init_state(params) for e in extensions}
        return {k: v for k, v in states.items() if v is not None}

    return init_ext


def trainable_filter(extensions: Sequence[StepExtension]) -> Any:
    """The one nnx filter of trained params (None: all of them); two extensions may not both set one."""
    filters = [e.trainable for e in extensions if e.trainable is not None]
    if len(filters) > 1:
        raise ValueError(f"two step extensions choose the trainable params: {[e.name for e in extensions]}")
    return filters[0] if filters else None


def check_names(extensions: Sequence[StepExtension]) -> None:
    names = [e.name for e in extensions]
    if len(set(names)) != len(names):
        raise ValueError(f"step extensions need distinct names, got {names}")


ENTRY_POINTS = "jaxinfra.extensions"


def extensions_for(cfg: Config) -> list[StepExtension]:
    """The feature extensions `cfg` turns on, in entry-point name order (a fixed hook order); each
    registered function returns its extension, or None when its config section is off."""
    found = (point.load()(cfg) for point in sorted(entry_points(group=ENTRY_POINTS), key=lambda p: p.name))
    return [ext for ext in found if ext is not None]


def check_sections_claimed(cfg: Config, exts: Sequence[StepExtension]) -> None:
    """A feature section that is on but has no extension would silently train without it: refuse."""
    names = {e.name for e in exts}
    wanted = [(s, s) for s in FEATURE_SECTIONS if getattr(cfg, s).enabled]
    wanted += [(name, "data") for name, on in IMPLIED_EXTENSIONS.items() if on(cfg)]  # e.g. chat data: sft
    for name, section in wanted:
        if name not in names:
            raise ConfigError(f"{section}: the config turns on {name!r} but no step extension named {name!r} "
                              f"was given or registered under the {ENTRY_POINTS!r} entry points (is jaxinfra "
                              f"installed? pip install -e .)")
