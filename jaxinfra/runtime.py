"""Everything a run computes with, built once from a validated Config.

`build_runtime(cfg, devices)` -> mesh, sharding rules, sharded TrainState, and the
jitted train/eval steps with their shardings. The train loop, the benchmarks and
the parity tests all use this one path, so what the tests prove is what runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.compile_cache import CompileTimes
from jaxinfra.config import Config, pipeline_settings, validate
from jaxinfra.extensions import (
    ModelStats,
    StepExtension,
    check_names,
    check_sections_claimed,
    extensions_for,
    init_ext_fn,
    trainable_filter,
)
from jaxinfra.optim import make_optimizer, make_schedule
from jaxinfra.quant_checks import check_trainable
from jaxinfra.state import (
    TrainState,
    abstract_state,
    create_train_state,
    model_graphdef,
    model_state,
    sharding_rules,
    shardings_for,
)
from jaxinfra.step import make_eval_step, make_train_step
from sharding.context import balanced_order
from sharding.mesh import make_mesh
from sharding.plan import ParallelPlan, plan_for
from sharding.rules import ShardingRules, logical_to_mesh


def batch_sharding(mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_mesh(("batch", "length"), rules.activations, mesh))


@dataclasses.dataclass
class Runtime:
    cfg: Config
    mesh: Mesh
    rules: ShardingRules
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    state_shardings: TrainState
    batch_sharding: NamedSharding
    sequence_order: np.ndarray | None  # ring attention's load-balanced token order
    _train_step: Any
    _eval_step: Any
    plan: ParallelPlan  # mesh, rules, pipeline settings, platform: what the steps were made with
    extensions: tuple[StepExtension, ...] = ()  # jaxinfra/extensions.py; ModelStats first

    def init_state(self) -> TrainState:
        state, _ = create_train_state(self.cfg.model, self.tx, jax.random.key(self.cfg.train.seed),
                                      self.mesh, self.rules, self.cfg.quant, init_ext_fn(self.extensions),
                                      trainable_filter(self.extensions), self.cfg.lora)
        return state

    def abstract_state(self) -> TrainState:
        """The TrainState's shapes, dtypes and logical metadata (with the extensions' state)."""
        return abstract_state(self.cfg.model, self.tx, self.cfg.quant, init_ext_fn(self.extensions),
                              trainable_filter(self.extensions), self.cfg.lora)

    def extension(self, name: str) -> StepExtension | None:
        return next((e for e in self.extensions if e.name == name), None)

    def step_inputs(self) -> tuple:
        """The train step's frozen inputs, one entry per extension (read each step: `start` may load them)."""
        return tuple(e.inputs() for e in self.extensions)

    def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> one global array per key, sharded on the batch axes.

        The sequence is permuted first when ring attention balances causal work; the
        loss is a sum over tokens, so the permutation does not change it.
        """
        if self.sequence_order is not None:
            local = {k: v[:, self.sequence_order] for k, v in local.items()}
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

    def train_step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer step; `state` is donated."""
        with jax.set_mesh(self.mesh):
            return self._train_step(state, batch, self.step_inputs())

    def lower_train_step(self, state: TrainState, batch: dict[str, jax.Array], inputs: tuple | None = None):
        """The lowered train step; `inputs` (abstract ones, for the plan's --compile) replace step_inputs()."""
        with jax.set_mesh(self.mesh):
            return self._train_step.lower(state, batch, self.step_inputs() if inputs is None else inputs)

    def compile_train_step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[Any, CompileTimes]:
        """Compile the train step ahead of its first call: (compiled, the seconds of each phase).

        The jitted step reuses this executable on its first call (jax shares the lowering and the
        compiled program between `jit(...).trace(...).lower().compile()` and `jit(...)(...)` for the same
        arguments; tests/test_step.py counts one compile), so the step compiles once and the phases are
        timed apart: tracing and lowering are Python work on every run, XLA's part is what the
        persistent cache saves."""
        with jax.set_mesh(self.mesh):
            start = time.perf_counter()
            traced = self._train_step.trace(state, batch, self.step_inputs())
            after_trace = time.perf_counter()
            lowered = traced.lower()
            after_lower = time.perf_counter()
            compiled = lowered.compile()
        return compiled, CompileTimes(after_trace - start, after_lower - after_trace, time.perf_counter() - after_lower)

    def eval_sums(self, params: nnx.State, batches: list[dict[str, np.ndarray]],
                  eval_step: Any = None) -> tuple[float, float]:
        """(summed cross-entropy, token count) over host batches; `params` are the model's variables
        (jaxinfra/state.py model_state), or another model's with its `eval_step`."""
        eval_step = eval_step or self._eval_step
        with jax.set_mesh(self.mesh):
            outs = [eval_step(params, self.to_global(b)) for b in batches]
        outs = jax.device_get(outs)
        return sum(float(o["ce_sum"]) for o in outs), sum(float(o["tokens"]) for o in outs)


