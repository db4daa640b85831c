"""DPO (jaxinfra/dpo/): the loss against TRL's fixtures, the step against a plain-numpy DPO, sequence
log-probs against transformers, sharded parity, LoRA's reference, saved reference log-probs, bad
input in one line; and (slow) the synthetic preference task of acceptance 2."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import assert_matches, parity_config, run_steps

from jaxinfra.checkpoint import save_params_only
from jaxinfra.cli import main
from jaxinfra.config import Config, OptimizerConfig, ScheduleConfig, load_config
from jaxinfra.config_sections import DpoConfig
from jaxinfra.data import make_train_iterator
from jaxinfra.data.config import DataConfig
from jaxinfra.dpo.extension import Dpo
from jaxinfra.dpo.loss import SEGMENT_KEYS, dpo_outputs
from jaxinfra.extensions import HostContext
from jaxinfra.state import init_params, model_graphdef
from jaxinfra.step import forward_sums
from jaxinfra.train import Trainer
from models import ModelConfig
from models.lora_config import LoraConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
V, B, T, STEPS = 258, 8, 64, 3  # 257 byte-level ids (+ end of document), even for mesh.tensor=2
MODEL = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    tie_embeddings=False, init_std=0.2, loss_chunk_size=16)
OPT = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad_norm=1.0, eps=1e-5)


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """The synthetic task: "Up: abcd" -> chosen "ABCD" (the rule), rejected "abcd"."""
    r = random.Random(seed)
    words = ["".join(r.choice("abcdefgh") for _ in range(4)) for _ in range(n)]
    return [{"prompt": f"Up: {w}\n", "chosen": w.upper(), "rejected": w} for w in words]


def _write(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("pref") / "pairs.jsonl", preference_rows(200))


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> str:
    """The checkpoint a run starts from (its reference): random weights of another seed than the runs'."""
    out = tmp_path_factory.mktemp("start")
    save_params_only(out, Config(model=MODEL), jax.jit(lambda k: init_params(MODEL, k))(jax.random.key(11)),
                     {"params_only": True, "step": 0})
    return str(out)


def dpo_config(data: str, mesh: dict, accum: int = 1, **dpo) -> Config:
    cfg = parity_config(MODEL, OPT, mesh, batch=B, seq=T, schedule=ScheduleConfig(warmup_steps=0), accum=accum)
    return dataclasses.replace(cfg, data=DataConfig(source="preference", paths=(data,), eval_fraction=0.1),
                               dpo=DpoConfig(**dpo))


@pytest.fixture(scope="module")
def batches(data) -> list[dict[str, np.ndarray]]:
    it = make_train_iterator(DataConfig(source="preference", paths=(data,), eval_fraction=0.1), seq_len=T,
                             global_batch_size=B, vocab_size=V, seed=0)
    return [next(it) for _ in range(STEPS)]


def _started(path: str | None, restore: str | None = None):
    def setup(rt):
        rt.extension("dpo").start(HostContext(rt, [], 0, rt.cfg.train.batch_size, restore_from=restore), {})
    return setup


# ---------------------------------------------------------------- the loss against TRL


def test_dpo_loss_and_rewards_equal_trls():
    fx = json.loads((FIXTURES / "dpo" / "trl_dpo_loss.json").read_text())
    pc, pr, rc, rr = (jnp.asarray(x, jnp.float32) for x in fx["logps"])
    counts = tuple(jnp.asarray(c, jnp.float32) for c in fx["counts"])
    sigmoid_rewards = None
    for case in fx["cases"]:
        losses, chosen, rejected = dpo_outputs((pc, pr), (rc, rr), counts, fx["beta"], case["loss"],
                                               case["label_smoothing"])
        np.testing.assert_allclose(losses, case["losses"], rtol=1e-5, atol=1e-6, err_msg=str(case["loss"]))
        if case["inputs"] == "sum":  # TRL's rewards of summed log-probs (ipo's TRL call saw means)
            np.testing.assert_allclose(chosen, case["chosen_rewards"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rejected, case["rejected_rewards"], rtol=1e-5, atol=1e-6)
            sigmoid_rewards = case["chosen_rewards"]
        else:  # our rewards are of the sums for every loss type (as TRL's trainer logs them)
            np.testing.assert_allclose(chosen, sigmoid_rewards, rtol=1e-5, atol=1e-6)
    assert "trl" in fx["trl"] and len(fx["cases"]) == 4


# ---------------------------------------------------------------- the step against plain numpy


def _plain_logps(model: ModelConfig, params, batch) -> np.ndarray:
    def fn(params, batch):
        m = nnx.merge(model_graphdef(model), params)
        h, _ = m.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
        return jax.nn.log_softmax(m.logits(h).astype(jnp.float32))

    logp = np.asarray(jax.jit(fn)(params, batch), np.float64)
    return np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]


