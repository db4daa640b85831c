"""The parity method shared by the layout tests (torchtitan's "converging" check as a harness).

A 1-device baseline, then each layout on 8 fake CPU devices must reproduce its losses
(and chosen metrics) to rtol 1e-5 and its final parameters; a new layout is one row in
a test file's table. Used by test_parallel, test_pipeline, test_expert_parallel, test_step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxinfra.config import Config, OptimizerConfig, ParallelismConfig, ScheduleConfig, TrainConfig
from jaxinfra.data import DataConfig
from jaxinfra.runtime import Runtime, build_runtime
from jaxinfra.state import model_state
from models import ModelConfig
from sharding.mesh import MeshConfig

# Parameters: summation noise (~3e-9 on the smallest gradients) x Adam's lr / eps (1e3, see
# tests/test_step.py) ~ 3e-6 observed; a real error moves parameters by ~lr = 1e-2 per step.
# Gradient *scale* errors are invisible in Adam's parameters (it normalises the gradient) and
# are caught by the loss / grad_norm checks.
PARAM_ATOL = 2e-5


def parity_config(model: ModelConfig, opt: OptimizerConfig, mesh: dict, *, batch: int, seq: int,
                  schedule: ScheduleConfig | None = None, total_steps: int = 20, accum: int = 1,
                  **parallelism) -> Config:
    """A synthetic-data config on `mesh` (data=1 unless given); warmup 0 so lr > 0 from step 1."""
    return Config(model=model, optimizer=opt, schedule=schedule or ScheduleConfig(warmup_steps=0),
                  mesh=MeshConfig(**{"data": 1, **mesh}), parallelism=ParallelismConfig(**parallelism),
                  data=DataConfig(source="synthetic", synthetic_vocab=model.vocab_size),
                  train=TrainConfig(steps=total_steps, batch_size=batch, seq_len=seq, grad_accum_steps=accum))


def packed_batches(batch: int, seq: int, vocab: int, steps: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """One packed batch (2 documents and some padding per row, so segment masks matter), repeated
    `steps` times: the model memorises it, so the loss visibly falls."""
    rng = np.random.default_rng(seed)
    seg = np.ones((batch, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    for r in range(batch):
        cut, end = sorted(rng.integers(4, seq - 2, size=2))
        seg[r, cut:], pos[r, cut:] = 2, np.arange(seq - cut)
        seg[r, end + 2:], pos[r, end + 2:] = 0, 0
    tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    one = {"inputs": tokens[:, :-1] * (seg > 0), "targets": tokens[:, 1:] * (seg > 0), "segment_ids": seg,
           "positions": pos}
    return [one] * steps


def run_steps(cfg: Config, devices: Sequence, batches: list[dict[str, np.ndarray]],
              setup: Callable[[Runtime], None] | None = None) -> dict:
    """Build the runtime the way jaxinfra/train.py does and take one step per batch; `setup(rt)`
    runs first (e.g. loading a distillation teacher's params)."""
    rt = build_runtime(cfg, devices)
    if setup is not None:
        setup(rt)
    state = rt.init_state()
    initial = jax.device_get(model_state(state))  # params and stats (router bias, amax histories)
    metrics = []
    for batch in batches:
        state, m = rt.train_step(state, rt.to_global(batch))
        metrics.append(jax.device_get(m))
    return {"losses": series({"metrics": metrics}, "loss"), "metrics": metrics, "initial": initial,
            "params": jax.device_get(model_state(state)), "state": state, "rt": rt}


def series(result: dict, key: str) -> np.ndarray:
    return np.array([float(m[key]) for m in result["metrics"]])


def assert_trees_close(got, want, *, rtol: float, atol: float, name: str = "") -> None:
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)), name
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=f"{name} {jax.tree_util.keystr(path)}".strip())


def assert_series_close(result: dict, baseline: dict, keys: Sequence[str], *, rtol: float, atol: float = 0.0,
                        name: str = "") -> None:
    for key in keys:
        np.testing.assert_allclose(series(result, key), series(baseline, key), rtol=rtol, atol=atol,
                                   err_msg=f"{name} {key}".strip())


def assert_matches(result: dict, baseline: dict, name: str, *, rtol: float = 1e-5, param_atol: float = PARAM_ATOL,
                   metric_keys: Sequence[str] = (), metric_atol: float = 0.0, trains: bool = True) -> None:
    """Same losses, `metric_keys` series and final parameters as the baseline; with `trains`,
    the loss also falls (it trains, not just agrees)."""
    np.testing.assert_allclose(result["losses"], baseline["losses"], rtol=rtol, err_msg=name)
    assert_series_close(result, baseline, metric_keys, rtol=rtol, atol=metric_atol, name=name)
    assert_trees_close(result["params"], baseline["params"], rtol=rtol, atol=param_atol, name=name)
    if trains:
        assert result["losses"][-1] < result["losses"][0], name