def build_runtime(cfg: Config, devices: Sequence[jax.Device] | None = None,
                  extensions: Sequence[StepExtension] | None = None) -> Runtime:
    """Validate against the devices, then build the mesh, rules and jitted steps.

    `extensions` join the step (jaxinfra/extensions.py); None: those the config asks for
    (jaxinfra/extensions.py extensions_for: the registered entry points). The core's ModelStats always runs first."""
    devices = list(devices) if devices is not None else jax.devices()
    validate(cfg, len(devices))
    check_trainable(cfg.quant, devices, frozen_base=cfg.lora.enabled)
    t = cfg.train
    mesh = make_mesh(cfg.mesh, devices)
    rules = sharding_rules(cfg.parallelism)
    plan = plan_for(mesh, rules, pipeline_settings(cfg.parallelism))  # settings kept only when mesh.stage > 1
    schedule = make_schedule(cfg.schedule, cfg.optimizer.lr, t.steps)
    tx = make_optimizer(cfg.optimizer, schedule)
    graphdef = model_graphdef(cfg.model, cfg.quant, cfg.lora)
    data_sharding = batch_sharding(mesh, rules)
    if extensions is None:
        extensions = extensions_for(cfg)
    exts = (ModelStats(cfg.model), *extensions)
    check_names(exts)
    check_sections_claimed(cfg, exts)
    order = _ring_order(cfg, plan)
    rt = Runtime(cfg, mesh, rules, schedule, tx, graphdef, None, data_sharding, order, None, None, plan, exts)
    for e in exts:  # e.g. a teacher resolved onto this mesh; bad input is refused before anything compiles
        e.setup(rt)
    rt.state_shardings = shardings_for(rt.abstract_state(), mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    step = make_train_step(graphdef, cfg.model, tx, schedule, t.grad_accum_steps, exts, trainable_filter(exts), plan)
    rt._train_step = jax.jit(step, in_shardings=(rt.state_shardings, data_sharding,
                                                 tuple(e.input_shardings() for e in exts)),
                             out_shardings=(rt.state_shardings, replicated), donate_argnums=0,
                             compiler_options=_profile_options(cfg, plan))
    rt._eval_step = jax.jit(make_eval_step(graphdef, cfg.model, plan, exts),  # their loss masks only
                            in_shardings=(model_state(rt.state_shardings), data_sharding), out_shardings=replicated)
    return rt


def _profile_options(cfg: Config, plan: ParallelPlan) -> dict[str, Any] | None:
    """XLA:CPU writes per-op trace events only for programs compiled to (a profile window needs them;
    jaxinfra/metrics/trace.py); other platforms trace their ops anyway."""
    if cfg.log.profile_steps and plan.platform == "cpu":
        return {"xla_cpu_enable_xprof_traceme": True}
    return None


def _ring_order(cfg: Config, plan: ParallelPlan) -> np.ndarray | None:
    ring = plan.context_size
    if ring > 1 and plan.context_impl == "ring" and plan.load_balance:
        return balanced_order(cfg.train.seq_len, ring)
    return None
