"""Inference: load a checkpoint, score token files, generate with a KV cache.

    cfg, params = load_model("runs/tiny-...", ["mesh.tensor=2"])   # run dir or RUN/checkpoints/<step>
    gen = Generator(cfg, params)
    result = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, temperature=0.0)
    result.tokens      # per prompt, the generated ids (ending at a stop token if one was drawn)
    loss, n = score(cfg, params, tokens)                        # mean next-token CE in float32

The model code is the training code (models/): `Transformer.prefill` is the training forward
that also returns every layer's cache entries, `Transformer.decode` runs one token per row
against the cache (layer scan over (layer params, layer cache)). See docs/inference.md for
the cache layout, MLA's absorbed decode and the memory / FLOP trade-offs.

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
import pathlib
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.checkpoint import CheckpointError, restore_params
from jaxinfra.config import Config, ConfigError, load_config, validate
from jaxinfra.loss import cross_entropy_sums
from jaxinfra.state import init_params, model_graphdef, sharding_rules, tree_shardings
from models import ModelConfig
from models import cache as kv_cache
from sharding.mesh import make_mesh, resolve_mesh_sizes
from sharding.rules import ShardingRules, activation_sharding, constrain, logical_to_mesh

MAX_CONTEXT = 32768  # prompt + new tokens per row: the cache is allocated up front
PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this: fewer distinct compiles


class InferenceError(ConfigError):
    """Bad inference input (prompt, token file, sampling options): one line, CLI exit status 2."""


# ---------------------------------------------------------------- loading


def resolve_checkpoint(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int | None]:
    """(run dir, checkpoints dir, step or None for the newest) for a run dir or RUN/checkpoints/<step>."""
    path = pathlib.Path(path)
    if (path / "config.yaml").is_file():
        return path, path / "checkpoints", None
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        if not path.name.isdigit():
            raise CheckpointError(f"{path} is not a checkpoint step directory (RUN/checkpoints/<step>)")
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}")
        return path.parent.parent, path.parent, int(path.name)
    raise CheckpointError(f"{path} is neither a run directory (with config.yaml) nor RUN/checkpoints/<step>")


def inference_model_config(model: ModelConfig) -> ModelConfig:
    """The model config inference runs: dropless MoE routing (exact per token), no remat."""
    return dataclasses.replace(model, moe_dispatch="dropless", remat_policy="none")


def inference_devices(cfg: Config, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices a config's mesh spans: all of them when an axis is -1 (fill), else the first
    product-of-axes devices (so `mesh.data=1` runs on one device of many)."""
    devices = list(devices) if devices is not None else jax.devices()
    sizes = [s for s in (*cfg.mesh.sizes().values(), *cfg.mesh.dcn_sizes().values())]
    if -1 in sizes:
        return devices
    need = math.prod(sizes)
    if need > len(devices):
        raise ConfigError(f"mesh needs {need} devices but {len(devices)} are available; "
                          f"set the mesh.* sizes (e.g. mesh.data=-1) for this machine")
    return devices[:need]


def inference_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, ShardingRules]:
    """The training mesh and sharding rules for a config (pipeline stages are not supported)."""
    devices = inference_devices(cfg, devices)
    sizes = resolve_mesh_sizes(cfg.mesh, len(devices))
    if sizes["stage"] != 1:
        raise ConfigError(f"inference does not run pipeline stages: set mesh.stage=1 (got {sizes['stage']})")
    # The training batch does not matter here: check the rest against a batch the mesh divides.
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    validate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=shards, grad_accum_steps=1)),
             len(devices))
    return make_mesh(cfg.mesh, devices), sharding_rules(cfg.parallelism)


def load_model(path: str | pathlib.Path, overrides: Sequence[str] = (),
               devices: Sequence[jax.Device] | None = None) -> tuple[Config, nnx.State]:
    """(Config, params) from a run directory (newest readable checkpoint) or RUN/checkpoints/<step>.

    The config is the run's config.yaml plus `overrides` (e.g. `mesh.tensor=2`); the params are
    restored straight into the training shardings of that config's mesh (a partial restore of
    the Orbax `state` item's `params`, so checkpoints with or without optimizer state load)."""
    run_dir, ckpt_dir, step = resolve_checkpoint(path)
    cfg = load_config(str(run_dir / "config.yaml"), list(overrides))
    mesh, rules = inference_mesh(cfg, devices)
    abstract = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    shardings = tree_shardings(abstract, mesh, rules.params)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    _, params = restore_params(ckpt_dir, target, step=step)
    return cfg, params


