"""Tests for jaxinfra.scaling: sweep specs and their expansion, the launchers' files, the local
runner end to end, and the scaling-law fits against known answers.

Golden numbers: the Chinchilla approach-3 fit of Hoffmann et al. 2022, "Training
Compute-Optimal Large Language Models" (section 3.3 / appendix D.2):
E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
import re
import shlex
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from jaxinfra import cli
from jaxinfra.config import ConfigError, load_config
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.scaling import fit as F
from jaxinfra.scaling import runner
from jaxinfra.scaling.results import read_table
from jaxinfra.scaling.sizes import SizeRule, shape_for_depth
from jaxinfra.scaling.spec import expand, load_spec
from jaxinfra.scaling.workflow import fit_results, sweep

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
GOPHER_COMPUTE = 5.76e23  # FLOPs (Hoffmann et al. 2022, section 3.4)


def chinchilla_loss(n, d, p=CHINCHILLA):
    return p["E"] + p["A"] / np.asarray(n) ** p["alpha"] + p["B"] / np.asarray(d) ** p["beta"]


# ---------------------------------------------------------------- approach 3


def test_optimal_allocation_closed_form():
    """N_opt = G (C/6)^(beta/(alpha+beta)) minimises the law along 6 N D = C."""
    from scipy.optimize import minimize_scalar

    p = CHINCHILLA
    n_opt, d_opt, l_opt = F.optimal_allocation(*p.values(), GOPHER_COMPUTE)
    assert 6 * n_opt * d_opt == pytest.approx(GOPHER_COMPUTE, rel=1e-12)
    g = (p["alpha"] * p["A"] / (p["beta"] * p["B"])) ** (1 / (p["alpha"] + p["beta"]))
    assert n_opt == pytest.approx(g * (GOPHER_COMPUTE / 6) ** (p["beta"] / (p["alpha"] + p["beta"])), rel=1e-12)
    best = minimize_scalar(lambda x: chinchilla_loss(math.exp(x), GOPHER_COMPUTE / (6 * math.exp(x))),
                           bounds=(math.log(1e8), math.log(1e13)), method="bounded", options={"xatol": 1e-9})
    assert math.exp(best.x) == pytest.approx(n_opt, rel=1e-4)
    assert l_opt == pytest.approx(best.fun, rel=1e-9)


def test_huber_objective_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    n, d = rng.uniform(1e7, 1e10, 30), rng.uniform(1e9, 1e12, 30)
    logs = (np.log(n), np.log(d), np.log(chinchilla_loss(n, d) * np.exp(0.02 * rng.standard_normal(30))))
    theta = np.array([6.0, 6.2, 0.5, 0.35, 0.3])
    f0, grad = F.huber_objective(theta, *logs)
    eps = 1e-6
    for i in range(5):
        step = np.zeros(5)
        step[i] = eps
        fd = (F.huber_objective(theta + step, *logs)[0] - F.huber_objective(theta - step, *logs)[0]) / (2 * eps)
        assert grad[i] == pytest.approx(fd, rel=1e-4, abs=1e-6)
    # the vectorised grid objective agrees with the single one
    assert F._grid_objective(theta[None], *logs, F.HUBER_DELTA)[0] == pytest.approx(f0, rel=1e-10)


def _synthetic_grid(seed: int = 0, size: int = 20):
    """Losses from the Chinchilla law on a log grid of N x D, 1% multiplicative noise."""
    n, d = np.meshgrid(np.logspace(7, 11, size), np.logspace(9, 13, size))
    n, d = n.ravel(), d.ravel()
    rng = np.random.default_rng(seed)
    return n, d, chinchilla_loss(n, d) * (1 + 0.01 * rng.standard_normal(n.size))


def test_approach3_recovers_chinchilla_parameters():
    """Acceptance 1: alpha, beta within 10%; N_opt at 5.76e23 FLOPs within 15% of the truth."""
    n, d, loss = _synthetic_grid()
    fit = F.fit_parametric(n, d, loss, bootstrap=20, seed=0)
    true_n_opt = F.optimal_allocation(*CHINCHILLA.values(), GOPHER_COMPUTE)[0]
    n_opt = float(fit.optimal(GOPHER_COMPUTE)[0])
    print(f"\nrecovered alpha={fit.alpha:.4f} beta={fit.beta:.4f} E={fit.E:.4f} A={fit.A:.1f} B={fit.B:.1f}; "
          f"N_opt(5.76e23)={n_opt:.4g} vs true {true_n_opt:.4g} ({n_opt / true_n_opt - 1:+.1%})")
    assert fit.alpha == pytest.approx(CHINCHILLA["alpha"], rel=0.10)
    assert fit.beta == pytest.approx(CHINCHILLA["beta"], rel=0.10)
    assert n_opt == pytest.approx(true_n_opt, rel=0.15)
    assert fit.n_bootstrap == 20
    for name in F.PARAM_NAMES:
        lo, hi = fit.ci[name]
        assert lo <= getattr(fit, name) <= hi, name
    assert fit.ci["alpha"][0] < CHINCHILLA["alpha"] < fit.ci["alpha"][1]


def test_approach3_without_noise_is_exact():
    n, d = (x.ravel() for x in np.meshgrid(np.logspace(7, 10, 6), np.logspace(9, 12, 6)))
    fit = F.fit_parametric(n, d, chinchilla_loss(n, d), bootstrap=0)
    for k, v in CHINCHILLA.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-3), k


@pytest.mark.slow
def test_screened_starts_find_the_full_grid_optimum():
    """The paper's full 4500-start grid (about 2 minutes) lands where the screened starts do."""
    n, d, loss = _synthetic_grid(seed=3, size=8)
    full = F.fit_parametric(n, d, loss, bootstrap=0, starts="full")
    screened = F.fit_parametric(n, d, loss, bootstrap=0)
    assert screened.objective == pytest.approx(full.objective, rel=1e-8)
    assert screened.alpha == pytest.approx(full.alpha, rel=1e-5)


