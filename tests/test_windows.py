"""Sliding-window attention through the one layer stack (models/stack.py): per-layer windows and
RoPE tables (model.sliding_window, sliding_window_pattern, rope_local_theta), periods that are the
lcm of the MoE period and the window pattern, suffix layers after the last whole period.

Every forward check is against an independent reference: a float64 numpy decoder, or the model's
own blocks applied one by one in layer order (no periods, no scan)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra.config import ConfigError, load_config, validate
from jaxinfra.state import model_graphdef
from models import ModelConfig, Transformer
from models.stack import LayerSpec, layer_schedule
from sharding.plan import SINGLE_DEVICE

# Gemma-like: sandwich norms, (1 + w) weights, QK-norm, sinks, windows of 8 on layers 0, 1, 3 (pattern 3:
# layer 2 global), so a period of 3 and a suffix of one layer; local layers rotate with base 100.
WIN = ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  tie_embeddings=True, norm_placement="sandwich", norm_weight_offset=1.0, qk_norm=True,
                  attention_sinks=True, sliding_window=8, sliding_window_pattern=3, rope_local_theta=100.0,
                  rope_theta=10000.0, param_dtype="float32", dtype="float32")
B, T = 2, 32


@functools.cache
def params_for(cfg: ModelConfig, seed: int = 0):
    """Random params in the model's layout from numpy (norm scales near their offset, sinks ~ N(0, 1))."""
    rng = np.random.default_rng(seed)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)

    def fill(path, x):
        name = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
        if name in ("scale", "q_norm", "k_norm"):
            value = 0.1 * rng.standard_normal(x.shape) + (1 - cfg.norm_weight_offset)
        elif name == "sinks":
            value = rng.standard_normal(x.shape)
        else:
            value = 0.1 * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


def _packed():
    """Row 0: documents of 20 and 9 tokens, then 3 padding; row 1: one document filling the row."""
    seg = np.array([[1] * 20 + [2] * 9 + [0] * 3, [1] * T], np.int32)
    pos = np.array([list(range(20)) + list(range(9)) + [0] * 3, list(range(T))], np.int32)
    tokens = np.random.default_rng(1).integers(0, WIN.vocab_size, size=(B, T)).astype(np.int32)
    return tokens, pos, seg


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens, positions, segment_ids):
    return nnx.merge(graphdef, params).forward(tokens, positions, segment_ids)


def forward(cfg, params, *batch):
    return _forward(model_graphdef(cfg), params, *(None if x is None else jnp.asarray(x) for x in batch))


# ---------------------------------------------------------------- numpy reference


def _rms(x, w, cfg):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps) * (cfg.norm_weight_offset + w)


def _rope(x, positions, theta):
    dim = x.shape[-1]
    angles = positions[:, :, None] * (1.0 / theta ** (np.arange(0, dim, 2) / dim))
    sin, cos = np.sin(angles)[:, :, None], np.cos(angles)[:, :, None]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_attention(x, p, cfg, pos, seg, window, theta):
    q = np.einsum("btd,dhk->bthk", x, p["wq"])
    k, v = (np.einsum("btd,dhk->bthk", x, p[w]) for w in ("wk", "wv"))
    q, k = (_rope(_rms(a, p[n], cfg), pos, theta) for a, n in ((q, "q_norm"), (k, "k_norm")))
    group = cfg.num_heads // cfg.kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(cfg.resolved_head_dim)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & (seg[:, :, None] == seg[:, None, :])  # [B, Tq, Tk]
    if window is not None:
        visible &= i - j < window
    s = np.where(visible[:, None], s, -np.inf)
    sink = p["sinks"][None, :, None, None]
    m = np.maximum(s.max(-1, keepdims=True), sink)
    e = np.exp(s - m)
    probs = e / (e.sum(-1, keepdims=True) + np.exp(sink - m))
    return np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", probs, v), p["wo"])


