"""Generation with a KV cache: sampling, and a compiled prefill + decode loop per shape.

Generation = one jitted prefill over right-padded prompts (each row's next write index is its
own length) and one jitted decode loop (`lax.while_loop` over single-token steps with a fixed
shape, so it compiles once per (batch, prompt bucket, max_new_tokens)), stopping early when
every row has drawn a stop token. Both run on the training mesh with the training sharding
rules (parameters as trained; the batch and cache over the data axes, heads over `tensor`).

MoE layers always run dropless here (whatever `moe_dispatch` says): capacity dropping depends
on which tokens share a group, so decoding one token at a time could not match the prompt's
forward. The router's aux-loss-free bias is used for selection as in training.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.config import Config
from jaxinfra.infer.loading import InferenceError, _place_params, _sharding, inference_mesh, inference_model_config
from jaxinfra.loss import target_logps
from jaxinfra.state import model_graphdef
from models import cache as kv_cache
from sharding.plan import plan_for

MAX_CONTEXT = 32768  # prompt + new tokens per row: the cache is allocated up front
PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this: fewer distinct compiles


# ---------------------------------------------------------------- sampling


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Next ids [B] from float32 logits [B, V]: greedy (argmax) when temperature == 0, else a
    draw from softmax(logits / temperature) restricted to the top_k ids (0: all) and then to
    the smallest set of the most likely ids whose probability reaches top_p (nucleus; 1: all).

    All settings are traced scalars, so one compiled step serves every setting; `lax.cond`
    runs only the branch in use (the sort behind top-k/top-p cost ~9 ms per step at batch 8
    x vocab 8192 on CPU, so greedy and plain temperature sampling skip it). keys [B]: one
    key per row, so a row's draws do not depend on the other rows."""

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = logits / temperature
        scaled = jax.lax.cond((top_k > 0) | (top_p < 1), _top_k_top_p, lambda x, k, p: x, scaled, top_k, top_p)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, greedy, None)


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """-inf outside the top_k ids (0: all) and then outside the nucleus of mass top_p."""
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)
    ordered = jnp.where(ranks[None, :] < k, ordered, -jnp.inf)  # top-k
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely ids
    kept = (before < top_p) & (ranks[None, :] < k)
    kept = kept.at[:, 0].set(True)  # the most likely id always stays
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def token_logps(logits: jax.Array, ids: jax.Array, temperature: jax.Array) -> jax.Array:
    """[B] float32 log-prob of ids [B] under softmax(logits [B, V] / temperature) (temperature 1
    when greedy): what the sampler records and what a trainer recomputes (jaxinfra/grpo/)."""
    return target_logps(logits, ids, jnp.where(temperature > 0, temperature, 1.0))


def _row_keys(seed: jax.Array, step: jax.Array, batch: int) -> jax.Array:
    base = jax.random.fold_in(jax.random.key(seed), step)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(batch))


