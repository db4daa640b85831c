"""Tests for jaxinfra.metrics: FLOP/parameter counts, peak table, writers.

References are computed by hand from the parameter shapes (wq [d,H,Dh], wk/wv
[d,KV,Dh], wo [H,Dh,d], w_gate/w_up [d,mlp], w_down [mlp,d], norm scales, embedding
[vocab,d], untied head [d,vocab]), never by calling the code under test.
"""

from __future__ import annotations

import json
import math
import struct
import types

import jax
import pytest

from jaxinfra.metrics import (
    PEAK_FLOPS_PER_DEVICE,
    MetricsLogger,
    ProgressBar,
    flops_per_token,
    mfu,
    param_counts,
    peak_flops_per_device,
    write_summary,
)
from jaxinfra.metrics import peak as peak_mod
from models.config import ModelConfig

# ---------------------------------------------------------------- FLOPs


def _hand_matmul_params(vocab, d, layers, heads, kv_heads, head_dim, mlp):
    wq = d * heads * head_dim
    wk = wv = d * kv_heads * head_dim
    wo = heads * head_dim * d
    swiglu = d * mlp + d * mlp + mlp * d
    head = d * vocab  # the output projection (tied embedding counted here, once)
    return layers * (wq + wk + wv + wo + swiglu) + head


@pytest.mark.parametrize("tied", [True, False])
def test_flops_dense_mha_matches_palm(tied):
    vocab, d, L, H, mlp, T = 1000, 64, 3, 4, 160, 128
    cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, mlp_dim=mlp,
                      tie_embeddings=tied)
    n = _hand_matmul_params(vocab, d, L, H, H, d // H, mlp)
    assert flops_per_token(cfg, T) == 6 * n + 12 * L * d * T
    # Inference: one forward = a third of training.
    assert flops_per_token(cfg, T, training=False) == 2 * n + 4 * L * d * T


def test_flops_causal_halves_only_attention():
    vocab, d, L, H, mlp, T = 512, 96, 2, 6, 256, 300
    cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, mlp_dim=mlp)
    n = _hand_matmul_params(vocab, d, L, H, H, d // H, mlp)
    assert flops_per_token(cfg, T, causal=True) == 6 * n + 6 * L * d * T
    full = flops_per_token(cfg, T)
    causal = flops_per_token(cfg, T, causal=True)
    assert full - causal == 6 * L * d * T  # exactly half of the 12·L·d·T attention term


def test_flops_gqa_reduces_only_kv_projections():
    vocab, d, L, H, KV, mlp, T = 300, 64, 2, 8, 2, 128, 64
    Dh = d // H
    mha = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, mlp_dim=mlp)
    gqa = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, num_kv_heads=KV,
                      mlp_dim=mlp)
    # k and v projections shrink from d·H·Dh to d·KV·Dh each; attention term unchanged.
    removed_params = L * 2 * d * (H - KV) * Dh
    assert flops_per_token(mha, T) - flops_per_token(gqa, T) == 6 * removed_params
    n = _hand_matmul_params(vocab, d, L, H, KV, Dh, mlp)
    assert flops_per_token(gqa, T) == 6 * n + 12 * L * H * Dh * T


def test_flops_explicit_head_dim():
    # H·Dh != d: the attention term follows H·Dh, not d.
    vocab, d, L, H, KV, Dh, mlp, T = 200, 48, 2, 4, 1, 16, 64, 32
    cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, num_kv_heads=KV,
                      head_dim=Dh, mlp_dim=mlp)
    n = _hand_matmul_params(vocab, d, L, H, KV, Dh, mlp)
    assert flops_per_token(cfg, T) == 3 * (2 * n + 4 * L * H * Dh * T)


# ---------------------------------------------------------------- parameter counts


def test_param_counts_small_qk_norm_untied():
    vocab, d, L, H, KV, Dh, mlp = 100, 32, 2, 4, 2, 16, 48
    cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, num_kv_heads=KV,
                      head_dim=Dh, mlp_dim=mlp, qk_norm=True, tie_embeddings=False)
    embedding = vocab * d
    output = d * vocab
    per_layer = (
        d * H * Dh  # wq
        + d * KV * Dh  # wk
        + d * KV * Dh  # wv
        + H * Dh * d  # wo
        + d * mlp + d * mlp + mlp * d  # w_gate, w_up, w_down
        + d + d  # attention-norm and mlp-norm scales
        + Dh + Dh  # q_norm, k_norm scales
    )
    final_norm = d
    total = embedding + L * per_layer + final_norm + output
    counts = param_counts(cfg)
    assert counts == {
        "total": total,
        "embedding": embedding,
        "output": output,
        "non_embedding": L * per_layer + final_norm,
        "matmul": L * (per_layer - 2 * d - 2 * Dh) + output,
    }


def test_param_counts_tied_has_no_output_and_counts_table_once():
    vocab, d, L, H, mlp = 64, 16, 1, 2, 32
    cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=L, num_heads=H, mlp_dim=mlp)
    counts = param_counts(cfg)
    layer_matrices = 4 * d * d + 3 * d * mlp
    assert counts["output"] == 0
    assert counts["total"] == vocab * d + L * (layer_matrices + 2 * d) + d
    assert counts["matmul"] == L * layer_matrices + vocab * d


