"""Weighted mixtures (data.mixture): realised proportions, staged weights, exact resume (also across
process counts and through a real SIGTERM), per-source held-out splits and eval losses.

Sources are token streams with disjoint id ranges, so every row names the source it came from.
"""

from __future__ import annotations

import hashlib
import json
import signal
import struct

import jax
import numpy as np
import pytest

from jaxinfra.config import ConfigError, load_config
from jaxinfra.data import DataConfig, make_eval_batches, make_eval_sets, make_train_iterator, row_states, set_row_states
from jaxinfra.data.config import DataError, MixtureConfig
from jaxinfra.data.mixture import WeightSchedule

RANGES = {"a": (0, 20), "b": (20, 40), "c": (40, 64)}


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("streams")
    rng = np.random.default_rng(0)
    paths = {}
    for name, (lo, hi) in RANGES.items():
        paths[name] = str(root / f"{name}.npy")
        np.save(paths[name], rng.integers(lo, hi, size=8000).astype(np.uint16))
    return paths


def _cfg(streams, weights: dict, **kw) -> DataConfig:
    parts = {n: MixtureConfig(paths=(streams[n],), **({"weights": w} if isinstance(w, tuple) else {"weight": w}))
             for n, w in weights.items()}
    return DataConfig(source="tokens", mixture=parts, **kw)


def _row_sources(batch) -> list[str]:
    out = []
    for row, seg in zip(batch["inputs"], batch["segment_ids"]):
        row = row[seg > 0]  # padding is 0
        (name,) = {n for n, (lo, hi) in RANGES.items() if lo <= row[0] < hi}
        assert np.all((row >= RANGES[name][0]) & (row < RANGES[name][1])), "a row mixes sources"
        out.append(name)
    return out


KW = dict(seq_len=8, global_batch_size=8, vocab_size=64, seed=3)


def test_realised_proportions_within_one_percent_over_10000_sequences(streams):
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    it = make_train_iterator(_cfg(streams, weights, shuffle=False), **KW)  # (the pick does not depend on shuffling)
    counts = dict.fromkeys(weights, 0)
    for _ in range(1250):  # 1250 batches x 8 rows
        for name in _row_sources(next(it)):
            counts[name] += 1
    for name, w in weights.items():
        assert abs(counts[name] / 10_000 - w) <= 0.01, counts


def test_staged_weights_switch_at_the_stated_step(streams):
    cfg = _cfg(streams, {"a": ((0, 1.0), (6, 0.0), (9, 0.5)), "b": ((0, 0.0), (6, 1.0), (9, 0.5))})
    it = make_train_iterator(cfg, **KW)
    rows = [_row_sources(next(it)) for _ in range(60)]
    assert all(set(r) == {"a"} for r in rows[:6]) and all(set(r) == {"b"} for r in rows[6:9])
    late = [n for r in rows[9:] for n in r]
    assert abs(late.count("a") / len(late) - 0.5) < 0.03
    schedule = WeightSchedule([cfg.mixture[n].stages() for n in ("a", "b")])
    assert schedule.weights(5) == [1.0, 0.0] and schedule.weights(6) == [0.0, 1.0] and schedule.weights(9) == [0.5, 0.5]


def _hash(batch) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))).hexdigest()


def test_mixture_is_process_count_invariant_and_resumes_across_counts(streams):
    cfg = _cfg(streams, {"a": 0.6, "b": ((0, 0.4), (10, 2.0)), "c": 0.2})
    one = make_train_iterator(cfg, **KW)
    halves = [make_train_iterator(cfg, **KW, process_index=p, process_count=2) for p in range(2)]
    for _ in range(15):
        whole, parts = next(one), [next(h) for h in halves]
        assert all(np.array_equal(whole[k], np.concatenate([p[k] for p in parts])) for k in whole)
    # A checkpoint's row-slot states (through JSON, as Orbax stores them) resume on 2 processes.
    saved = json.loads(json.dumps(row_states(one, 0)))
    expected = [_hash(next(one)) for _ in range(12)]
    resumed = [make_train_iterator(cfg, **KW, process_index=p, process_count=2) for p in range(2)]
    for p, it in enumerate(resumed):
        set_row_states(it, saved, 4 * p, 4)
    got = []
    for _ in range(12):
        parts = [next(it) for it in resumed]
        got.append(_hash({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}))
    assert got == expected
    renamed = make_train_iterator(_cfg(streams, {"a": 0.6, "c": 0.4}), **KW)
    with pytest.raises(DataError, match=r"mixes sources \['a', 'b', 'c'\], this config \['a', 'c'\]"):
        set_row_states(renamed, saved, 0, 8)


def test_each_source_keeps_its_own_held_out_split(streams):
    cfg = _cfg(streams, {"a": 0.7, "b": 0.3}, eval_batches=2)
    sets = make_eval_sets(cfg, **KW)
    assert list(sets) == ["a", "b"]
    for name, batches in sets.items():
        alone = make_eval_batches(DataConfig(source="tokens", paths=(streams[name],), eval_batches=2), **KW)
        assert [_hash(b) for b in batches] == [_hash(b) for b in alone]
        assert all(set(_row_sources(b)) == {name} for b in batches)
    assert [_hash(b) for b in make_eval_batches(cfg, **KW)] == [_hash(b) for bs in sets.values() for b in bs]