def _np_logits(cfg, params, tokens, pos, seg):
    """The decoder in float64 numpy, layer i sliding over `window` keys with base rope_local_theta
    when (i + 1) % pattern != 0 (written out here, not read from the schedule)."""
    leaf = lambda *keys: np.asarray(functools.reduce(lambda n, k: n[k], keys, params)[...], np.float64)  # noqa: E731
    table = leaf("embed")
    h = table[tokens]
    for i in range(cfg.num_layers):
        local = (i + 1) % cfg.sliding_window_pattern != 0
        window, theta = (cfg.sliding_window, cfg.rope_local_theta) if local else (None, cfg.rope_theta)
        p = {n: leaf("layers", "attn", n)[i] for n in ("wq", "wk", "wv", "wo", "q_norm", "k_norm", "sinks")}
        p.update({n: leaf("layers", "mlp", n)[i] for n in ("w_gate", "w_up", "w_down")})
        norm = lambda x, name: _rms(x, leaf("layers", name, "scale")[i], cfg)  # noqa: E731
        h = h + norm(_np_attention(norm(h, "attn_norm"), p, cfg, pos, seg, window, theta), "attn_post_norm")
        x = norm(h, "mlp_norm")
        silu = x @ p["w_gate"] / (1 + np.exp(-(x @ p["w_gate"])))
        h = h + norm((silu * (x @ p["w_up"])) @ p["w_down"], "mlp_post_norm")
    return _rms(h, leaf("final_norm", "scale"), cfg) @ table.T


# ---------------------------------------------------------------- the schedule


def test_schedule_specs_period_and_suffix():
    s = layer_schedule(WIN)
    assert [(x.window, x.rope) for x in s.layers] == [(8, "local"), (8, "local"), (None, "global"), (8, "local")]
    assert (s.prefix, s.period, s.periods, s.suffix_start, s.grouped("dense")) == (0, 3, 1, 3, True)
    # gpt-oss: every layer MoE, alternating sliding/full: a period of two MoE blocks, no suffix.
    oss = layer_schedule(dataclasses.replace(WIN, num_layers=24, moe_num_experts=4, moe_top_k=2,
                                             sliding_window_pattern=2, rope_local_theta=None))
    assert (oss.period, oss.periods, oss.per_period("moe"), oss.grouped("moe"), oss.stacks) == (2, 12, 2, True,
                                                                                                 ("moe_layers",))
    assert oss.layers[:2] == (LayerSpec("moe", 0, 8, "global"), LayerSpec("moe", 1, None, "global"))
    # Gemma 3 27B's shape: 62 layers, pattern 6 -> 10 periods and a suffix of 2 sliding layers.
    gemma = layer_schedule(dataclasses.replace(WIN, num_layers=62, sliding_window_pattern=6))
    assert (gemma.period, gemma.periods, gemma.suffix_start) == (6, 10, 60)
    assert [x.window for x in gemma.layers[60:]] == [8, 8]
    # No windows: the schedule of before (one dense layer per period, ungrouped).
    plain = layer_schedule(dataclasses.replace(WIN, sliding_window=None))
    assert (plain.period, plain.simple, {x.variant for x in plain.layers}) == (1, True, {("dense", None, "global")})
    every = layer_schedule(dataclasses.replace(WIN, sliding_window_pattern=0))  # every layer slides
    assert every.period == 1 and all(x.window == 8 for x in every.layers)


# ---------------------------------------------------------------- the forward


def test_windowed_forward_matches_numpy_reference_with_packed_segments():
    """Windows (period 3 + a suffix layer), local RoPE base, sinks, sandwich norms and packed documents
    longer than the window equal the float64 numpy decoder; scan_layers on and off agree."""
    tokens, pos, seg = _packed()
    params = params_for(WIN)
    got = np.asarray(forward(WIN, params, tokens, pos, seg)[0])
    want = _np_logits(WIN, params, tokens, pos, seg)
    real = seg > 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    unrolled = np.asarray(forward(dataclasses.replace(WIN, scan_layers=False), params, tokens, pos, seg)[0])
    np.testing.assert_allclose(unrolled, got, rtol=1e-5, atol=1e-5)
    # The windows and the local table matter here: the all-global model differs by far more than the tolerance.
    plain = _np_logits(dataclasses.replace(WIN, sliding_window_pattern=1), params, tokens, pos, seg)
    assert np.abs(plain - want)[real].max() > 1e-2


def _layer_by_layer(model: Transformer, tokens, positions):
    """The model's own blocks applied one at a time in layer order, each with the window and RoPE table
    its position in the stack should have (from the config, not the schedule)."""
    cfg = model.cfg
    h, positions, ropes = model._embed(tokens, positions, SINGLE_DEVICE)
    mask, order = jnp.ones(tokens.shape, jnp.bool_), jnp.argsort(positions, axis=-1, stable=True)
    stats, slots = [], {"layers": 0, "moe_layers": 0}
    for sparse, window in zip(cfg.moe_layer_flags(), cfg.layer_windows(), strict=True):
        stack = "moe_layers" if sparse else "layers"
        graphdef, state = nnx.split(getattr(model, stack))
        blk = nnx.merge(graphdef, jax.tree.map(lambda x, j=slots[stack]: x[j], state))
        slots[stack] += 1
        rope = ropes["local" if window is not None and cfg.rope_local_theta is not None else "global"]
        if sparse:
            h, st = blk(h, positions, None, rope, mask, order, window=window)
            stats.append(st["counts"])
        else:
            h = blk(h, positions, None, rope, window=window)
    return model.logits(model.final_norm(h)), jnp.stack(stats)


