"""GRPO (jaxinfra/grpo/): the per-token loss and the group advantages against plain numpy, the
train step on hand-made rows against a numpy GRPO over the model's own logits, reward and prompt
errors (one line, exit 2), rollouts and losses under fsdp=4 x tensor=2 equal to one device
(temperature 0), and a resume after SIGTERM mid-rollout bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra import cli
from jaxinfra.config import load_config
from jaxinfra.data import DataError
from jaxinfra.grpo.extension import Grpo
from jaxinfra.grpo.loss import CLIP_SUM, KL_SUM, PG_SUM, grpo_token_sums
from jaxinfra.grpo.prompts import rollout_indices
from jaxinfra.grpo.rewards import Rewards
from jaxinfra.grpo.rollout import group_advantages, pack_rows
from jaxinfra.runtime import build_runtime
from jaxinfra.state import model_state
from jaxinfra.train import EXIT_PREEMPTED, train

REWARDS = '''import os, pathlib, signal

def digits(prompts, completions, answers):
    """A reward a random model gets now and then: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]

def exact(prompts, completions, answers):
    return [float(c.strip() == a) for c, a in zip(completions, answers)]

def kill_at(prompts, completions, answers):
    """digits, and SIGTERM to this process on the rollout named in the file KILL (calls counted in CALLS)."""
    here = pathlib.Path(__file__).parent
    calls = here / "CALLS"
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    kill = here / "KILL"
    if kill.exists() and int(kill.read_text()) == n:
        kill.unlink()
        os.kill(os.getpid(), signal.SIGTERM)
    return digits(prompts, completions, answers)

def raises(prompts, completions, answers):
    raise RuntimeError("boom")

def short(prompts, completions, answers):
    return [0.0]

def nan(prompts, completions, answers):
    return [float("nan")] * len(completions)
