"""One GRPO rollout: sample group_size completions per prompt with the current policy, score them,
normalise the rewards within each group, and lay the rows out for the train step.

The sampler is the in-stack KV-cache Generator (jaxinfra/infer/generation.py) built once on the
run's own mesh; each rollout passes it the TrainState's params in place (`model_state` of
`host.current_state()`: no copy, no export), so the programs compile once. The sampling seed is a
function of (train.seed, rollout index), so a resumed run draws the same rollout again from the
same params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfra.config import Config
from jaxinfra.grpo.prompts import PromptSet, rollout_indices
from jaxinfra.grpo.rewards import Rewards
from jaxinfra.infer.generation import Generator, Sampling

ADV_EPS = 1e-4  # added to the group std (as TRL): a group of equal rewards gets advantage 0, not 0 / 0


def rollout_seed(seed: int, rollout: int) -> int:
    """The sampler's seed for rollout `rollout` (a function of train.seed and the index only)."""
    return int(np.random.SeedSequence([seed, rollout, 0x9790]).generate_state(1)[0])


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> np.ndarray:
    """float32 [rows]: each reward minus its group's mean, divided by the group's std (ddof=1, as
    torch's `std` in TRL) + 1e-4 unless `scale` is False (Dr. GRPO). Groups are consecutive rows."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + ADV_EPS)
    return centred.reshape(-1).astype(np.float32)


def pack_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              logps: Sequence[Sequence[float]], advantages: np.ndarray, rewards: np.ndarray,
              seq_len: int) -> dict[str, np.ndarray]:
    """The step's rows: prompt + completion as inputs/targets/positions/segment_ids padded to
    seq_len; `completion` 1 where the target is a generated token; `old_logps` (the sampler's
    log-prob of that target) and `advantages` there; `rewards` holds each row's reward at column
    0 (a per-row value the step sums for its metrics)."""
    rows = len(prompts)
    out = {k: np.zeros((rows, seq_len), np.int32) for k in ("inputs", "targets", "positions", "segment_ids",
                                                             "completion")}
    out.update({k: np.zeros((rows, seq_len), np.float32) for k in ("old_logps", "advantages", "rewards")})
    for r, (p, c, lp) in enumerate(zip(prompts, completions, logps, strict=True)):
        tokens = np.asarray([*p, *c], np.int32)
        n = len(tokens) - 1  # targets in the row
        if n > seq_len:
            raise ValueError(f"row {r}: {len(p)} prompt + {len(c)} completion tokens exceed seq_len + 1")
        out["inputs"][r, :n], out["targets"][r, :n] = tokens[:-1], tokens[1:]
        out["positions"][r, :n], out["segment_ids"][r, :n] = np.arange(n), 1
        first = len(p) - 1  # the target at position len(p) - 1 is the first generated token
        out["completion"][r, first:n] = 1
        out["old_logps"][r, first:n] = np.asarray(lp, np.float32)
        out["advantages"][r, first:n] = advantages[r]
        out["rewards"][r, 0] = rewards[r]
    return out


@dataclasses.dataclass
class Rollout:
    index: int
    rows: dict[str, np.ndarray]  # the global batch (every row of the rollout)
    samples: list[dict[str, Any]]  # for RUN/samples.jsonl


class Roller:
    """Draws rollouts: prompts in their seeded order, the Generator on the run's mesh, the rewards."""

    def __init__(self, cfg: Config, prompts: PromptSet, rewards: Rewards):
        self.cfg, self.prompts, self.rewards = cfg, prompts, rewards
        self.group = cfg.grpo.group_size
        self.per_rollout = cfg.train.batch_size // self.group
        self.generator: Generator | None = None

    def sampler(self, params: Any, mesh: Any) -> Generator:
        """The one Generator, built on the first rollout against these params' shapes and shardings."""
        if self.generator is None:
            self.generator = Generator(self.cfg, params, mesh=mesh)
            self.generator.params = None  # never used (every call passes the policy's params): hold no reference
        return self.generator

    def draw(self, index: int, params: Any, mesh: Any, step: int) -> Rollout:
        """Rollout `index` with `params` (the policy's, in place); `step` is the first step training on it."""
        g, t = self.cfg.grpo, self.cfg.train
        chosen = [self.prompts.prompts[i] for i in rollout_indices(len(self.prompts), t.seed, index,
                                                                     self.per_rollout)]
        repeated = [p for p in chosen for _ in range(self.group)]
        result = self.sampler(params, mesh).generate(
            [p.ids for p in repeated], max_new_tokens=g.max_new_tokens, params=params,
            sampling=Sampling(temperature=g.temperature, top_p=g.top_p, seed=rollout_seed(t.seed, index)),
            stop_ids=self.prompts.stop_ids, stop_sequence=self.prompts.stop_sequence)
        texts = [self.prompts.completion_text(ids) for ids in result.tokens]
        rewards = self.rewards([p.text for p in repeated], texts, [p.answer for p in repeated])
        adv = group_advantages(rewards, self.group, g.scale_rewards)
        rows = pack_rows([p.ids for p in repeated], result.tokens, result.logps, adv, rewards, t.seq_len)
        picks = [(i % self.per_rollout) * self.group + (i // self.per_rollout) % self.group
                 for i in range(min(g.samples_per_rollout, len(repeated)))]  # one per prompt first
        samples = [{"step": step, "rollout": index, "prompt": repeated[i].text, "completion": texts[i],
                    "reward": float(rewards[i]), "answer": repeated[i].answer} for i in picks]
        return Rollout(index, rows, samples)