# Unrolled (a Python loop over the same period function) is slow-marked: the dense test compares scan and unrolled.
@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_moe_windows_prefix_periods_and_suffix_match_layer_by_layer(scan):
    """5 layers, 2 dense prefix layers of different windows (unrolled), then MoE every layer with pattern 2:
    a period of two MoE blocks and a suffix MoE layer; scan (and unrolled) equal the layer-by-layer loop."""
    cfg = dataclasses.replace(WIN, num_layers=5, moe_num_experts=4, moe_top_k=2, moe_mlp_dim=32,
                              moe_first_dense_layers=2, sliding_window_pattern=2, norm_placement="pre",
                              norm_weight_offset=0.0, attention_sinks=False)
    s = layer_schedule(cfg)
    assert (s.prefix, s.period, s.periods, s.suffix_start, s.grouped("moe")) == (2, 2, 1, 4, True)
    tokens, pos, _ = _packed()
    params = params_for(cfg)
    want, want_counts = jax.jit(lambda p, t, q: _layer_by_layer(nnx.merge(model_graphdef(cfg), p), t, q))(
        params, jnp.asarray(tokens), jnp.asarray(pos))
    logits, stats = forward(dataclasses.replace(cfg, scan_layers=scan), params, tokens, pos, None)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(stats["counts"]), np.asarray(want_counts))


# ---------------------------------------------------------------- refused combinations