# Cross-check against the real model goes here: build the NNX model from a small
# ModelConfig (qk_norm on, untied) and compare the number of elements in its
# nnx.Param state with param_counts(cfg)["total"].


def test_param_counts_llama3_8b():
    cfg = ModelConfig(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, mlp_dim=14336, tie_embeddings=False)
    total = param_counts(cfg)["total"]
    assert total == pytest.approx(8.03e9, rel=5e-3)  # Meta's published 8.03B
    assert total == 8_030_261_248  # the exact count Hugging Face reports for Meta-Llama-3-8B


# ---------------------------------------------------------------- peak FLOP/s


def _fake(kind, platform="gpu"):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize(
    "kind, platform, bf16, f32, key",
    [
        ("NVIDIA H100 80GB HBM3", "gpu", 989e12, 67e12, "NVIDIA H100 SXM"),
        ("NVIDIA H200", "gpu", 989e12, 67e12, "NVIDIA H200"),
        ("NVIDIA A100-SXM4-80GB", "gpu", 312e12, 19.5e12, "NVIDIA A100"),
        ("TPU v4", "tpu", 275e12, 275e12, "TPU v4"),
        ("TPU v5 lite", "tpu", 197e12, 197e12, "TPU v5e"),
        ("TPU v5e", "tpu", 197e12, 197e12, "TPU v5e"),
        ("TPU v5p", "tpu", 459e12, 459e12, "TPU v5p"),
        ("TPU v6 lite", "tpu", 918e12, 918e12, "TPU v6e"),
        ("TPU v6e", "tpu", 918e12, 918e12, "TPU v6e"),
    ],
)
def test_peak_table_lookup(kind, platform, bf16, f32, key):
    dev = _fake(kind, platform)
    assert peak_flops_per_device(dev, "bfloat16") == (bf16, f"table:{key}")
    assert peak_flops_per_device(dev, "float32") == (f32, f"table:{key}")
    assert PEAK_FLOPS_PER_DEVICE[key] == {"bfloat16": bf16, "float32": f32}


def test_peak_override_wins():
    assert peak_flops_per_device(_fake("NVIDIA H100 80GB HBM3"), "bfloat16", override=5e14) == (5e14, "config")
    assert peak_flops_per_device(_fake("cpu", "cpu"), "float32", override=1e11) == (1e11, "config")


def test_peak_unknown_kind_probes_once(monkeypatch):
    calls = []

    def fake_probe(*args, **kwargs):
        calls.append(kwargs)
        return 1.25e12

    monkeypatch.setattr(peak_mod, "_PROBE_CACHE", {})
    monkeypatch.setattr(peak_mod, "measure_matmul_flops", fake_probe)
    dev = _fake("Some Future Accelerator X1")
    assert peak_flops_per_device(dev, "bfloat16") == (1.25e12, "measured:matmul-probe")
    assert peak_flops_per_device(dev, "bfloat16") == (1.25e12, "measured:matmul-probe")
    assert len(calls) == 1  # cached per process
    # A TPU v4 *lite* (v4i) is a different chip and must not be taken for a v4.
    assert peak_flops_per_device(_fake("TPU v4 lite", "tpu"), "bfloat16")[1] == "measured:matmul-probe"


def test_peak_cpu_is_measured(monkeypatch):
    monkeypatch.setattr(peak_mod, "_PROBE_CACHE", {})
    cpu = jax.devices("cpu")[0]
    flops, source = peak_flops_per_device(cpu, "float32")
    assert source == "measured:matmul-probe"
    assert math.isfinite(flops) and flops > 1e8  # any real CPU does > 0.1 GFLOP/s


# ---------------------------------------------------------------- writers


def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c

    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _read_tfrecords(path):
    """TFRecord framing: u64 length, u32 masked crc(length), data, u32 masked crc(data)."""
    blob = path.read_bytes()
    records, pos = [], 0
    while pos < len(blob):
        header = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        assert len_crc == _masked_crc(header)
        data = blob[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length:pos + 16 + length])
        assert data_crc == _masked_crc(data)
        records.append(data)
        pos += 16 + length
    return records


def _tb_scalars(run_dir):
    from tensorboardX.proto import event_pb2

    files = list(run_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    out = {}
    for raw in _read_tfrecords(files[0]):
        event = event_pb2.Event.FromString(raw)
        for value in event.summary.value:
            out[(event.step, value.tag)] = value.simple_value
    return out


def test_metrics_logger_jsonl_and_tensorboard(tmp_path):
    train = {"loss": 2.5, "lr": 3e-4, "grad_norm": 1.1, "tokens_per_s": 12345.0,
             "tflops_per_device": 0.05, "mfu": 0.4, "step_time_s": 0.25}
    with MetricsLogger(tmp_path) as logger:
        logger.log(10, train)
        # The line is on disk before close: a crash must not lose it.
        first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
        assert first == {"step": 10, **train}
        logger.log(20, {"eval_loss": 2.25})
        logger.log(30, {"loss": float("nan"), "grad_norm": float("inf")})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 10, **train},
        {"step": 20, "eval_loss": 2.25},
        {"step": 30, "loss": None, "grad_norm": None},  # non-finite -> null, as documented
    ]
    scalars = _tb_scalars(tmp_path)
    assert scalars[(10, "loss")] == pytest.approx(2.5)
    assert scalars[(10, "mfu")] == pytest.approx(0.4)
    assert scalars[(20, "eval_loss")] == pytest.approx(2.25)
    assert math.isnan(scalars[(30, "loss")])  # TensorBoard keeps the raw NaN
    assert (30, "grad_norm") in scalars


