"""Per-token log-probs of token rows under the TRAINING forward: what a trainer recomputes.

`policy_token_logps(cfg, params, tokens)` runs the model exactly as the train step does
(jaxinfra/step.py forward_sums): the run's model config as trained (its `moe_dispatch`, its remat
policy; not `inference_model_config`), `model.hidden` on the rows with positions 0.. and segment
id 1 on the inputs whose target is real, then `model.logits` per loss chunk, and `jaxinfra.loss.target_logps` of
each next token. The sampler records the same quantity while it decodes
(jaxinfra/infer/generation.py `GenerationResult.logps`); the two agree to the tolerances that
docs/post-training.md states ("Sampler and trainer log-probs") and tests/test_logprobs.py checks,
not bitwise: prefill and decode run other kernels than the training forward (the KV cache, MLA's
absorbed decode, dropless MoE).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxinfra.config import Config
from jaxinfra.infer.loading import InferenceError, _place_params, _sharding, inference_mesh
from jaxinfra.infer.scoring import check_token_array
from jaxinfra.loss import target_logps
from jaxinfra.state import model_graphdef, sharding_rules
from models import ModelConfig
from models.lora_config import LoraConfig
from models.quant_config import QuantConfig
from sharding.plan import ParallelPlan, plan_for


def chunked_token_logps(model: nnx.Module, h: jax.Array, targets: jax.Array, temperature: jax.Array | float,
                        chunk: int, plan: ParallelPlan) -> jax.Array:
    """[B, T] float32 log-probs of `targets` from final hidden states h [B, T, d]: `model.logits`
    per sequence chunk of `chunk` positions (0 or >= T: one call), interleaved as the loss's
    chunks are (jaxinfra/loss.py chunked_sums), so no [B, T, vocab] float32 buffer is ever whole."""
    t = h.shape[1]
    if not chunk or chunk >= t or t % chunk:
        return target_logps(model.logits(h, plan=plan), targets, temperature)
    n = t // chunk
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], chunk, n, *x.shape[2:]), 2, 0)  # noqa: E731
    out = jax.lax.map(lambda xs: target_logps(model.logits(xs[0], plan=plan), xs[1], temperature),
                      (split(h), split(targets)))  # [n, B, chunk]
    return jnp.moveaxis(out, 0, 2).reshape(h.shape[0], t)


# (max, mean) |sampler - trainer| per completion token that tests/test_logprobs.py allows, per
# model dtype; measured on the tiny test models (scripts/logprob_gap.py): float32 <= 8e-6 max,
# bfloat16 <= 0.14 max and 0.021 mean (MoE 0.036; bf16 rounds the hidden states to 8 bits of mantissa, and
# prefill/decode round at other places than the training forward).
LOGP_TOLERANCE: dict[str, tuple[float, float]] = {"float32": (5e-5, 5e-6), "bfloat16": (0.25, 0.05)}
# MoE in bfloat16 only: the share of tokens allowed past the max. A token whose router scores are
# near a tie can pick another expert in one of the two forwards once bf16 rounds them (measured:
# 1 token of 96 at 1.39, where the float32 forward of the same weights sides with the sampler).
MOE_BF16_FLIP_SHARE = 0.03


@functools.lru_cache(maxsize=32)
def _logps_fn(model: ModelConfig, quant: QuantConfig, lora: LoraConfig, plan: ParallelPlan) -> Callable:
    """The jitted (params, tokens [N, T], lengths [N], temperature) -> [N, T - 1]; one per model and mesh."""
    graphdef = model_graphdef(model, quant, lora)

    def logps(params: nnx.State, tokens: jax.Array, lengths: jax.Array, temperature: jax.Array) -> jax.Array:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        t = inputs.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), inputs.shape)
        # segment 1 on the inputs whose target is real (tokens 0 .. length - 2), 0 on the rest, as
        # GRPO packs its rows (jaxinfra/grpo/rollout.py): padding routes no MoE token, and causal
        # attention keeps it out of every real position
        segment_ids = (positions < lengths[:, None] - 1).astype(jnp.int32)
        m = nnx.merge(graphdef, params)
        h, _ = m.hidden(inputs, positions, segment_ids, plan=plan)  # no rng: no LoRA dropout
        return chunked_token_logps(m, h, targets, temperature, model.loss_chunk_size, plan)

    return jax.jit(logps)


def policy_token_logps(cfg: Config, params: nnx.State, tokens: np.ndarray, temperature: float = 1.0,
                       mesh: Mesh | None = None, lengths: np.ndarray | None = None) -> np.ndarray:
    """[N, T - 1] float32: entry [i, j] is log softmax(logits / temperature)[tokens[i, j + 1]] of
    row i under the training forward (module docstring). `tokens` [N, T] int ids; `lengths` [N]
    (default T) marks each row's real tokens, the rest right padding (their entries are computed
    but mean nothing). `mesh`: the run's own mesh (its params in place, sharded by the run's
    rules); None: the config's mesh over this process's devices, as `jaxinfra eval`. Rows are
    padded up to a multiple of the batch shards. With `moe_dispatch=capacity` an expert's slots
    per sequence scale with the row width: pass rows of train.seq_len + 1 tokens to reproduce the
    train step's drops exactly."""
    tokens = check_token_array(tokens, cfg.model.vocab_size)
    n, t = tokens.shape
    lengths = np.full((n,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (n,) or lengths.min() < 1 or lengths.max() > t:
        raise InferenceError(f"lengths must be {n} integers in [1, {t}], got {lengths.tolist()}")
    if not temperature > 0:
        raise InferenceError(f"temperature={temperature} is invalid: log-probs need temperature > 0 (greedy: 1)")
    if mesh is None:
        mesh, rules = inference_mesh(cfg)
    else:
        rules = sharding_rules(cfg.parallelism)
    if mesh.shape["stage"] > 1:  # the train step's pipeline runs it; this forward has no pipeline settings
        raise InferenceError(f"policy_token_logps does not run pipeline stages: mesh.stage={mesh.shape['stage']}")
    plan = plan_for(mesh, rules)
    shards = int(np.prod([mesh.shape[a] for a in ("data", "fsdp", "expert")]))
    rows = -(-n // shards) * shards
    tokens = np.concatenate([tokens, np.zeros((rows - n, t), np.int32)])
    lengths = np.concatenate([lengths, np.full((rows - n,), t, np.int32)])
    fn = _logps_fn(cfg.model, cfg.quant, cfg.lora, plan)
    with jax.set_mesh(mesh):
        out = fn(_place_params(params, mesh, rules), jax.device_put(tokens, _sharding(mesh, rules, ("batch", "length"),
                                                                                       tokens.shape)),
                 jax.device_put(lengths, _sharding(mesh, rules, ("batch",), lengths.shape)), jnp.float32(temperature))
    return np.asarray(jax.device_get(out), np.float32)[:n]


def completion_logps(trainer: np.ndarray, prompt_lengths: list[int], completion_lengths: list[int],
                     shift: int = 0) -> list[np.ndarray]:
    """Per row, the trainer's log-probs of the completion tokens: the token at position p of
    prompt + completion is predicted at entry p - 1 of `policy_token_logps`'s [N, T - 1] output
    (`shift` moves that alignment: the tests' off-by-one check)."""
    return [trainer[i, p - 1 + shift:p - 1 + shift + c] for i, (p, c) in enumerate(zip(prompt_lengths,
                                                                                         completion_lengths))]


def sampler_and_trainer_logps(cfg: Config, params: nnx.State, generator: object, prompts: list[list[int]],
                              sampling: object, max_new_tokens: int, mesh: Mesh | None = None,
                              temperature: float | None = None, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(sampler, trainer): flat float32 log-probs of every generated token, as `generator`
    (a jaxinfra.infer.Generator) recorded them drawing with `sampling`, and as
    `policy_token_logps` recomputes them on prompt + completion at `temperature` (default: the
    sampler's, 1 when greedy), padded to one width so one compiled program serves every call."""
    result = generator.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling)
    rows = [list(p) + list(c) for p, c in zip(prompts, result.tokens)]
    from jaxinfra.infer.generation import PROMPT_BUCKET

    width = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET + max_new_tokens
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    if temperature is None:
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    trainer = policy_token_logps(cfg, params, tokens, temperature, mesh, lengths=np.asarray([len(r) for r in rows]))
    recomputed = completion_logps(trainer, [len(p) for p in prompts], [len(c) for c in result.tokens], shift)
    return (np.concatenate([np.asarray(lp, np.float32) for lp in result.logps]),
            np.concatenate(recomputed).astype(np.float32))
