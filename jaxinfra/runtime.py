"""Everything a run computes with, built once from a validated Config.

`build_runtime(cfg, devices)` -> mesh, sharding rules, the parallel plan (sharding/plan.py),
sharded TrainState, and the jitted train/eval steps with their shardings. The steps are made
with the plan, so nothing but their arguments decides what they trace. The train loop, the benchmarks and
the parity tests all use this one path, so what the tests prove is what runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.config import Config, pipeline_settings, validate
from jaxinfra.optim import make_optimizer, make_schedule
from jaxinfra.quantize import check_trainable
from jaxinfra.state import TrainState, abstract_state, create_train_state, model_graphdef, sharding_rules, shardings_for
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
    distill: Any = None  # jaxinfra.distill.step.DistillParts when the distill section is on
    step_inputs: tuple = ()  # the train step's arguments after the batch (distillation: jaxinfra/distill/step.py)

    def init_state(self) -> TrainState:
        state, _ = create_train_state(self.cfg.model, self.tx, jax.random.key(self.cfg.train.seed),
                                      self.mesh, self.rules, self.cfg.quant)
        return state

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
            return self._train_step(state, batch, *self.step_inputs)

    def lower_train_step(self, state: TrainState, batch: dict[str, jax.Array], *inputs: Any):
        """The lowered train step; `inputs` (abstract ones, for the plan's --compile) replace step_inputs."""
        with jax.set_mesh(self.mesh):
            return self._train_step.lower(state, batch, *(inputs or self.step_inputs))

    def eval_sums(self, params: nnx.State, batches: list[dict[str, np.ndarray]],
                  eval_step: Any = None) -> tuple[float, float]:
        """(summed cross-entropy, token count) over host batches (of another model with its `eval_step`)."""
        eval_step = eval_step or self._eval_step
        with jax.set_mesh(self.mesh):
            outs = [eval_step(params, self.to_global(b)) for b in batches]
        outs = jax.device_get(outs)
        return sum(float(o["ce_sum"]) for o in outs), sum(float(o["tokens"]) for o in outs)


def build_runtime(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Runtime:
    """Validate against the devices, then build the mesh, rules and jitted steps."""
    devices = list(devices) if devices is not None else jax.devices()
    validate(cfg, len(devices))
    check_trainable(cfg.quant, devices)
    t = cfg.train
    mesh = make_mesh(cfg.mesh, devices)
    rules = sharding_rules(cfg.parallelism)
    plan = plan_for(mesh, rules, pipeline_settings(cfg.parallelism))  # settings kept only when mesh.stage > 1
    schedule = make_schedule(cfg.schedule, cfg.optimizer.lr, t.steps)
    tx = make_optimizer(cfg.optimizer, schedule)
    graphdef = model_graphdef(cfg.model, cfg.quant)
    state_shardings = shardings_for(abstract_state(cfg.model, tx, cfg.quant), mesh, rules)
    data_sharding = batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    distill = None
    if cfg.distill.enabled:  # the teacher's logits join the loss (jaxinfra/distill/)
        from jaxinfra.distill.step import distill_parts

        distill = distill_parts(cfg, mesh, rules, graphdef, plan)
    train_step = jax.jit(make_train_step(graphdef, cfg.model, tx, schedule, t.grad_accum_steps, t.nan_steps,
                                         loss_sums=distill.loss_sums if distill else None, plan=plan),
                         in_shardings=(state_shardings, data_sharding, *(distill.input_shardings if distill else ())),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(graphdef, cfg.model, plan), in_shardings=(state_shardings.params, data_sharding),
                        out_shardings=replicated)
    ring = mesh.shape["context"]
    order = (balanced_order(t.seq_len, ring)
             if ring > 1 and plan.context_impl == "ring" and plan.load_balance else None)
    return Runtime(cfg, mesh, rules, schedule, tx, graphdef, state_shardings, data_sharding, order,
                   train_step, eval_step, plan, distill, distill.step_inputs() if distill else ())