def _numpy_dpo(policy: np.ndarray, ref: np.ndarray, batch: dict, beta: float, ls: float) -> tuple[float, int, list]:
    seg, comp = batch["segment_ids"], batch["completion"] > 0
    losses, rewards = [], []
    for r in range(seg.shape[0]):
        for k in range(1, seg[r].max() // 2 + 1):
            c, j = comp[r] & (seg[r] == 2 * k - 1), comp[r] & (seg[r] == 2 * k)
            z = (policy[r, c].sum() - policy[r, j].sum()) - (ref[r, c].sum() - ref[r, j].sum())
            sig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731  log sigmoid
            losses.append(-(1 - ls) * sig(beta * z) - ls * sig(-beta * z))
            rewards.append(beta * (policy[r, c].sum() - ref[r, c].sum()))
    return float(np.sum(losses)), len(losses), rewards


def test_the_dpo_step_equals_a_plain_numpy_dpo(data, start, batches):
    cfg = dpo_config(data, {}, beta=0.5, label_smoothing=0.1, reference=start)
    from jaxinfra.runtime import build_runtime

    rt = build_runtime(cfg, jax.devices()[:1])
    ext = rt.extension("dpo")
    _started(start)(rt)
    policy = jax.jit(lambda k: init_params(MODEL, k))(jax.random.key(5))
    batch = {k: jnp.asarray(v) for k, v in batches[0].items()}
    sums = jax.jit(lambda p, b, x: forward_sums(rt.graphdef, MODEL, [ext])((p,), b, jnp.int32(0), (x,)))(
        policy, batch, ext.inputs())
    np_batch = {k: np.asarray(v) for k, v in batches[0].items()}
    loss, pairs, rewards = _numpy_dpo(_plain_logps(MODEL, policy, batch), _plain_logps(MODEL, ext.inputs(), batch),
                                      np_batch, 0.5, 0.1)
    assert pairs >= 2 * B and float(sums["tokens"]) == pairs  # several pairs per row, `tokens` counts pairs
    np.testing.assert_allclose(float(sums["loss_sum"]), loss, rtol=1e-5)
    np.testing.assert_allclose(float(sums["dpo_chosen_sum"]), np.sum(rewards), rtol=1e-5, atol=1e-5)
    assert not any(k in sums for k in SEGMENT_KEYS)


def test_sequence_logps_of_an_hf_import_equal_transformers(tmp_path):
    """Per-sequence completion log-probs through the DPO step's own per-segment sums (the extension's
    per_token / token_sums / segment_sums, the objective's pairing kept aside) vs transformers'."""
    from jaxinfra.hf.importer import import_hf

    fx = dict(np.load(FIXTURES / "dpo" / "hf_llama_logps.npz"))
    run = tmp_path / "llama"
    import_hf(FIXTURES / "hf" / "llama", run, devices=jax.devices()[:1])
    cfg = load_config(str(run / "config.yaml"), ["train.seq_len=48", "train.batch_size=3", "mesh.data=1"])
    cfg = dataclasses.replace(cfg, data=DataConfig(source="preference", paths=("unused.jsonl",)),
                              dpo=DpoConfig(reference=str(run)))

    class KeepSegments(Dpo):
        def objective(self, ctx, sums):
            return {**super().objective(ctx, sums), **{k: sums[k] for k in SEGMENT_KEYS}}

    from types import SimpleNamespace

    from jaxinfra.state import sharding_rules
    from sharding.mesh import make_mesh

    # No runtime: the fixture's 128-token vocabulary is below the byte data's 257 that validation asks for.
    rt = SimpleNamespace(mesh=make_mesh(cfg.mesh, jax.devices()[:1]), rules=sharding_rules(cfg.parallelism))
    ext = KeepSegments(cfg)
    ext.setup(rt)
    ext.start(HostContext(rt, [], 0, 3), {})
    rows = {k: np.zeros((3, 48), np.int32) for k in ("inputs", "targets", "segment_ids", "positions", "completion")}
    for pair in range(3):
        at = 0
        for half in (0, 1):
            i = 2 * pair + half
            ids, p, n = fx["tokens"][i], int(fx["prompt_len"][i]), int(fx["length"][i])
            span = slice(at, at + n - 1)
            rows["inputs"][pair, span], rows["targets"][pair, span] = ids[:n - 1], ids[1:n]
            rows["segment_ids"][pair, span], rows["positions"][pair, span] = 1 + half, np.arange(n - 1)
            rows["completion"][pair, at + p - 1:at + n - 1] = 1
            at += n - 1
    graphdef = model_graphdef(cfg.model)
    sums = jax.jit(lambda v, b, x: forward_sums(graphdef, cfg.model, [ext])((v,), b, None, (x,)))(
        ext.inputs(), {k: jnp.asarray(v) for k, v in rows.items()}, ext.inputs())
    got = np.asarray(sums["dpo_policy"]).reshape(3, 49)[:, 1:3].reshape(-1)
    np.testing.assert_allclose(got, fx["logp_sum"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sums["dpo_ref"]).reshape(3, 49)[:, 1:3].reshape(-1), got, rtol=1e-6)


# ---------------------------------------------------------------- the step on meshes, LoRA, saved log-probs


@pytest.fixture(scope="module")
def single(data, start, batches):
    return run_steps(dpo_config(data, {}, reference=start), jax.devices()[:1], batches, setup=_started(start))


def test_dpo_trains_and_fsdp4_tensor2_with_accumulation_equals_one_device(single, data, start, batches):
    m = single["metrics"]
    assert float(m[-1]["rewards/margin"]) > float(m[0]["rewards/margin"]) and single["losses"][-1] < single["losses"][0]
    keys = ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "grad_norm")
    assert all(float(x["loss"]) == float(x["dpo/loss"]) for x in m)
    sharded = run_steps(dpo_config(data, dict(fsdp=4, tensor=2), accum=2, reference=start), jax.devices(), batches,
                        setup=_started(start))
    assert_matches(sharded, single, "fsdp=4 tensor=2 accum=2", metric_keys=keys, metric_atol=1e-6)