@pytest.mark.parametrize("overrides, names", [
    (["mesh.context=2", "mesh.data=4", "parallelism.context_impl=ring"], ("model.sliding_window", "context_impl")),
    (["mesh.stage=2", "mesh.data=4", "model.num_layers=5"], ("model.num_layers=5", "sliding_window_pattern=2")),
    (["model.attention_type=mla", "model.num_kv_heads=null"], ("model.sliding_window", "mla")),
])
def test_windows_refuse_what_cannot_run_them(overrides, names):
    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny", ["model.sliding_window=8", "model.sliding_window_pattern=2", *overrides]),
                 device_count=8)
    msg = str(info.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    validate(load_config("tiny", ["model.sliding_window=8", "model.sliding_window_pattern=2", "mesh.context=2",
                                  "mesh.data=4", "parallelism.context_impl=allgather"]), device_count=8)


# ---------------------------------------------------------------- KV cache (models/cache.py)

# 3 layers, window 6, pattern 2: layers 0 and 2 slide (a period of 2 and a suffix layer), local RoPE base,
# nonzero sinks; prompts longer and shorter than the window, generation well past it.
GEN = ["data.source=synthetic", "model.vocab_size=64", "model.d_model=32", "model.num_layers=3", "model.num_heads=4",
       "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.tie_embeddings=false",
       "model.init_std=0.3", "mesh.data=1", "model.sliding_window=6", "model.sliding_window_pattern=2",
       "model.rope_local_theta=100", "model.attention_sinks=true"]
PROMPTS = [[7, 3, 60, 12, 40, 41, 8, 19, 22, 50, 11], [5, 9, 1], [4, 4, 8, 15, 16, 23, 42, 1, 2]]
NEW = 20


@pytest.fixture(scope="module")
def windowed():
    cfg = load_config("tiny", GEN)
    return cfg, params_for(cfg.model, seed=3)  # (sinks ~ N(0, 1): nonzero)


def _full_logps(cfg, params, rows: list[list[int]]) -> np.ndarray:
    """The training forward on each whole row (prompt + generation), right-padded: log-softmax [rows, T, V]."""
    total = max(map(len, rows))
    tokens = np.zeros((len(rows), total), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    logits = forward(cfg, params, tokens, None, None)[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


# int8 is slow-marked: the float run checks the ring buffers exactly; int8 stores the same slots quantized.
@pytest.mark.parametrize("kv", ["float", pytest.param("int8", marks=pytest.mark.slow)])
def test_windowed_generation_equals_full_forward(windowed, kv):
    """Batched rows of different lengths with ring-buffer caches on the sliding layers (sinks on): float
    greedy tokens equal the full forward's argmax at every step and every recorded log-prob equals the full
    forward's (teacher-forced on the generated rows); int8 log-probs within its quantization noise."""
    from jaxinfra.infer import Generator, inference_model_config

    cfg, params = windowed
    if kv == "int8":
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, kv_cache="int8"))
    result = Generator(cfg, params).generate(PROMPTS, max_new_tokens=NEW)
    rows = [p + t for p, t in zip(PROMPTS, result.tokens)]
    logps = _full_logps(inference_model_config(cfg.model), params, rows)
    for i, (prompt, gen) in enumerate(zip(PROMPTS, result.tokens)):
        assert len(gen) == NEW
        at = np.arange(len(prompt) - 1, len(prompt) + NEW - 1)
        want = logps[i, at, gen]
        if kv == "float":
            assert gen == list(np.argmax(logps[i, at], axis=-1)), i
            np.testing.assert_allclose(result.logps[i], want, rtol=1e-4, atol=1e-4)
        else:
            # (the same model without windows shows int8 noise up to 0.1 here)
            np.testing.assert_allclose(result.logps[i], want, atol=0.15)


def test_cache_groups_and_bytes_count_windows(windowed):
    """Sliding layers keep min(window, max_len) slots in their own group; bytes by the exact formula."""
    from models import cache as kv_cache

    model = windowed[0].model
    lay = kv_cache.layout(model, 3, 40)
    assert lay["layers"]["k"][0] == (1, 3, 2, 40, 8) and lay["layers_sliding"]["k"][0] == (2, 3, 2, 6, 8)
    assert kv_cache.layer_slots(model)["layers"].tolist() == [0, 0, 1]
    per_layer_slot = 2 * 2 * 8 * 4  # k and v x kv_heads x head_dim x float32
    assert kv_cache.cache_bytes(model, 3, 40) == 3 * per_layer_slot * (1 * 40 + 2 * 6)
    assert kv_cache.cache_bytes(model, 3, 4) == 3 * per_layer_slot * 3 * 4  # windows longer than the cache
    plain = dataclasses.replace(model, sliding_window=None)
    assert kv_cache.cache_bytes(plain, 3, 40) == 3 * per_layer_slot * 3 * 40 > kv_cache.cache_bytes(model, 3, 40)


def test_info_inference_reports_window_aware_cache_bytes(windowed):
    from jaxinfra.info import inference_lines

    lines = inference_lines(windowed[0], 40)
    assert lines[0] == (f"kv cache per row of 40 positions: {128 * (40 + 2 * 6):,} bytes (float32); "
                        f"{128 * 3 * 40:,} without sliding windows")  # 128: k, v x 2 heads x 8 x 4 B
    assert lines[1:] == ["  layers: 1 layers (global) x 40 slots", "  layers_sliding: 2 layers (window 6) x 6 slots"]


# ---------------------------------------------------------------- parity (tests/parity.py)

PARITY_MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           mlp_dim=64, tie_embeddings=False, sliding_window=8, sliding_window_pattern=2,
                           rope_local_theta=100.0, attention_sinks=True, norm_placement="sandwich",
                           norm_weight_offset=1.0, qk_norm=True)


# fsdp4-tensor2 is slow-marked: the context run shards over fsdp too, and tests/test_parallel.py trains sinks under
# fsdp4 x tensor2 (windows add only a mask to the same heads' computation).
@pytest.mark.parametrize("mesh, parallelism", [
    pytest.param(dict(fsdp=4, tensor=2), {}, marks=pytest.mark.slow),
    (dict(context=2, fsdp=4), dict(context_impl="allgather")),
], ids=["fsdp4-tensor2", "context2-fsdp4-allgather"])
def test_windowed_model_trains_under_parallel_layouts_like_one_device(mesh, parallelism, parity_baseline):
    """Windows (a local and a global layer), the local RoPE base, sinks and sandwich norms: the same
    losses and parameters on 8 devices as on one (to 1e-5)."""
    from parity import assert_matches, run_steps

    batches, make = parity_baseline["batches"], parity_baseline["make"]
    split = run_steps(make(mesh, **parallelism), jax.devices(), batches)
    assert_matches(split, parity_baseline["one"], "windows-" + "-".join(f"{k}{v}" for k, v in mesh.items()))


@pytest.fixture(scope="module")
def parity_baseline():
    from parity import packed_batches, parity_config, run_steps

    from jaxinfra.config import OptimizerConfig

    def make(mesh, **parallelism):
        return parity_config(PARITY_MODEL, OptimizerConfig(lr=1e-2, eps=1e-5), mesh, batch=8, seq=32, **parallelism)

    batches = packed_batches(8, 32, PARITY_MODEL.vocab_size, 2)
    return {"batches": batches, "make": make, "one": run_steps(make({}), jax.devices()[:1], batches)}