def test_approach3_needs_five_points():
    with pytest.raises(ValueError, match="at least 5"):
        F.fit_parametric([1e6, 2e6, 3e6, 4e6], [1e9] * 4, [3.0, 2.9, 2.8, 2.7])


# ---------------------------------------------------------------- approach 2 and the frontier


def _isoflop_data(noise: float = 0.0, seed: int = 0):
    """IsoFLOP profiles of the Chinchilla law: 5 budgets, 9 sizes each around the optimum."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in np.logspace(18, 22, 5):
        n_opt = F.optimal_allocation(*CHINCHILLA.values(), c)[0]
        for n in n_opt * np.logspace(-0.8, 0.8, 9):
            d = c / (6 * n)
            rows.append((n, d, c, chinchilla_loss(n, d) * (1 + noise * rng.standard_normal())))
    return np.array(rows).T


def test_approach2_recovers_the_exponent():
    """Acceptance 2: N_opt ∝ C^a with a within 0.05 of beta / (alpha + beta)."""
    n, d, c, loss = _isoflop_data(noise=0.002)
    fit = F.fit_isoflop(n, d, loss, c)
    a_true = CHINCHILLA["beta"] / (CHINCHILLA["alpha"] + CHINCHILLA["beta"])
    print(f"\napproach 2: a={fit.a:.4f} (true {a_true:.4f}), b={fit.b:.4f} (true {1 - a_true:.4f})")
    assert len(fit.profiles) == 5
    assert fit.a == pytest.approx(a_true, abs=0.05)
    assert fit.b == pytest.approx(1 - a_true, abs=0.05)
    assert fit.a_ci[0] < fit.a < fit.a_ci[1]
    # profiles found by grouping C alone match the explicit budget labels
    assert F.fit_isoflop(n, d, loss, c * (1 + 0.01 * np.sin(np.arange(len(c)))), budget=c).a == pytest.approx(
        F.fit_isoflop(n, d, loss, c).a, abs=0.01)


def test_approach2_skips_profiles_without_three_sizes():
    n, d, c, loss = _isoflop_data()
    keep = np.ones(len(n), bool)
    keep[:7] = False  # the first budget keeps only 2 sizes
    fit = F.fit_isoflop(n[keep], d[keep], loss[keep], c[keep])
    assert len(fit.profiles) == 4 and "needs 3" in fit.skipped[0]
    with pytest.raises(ValueError, match="at least 2 IsoFLOP profiles"):
        F.fit_isoflop(n[:9], d[:9], loss[:9], c[:9])
    # a profile sampled only on one side of its optimum has no minimum to offer
    one_sided = np.ones(len(n), bool)
    one_sided[9:14] = False  # the second budget keeps only its 4 sizes above the optimum
    fit = F.fit_isoflop(n[one_sided], d[one_sided], loss[one_sided], c[one_sided])
    assert len(fit.profiles) == 4 and "keeps falling towards smaller N" in fit.skipped[0]


def test_fit_note_for_a_skipped_approach_2_is_one_line_with_a_count_and_the_first_reasons(tmp_path, capsys):
    n, d, c, loss = _isoflop_data()
    two_sizes = np.arange(len(n)) % 9 < 2  # every one of the 5 budgets keeps 2 sizes
    results = tmp_path / "results.csv"
    _write_csv(results, {"N": n[two_sizes], "D": d[two_sizes], "C": c[two_sizes], "eval_loss": loss[two_sizes]})
    assert cli.main(["scaling", "fit", str(results), "--bootstrap", "0"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "approach 2" in line]
    reasons = "; ".join(f"C={x:.3g}: 2 model sizes (a parabola needs 3)" for x in np.logspace(18, 20, 3))
    assert notes == [f"note: approach 2 skipped: 5 of 5 compute budgets unusable; at least 2 IsoFLOP profiles "
                     f"with 3+ model sizes each are needed ({reasons}; and 2 more)"]
    assert len(json.loads((tmp_path / "fit.json").read_text())["notes"]) == 1  # approach 3 and the frontier still fit


def test_frontier_power_law():
    c = np.logspace(15, 20, 6)
    loss = 50.0 * c**-0.05
    # dominated runs (more compute, higher loss) are left off the frontier
    cc = np.concatenate([c, c * 1.5])
    ll = np.concatenate([loss, loss * 1.2])
    fit = F.fit_frontier(cc, ll)
    assert fit.gamma == pytest.approx(0.05, rel=1e-9)
    assert fit.k == pytest.approx(50.0, rel=1e-9)
    assert len(fit.points) == 6


def test_predict_from_a_saved_fit(tmp_path):
    n, d, c, loss = _isoflop_data(noise=0.001)
    table = {"N": n, "D": d, "C": c, "eval_loss": loss}
    fit = F.fit_all(table, bootstrap=0)
    pred = F.predict(json.loads(json.dumps(fit)), GOPHER_COMPUTE)
    true_n = F.optimal_allocation(*CHINCHILLA.values(), GOPHER_COMPUTE)[0]
    assert pred["approach3"]["N_opt"] == pytest.approx(true_n, rel=0.15)
    assert 6 * pred["approach3"]["N_opt"] * pred["approach3"]["D_opt"] == pytest.approx(GOPHER_COMPUTE)
    assert pred["approach2"]["N_opt"] == pytest.approx(true_n, rel=0.3)
    assert pred["frontier"]["loss"] > 0


# ---------------------------------------------------------------- fit / predict CLI


def _write_csv(path: pathlib.Path, columns: dict[str, np.ndarray]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(zip(*columns.values()))


def test_fit_and_predict_cli(tmp_path, capsys):
    n, d, c, loss = _isoflop_data(noise=0.002)
    results = tmp_path / "results.csv"
    _write_csv(results, {"run": [f"r{i}" for i in range(len(n))], "N": n, "D": d, "C": c, "eval_loss": loss})
    plots = tmp_path / "plots"
    assert cli.main(["scaling", "fit", str(results), "--plot", str(plots), "--bootstrap", "10"]) == 0
    out = capsys.readouterr().out
    for name in ("E", "A", "B", "alpha", "beta"):
        assert re.search(rf"^  {name}\s+\S+\s+\[\S+, \S+\]$", out, re.M), (name, out)
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert set(saved) >= {"approach3", "approach2", "frontier"}
    assert saved["approach3"]["alpha"] == pytest.approx(0.34, rel=0.1)
    assert sorted(p.name for p in plots.iterdir()) == ["frontier.png", "isoflop.png", "predicted_vs_observed.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in plots.iterdir())

    assert cli.main(["scaling", "predict", "--fit", str(tmp_path / "fit.json"), "--compute", "5.76e23"]) == 0
    out = capsys.readouterr().out
    assert "approach 3 (C = 6 N D): N_opt = " in out and "approach 2" in out and "frontier: loss" in out


def test_fit_reads_jsonl_and_names_missing_columns(tmp_path, capsys):
    n, d, c, loss = _isoflop_data()
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"N": a, "D": b, "eval_loss": x}) + "\n" for a, b, x in zip(n, d, loss)))
    table, notes = read_table(path)
    assert len(table["N"]) == len(n) and not notes
    fit = fit_results(path, out=tmp_path / "f.json", bootstrap=0, echo=lambda _: None)
    assert fit["approach2"]["a"] == pytest.approx(0.4516, abs=0.05)  # C = 6 N D when no C column

    bad = tmp_path / "bad.csv"
    _write_csv(bad, {"N": n, "tokens": d, "eval_loss": loss})
    assert cli.main(["scaling", "fit", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing column(s) D" in err[0]
    assert cli.main(["scaling", "predict", "--fit", str(tmp_path / "nope.json"), "--compute", "1e20"]) == 2


def test_fit_on_a_task_metric_fits_its_error(tmp_path, capsys):
    """`--metric NAME --higher-is-better` fits the error 1 - metric: with acc = 1 - L/5 of the Chinchilla
    law the fit must give E/5, A/5, B/5 and the same exponents (the eval_loss column is ignored)."""
    n, d, c, loss = _isoflop_data()
    results = tmp_path / "results.csv"
    _write_csv(results, {"N": n, "D": d, "C": c, "eval_loss": np.full_like(n, 3.0), "eval/fake/acc": 1 - loss / 5})
    args = ["scaling", "fit", str(results), "--metric", "eval/fake/acc", "--bootstrap", "0"]
    assert cli.main([*args, "--higher-is-better"]) == 0
    assert "fitted as the loss: 1 - eval/fake/acc" in capsys.readouterr().out
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert (fit["metric"], fit["target"], fit["higher_is_better"]) == ("eval/fake/acc", "1 - eval/fake/acc", True)
    expected = {**{k: CHINCHILLA[k] / 5 for k in ("E", "A", "B")}, "alpha": 0.34, "beta": 0.28}
    for k, v in expected.items():
        assert fit["approach3"][k] == pytest.approx(v, rel=1e-2), k
    assert fit["approach2"]["a"] == pytest.approx(0.28 / (0.34 + 0.28), abs=0.05)

    _write_csv(results, {"N": n, "D": d, "eval/fake/acc": loss})  # not a score in [0, 1]
    for bad, needle in ((args + ["--higher-is-better"], "needs scores in [0, 1]"),
                        (["scaling", "fit", str(results), "--higher-is-better"], "goes with --metric NAME"),
                        (["scaling", "fit", str(results), "--metric", "eval/other/acc"], "missing column(s) eval/other")):
        assert cli.main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_sweep_runs_are_grouped_under_the_sweep_and_fit_spec_parsed(tmp_path):
    overrides = ["data.source=synthetic", "log.wandb.project=p", "log.mlflow.tracking_uri=sqlite:///x.db"]
    spec = load_spec(_spec(tmp_path, overrides=overrides, fit={"metric": "eval/t/acc", "higher_is_better": True}))
    assert (spec.fit.metric, spec.fit.higher_is_better) == ("eval/t/acc", True)
    for run in expand(spec, tmp_path / "out").runs:
        log = run.config.log
        assert (log.wandb.group, log.mlflow.group, log.mlflow.experiment) == ("t", "t", "t")
    explicit = load_spec(_spec(tmp_path, overrides=[*overrides, "log.wandb.group=mine", "log.mlflow.experiment=e"]))
    log = expand(explicit, tmp_path / "out").runs[0].config.log
    assert (log.wandb.group, log.mlflow.group, log.mlflow.experiment) == ("mine", "t", "e")
    with pytest.raises(ConfigError, match=r"fit\.metric"):
        load_spec(_spec(tmp_path, fit={"metric": " "}))


# ---------------------------------------------------------------- specs and sizes


def test_size_rule():
    rule = SizeRule(aspect_ratio=64, head_dim=64, mlp_ratio=4, multiple_of=256, gqa_group=4)
    shape = shape_for_depth(rule, 12)
    assert shape == {"num_layers": 12, "d_model": 768, "num_heads": 12, "num_kv_heads": 3, "head_dim": 64,
                     "mlp_dim": 3072}
    assert shape_for_depth(SizeRule(aspect_ratio=48, head_dim=32, mlp_ratio=3), 2)["d_model"] == 96


def _spec(tmp_path, **changes):
    spec = {
        "name": "t",
        "base": "tiny",
        "overrides": ["data.source=synthetic", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
                      "data.eval_batches=1", "log.progress=false", "log.tensorboard=false", "log.peak_tflops=1"],
        "sizes": {"rule": {"aspect_ratio": 32, "head_dim": 16, "mlp_ratio": 2, "multiple_of": 16},
                  "depths": [1, 2]},
        "grid": {"tokens": [3000, 5000]},
        "schedule": {"warmup_fraction": 0.2},
    }
    spec.update(changes)
    for key in [k for k, v in spec.items() if v is None]:
        del spec[key]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_grid_expansion(tmp_path):
    plan = expand(load_spec(_spec(tmp_path)), tmp_path / "out")
    assert [r.name for r in plan.runs] == ["L1-d32-D3e3", "L2-d64-D3e3", "L1-d32-D5e3", "L2-d64-D5e3"]
    for r in plan.runs:
        assert r.steps == round(r.budget / 256) and r.D == r.steps * 256
        assert r.N == param_counts(r.config.model)["total"]
        assert r.C == pytest.approx(flops_per_token(r.config.model, 32) * r.D)
        assert r.config.schedule.warmup_steps == round(0.2 * r.steps)
        assert r.command == ["jaxinfra", "train", f"{tmp_path}/out/{r.name}/config.yaml", "--run-dir",
                             f"{tmp_path}/out/{r.name}"]


def test_isoflop_expansion_and_lr_rule(tmp_path):
    path = _spec(tmp_path, grid=None, isoflop={"compute": [3e9, 1e10], "min_steps": 5},
                 lr={"base": 1e-3, "reference_d_model": 64, "width_exponent": 1.0},
                 sizes={"rule": {"aspect_ratio": 32, "head_dim": 16}, "depths": [1, 2, 4]})
    plan = expand(load_spec(path), tmp_path / "out")
    for r in plan.runs:
        assert r.C == pytest.approx(r.budget, rel=0.5 * r.flops_per_token * 256 / r.budget + 1e-9)
        assert r.C_budget == r.budget
        assert r.lr == pytest.approx(1e-3 * 64 / r.config.model.d_model)
        assert r.steps >= 5
    assert plan.dropped and all("min_steps=5" in line for line in plan.dropped)
    assert len(plan.runs) + len(plan.dropped) == 6


def test_explicit_sizes_and_targets(tmp_path):
    models = [{"name": "a", "d_model": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64, "lr": 0.01},
              {"d_model": 64, "num_layers": 2, "num_heads": 4, "mlp_dim": 128}]
    plan = expand(load_spec(_spec(tmp_path, sizes={"models": models})), tmp_path / "out")
    assert [r.size for r in plan.runs[:2]] == ["a", "L2-d64"]
    assert plan.runs[0].lr == 0.01 and plan.runs[0].config.model.mlp_dim == 64
    spec = load_spec(_spec(tmp_path, sizes={"rule": {"head_dim": 16}, "params": [2e4, 2e5]}))
    got = [param_counts(load_config("tiny", [f"model.{k}={v}" for k, v in s.model.items()]).model)["non_embedding"]
           for s in spec.sizes]
    assert 0.5 < got[0] / 2e4 < 2 and 0.5 < got[1] / 2e5 < 2


@pytest.mark.parametrize("change, needle", [
    ({"grid": {"tokenz": [1]}}, "'grid.tokenz'"),
    ({"isoflop": {"compute": [1e9]}}, "exactly one of 'grid'"),
    ({"grid": None}, "exactly one of 'grid'"),
    ({"grid": {"tokens": [1e4, 1e4]}}, "grid.tokens: values must be unique"),
    ({"sizes": {"depths": [1], "params": [1e5]}}, "exactly one"),
    ({"sizes": {"rule": {"head_dim": 15}, "depths": [1]}}, "sizes.rule.head_dim=15"),
    ({"sizes": {"models": [{"d_model": 32, "num_layers": 1, "num_headz": 2}]}}, "sizes.models[0].num_headz"),
    ({"lr": {"base": -1}}, "lr.base=-1"),
    ({"schedule": {"warmup_fraction": 2}}, "schedule.warmup_fraction=2"),
    ({"overrides": ["model.num_layerz=2"]}, "base config: unknown key 'model.num_layerz'"),
    ({"base": "no-such-preset"}, "base: unknown preset"),
    ({"launcher": {"slurm": {"partitionn": "x"}}}, "launcher.slurm.partitionn"),
    ({"colour": "red"}, "unknown key 'colour'; allowed: base, sizes, grid, isoflop"),
    ({"isoflops": {"compute": [1e9]}}, "(did you mean 'isoflop'?)"),
])
def test_bad_specs_name_the_key(tmp_path, change, needle):
    with pytest.raises(ConfigError) as e:
        load_spec(_spec(tmp_path, **change))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sweep_cli_bad_spec_exits_2(tmp_path, capsys):
    assert cli.main(["sweep", str(_spec(tmp_path, grid={"tokenz": [1]})), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfra: error: sweep spec") and "grid.tokenz" in err[0]
    assert cli.main(["sweep", str(tmp_path / "missing.yaml")]) == 2


def test_dry_run_prints_the_table_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["sweep", str(_spec(tmp_path)), "--dry-run", "--out", str(out), "train.batch_size=4"]) == 0
    text = capsys.readouterr().out
    header = text.splitlines()[0].split()
    assert header[:7] == ["run", "N", "N_nonemb", "D", "C", "steps", "batch"]
    assert "L2-d64-D5e3" in text and "4 runs (grid)" in text
    assert re.search(r"^L1-d32-D3e3\s+\S+\s+\S+\s+\S+\s+\S+\s+\d+\s+4\s", text, re.M)  # the override applies
    assert not out.exists()


# ---------------------------------------------------------------- launcher files (acceptance 4)


def _bash_case_commands(script: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+)\) CMD=\((.*)\) ;;$", script, re.M)}


@pytest.mark.parametrize("launcher", ["slurm", "k8s"])
def test_cluster_files_name_every_run_once(tmp_path, launcher, capsys):
    out = tmp_path / "out"
    spec = _spec(tmp_path, isoflop={"compute": [3e9, 1e10]}, grid=None,
                 sizes={"rule": {"head_dim": 16}, "depths": [1, 2, 3]})
    assert cli.main(["sweep", str(spec), "--launcher", launcher, "--out", str(out)]) == 0
    plan = expand(load_spec(spec), out)
    if launcher == "slurm":
        path = out / "sweep.sbatch"
        script = path.read_text()
        assert f"#SBATCH --array=0-{len(plan.runs) - 1}\n" in script
        assert script.startswith("#!/bin/bash")
    else:
        path = out / "sweep-job.yaml"
        job = yaml.safe_load(path.read_text())
        assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == len(plan.runs)
        script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
        assert "$JOB_COMPLETION_INDEX" in script
    commands = _bash_case_commands(script)
    assert sorted(commands) == list(range(len(plan.runs)))
    text = path.read_text()
    for i, run in enumerate(plan.runs):
        exact = shlex.join(run.command)
        assert exact.startswith(f"jaxinfra train {run.run_dir}/config.yaml --run-dir {run.run_dir}")
        assert commands[i] == exact
        assert text.count(exact) == 1
        assert sum(1 for line in text.splitlines() if f"/{run.name}/" in line) == 1
        # the config is written first, and reproduces the planned run exactly
        assert load_config(str(run.config_path)) == run.config
    assert (out / "plan.jsonl").is_file()
    # the script's own logic: bash picks the command by index, skips completed runs
    last = plan.runs[-1]
    (last.run_dir / "summary.json").write_text("{}")
    env_var = "SLURM_ARRAY_TASK_ID" if launcher == "slurm" else "JOB_COMPLETION_INDEX"
    body = script[script.index("case"):]
    done = subprocess.run(["bash", "-c", body], env={env_var: str(len(plan.runs) - 1), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert done.returncode == 0 and "skipping" in done.stdout
    bad = subprocess.run(["bash", "-c", body], env={env_var: "99", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert bad.returncode == 1


# ---------------------------------------------------------------- the local runner


def test_local_runner_runs_the_exact_command(tmp_path, monkeypatch):
    """Child processes get `python -m jaxinfra train <dir>/config.yaml --run-dir <dir>`."""
    plan = expand(load_spec(_spec(tmp_path)), tmp_path / "out")
    runner.prepare(plan)
    calls = []

    def fake_run(argv, **_):
        calls.append(argv)
        pathlib.Path(argv[-1], "summary.json").write_text("{}")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    (plan.runs[0].run_dir / "summary.json").write_text("{}")
    (plan.runs[1].run_dir / "metrics.jsonl").write_text('{"step": 3}\n')  # an interrupted run
    status = runner.run_local(plan, echo=lambda _: None)
    assert status == {plan.runs[0].name: "skipped", **{r.name: "done" for r in plan.runs[1:]}}
    assert calls == [[sys.executable, "-m", "jaxinfra", *r.command[1:]] for r in plan.runs[1:]]
    assert (plan.runs[1].run_dir / "metrics.interrupted-1.jsonl").is_file()


def test_sweep_end_to_end(tmp_path):
    """2 sizes x 2 budgets trained in-process on 1 device; re-running skips completed runs and
    re-runs an interrupted one."""
    spec = _spec(tmp_path)
    out = tmp_path / "out"
    devices = jax.devices()[:1]
    start = time.perf_counter()
    result = sweep(spec, out=out, in_process=True, devices=devices, bootstrap=5, echo=print)
    assert set(result["status"].values()) == {"done"}, result["status"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 4
    assert list(rows[0])[:8] == ["run", "N", "N_nonemb", "D", "C", "eval_loss", "tokens_per_s", "wall_s"]
    plan = result["plan"]
    for row, run in zip(rows, plan.runs):
        assert row["run"] == run.name and int(row["N"]) == run.N and int(row["D"]) == run.D
        assert float(row["C"]) == pytest.approx(run.C)
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert float(row["eval_loss"]) == pytest.approx(summary["final_eval_loss"])
        assert summary["steps"] == run.steps
    jsonl = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["run"] for r in jsonl] == [r["run"] for r in rows]
    fit = json.loads((out / "fit.json").read_text())
    assert any("approach 3 skipped" in note for note in fit["notes"])  # 4 runs < 5 parameters
    first = time.perf_counter() - start

    again = sweep(spec, out=out, in_process=True, devices=devices, fit=False, echo=lambda _: None)
    assert set(again["status"].values()) == {"skipped"}
    interrupted = plan.runs[2]
    (interrupted.run_dir / "summary.json").unlink()
    third = sweep(spec, out=out, in_process=True, devices=devices, fit=False, echo=lambda _: None)
    assert third["status"][interrupted.name] == "done"
    assert [v for k, v in third["status"].items() if k != interrupted.name] == ["skipped"] * 3
    print(f"\nend-to-end sweep of 4 runs: {first:.1f}s")


@pytest.mark.slow
def test_example_cpu_sweep(tmp_path):
    """Acceptance 3: the example 3 sizes x 2 budgets sweep on the default data, by the CLI (child
    processes, 1 device each): results, a fit, three plots, and a re-run that skips every run."""
    import os

    spec = REPO_ROOT / "examples" / "sweeps" / "cpu-isoflop.yaml"
    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "jaxinfra", "sweep", str(spec), "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert wall < 600
    assert len((out / "results.csv").read_text().splitlines()) == 7
    fit = json.loads((out / "fit.json").read_text())
    assert "approach3" in fit and "frontier" in fit
    assert {p.name for p in (out / "plots").iterdir()} == {"isoflop.png", "frontier.png",
                                                          "predicted_vs_observed.png"}
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 0 and "6 of 6 runs complete, skipping them" in again.stdout