def test_metrics_logger_appends_and_no_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, jsonl_name="m.jsonl") as logger:
        logger.log(1, {"loss": 1.0})
    with MetricsLogger(tmp_path, tensorboard=False, jsonl_name="m.jsonl") as logger:
        logger.log(2, {"loss": 0.5})
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    with pytest.raises(RuntimeError):
        logger.log(3, {"loss": 0.1})


def test_metrics_logger_converts_array_scalars(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(np.int64(5), {"loss": jnp.float32(1.5), "tokens": np.int32(7)})
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line == {"step": 5, "loss": 1.5, "tokens": 7}


def test_progress_bar_disabled_is_silent(capsys):
    bar = ProgressBar(100, initial=10, enabled=False)
    bar.update(20, {"loss": 1.0, "tokens_per_s": 5000.0, "mfu": 0.5})
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_bar_shows_postfix(capsys):
    bar = ProgressBar(100, initial=10)
    bar.update(20, {"loss": 1.2345, "tokens_per_s": 12300.0, "mfu": 0.423})
    assert bar.n == 20
    bar.close()
    err = capsys.readouterr().err
    assert "20/100" in err
    assert "loss=1.2345" in err and "tok/s=12.3k" in err and "MFU=42.3%" in err


def test_write_summary_atomic(tmp_path):
    path = write_summary(tmp_path / "run", {"final_loss": 1.5, "steps": 100, "bad": float("nan"),
                                             "nested": {"mfu": 0.3}})
    assert path == tmp_path / "run" / "summary.json"
    assert json.loads(path.read_text()) == {"final_loss": 1.5, "steps": 100, "bad": None,
                                            "nested": {"mfu": 0.3}}
    write_summary(tmp_path / "run", {"final_loss": 1.0})  # overwrite in place
    assert json.loads(path.read_text()) == {"final_loss": 1.0}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def test_mfu_hand_example():
    # 1000 tok/s/device x 6e9 FLOP/token = 6e12 FLOP/s on a 12e12 FLOP/s device -> 50%.
    assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


# ---------------------------------------------------------------- tables


def test_plain_table_widths_alignment_and_formats():
    from jaxinfra.metrics.table import Column, format_table

    columns = [Column("name"), Column("bytes", ",", ">"), Column("ms", ".2f", ">", width=6), "note"]
    text = format_table([("wq", 4096, 1.5, "ok"), ("embed/table", 12, None, "")], columns)
    assert text.splitlines() == [
        "name         bytes      ms  note",
        "wq           4,096    1.50  ok",
        "embed/table     12       -",  # None prints as '-', trailing blanks are stripped
    ]


def test_plain_rows_printed_one_at_a_time_line_up_under_the_header():
    from jaxinfra.metrics.table import Column, format_table

    columns = [Column("op", width=10), Column("us", ".1f", ">", 8)]
    head = format_table([], columns, sep=" ", rule=True).splitlines()
    rows = [format_table([r], columns, sep=" ", header=False) for r in (("all_reduce", 3.25), ("ppermute", 120.0))]
    assert head == ["op               us", "-------------------"]
    assert rows == ["all_reduce      3.2", "ppermute      120.0"]
    assert {len(line) for line in [head[0], *rows]} == {19}


def test_markdown_table_and_cell_count_check():
    from jaxinfra.metrics.table import Column, format_table

    columns = ["schedule", Column("bubble", ".3f")]
    assert format_table([("gpipe", 1 / 3), ("1f1b", 0.2)], columns, style="markdown") == (
        "| schedule | bubble |\n|---|---|\n| gpipe | 0.333 |\n| 1f1b | 0.200 |")
    assert format_table([("gpipe", 0.5)], columns, style="markdown", header=False) == "| gpipe | 0.500 |"
    with pytest.raises(ValueError):
        format_table([("gpipe",)], columns)


def test_bench_collectives_table_keeps_its_columns():
    from jaxinfra.bench import format_table

    row = {"op": "all_reduce", "axis": "fsdp", "n": 4, "bytes": 67108864, "time_us": 1234.56, "algbw_GBps": 54.4,
           "busbw_GBps": 81.6}
    assert format_table([row]).splitlines() == [
        "axis       n op                     bytes     time us  algbw GB/s  busbw GB/s",
        "fsdp       4 all_reduce        67,108,864      1234.6      54.400      81.600",
    ]