# ---------------------------------------------------------------- generation


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # per prompt: generated ids, ending with the stop id if one was drawn
    prefill_tokens: int  # real prompt tokens processed
    prefill_s: float
    decode_steps: int  # single-token steps run (one token per row each)
    decode_s: float
    compile_s: float  # compile time of this call (0 when already compiled)
    batch: int
    # per prompt, aligned with `tokens`: each generated id's float32 log-prob under the sampler,
    # log_softmax(logits / temperature) (temperature 1 when greedy), before top-k / top-p
    logps: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second by the decode loop (batch x steps / time)."""
        return self.batch * self.decode_steps / max(self.decode_s, 1e-9)

    def summary(self) -> str:
        return (f"prefill: {self.prefill_tokens} tokens in {self.prefill_s:.3f}s "
                f"({self.prefill_tokens_per_s:.1f} tok/s); "
                f"decode: {self.decode_steps} steps x batch {self.batch} in {self.decode_s:.3f}s "
                f"({self.decode_tokens_per_s:.1f} tok/s); compile {self.compile_s:.1f}s")


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def check(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InferenceError(f"temperature={self.temperature} is invalid: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InferenceError(f"top_k={self.top_k} is invalid: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise InferenceError(f"top_p={self.top_p} is invalid: must be in (0, 1] (1 = off)")


class Generator:
    """Compiled prefill and decode for one model on its training mesh; reuse it across calls."""

    def __init__(self, cfg: Config, params: nnx.State, *, absorb: bool = True,
                 devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None):
        """`mesh`: a training run's own mesh (a rollout samples with the trained params in place, so
        `generate(params=...)` takes them in the training shardings without a copy)."""
        self.cfg = cfg
        self.model_cfg = inference_model_config(cfg.model)
        self.mesh, self.rules = inference_mesh(cfg, devices if mesh is None else list(mesh.devices.flat))
        if mesh is not None:
            self.mesh = mesh
        self.plan = plan_for(self.mesh, self.rules)  # passed to the model: nothing ambient decides the program
        self.params = _place_params(params, self.mesh, self.rules)
        # What the programs are compiled for (the params a call passes may be newer: same shapes and shardings).
        self.abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                            self.params)
        self.graphdef = model_graphdef(self.model_cfg, cfg.quant, cfg.lora)
        self.absorb = absorb
        self.kv_int8 = cfg.quant.kv_cache == "int8"  # int8 values + per-token-per-head scales (models/cache.py)
        self._compiled: dict[tuple, tuple[Any, Any]] = {}

    # -------------------------------------------------------- the two jitted functions

    def _cache_constrain(self, cache: kv_cache.Cache, batch: int, max_len: int) -> kv_cache.Cache:
        names = kv_cache.layout(self.model_cfg, batch, max_len, self.kv_int8)
        pin = self.plan.constrain
        return {s: {n: pin(a, names[s][n][1]) for n, a in arrays.items()} for s, arrays in cache.items()}

    def _prefill_fn(self, max_new: int) -> Callable:
        graphdef = self.graphdef

        def prefill(params, tokens, lengths, stop_ids, settings):
            b, p = tokens.shape
            max_len = p + max_new
            logits, entries = nnx.merge(graphdef, params).prefill(tokens, plan=self.plan)
            cache = kv_cache.from_prefill(self.model_cfg, entries, lengths, max_len)  # (sliding layers: ring buffers)
            if self.kv_int8:
                cache = {stack: kv_cache.quantize_entries(arrays) for stack, arrays in cache.items()}
            cache = self._cache_constrain(cache, b, max_len)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
            temperature, top_k, top_p, seed = settings
            first = sample(last, _row_keys(seed, 0, b), temperature, top_k, top_p)
            out = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
            logps = jnp.zeros((b, max_new), jnp.float32).at[:, 0].set(token_logps(last, first, temperature))
            done = jnp.isin(first, stop_ids)
            return {"cache": cache, "out": out, "logps": logps, "done": done, "pos": lengths,
                    "t": jnp.ones((), jnp.int32)}

        return prefill

    def _decode_fn(self, stop_sequence: tuple[int, ...] = ()) -> Callable:
        """The decode loop; `stop_sequence` (ids baked into the program, e.g. a byte-level
        end-of-turn) also ends a row whose last ids spell it (none: the program as without it)."""
        graphdef, absorb = self.graphdef, self.absorb

        def decode(params, state, stop_ids, settings):
            temperature, top_k, top_p, seed = settings
            b, max_new = state["out"].shape
            model = nnx.merge(graphdef, params)

            def cond(s):
                return (s["t"] < max_new) & ~jnp.all(s["done"])

            def body(s):
                prev = jnp.maximum(jax.lax.dynamic_slice_in_dim(s["out"], s["t"] - 1, 1, axis=1), 0)  # [B, 1]
                logits, cache = model.decode(prev, s["pos"][:, None], s["cache"], absorb, plan=self.plan)
                tok = sample(logits[:, 0], _row_keys(seed, s["t"], b), temperature, top_k, top_p)
                logp = token_logps(logits[:, 0], tok, temperature)
                tok = jnp.where(s["done"], -1, tok)
                out = jax.lax.dynamic_update_slice_in_dim(s["out"], tok[:, None], s["t"], axis=1)
                logps = jax.lax.dynamic_update_slice_in_dim(s["logps"], logp[:, None], s["t"], axis=1)
                cache = self._cache_constrain(cache, b, cache_len(cache))
                done = s["done"] | jnp.isin(tok, stop_ids)
                if stop_sequence:
                    done = done | _ends_with(out, s["t"], stop_sequence)
                return {"cache": cache, "out": out, "logps": logps, "done": done, "pos": s["pos"] + 1,
                        "t": s["t"] + 1}

            return jax.lax.while_loop(cond, body, state)

        return decode

    def _compile(self, batch: int, prompt_len: int, max_new: int, n_stop: int,
                 stop_sequence: tuple[int, ...] = ()) -> tuple[Any, Any]:
        key = (batch, prompt_len, max_new, n_stop, stop_sequence)
        if key not in self._compiled:
            m, r = self.mesh, self.rules
            tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32,
                                          sharding=_sharding(m, r, ("batch", "length"), (batch, prompt_len)))
            lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=_sharding(m, r, ("batch",), (batch,)))
            stop = jax.ShapeDtypeStruct((n_stop,), jnp.int32, sharding=NamedSharding(m, PartitionSpec()))
            settings = self._settings(Sampling())
            with jax.set_mesh(m):
                params = self.abstract_params
                prefill = jax.jit(self._prefill_fn(max_new)).lower(params, tokens, lengths, stop, settings).compile()
                state = jax.eval_shape(self._prefill_fn(max_new), params, tokens, lengths, stop, settings)
                state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                                     prefill.output_shardings)
                decode = jax.jit(self._decode_fn(stop_sequence), donate_argnums=1).lower(params, state, stop,
                                                                                          settings).compile()
            self._compiled[key] = (prefill, decode)
        return self._compiled[key]

    def _settings(self, s: Sampling) -> tuple:
        rep = NamedSharding(self.mesh, PartitionSpec())
        return (jax.device_put(np.float32(s.temperature), rep), jax.device_put(np.int32(s.top_k), rep),
                jax.device_put(np.float32(s.top_p), rep), jax.device_put(np.uint32(s.seed % 2**32), rep))

    # -------------------------------------------------------- the public call

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
                 sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (),
                 stop_sequence: Sequence[int] = (), params: nnx.State | None = None) -> GenerationResult:
        """Continue each prompt (a list of ids) by up to `max_new_tokens` ids; a row that draws
        one of `stop_ids` stops there (the stop id is the last one returned), as does a row whose
        last ids are `stop_sequence` (e.g. "<|im_end|>" in bytes; returned with it). `params`:
        newer params of the same model in the same shardings (a training run's, used in place)."""
        sampling.check()
        vocab = self.model_cfg.vocab_size
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InferenceError("every prompt needs at least one token")
        bad = [i for p in prompts for i in p if not 0 <= i < vocab]
        if bad:
            raise InferenceError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise InferenceError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > MAX_CONTEXT:
            raise InferenceError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"{MAX_CONTEXT}-token cache limit")
        batch = len(prompts)
        prompt_len = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
        tokens = np.zeros((batch, prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        stops = sorted(set(int(s) for s in stop_ids))
        n_stop = max(8, -(-len(stops) // 8) * 8)
        stop_arr = np.full((n_stop,), -2, np.int32)  # -2 never matches (finished rows hold -1)
        stop_arr[:len(stops)] = stops

        t0 = time.perf_counter()
        # A stop sequence longer than the completion can never be drawn whole (and the decode loop's
        # window over the output could not hold it): none then.
        sequence = tuple(int(i) for i in stop_sequence) if len(stop_sequence) <= max_new_tokens else ()
        fresh = (batch, prompt_len, max_new_tokens, n_stop, sequence) not in self._compiled
        prefill, decode = self._compile(batch, prompt_len, max_new_tokens, n_stop, sequence)
        compile_s = time.perf_counter() - t0 if fresh else 0.0
        m, r = self.mesh, self.rules
        args = (jax.device_put(tokens, _sharding(m, r, ("batch", "length"), tokens.shape)),
                jax.device_put(lengths, _sharding(m, r, ("batch",), lengths.shape)),
                jax.device_put(stop_arr, NamedSharding(m, PartitionSpec())))
        settings = self._settings(sampling)
        jax.block_until_ready(args)

        params = self.params if params is None else params
        t0 = time.perf_counter()
        state = jax.block_until_ready(prefill(params, *args, settings))
        t1 = time.perf_counter()
        state = decode(params, state, args[2], settings)
        out, logps, steps = jax.device_get((state["out"], state["logps"], state["t"]))
        t2 = time.perf_counter()

        rows = [_trimmed(row, stops, sequence) for row in out]
        return GenerationResult(tokens=rows, prefill_tokens=int(lengths.sum()), prefill_s=t1 - t0,
                                decode_steps=int(steps) - 1, decode_s=t2 - t1, compile_s=compile_s, batch=batch,
                                logps=[[float(x) for x in lp[:len(row)]] for row, lp in zip(rows, logps)])


def _ends_with(out: jax.Array, t: jax.Array, sequence: tuple[int, ...]) -> jax.Array:
    """[B] whether each row's ids out[:, t - len + 1 : t + 1] are `sequence` (False before t + 1 >= len)."""
    n = len(sequence)
    window = jax.lax.dynamic_slice_in_dim(out, jnp.maximum(t - n + 1, 0), n, axis=1)
    return (t + 1 >= n) & jnp.all(window == jnp.asarray(sequence, jnp.int32)[None], axis=1)


def _trimmed(row: np.ndarray, stops: Sequence[int], sequence: tuple[int, ...]) -> list[int]:
    """A row's generated ids up to and including its first stop id or stop sequence."""
    ids = [int(x) for x in row if x >= 0]
    for j, x in enumerate(ids):
        if x in stops or (sequence and tuple(ids[max(j + 1 - len(sequence), 0):j + 1]) == sequence):
            return ids[:j + 1]
    return ids


def cache_len(cache: kv_cache.Cache) -> int:
    """The positions a cache holds (its global groups' slots; sliding groups hold at most that)."""
    return max(leaf.shape[3] for leaf in jax.tree.leaves(cache))