def test_lora_reference_is_the_base_rewards_start_at_zero(data, batches):
    cfg = dataclasses.replace(dpo_config(data, {}), lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "up")))
    run = run_steps(cfg, jax.devices()[:1], batches, setup=_started(None))
    first = run["metrics"][0]
    assert float(first["rewards/chosen"]) == 0.0 and float(first["rewards/rejected"]) == 0.0
    assert float(first["loss"]) == pytest.approx(math.log(2), rel=1e-6)  # z = 0 exactly; float32 sum over pairs
    assert float(run["metrics"][-1]["rewards/margin"]) > 0 and run["losses"][-1] < math.log(2)
    assert run["rt"].extension("dpo").inputs() == ()


def _losses(run_dir: pathlib.Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


RUN = [f"model.vocab_size={V}", "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
       "model.head_dim=8", "model.mlp_dim=64", "model.tie_embeddings=false", "model.loss_chunk_size=16",
       f"train.seq_len={T}", f"train.batch_size={B}", "train.steps=3", "train.eval_every=3", "data.eval_batches=1",
       "data.source=preference", "data.eval_fraction=0.1", "log.every=1", "log.progress=false",
       "log.tensorboard=false", "checkpoint.every=0", "schedule.warmup_steps=0", "mesh.data=-1"]


def test_saved_reference_logps_train_like_the_reference_model(data, start, tmp_path, capsys):
    from jaxinfra.dpo.save import save_reference

    run = [*RUN, f"data.paths=[{data}]", "mesh.data=1", "data.eval_batches=0"]  # one device, no evaluation
    report = save_reference("tiny", run, str(tmp_path / "ref"), restore=start, progress=False,
                            devices=jax.devices()[:1])
    assert report["steps"] == 3 and report["reference"]["step"] == 0
    live = Trainer(load_config("tiny", run), tmp_path / "live", jax.devices()[:1], restore_from=start)
    live.run()
    saved = Trainer(load_config("tiny", [*run, f"dpo.reference={tmp_path / 'ref'}"]), tmp_path / "saved",
                    jax.devices()[:1], restore_from=start)
    saved.run()
    np.testing.assert_allclose(_losses(tmp_path / "saved"), _losses(tmp_path / "live"), rtol=1e-5)
    code = main(["train", "tiny", *run, "mesh.data=-1", "train.seed=4", f"dpo.reference={tmp_path / 'ref'}", "--run-dir",
                 str(tmp_path / "other"), "--restore", start])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jaxinfra: error")]
    assert code == 2 and len(err) == 1 and "train.seed: 0 -> 4" in err[0], err


@pytest.mark.parametrize("case", ["missing rejected", "another shape", "stages", "random start"])
def test_bad_dpo_input_is_one_line_exit_2(case, data, start, tmp_path, tmp_path_factory, capsys):
    run, extra = [*RUN, f"data.paths=[{data}]"], ["--restore", start]
    if case == "missing rejected":
        rows = preference_rows(60)
        del rows[7]["rejected"]
        run = [*RUN, f"data.paths=[{_write(tmp_path / 'bad.jsonl', rows)}]", "data.shuffle=false",
               "data.eval_fraction=0.5"]
    elif case == "another shape":
        wide = dataclasses.replace(MODEL, d_model=48)
        save_params_only(tmp_path / "wide", Config(model=wide), jax.jit(lambda k: init_params(wide, k))(
            jax.random.key(0)), {"params_only": True, "step": 0})
        run = [*run, f"dpo.reference={tmp_path / 'wide'}"]
    elif case == "stages":
        run = [*run, "mesh.stage=2", "mesh.fsdp=1"]
    else:
        extra = []
    code = main(["train", "tiny", *run, "--run-dir", str(tmp_path / "run"), *extra])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jaxinfra: error")]
    assert code == 2 and len(err) == 1, err
    want = {"missing rejected": r"bad\.jsonl:8: no 'rejected'", "another shape": r"dpo\.reference=.*model\.d_model=48",
            "stages": r"dpo with mesh\.stage=2 is not supported",
            "random start": r"dpo\.reference is null and the run starts from random weights"}[case]
    import re

    assert re.search(want, err[0]), err


# ---------------------------------------------------------------- preference items (no model)


def _pair(row: dict, seq_len: int) -> dict[str, np.ndarray]:
    from jaxinfra.data.chat import load_chat_template
    from jaxinfra.data.encode import make_encoder
    from jaxinfra.data.preference import encode_pair, pair_item

    return pair_item(encode_pair(row, "p.jsonl:3", load_chat_template("chatml", None), make_encoder(None)),
                     "p.jsonl:3", seq_len)


def _completion_text(item: dict, half: int) -> bytes:
    keep = (item["completion"] > 0) & (item["half"] == half)
    return bytes(int(t) for t in item["targets"][keep] if t < 256)


def test_a_plain_pair_is_one_item_with_an_end_of_document_completion(batches):
    item = _pair({"prompt": "Up: abcd\n", "chosen": "ABCD", "rejected": "abcd"}, T)
    assert _completion_text(item, 1) == b"ABCD" and _completion_text(item, 2) == b"abcd"
    assert item["targets"][(item["half"] == 1) & (item["completion"] > 0)][-1] == 256  # end of document
    assert list(item["position_in_half"][:3]) == [0, 1, 2] and item["position_in_half"][item["half"] == 2][0] == 0
    assert item["truncated"].sum() == 0
    b = batches[0]  # packed: pair k's halves are segments 2k - 1, 2k; positions restart at each half
    for r in range(B):
        seg, pos = b["segment_ids"][r], b["positions"][r]
        starts = np.flatnonzero(np.diff(np.concatenate([[0], seg])) != 0)
        assert all(pos[s] == 0 for s in starts if seg[s] > 0) and seg.max() % 2 == 0 and seg.max() >= 4


def test_a_chat_pair_trains_the_assistant_reply_with_its_end_of_turn():
    item = _pair({"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
                  "chosen": "Hello!", "rejected": [{"role": "assistant", "content": "No."}]}, 256)
    assert _completion_text(item, 1) == b"Hello!<|im_end|>" and _completion_text(item, 2) == b"No.<|im_end|>"


def test_long_pairs_cut_completions_and_keep_the_prompt_or_are_refused():
    from jaxinfra.data import DataError

    row = {"prompt": "Up: abcd\n", "chosen": "ABCDEFGHIJ", "rejected": "abcdefghij"}
    item = _pair(row, 24)  # 2 x 20 ids -> 2 x 13: 24 targets, 4 completion targets per half
    assert len(item["targets"]) == 24 and item["truncated"][0] == 1 and item["completion"].sum() == 8
    with pytest.raises(DataError, match=r"p\.jsonl:3: the prompt \(9 tokens\) leaves no room .*seq_len=16"):
        _pair(row, 16)
    with pytest.raises(DataError, match=r"p\.jsonl:3: no 'chosen'"):
        _pair({"prompt": "x", "rejected": "y"}, 24)


# ---------------------------------------------------------------- acceptance 2 (slow): the synthetic preference task

TASK = ["model.vocab_size=258", "model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_dim=128", "train.seq_len=64", "train.batch_size=16", "mesh.data=1", "log.progress=false",
        "log.tensorboard=false", "log.every=10", "data.eval_fraction=0.1", "data.eval_batches=4",
        "schedule.warmup_steps=10"]


def _eval_lines(run_dir: pathlib.Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]


@pytest.mark.slow
def test_dpo_teaches_the_rule_after_sft_on_both_styles(tmp_path):
    """SFT on both styles equally ("Up: abcd" -> "ABCD" and -> "abcd"), so the SFT'd model prefers
    either about half the time; DPO from it (reference: the SFT checkpoint) on pairs that prefer the
    upper-case one: held-out preference accuracy >= 0.9 and greedy replies follow the rule on >= 80%.
    A small learning rate and few steps: the pairs separate within ~20 steps, and Adam's steps on the
    vanishing gradients after that drift the model (150 steps at 1e-3 broke the copying itself)."""
    import time

    from jaxinfra.infer.generation import Generator, Sampling
    from jaxinfra.infer.loading import load_model

    rows = preference_rows(2000, seed=1)
    docs = [{"text": r["prompt"] + c} for r in rows for c in (r["chosen"], r["rejected"])]
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    t0 = time.perf_counter()
    Trainer(load_config("tiny", [*TASK, "data.source=jsonl", f"data.paths=[{_write(tmp_path / 'sft.jsonl', docs)}]",
                                 "train.steps=400", "optimizer.lr=3e-3", "train.eval_every=400"]),
            sft, jax.devices()[:1]).run()
    t1 = time.perf_counter()
    Trainer(load_config("tiny", [*TASK, "data.source=preference", f"data.paths=[{_write(tmp_path / 'p.jsonl', rows)}]",
                                 "train.steps=60", "optimizer.lr=5e-5", "train.eval_every=30", "dpo.beta=0.1",
                                 "checkpoint.restore=params"]),
            dpo, jax.devices()[:1], restore_from=str(sft)).run()
    t2 = time.perf_counter()
    evals = _eval_lines(dpo)
    before, after = evals[0]["eval_logps/accuracy"], evals[-1]["eval_rewards/accuracy"]
    cfg, params = load_model(dpo, devices=jax.devices()[:1])
    held = preference_rows(100, seed=99)
    out = Generator(cfg, params, devices=jax.devices()[:1]).generate(
        [list(r["prompt"].encode()) for r in held], max_new_tokens=5, sampling=Sampling(temperature=0.0))
    follows = np.mean([bytes(t for t in ids if t < 256).startswith(r["chosen"].encode())
                       for ids, r in zip(out.tokens, held)])
    print(f"\nacceptance 2: SFT {t1 - t0:.0f}s, DPO {t2 - t1:.0f}s; held-out policy preference accuracy before DPO "
          f"{before:.3f}, implicit-reward accuracy after {after:.3f} (policy's own {evals[-1]['eval_logps/accuracy']:.3f}), "
          f"greedy follows the rule {follows:.2f}; evals {[(e['step'], round(e['eval_rewards/accuracy'], 3)) for e in evals]}")
    assert 0.3 <= before <= 0.7 and after >= 0.9 and follows >= 0.8


def test_parquet_pairs_are_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxinfra.data import DataError

    rows = preference_rows(40)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}), tmp_path / "p.parquet")
    from jaxinfra.data.preference import PreferenceRecords

    records = PreferenceRecords([str(tmp_path / "p.parquet")], None)
    assert [records.row(i)[0] for i in (0, 17, 39)] == [rows[i] for i in (0, 17, 39)]
    args = dict(seq_len=T, global_batch_size=2, vocab_size=V, seed=0)
    batch = next(make_train_iterator(DataConfig(source="preference", paths=(str(tmp_path / "p.parquet"),)), **args))
    assert batch["segment_ids"].max() >= 4 and batch["completion"].sum() > 0
    pq.write_table(pa.table({"prompt": ["a"] * 4, "chosen": ["b"] * 4}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet has no 'rejected' column"):
        make_train_iterator(DataConfig(source="preference", paths=(str(tmp_path / "bad.parquet"),)), **args)