'''

BATCH, SEQ, GROUP, NEW = 8, 80, 4, 8  # the chat row renders to 67 ChatML bytes


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("grpo")
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rng.integers(10, 100, (12, 2))]
    rows[3] = {"prompt": [{"role": "user", "content": "What is 1 plus 2?"}], "answer": "3"}  # chat messages too
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def overrides(root: pathlib.Path, reward: str = "digits", **extra) -> list[str]:
    base = {"model.vocab_size": 384, "model.d_model": 32, "model.num_layers": 1, "model.num_heads": 4,
            "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.scan_layers": "false",
            "train.batch_size": BATCH, "train.seq_len": SEQ, "train.steps": 3, "train.eval_every": 0,
            "log.progress": "false", "log.tensorboard": "false", "log.every": 1, "data.source": "prompts",
            "data.paths": root / "prompts.jsonl", "grpo.reward": f"{root / 'rewards.py'}:{reward}",
            "grpo.group_size": GROUP, "grpo.max_new_tokens": NEW, "grpo.kl_beta": 0, "optimizer.lr": 1e-2,
            "schedule.warmup_steps": 0, **extra}
    return [f"{k}={v}" for k, v in base.items()]


# ---------------------------------------------------------------- the loss and advantages vs numpy


def numpy_grpo(logp, old, adv, mask, eps, ref=None):
    """Plain-numpy GRPO sums, per token (the formulas of the GRPO / DAPO papers written out)."""
    ratio = np.exp(logp - old)
    pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    clipped = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
    kl = np.zeros_like(logp) if ref is None else np.exp(ref - logp) - (ref - logp) - 1
    return {PG_SUM: (pg * mask).sum(), KL_SUM: (kl * mask).sum(), CLIP_SUM: (clipped & mask).sum()}


def test_token_sums_match_numpy():
    rng = np.random.default_rng(0)
    logp, ref = rng.normal(-2, 1, (2, 4, 16)).astype(np.float32), rng.normal(-2, 1, (2, 4, 16)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)  # ratios on both sides of the clip range
    adv = np.repeat(rng.normal(0, 1, (2, 4, 1)), 16, axis=2).astype(np.float32)
    mask = rng.random(logp.shape) < 0.7
    for r in (None, ref):
        got = jax.device_get(grpo_token_sums(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                             0.2, None if r is None else jnp.asarray(r)))
        want = numpy_grpo(logp, old, adv, mask, 0.2, r)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert 0 < want[CLIP_SUM] < mask.sum()


def test_group_advantages_match_numpy():
    rewards = np.array([1, 0, 0, 1, 3, 3, 3, 3, 0.5, 2, -1, 0], np.float64)
    for scale in (True, False):
        got = group_advantages(rewards, 4, scale)
        for g in range(3):
            r = rewards[4 * g:4 * g + 4]
            want = r - r.mean()
            if scale:
                want = want / (np.std(r, ddof=1) + 1e-4)
            np.testing.assert_allclose(got[4 * g:4 * g + 4], want, rtol=1e-6, atol=1e-7)
    assert np.all(group_advantages(rewards, 4)[4:8] == 0)  # equal rewards: no signal, not 0 / 0


def test_byte_level_prompts_need_only_the_256_byte_ids(tmp_path):
    """A prompt is encoded as is (no end-of-document id), so a byte-level SFT'd chat model (256 ids)
    runs GRPO on its own params; preference pairs end plain completions with id 256 and need 257."""
    from jaxinfra.data import vocab_size_of

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for source, vocab in (("prompts", 256), ("preference", 257)):
        cfg = load_config("tiny", [f"data.source={source}", f"data.paths=[{path}]", "grpo.reward=r.py:f"])
        assert vocab_size_of(cfg.data) == vocab, source


def test_prompt_order_is_a_seeded_permutation_per_epoch():
    seen = [i for k in range(3) for i in rollout_indices(6, 5, k, 2)]  # 3 rollouts of 2 = one epoch
    assert sorted(seen) == list(range(6)) and seen == [i for k in range(3) for i in rollout_indices(6, 5, k, 2)]
    second = [i for k in range(3, 6) for i in rollout_indices(6, 5, k, 2)]
    assert sorted(second) == list(range(6)) and second != seen  # the next epoch: another permutation


# ---------------------------------------------------------------- the train step vs a numpy GRPO


def _numpy_logps(graphdef, variables, rows: dict, temperature: float) -> np.ndarray:
    """float64 [rows, seq] log-probs of the targets: a plain forward, then log-softmax in numpy."""

    def forward(variables, inputs, positions, segment_ids):
        model = nnx.merge(graphdef, variables)
        return model.logits(model.hidden(inputs, positions, segment_ids)[0])

    # jitted: one program instead of the forward compiled op by op (the cold-cache cost)
    logits = jax.jit(forward)(variables, rows["inputs"], rows["positions"], rows["segment_ids"])
    logits = np.asarray(logits, np.float64) / temperature
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return np.take_along_axis(logits, rows["targets"][..., None], -1)[..., 0] - logz


def test_step_matches_numpy_grpo_over_the_models_logits(files):
    """Rows packed by the rollout code; policy and reference log-probs from a plain forward
    (temperature 0.7; the reference: the policy's params x 1.05); with old_logps equal to the policy's
    the ratio is 1 (the step-1 case), perturbed ones exercise the clip. Loss = (pg + kl_beta k3) per
    completion token."""
    cfg = load_config("tiny", overrides(files, **{"grpo.temperature": 0.7, "grpo.kl_beta": 0.1}))
    ext = Grpo(cfg)
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[ext])
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 256, 5 + r % 3)) for r in range(BATCH)]
    completions = [list(rng.integers(0, 256, 1 + (3 * r) % NEW)) for r in range(BATCH)]
    rewards = rng.random(BATCH)
    adv = group_advantages(rewards, GROUP)
    rows = pack_rows(prompts, completions, [[0.0] * len(c) for c in completions], adv, rewards, SEQ)
    state = rt.init_state()
    variables = jax.device_get(model_state(state))
    ext.ref.params = jax.tree.map(lambda x: x * 1.05, variables)  # a frozen reference near the policy
    logp = _numpy_logps(rt.graphdef, variables, rows, 0.7)
    ref = _numpy_logps(rt.graphdef, ext.ref.params, rows, 0.7)
    mask = rows["completion"] > 0
    for shift in (0.0, 0.4):
        old = np.where(mask, logp + shift * rng.normal(size=logp.shape), 0).astype(np.float32)
        _, m = rt.train_step(rt.init_state(), rt.to_global({**rows, "old_logps": old}))
        m = jax.device_get(m)
        want = numpy_grpo(logp, old, rows["advantages"], mask, cfg.grpo.clip_eps, ref)
        n = mask.sum()
        np.testing.assert_allclose(m["loss"], (want[PG_SUM] + 0.1 * want[KL_SUM]) / n, rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(m["kl"], want[KL_SUM] / n, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(m["clip_frac"], want[CLIP_SUM] / n, atol=1e-7)
        assert (m["clip_frac"] == 0) == (shift == 0) and m["kl"] > 0
    np.testing.assert_allclose(m["reward/mean"], rewards.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["reward/std"], rewards.std(), rtol=1e-4)
    np.testing.assert_allclose(m["completion_len"], np.mean([len(c) for c in completions]), rtol=1e-6)
    assert m["tokens"] == mask.sum()


# ---------------------------------------------------------------- bad input: one line, exit 2


def test_reward_errors_name_the_function_and_the_row(files):
    path = files / "rewards.py"
    rows = (["p0", "p1"], ["c0", "c1"], ["a", None])
    for fn, words in (("raises", ["raised RuntimeError: boom", "row 0", "'p0'"]),
                      ("short", ["returned 1 rewards for 2 completions"]), ("nan", ["returned nan for row 0", "'p0'"])):
        with pytest.raises(DataError) as e:
            Rewards([f"{path}:{fn}"])(*rows)
        assert all(w in str(e.value) for w in [f"{path}:{fn}", *words]), str(e.value)
    np.testing.assert_array_equal(Rewards([f"{path}:digits", f"{path}:exact"], (2.0, 1.0))(["x"], ["12"], ["12"]), [1.5])


@pytest.mark.parametrize("case", ["import", "file", "group", "row", "raises", "reference"])
def test_bad_grpo_input_is_one_line_exit_2(files, tmp_path, capsys, case):
    extra = {"import": {"grpo.reward": "no_such_module_xyz:fn"}, "file": {"grpo.reward": "missing.py:fn"},
             "group": {"grpo.group_size": 1}, "raises": {"grpo.reward": f"{files / 'rewards.py'}:raises"},
             "row": {"data.paths": tmp_path / "bad.jsonl"}, "reference": {"grpo.kl_beta": 0.04}}[case]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"answer": "b"}\n')
    argv = ["train", "tiny", "--run-dir", str(tmp_path / "run"), *overrides(files, **extra)]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    want = {"import": "no_such_module_xyz", "file": "'missing.py' not found", "group": "group_size",
            "raises": "rewards.py:raises' raised RuntimeError: boom", "row": "bad.jsonl:2: no 'prompt'",
            "reference": "grpo.reference is null and the run starts from random weights"}[case]
    assert len(err) == 1 and want in err[0], err


# ---------------------------------------------------------------- acceptance 4: fsdp=4 x tensor=2 == 1 device


def _metrics(run: pathlib.Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.endswith(("_s", "per_s", "per_device", "mfu"))}
            for x in lines if "loss" in x]


def _samples(run: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]


def test_sharded_rollouts_and_losses_equal_one_device(files, tmp_path, capsys):
    """Greedy rollouts (every row written to samples.jsonl) identical and losses to 1e-5 under
    fsdp=4 x tensor=2 on 8 devices and on one; `generate --chat` runs on the GRPO run."""
    common = overrides(files, **{"grpo.temperature": 0, "grpo.samples_per_rollout": BATCH})
    train(load_config("tiny", common), tmp_path / "one", devices=jax.devices()[:1])
    train(load_config("tiny", [*common, "mesh.fsdp=4", "mesh.tensor=2"]), tmp_path / "eight", devices=jax.devices())
    one, eight = _metrics(tmp_path / "one"), _metrics(tmp_path / "eight")
    assert _samples(tmp_path / "one") == _samples(tmp_path / "eight") and len(_samples(tmp_path / "one")) == 3 * BATCH
    assert one[0]["clip_frac"] == 0  # step 1: the sampler's log-probs are the trainer's (ratio 1 up to their gap)
    for key in ("loss", "reward/mean", "reward/std", "completion_len", "clip_frac", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in eight], [m[key] for m in one], rtol=1e-5, atol=1e-6, err_msg=key)
    argv = ["generate", str(tmp_path / "one"), "--chat", "--prompt", "What is 1 plus 2?", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- resume after SIGTERM mid-rollout


@pytest.fixture(scope="module")
def start_run(files, tmp_path_factory) -> pathlib.Path:
    """A 1-step GRPO run: the checkpoint a KL run starts from (its null reference)."""
    run = tmp_path_factory.mktemp("grpo_start") / "run"
    train(load_config("tiny", overrides(files, **{"train.steps": 1})), run, devices=jax.devices()[:1])
    return run


@pytest.mark.parametrize("epochs,kl_beta", [(1, 0.0), (2, 0.04)])
def test_resume_after_sigterm_mid_rollout_is_bit_identical(files, start_run, tmp_path, epochs, kl_beta):
    """SIGTERM from inside the reward function of rollout 1: the loop stops at the step boundary and
    checkpoints; the rerun ends with the metrics and params of an uninterrupted run, bit for bit
    (epochs_per_rollout=2: the resume falls inside rollout 1, reloaded from RUN/grpo/; with the KL
    to a null reference, the restored start, reloaded on resume from the checkpoint meta)."""
    steps = 2 + 2 * epochs
    extra = {"train.steps": steps, "grpo.epochs_per_rollout": epochs, "grpo.temperature": 1.0,
             "grpo.kl_beta": kl_beta, "checkpoint.restore": "params"}
    cfg = load_config("tiny", overrides(files, "kill_at", **extra))
    one, start = jax.devices()[:1], start_run if kl_beta else None
    full = train(cfg, tmp_path / "full", devices=one, restore_from=start)
    (files / "CALLS").unlink(missing_ok=True)
    (files / "KILL").write_text("1")
    stopped = train(cfg, tmp_path / "cut", devices=one, restore_from=start)
    assert stopped["exit_code"] == EXIT_PREEMPTED and stopped["steps"] == epochs + 1
    if epochs > 1:
        assert sorted(p.name for p in (tmp_path / "cut" / "grpo").iterdir()) == ["rollout-1.npz"]
    resumed = train(cfg, tmp_path / "cut", devices=one, restore_from=start)
    assert resumed["exit_code"] == full["exit_code"] == 0
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "full")
    assert _samples(tmp_path / "cut") == _samples(tmp_path / "full")
    kl = [m["kl"] for m in _metrics(tmp_path / "full")]
    assert (kl[0] == 0 and max(kl) > 0) if kl_beta else max(kl) == 0
    from jaxinfra.infer import load_model

    for a, b in zip(jax.tree.leaves(load_model(tmp_path / "cut")[1]), jax.tree.leaves(load_model(tmp_path / "full")[1]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- acceptance 3: two-digit addition


@pytest.mark.slow  # SFT + GRPO, ~20 min on 2 shared CPU cores; the tests above cover the mechanics
def test_grpo_raises_the_exact_sum_reward_after_sft(tmp_path):
    """scripts/grpo_addition.py: SFT tiny-chat to a sampled reward in [0.2, 0.5], then GRPO with the
    exact-sum reward and the KL to the SFT'd start: last-10% mean reward >= 1.5x the first 10% and
    >= 0.8; KL finite and logged."""
    import importlib.util

    path = pathlib.Path(__file__).parent.parent / "scripts" / "grpo_addition.py"
    spec = importlib.util.spec_from_file_location("grpo_addition", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    figures = script.main([str(tmp_path)])  # the measured recipe (docs/post-training.md): not yet >= 0.8 on CPU
    print(figures)
    assert figures["last_10pct_reward"] >= max(0.8, 1.5 * figures["first_10pct_reward"])
    assert figures["kl_finite"] and figures["kl_max"] > 0
