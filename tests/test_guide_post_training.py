"""The formulas and tables of guide pages 21 (post-training) and 22 (clusters and storage) against the code:
the SFT mask the page shows, the DPO loss on hand-made log-probs, GRPO's k3 KL, LoRA's count by hand, the
page's reward, and the exit-status table read from the code and scripts (docs/clusters.md's table)."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfra.dpo.loss import dpo_outputs, pair_losses
from jaxinfra.grpo.loss import KL_SUM, grpo_token_sums

GUIDE_SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "guide"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"guide_{name}", GUIDE_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


post = _script("post_training")
clusters = _script("clusters")


def test_sft_mask_trains_the_reply_and_its_end_of_turn_only():
    messages = [{"role": "user", "content": "Write kguce in capitals"}, {"role": "assistant", "content": "KGUCE"}]
    text, ids, codes = post.trained_mask(messages)
    assert bytes(ids).decode() == text  # byte-level: one id per byte
    trained = bytes(i for i, c in zip(ids, codes, strict=True) if c).decode()
    assert trained == "KGUCE<|im_end|>"
    assert post.show_mask(text, codes).endswith("assistant\\n[KGUCE<|im_end|>]\\n")


@pytest.mark.parametrize("pc,pr,rc,rr", [(-3.0, -5.0, -4.0, -4.0), (-10.0, -2.0, -9.0, -2.5), (-1.0, -1.0, -1.0, -1.0)])
def test_dpo_loss_is_minus_log_sigmoid_of_beta_z_with_rewards_beta_log_ratios(pc, pr, rc, rr):
    beta = 0.1
    z = (pc - rc) - (pr - rr)
    want = -math.log(1 / (1 + math.exp(-beta * z)))
    losses, chosen, rejected = dpo_outputs((jnp.array([pc]), jnp.array([pr])), (jnp.array([rc]), jnp.array([rr])),
                                           (jnp.array([3.0]), jnp.array([3.0])), beta, "sigmoid")
    np.testing.assert_allclose(float(losses[0]), want, rtol=1e-6)
    np.testing.assert_allclose([float(chosen[0]), float(rejected[0])], [beta * (pc - rc), beta * (pr - rr)], rtol=1e-6)


def test_dpo_loss_starts_at_log_2_when_the_policy_is_the_reference():
    np.testing.assert_allclose(float(pair_losses(jnp.zeros(()), 0.1, "sigmoid")), math.log(2), rtol=1e-7)


def test_grpo_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp = jnp.array([-1.0, -2.0, -0.5, -3.0])
    ref = jnp.array([-1.0, -1.0, -2.5, -0.1])
    mask = jnp.array([True, True, True, True])
    zero = jnp.zeros(4)
    same = grpo_token_sums(logp, logp, zero, mask, 0.2, ref_logp=logp)[KL_SUM]
    assert float(same) == 0.0
    d = np.asarray(ref - logp)
    got = grpo_token_sums(logp, logp, zero, mask, 0.2, ref_logp=ref)[KL_SUM]
    np.testing.assert_allclose(float(got), np.sum(np.exp(d) - d - 1), rtol=1e-6)
    assert np.exp(d[0]) - d[0] - 1 == 0 and all(np.exp(d[1:]) - d[1:] - 1 > 0)  # >= 0, 0 only where equal


def test_lora_rows_are_rank_times_in_plus_out_over_targets_and_layers():
    (tiny_attn, tiny_all), = [post.lora_rows(("tiny",), ((8, "q,k,v,o"), (16, "q,k,v,o,gate,up,down")))]
    d, kv, mlp, layers = 128, 64, 384, 4  # tiny: 4 heads of 32, 2 KV heads, mlp 384
    attn = (d + d) + (d + kv) + (d + kv) + (d + d)
    assert tiny_attn[3] == 8 * attn * layers == 28672
    assert tiny_all[3] == 16 * (attn + 2 * (d + mlp) + (mlp + d)) * layers
    assert tiny_attn[4] == tiny_all[4] and tiny_attn[5] == f"{100 * 28672 / tiny_attn[4]:.2f}%"


def test_the_pages_reward_pays_letters_of_the_answer_and_not_padding():
    namespace: dict = {}
    exec(post.REWARDS, namespace)
    reward = namespace["word_letters"]
    got = reward(["p"] * 4, ["ABCD", " ABCD\n", "ABCDXXXX", "DCBA"], ["ABCD"] * 4)
    assert got == [1.0, 1.0, 0.5, 1.0]
    assert reward(["p"], ["QQQQ"], ["ABCD"]) == [0.0]


def test_exit_table_is_the_one_docs_clusters_md_states():
    rows = {r[0]: r[2:] for r in clusters.exit_rows()}
    assert rows == {0: ["-", "ends", "completes"],
                    2: ["no retry", "no requeue", "fails the set"],
                    3: ["no retry", "no requeue", "fails the set"],
                    70: ["resubmit", "requeue", "restarts every pod"],
                    74: ["no retry", "no requeue", "fails the set"],
                    75: ["resubmit", "requeue", "restarts every pod"]}


def test_sbatch_requeue_set_is_read_from_the_script():
    assert clusters.sbatch_requeued(clusters.SBATCH.read_text()) == {70, 75}
    edited = clusters.SBATCH.read_text().replace('|| [ "$STATUS" = 70 ]', "")
    assert clusters.sbatch_requeued(edited) == {75}
    with pytest.raises(ValueError):
        clusters.sbatch_requeued("#!/bin/bash\nexit 0\n")