@pytest.mark.parametrize("overrides, message", [
    (["data.mixture.a.weights=[[5, 1.0]]"], r"data\.mixture\.a\.weights=.*the first at step 0"),
    (["data.mixture.a.weight=-1"], r"data\.mixture\.a\.weight=-1\.0 is invalid: must be a number >= 0"),
    (["data.mixture.a.weights=[[0, 1.0, 2.0]]"], r"data\.mixture\.a\.weights=.*\[step, weight\] pairs"),
    (["data.mixture.a.weight=0", "data.mixture.b.weight=0"], r"data\.mixture='weights at step 0' is invalid"),
    (["data.paths=[x.npy]"], r"data\.paths=\('x\.npy',\) is invalid: must be empty when data\.mixture is set"),
    (["data.mixture.a.wieght=1"], r"unknown key 'data\.mixture\.a\.wieght' \(did you mean 'data\.mixture\.a\.weight'"),
])
def test_mixture_config_errors_are_one_line(streams, overrides, message, tmp_path):
    base = ["data.source=tokens", f"data.mixture.a.paths=[{streams['a']}]", f"data.mixture.b.paths=[{streams['b']}]",
            "model.vocab_size=64"]
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [*base, *overrides])
    cfg = load_config("tiny", [*base, "data.mixture.a.weights=[[0, 0.7], [1000, 0.5]]"])
    assert cfg.data.mixture["a"].stages() == [(0, 0.7), (1000, 0.5)]
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())  # a run dir's config.yaml restarts the same mixture
    assert load_config(str(tmp_path / "config.yaml")) == cfg


# --------------------------------------------------------------- training runs

STEPS, STOP_AT = 20, 10
BASE = ["data.source=tokens", "data.mixture.a.weight=0.7", "data.mixture.b.weight=0.3", "data.eval_batches=2",
        "model.vocab_size=64", "model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128",
        "train.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}", "train.eval_every=0", "log.every=1",
        "log.progress=false", "log.peak_tflops=1", "checkpoint.every=0", "mesh.data=1"]
# (the model, optimizer and steps of test_checkpoint.py: the suite compiles those programs once)


def _train_cfg(streams, *extra: str):
    return load_config("tiny", [*BASE, f"data.mixture.a.paths=[{streams['a']}]",
                                f"data.mixture.b.paths=[{streams['b']}]", *extra])


def _run(cfg, run_dir, signal_at: int | None = None):
    """Train, recording the hash of every batch the loop consumes (a real SIGTERM before batch `signal_at`)."""
    from jaxinfra.train import Trainer

    hashes: list[str] = []

    def recording(self):
        for local in self.train_iter:
            hashes.append(_hash(local))
            if signal_at is not None and len(hashes) == signal_at:
                signal.raise_signal(signal.SIGTERM)  # handled by the Trainer: finish the step, save, stop
            yield self.rt.to_global(local)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "batches", recording)
        trainer = Trainer(cfg, run_dir, jax.devices()[:1])
        summary = trainer.run()
    return trainer, summary, hashes


@pytest.fixture(scope="module")
def killed_and_resumed(streams, tmp_path_factory) -> dict:
    """A run stopped by SIGTERM at step STOP_AT, then the same command resumed to STEPS."""
    run_dir = tmp_path_factory.mktemp("mixture-run")
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        _, stopped, first = _run(_train_cfg(streams), run_dir, signal_at=STOP_AT)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    trainer, resumed, second = _run(_train_cfg(streams), run_dir)
    return {"stopped": stopped, "resumed": resumed, "hashes": first + second, "trainer": trainer}


def test_sigterm_then_resume_yields_the_uninterrupted_batches(streams, killed_and_resumed):
    from jaxinfra.train import EXIT_PREEMPTED

    run = killed_and_resumed
    assert run["stopped"]["exit_code"] == EXIT_PREEMPTED and run["stopped"]["steps"] == STOP_AT
    assert run["resumed"]["resumed_from_step"] == STOP_AT and run["resumed"]["exit_code"] == 0
    # An uninterrupted run consumes the iterator's batches one per step (Trainer.batches).
    cfg = _train_cfg(streams)
    it = make_train_iterator(cfg.data, seq_len=32, global_batch_size=8, vocab_size=64, seed=cfg.train.seed)
    assert run["hashes"] == [_hash(next(it)) for _ in range(STEPS)]


def test_per_source_eval_losses_equal_each_source_evaluated_alone(streams, killed_and_resumed):
    trainer, summary = killed_and_resumed["trainer"], killed_and_resumed["resumed"]
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, STEPS] and all({"eval_loss/a", "eval_loss/b"} <= set(r) for r in evals)
    final = evals[-1]
    sums = {}
    for name in ("a", "b"):
        alone = load_config("tiny", [*BASE, "data.mixture={}", f"data.paths=[{streams[name]}]"])
        batches = make_eval_batches(alone.data, seq_len=32, global_batch_size=8, vocab_size=64, seed=0)
        sums[name] = trainer.rt.eval_sums(trainer.state.params, batches)
        assert final[f"eval_loss/{name}"] == sums[name][0] / sums[name][1]
    assert final["eval_loss"] == pytest.approx(sum(c for c, _ in sums.values()) / sum(n for _, n in sums.values()),
                                               rel=1e-12)
    assert final["eval_loss/a"] != final["eval_loss/b"]
    assert summary["final_eval_loss"] == final["eval_loss"]
    tags = _tensorboard_tags(trainer.run_dir)
    assert {"eval_loss", "eval_loss/a", "eval_loss/b"} <= tags


def _tensorboard_tags(run_dir) -> set[str]:
    """Scalar tags in the run's event files (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in run_dir.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            at += 12 + length + 4
    return tags