def _place_params(params: nnx.State, cfg: Config, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """Params in the training shardings of this mesh (a no-op for load_model's output)."""
    shardings = tree_shardings(params, mesh, rules.params)
    return jax.device_put(params, shardings)


def _sharding(mesh: Mesh, rules: ShardingRules, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_mesh(names, rules.activations, mesh, shape))


# ---------------------------------------------------------------- scoring


def score(cfg: Config, params: nnx.State, tokens: np.ndarray, batch_size: int = 8,
          devices: Sequence[jax.Device] | None = None) -> tuple[float, int]:
    """(mean next-token cross-entropy, prediction count) of token rows [N, T]: the training
    forward on each row, float32 log-softmax, every position predicting the next; N*(T-1)
    predictions. Rows go in batches of `batch_size` (the last one padded and masked)."""
    tokens = check_token_array(tokens, cfg.model.vocab_size)
    n, t = tokens.shape
    mesh, rules = inference_mesh(cfg, devices)
    params = _place_params(params, cfg, mesh, rules)
    graphdef = model_graphdef(inference_model_config(cfg.model))
    batch_size = max(1, min(batch_size, n))

    def ce_sum(params: nnx.State, rows: jax.Array, mask: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, params).forward(rows[:, :-1])
        keep = jnp.broadcast_to(mask[:, None], (rows.shape[0], t - 1))
        return cross_entropy_sums(logits, rows[:, 1:], keep)["ce_sum"]

    rows_sharding = _sharding(mesh, rules, ("batch", "length"), (batch_size, t))
    mask_sharding = _sharding(mesh, rules, ("batch",), (batch_size,))
    total = 0.0
    with jax.set_mesh(mesh), activation_sharding(mesh, rules):
        fn = jax.jit(ce_sum)
        for lo in range(0, n, batch_size):
            chunk = tokens[lo:lo + batch_size]
            mask = np.arange(batch_size) < len(chunk)
            chunk = np.concatenate([chunk, np.zeros((batch_size - len(chunk), t), np.int32)])
            total += float(fn(params, jax.device_put(chunk, rows_sharding), jax.device_put(mask, mask_sharding)))
    count = n * (t - 1)
    return total / count, count


def check_token_array(tokens: Any, vocab_size: int) -> np.ndarray:
    """A 2-D integer array [batch, seq >= 2] of ids in [0, vocab) as int32; InferenceError otherwise."""
    arr = np.asarray(tokens)
    if arr.ndim != 2:
        raise InferenceError(f"tokens must be a 2-D array [batch, seq], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InferenceError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    if arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InferenceError(f"tokens need at least 1 row and 2 columns (seq >= 2), got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise InferenceError(f"token ids must be in [0, {vocab_size}) (model.vocab_size), found {lo if lo < 0 else hi}")
    return arr.astype(np.int32)


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

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second by the decode loop (batch x steps / time)."""
        return self.batch * self.decode_steps / max(self.decode_s, 1e-9)

    def summary(self) -> str:
        return (f"prefill: {self.prefill_tokens} tokens in {self.prefill_s:.3f}s ({self.prefill_tokens_per_s:.1f} tok/s); "
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
                 devices: Sequence[jax.Device] | None = None):
        self.cfg = cfg
        self.model_cfg = inference_model_config(cfg.model)
        self.mesh, self.rules = inference_mesh(cfg, devices)
        self.params = _place_params(params, cfg, self.mesh, self.rules)
        self.graphdef = model_graphdef(self.model_cfg)
        self.absorb = absorb
        self._compiled: dict[tuple, tuple[Any, Any]] = {}

    # -------------------------------------------------------- the two jitted functions

    def _cache_constrain(self, cache: kv_cache.Cache, batch: int, max_len: int) -> kv_cache.Cache:
        names = kv_cache.layout(self.model_cfg, batch, max_len)
        return {s: {n: constrain(a, names[s][n][1]) for n, a in arrays.items()} for s, arrays in cache.items()}

    def _prefill_fn(self, max_new: int) -> Callable:
        graphdef = self.graphdef

        def prefill(params, tokens, lengths, stop_ids, settings):
            b, p = tokens.shape
            max_len = p + max_new
            logits, entries = nnx.merge(graphdef, params).prefill(tokens)
            pad = lambda e: jnp.pad(e, [(0, 0), (0, 0), (0, 0), (0, max_len - p), (0, 0)])  # noqa: E731
            cache = self._cache_constrain(jax.tree.map(pad, entries), b, max_len)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
            temperature, top_k, top_p, seed = settings
            first = sample(last, _row_keys(seed, 0, b), temperature, top_k, top_p)
            out = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
            done = jnp.isin(first, stop_ids)
            return {"cache": cache, "out": out, "done": done, "pos": lengths, "t": jnp.ones((), jnp.int32)}

        return prefill

    def _decode_fn(self) -> Callable:
        graphdef, absorb = self.graphdef, self.absorb

        def decode(params, state, stop_ids, settings):
            temperature, top_k, top_p, seed = settings
            b, max_new = state["out"].shape
            model = nnx.merge(graphdef, params)

            def cond(s):
                return (s["t"] < max_new) & ~jnp.all(s["done"])

            def body(s):
                prev = jnp.maximum(jax.lax.dynamic_slice_in_dim(s["out"], s["t"] - 1, 1, axis=1), 0)  # [B, 1]
                logits, cache = model.decode(prev, s["pos"][:, None], s["cache"], absorb)
                tok = sample(logits[:, 0], _row_keys(seed, s["t"], b), temperature, top_k, top_p)
                tok = jnp.where(s["done"], -1, tok)
                out = jax.lax.dynamic_update_slice_in_dim(s["out"], tok[:, None], s["t"], axis=1)
                cache = self._cache_constrain(cache, b, cache_len(cache))
                return {"cache": cache, "out": out, "done": s["done"] | jnp.isin(tok, stop_ids),
                        "pos": s["pos"] + 1, "t": s["t"] + 1}

            return jax.lax.while_loop(cond, body, state)

        return decode

    def _compile(self, batch: int, prompt_len: int, max_new: int, n_stop: int) -> tuple[Any, Any]:
        key = (batch, prompt_len, max_new, n_stop)
        if key not in self._compiled:
            m, r = self.mesh, self.rules
            tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32,
                                          sharding=_sharding(m, r, ("batch", "length"), (batch, prompt_len)))
            lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=_sharding(m, r, ("batch",), (batch,)))
            stop = jax.ShapeDtypeStruct((n_stop,), jnp.int32, sharding=NamedSharding(m, PartitionSpec()))
            settings = self._settings(Sampling())
            with jax.set_mesh(m), activation_sharding(m, r):
                prefill = jax.jit(self._prefill_fn(max_new)).lower(self.params, tokens, lengths, stop,
                                                                   settings).compile()
                state = jax.eval_shape(self._prefill_fn(max_new), self.params, tokens, lengths, stop, settings)
                state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                                     prefill.output_shardings)
                decode = jax.jit(self._decode_fn(), donate_argnums=1).lower(self.params, state, stop,
                                                                            settings).compile()
            self._compiled[key] = (prefill, decode)
        return self._compiled[key]

    def _settings(self, s: Sampling) -> tuple:
        rep = NamedSharding(self.mesh, PartitionSpec())
        return (jax.device_put(np.float32(s.temperature), rep), jax.device_put(np.int32(s.top_k), rep),
                jax.device_put(np.float32(s.top_p), rep), jax.device_put(np.uint32(s.seed % 2**32), rep))

    # -------------------------------------------------------- the public call

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
                 sampling: Sampling = Sampling(), stop_ids: Sequence[int] = ()) -> GenerationResult:
        """Continue each prompt (a list of ids) by up to `max_new_tokens` ids; a row that draws
        one of `stop_ids` stops there (the stop id is the last one returned)."""
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
        fresh = (batch, prompt_len, max_new_tokens, n_stop) not in self._compiled
        prefill, decode = self._compile(batch, prompt_len, max_new_tokens, n_stop)
        compile_s = time.perf_counter() - t0 if fresh else 0.0
        m, r = self.mesh, self.rules
        args = (jax.device_put(tokens, _sharding(m, r, ("batch", "length"), tokens.shape)),
                jax.device_put(lengths, _sharding(m, r, ("batch",), lengths.shape)),
                jax.device_put(stop_arr, NamedSharding(m, PartitionSpec())))
        settings = self._settings(sampling)
        jax.block_until_ready(args)

        t0 = time.perf_counter()
        state = jax.block_until_ready(prefill(self.params, *args, settings))
        t1 = time.perf_counter()
        state = decode(self.params, state, args[2], settings)
        out, steps = jax.device_get((state["out"], state["t"]))
        t2 = time.perf_counter()

        rows = []
        for row in out:
            ids = [int(x) for x in row if x >= 0]
            for j, x in enumerate(ids):
                if x in stops:
                    ids = ids[:j + 1]
                    break
            rows.append(ids)
        return GenerationResult(tokens=rows, prefill_tokens=int(lengths.sum()), prefill_s=t1 - t0,
                                decode_steps=int(steps) - 1, decode_s=t2 - t1, compile_s=compile_s, batch=batch)


def cache_len(cache: kv_cache.Cache) -> int:
    return jax.tree.leaves(cache)[0].shape[3]


# ---------------------------------------------------------------- text


def text_codec(cfg: Config, run_dir: str | pathlib.Path | None = None) -> tuple[Callable[[str], list[int]],
                                                                                 Callable[[list[int]], str]]:
    """(encode, decode) for the run's data config: byte-level UTF-8 (ids 0..255) or its tokenizer.json."""
    data = cfg.data
    if data.source != "text":
        raise InferenceError(f"the run's data.source={data.source!r} has no text tokenizer: use --prompt-ids")
    if data.tokenizer is None:
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace"))
    from jaxinfra.data.tokenizer import load_tokenizer

    path = pathlib.Path(data.tokenizer)
    if not path.is_file() and not path.is_absolute() and run_dir is not None and (pathlib.Path(run_dir) / path).is_file():
        path = pathlib.Path(run_dir) / path
    tok = load_tokenizer(str(path))
    return (lambda text: list(tok.encode(text, add_special_tokens=False).ids),
            lambda ids: tok.decode(list(ids)))
