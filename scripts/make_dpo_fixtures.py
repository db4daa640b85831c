"""DPO reference fixtures for tests/test_dpo.py, made with torch + trl + transformers (never by the suite).

    pip install trl
    python scripts/make_dpo_fixtures.py [--trl-dpo-trainer PATH]

1. tests/fixtures/dpo/trl_dpo_loss.json: TRL's `DPOTrainer.dpo_loss(chosen_logps, rejected_logps,
   ref_chosen_logps, ref_rejected_logps) -> (losses, chosen_rewards, rejected_rewards)`, called unbound
   with a minimal stand-in `self` (beta, loss_type, label_smoothing, reference_free=False,
   f_divergence_type=reverse_kl), on random per-sequence log-probs (float64), for sigmoid with
   label_smoothing 0 and 0.2, ipo and hinge. TRL trains IPO on per-token MEAN log-probs (its
   concatenated_forward divides the sums by the completion lengths before dpo_loss), so the ipo case
   is given sums / counts, and the counts are stored too. TRL >= 1.0 folded dpo_loss into
   `_compute_loss` and dropped sigmoid's label smoothing, so when the installed trl has no
   `dpo_loss`, the function (and its FDivergence enums) is read from the dpo_trainer.py of a TRL
   release that has it (`--trl-dpo-trainer`, e.g. trl 0.19.1's, unpacked with
   `pip install --no-deps --target DIR trl==0.19.1`) and executed as TRL wrote it; that release
   and the installed one are both recorded.
2. tests/fixtures/dpo/hf_llama_logps.npz: transformers' summed completion log-probs (float32 model,
   log_softmax in float32, summed in float64) of a few (prompt, completion) id sequences under the
   tests/fixtures/hf/llama checkpoint: `tokens` [N, L] (0-padded), `prompt_len` [N], `length` [N],
   `logp_sum` [N] (targets prompt_len..length-1, i.e. the completion's ids).
"""

from __future__ import annotations

import argparse
import ast
import enum
import json
import math
import pathlib
import types

import numpy as np
import torch
import torch.nn.functional as F  # TRL's own name: its code below uses it
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "dpo"
CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)]
BETA, PAIRS = 0.1, 16


def _from_source(path: pathlib.Path):
    """DPOTrainer.dpo_loss as written in a TRL release's dpo_trainer.py, with its FDivergence names."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPOTrainer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "dpo_loss")
    config = ast.parse((path.parent / "dpo_config.py").read_text())
    names = {"torch": torch, "F": F, "math": math, "Enum": enum.Enum}
    for node in config.body:
        if isinstance(node, ast.ClassDef) and node.name in ("FDivergenceType", "FDivergenceConstants"):
            exec(compile(ast.Module([node], []), str(path.parent / "dpo_config.py"), "exec"), names)
    exec(compile(ast.Module([fn], []), str(path), "exec"), names)  # TRL's code, verbatim
    return names["dpo_loss"], names["FDivergenceType"].REVERSE_KL.value


def trl_dpo_loss(source: pathlib.Path | None):
    import trl

    trainer = getattr(trl, "DPOTrainer", None)
    if trainer is not None and hasattr(trainer, "dpo_loss"):
        return trainer.dpo_loss, "reverse_kl", f"trl {trl.__version__} (installed)"
    if source is None:
        raise SystemExit(f"trl {trl.__version__} has no DPOTrainer.dpo_loss: pass --trl-dpo-trainer PATH")
    version = (source.parent.parent / "__init__.py").read_text().split("__version__ = ")[-1].split("\n")[0]
    fn, reverse_kl = _from_source(source)
    return fn, reverse_kl, f"trl {version.strip(chr(34) + chr(39))} dpo_trainer.py (installed: trl {trl.__version__})"


def loss_fixture(source: pathlib.Path | None) -> dict:
    dpo_loss, reverse_kl, version = trl_dpo_loss(source)
    rng = np.random.default_rng(29)
    counts = rng.integers(1, 40, size=(2, PAIRS)).astype(np.float64)  # completion tokens, chosen / rejected
    sums = -rng.uniform(0.5, 3.0, size=(4, PAIRS)) * np.concatenate([counts, counts])  # pc, pr, rc, rr
    sums[2:] += rng.normal(0, 2.0, size=(2, PAIRS))  # the reference differs from the policy
    out = {"trl": version, "beta": BETA, "counts": counts.tolist(), "logps": sums.tolist(), "cases": []}
    for loss_type, ls in CASES:
        stand_in = types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu"), reference_free=False,
                                         f_divergence_type=reverse_kl, f_divergence_params={}, beta=BETA,
                                         loss_type=loss_type, label_smoothing=ls, use_weighting=False)
        given = sums / np.concatenate([counts, counts]) if loss_type == "ipo" else sums
        losses, chosen, rejected = dpo_loss(stand_in, *(torch.tensor(x, dtype=torch.float64) for x in given))
        out["cases"].append({"loss": loss_type, "label_smoothing": ls, "inputs": "mean" if loss_type == "ipo" else
                             "sum", "losses": losses.tolist(), "chosen_rewards": chosen.tolist(),
                             "rejected_rewards": rejected.tolist()})
    return out


def logps_fixture() -> dict[str, np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(ROOT / "tests" / "fixtures" / "hf" / "llama",
                                                              attn_implementation="eager", dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    lengths = [(5, 9), (5, 4), (8, 12), (8, 3), (3, 20), (3, 7)]  # (prompt, completion): pairs share a prompt
    width = max(p + c for p, c in lengths)
    tokens = np.zeros((len(lengths), width), np.int32)
    logp = np.zeros(len(lengths))
    for i, (p, c) in enumerate(lengths):
        if i % 2 == 0:
            prompt = rng.integers(3, model.config.vocab_size, p)
        ids = np.concatenate([prompt, rng.integers(3, model.config.vocab_size, c)])
        tokens[i, :p + c] = ids
        with torch.no_grad():
            logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].float()
        per_token = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:, None]))[:, 0]
        logp[i] = per_token[p - 1:].double().sum().item()  # targets p..p+c-1: the completion's ids
    return {"tokens": tokens, "prompt_len": np.array([p for p, _ in lengths], np.int32),
            "length": np.array([p + c for p, c in lengths], np.int32), "logp_sum": logp,
            "transformers": np.array(transformers.__version__)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-dpo-trainer", type=pathlib.Path, default=None,
                        help="dpo_trainer.py of a TRL release with DPOTrainer.dpo_loss (when the installed has none)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "trl_dpo_loss.json").write_text(json.dumps(loss_fixture(args.trl_dpo_trainer), indent=1))
    np.savez(OUT / "hf_llama_logps.npz", **logps_fixture())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
