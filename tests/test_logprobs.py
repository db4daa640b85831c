"""Sampler = trainer: the log-prob the KV-cache sampler records for each generated token
(jaxinfra/infer/generation.py) against `policy_token_logps`, the training forward's recomputation
(jaxinfra/infer/logprobs.py), on every test model family in float32 and bfloat16, greedy and
sampled. The tolerances are LOGP_TOLERANCE (measured gaps: docs/post-training.md "Sampler and
trainer log-probs"; MoE in bfloat16 lets a few tokens past the max:
MOE_BF16_FLIP_SHARE, router near-ties); an off-by-one alignment and a forgotten temperature must exceed them.
One Generator (prefill + decode compiled once) and one recomputation program per (family, dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from logprob_models import FAMILIES, PROMPTS, SAMPLINGS, make

from jaxinfra.infer import Generator, inference_mesh
from jaxinfra.infer.logprobs import LOGP_TOLERANCE, MOE_BF16_FLIP_SHARE, policy_token_logps, sampler_and_trainer_logps
from jaxinfra.state import model_graphdef

NEW = 16


@functools.cache
def model(family: str, dtype: str):
    cfg, params = make(family, dtype)
    return cfg, params, Generator(cfg, params)


def gap(family: str, dtype: str, sampling, **kw) -> np.ndarray:
    cfg, params, gen = model(family, dtype)
    a, b = sampler_and_trainer_logps(cfg, params, gen, PROMPTS, sampling, NEW, **kw)
    assert len(a) == len(b) == len(PROMPTS) * NEW
    return np.abs(a - b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampler_logps_equal_the_training_forward(family, dtype):
    worst, mean = LOGP_TOLERANCE[dtype]
    flips = MOE_BF16_FLIP_SHARE if (family, dtype) == ("MoE", "bfloat16") else 0.0
    for name, sampling in SAMPLINGS.items():  # greedy, T=1, T=0.7: one compiled program for all
        d = gap(family, dtype, sampling)
        assert np.mean(d > worst) <= flips and d.mean() <= mean, (family, dtype, name, d.max(), d.mean())
    if family == "MoE":  # training routes with capacity (factor 1.5), the sampler dropless: equal
        assert training_drops(*model(family, dtype)) == 0  # only while training drops nothing: checked


def training_drops(cfg, params, gen) -> float:
    """Expert assignments the training forward (capacity dispatch) drops on sampled rows, laid out
    as policy_token_logps lays them out (inputs = row[:-1], segment id 0 past the last target)."""
    out = gen.generate(PROMPTS, max_new_tokens=NEW, sampling=SAMPLINGS["T=1"]).tokens
    width = 16 + NEW - 1
    rows, segments = np.zeros((len(PROMPTS), width), np.int32), np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, c) in enumerate(zip(PROMPTS, out)):
        tokens = [*p, *c][:-1]
        rows[i, :len(tokens)], segments[i, :len(tokens)] = tokens, 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), rows.shape)
    graphdef = model_graphdef(cfg.model)
    dropped = jax.jit(lambda p, *a: jnp.sum(nnx.merge(graphdef, p).forward(*a)[1]["dropped"]))
    return float(dropped(params, rows, positions, segments))

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_off_by_one_or_a_missing_temperature_exceeds_the_tolerance(dtype):
    worst, _ = LOGP_TOLERANCE[dtype]
    assert gap("GQA", dtype, SAMPLINGS["T=0.7"]).max() <= worst  # the right computation passes
    assert gap("GQA", dtype, SAMPLINGS["T=0.7"], shift=1).max() > 4 * worst
    assert gap("GQA", dtype, SAMPLINGS["T=0.7"], temperature=1.0).max() > 2 * worst


def test_policy_token_logps_equal_numpy_log_softmax_of_the_forward():
    """An independent reference: numpy's log-softmax of the training forward's logits / T."""
    cfg, params, _ = model("GQA", "float32")
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (3, 12)).astype(np.int32)
    got = policy_token_logps(cfg, params, tokens, temperature=0.7)
    logits = np.asarray(nnx.merge(model_graphdef(cfg.model), params).forward(jnp.asarray(tokens[:, :-1]))[0],
                        np.float64) / 0.7
    top = logits.max(-1, keepdims=True)
    logsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    want = np.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got, want, atol=2e-5)
    chunked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk_size=4))  # 11 = no divisor
    np.testing.assert_allclose(policy_token_logps(chunked, params, tokens[:, :9], temperature=0.7), want[:, :8],
                               atol=2e-5)  # loss chunks of 4 over 8 positions, interleaved as the loss's


def test_on_the_runs_mesh_sampler_and_trainer_agree_and_equal_one_device():
    """fsdp=2 x tensor=2: the sampler on the run's mesh (params in place) and the recomputation
    sharded by the run's rules; both agree with each other and with one device."""
    cfg, params = make("GQA", "float32", extra=("mesh.fsdp=2", "mesh.tensor=2"))
    mesh, _ = inference_mesh(cfg, jax.devices()[:4])
    gen = Generator(cfg, params, mesh=mesh)
    a, b = sampler_and_trainer_logps(cfg, params, gen, PROMPTS, SAMPLINGS["T=1"], NEW, mesh=mesh)
    assert np.abs(a - b).max() <= LOGP_TOLERANCE["float32"][0]
    one_cfg, one_params, one_gen = model("GQA", "float32")
    a1, b1 = sampler_and_trainer_logps(one_cfg, one_params, one_gen, PROMPTS, SAMPLINGS["T=1"], NEW)
    np.testing.assert_allclose(b, b1, atol=LOGP_TOLERANCE["float32"][0])
    np.testing.assert_allclose(a, a1, atol=LOGP_TOLERANCE["float32"][0])
