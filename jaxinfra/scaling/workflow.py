"""What the `jaxinfra sweep` and `jaxinfra scaling ...` commands do, as plain functions.

    sweep(spec_path, launcher="local", out=None, dry_run=False)  # plan, write configs, run / write job files
    sweep(spec_path, launcher="slurm", submit=True, wait=True)   # sbatch, follow, retry, collect + fit
    sweep_status(spec_path, out=None)                            # one line per run of a submitted sweep
    collect_results(out_dir)                                     # results.csv + results.jsonl
    fit_results(results_path, plot_dir=None, out=None)           # fit.json (+ PNGs)
    fit_results(results_path, metric="eval/arc_easy/acc", higher_is_better=True)   # a task metric's error
    predict_from_file(fit_path, compute)                         # N_opt, D_opt, loss at C
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from jaxinfra.atomic import atomic_write_bytes, atomic_write_text
from jaxinfra.cluster import slurm
from jaxinfra.cluster.attempts import RunStatus, format_status
from jaxinfra.config import ConfigError, require_file
from jaxinfra.scaling import fit as fitting
from jaxinfra.scaling.results import collect, read_table, write_results
from jaxinfra.scaling.runner import (
    LAUNCHERS,
    jobset_manifests,
    prepare,
    run_local,
    set_aside_partial_metrics,
    write_jobsets,
    write_k8s,
    write_slurm,
)
from jaxinfra.scaling.spec import FitSpec, Plan, expand, format_plan, load_spec
from jaxinfra.storage import as_path, is_url

Echo = Callable[[str], None]


def sweep(spec_path: str | pathlib.Path, *, launcher: str = "local", out: str | pathlib.Path | None = None,
          dry_run: bool = False, overrides: list[str] | None = None, fit: bool = True, bootstrap: int = 100,
          in_process: bool = False, devices: Sequence[Any] | None = None, submit: bool = False,
          wait: bool = False, poll_s: float = 10.0, echo: Echo = print) -> dict[str, Any]:
    """Expand a spec and run it (local), write its job files (slurm, k8s, jobset), or submit them (slurm).

    local: runs the unfinished runs one after another, then writes out/results.{csv,jsonl}
    and, with `fit`, out/fit.json and out/plots/*.png. Returns {"plan", "status",
    "results", "fit", "files"}; "status" maps run -> skipped | done | failed.
    slurm with `submit`: sbatch's the unfinished runs that no job is running or queued for;
    with `wait` also follows them (retrying 75 / 70 / lost, launcher.retries times), then
    collects and fits as local does; "status" maps run -> done | failed.
    """
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r} is not allowed; choose one of {list(LAUNCHERS)}")
    if (submit or wait) and launcher != "slurm":
        raise ConfigError(f"--submit/--wait need --launcher slurm (got --launcher {launcher})")
    if wait and not submit:
        raise ConfigError("--wait follows what --submit sends: give both (--submit skips runs already queued)")
    if submit:
        slurm.require("sbatch")  # before anything is written
    plan = expand(load_spec(spec_path, overrides), out)
    echo(format_plan(plan))
    result: dict[str, Any] = {"plan": plan, "status": {}, "files": []}
    if dry_run:
        return result
    jobsets = jobset_manifests(plan) if launcher == "jobset" else None  # a bad setting fails before any write
    for warning in prepare(plan):
        echo(f"sweep: warning: {warning}")
    if launcher == "slurm":
        result["files"].append(write_slurm(plan))
        if submit:
            result["status"] = _submit_slurm(plan, result["files"][0], wait, poll_s, echo)
            if not wait:
                return result
    elif launcher == "k8s":
        result["files"].append(write_k8s(plan))
    elif launcher == "jobset":
        result["files"] += write_jobsets(plan, jobsets)
    if launcher != "local" and not wait:
        echo(f"sweep: wrote {result['files'][0]} ({len(plan.runs)} runs); after the jobs finish: "
             f"jaxinfra scaling collect {plan.out}")
        return result
    if launcher == "local":
        result["status"] = run_local(plan, in_process=in_process, devices=devices, echo=echo)
    _collect_and_fit(plan, result, fit, bootstrap, echo)
    return result


def _collect_and_fit(plan: Plan, result: dict[str, Any], fit: bool, bootstrap: int, echo: Echo) -> None:
    on: FitSpec = plan.spec.fit  # the spec's `fit:` (default: the final eval loss)
    rows, csv_path = collect_results(plan.out, metrics=[on.metric] if on.metric else (), echo=echo)
    result["results"] = csv_path
    if fit and rows:
        fit_path = plan.out / "fit.json"
        result["fit"] = fit_results(csv_path, plot_dir=plan.out / "plots", out=fit_path, bootstrap=bootstrap,
                                    metric=on.metric, higher_is_better=on.higher_is_better, echo=echo)
    failed = [k for k, v in result["status"].items() if v == "failed"]
    if failed:
        echo(f"sweep: {len(failed)} run(s) failed: {', '.join(failed)}")


def _runs(plan: Plan) -> list[tuple[str, pathlib.Path]]:
    return [(r.name, r.run_dir) for r in plan.runs]


def _submit_slurm(plan: Plan, script: pathlib.Path, wait: bool, poll_s: float, echo: Echo) -> dict[str, str]:
    """sbatch the runs that are neither finished nor queued/running; with `wait`, follow them all.
    Returns run -> done | failed after `wait`, run -> submitted | <state> without."""
    by_name = {r.name: r for r in plan.runs}
    retries = plan.spec.launcher.retries
    now = slurm.statuses(_runs(plan), plan.out, retries)
    todo = [s.run for s in now if s.state in ("not submitted", "failed", "retrying", "cancelled")]
    if todo:
        for name in todo:
            set_aside_partial_metrics(by_name[name])
        index = {r.name: i for i, r in enumerate(plan.runs)}
        job = slurm.submit(plan.out, script, [index[n] for n in todo], todo, plan.spec.launcher.slurm.max_parallel)
        echo(f"sweep: submitted {len(todo)} run(s) as job array {job}: {script}")
    busy = [s.run for s in now if s.state in ("pending", "running", "unknown")]
    if busy:
        echo(f"sweep: already queued or running, not resubmitted: {', '.join(busy)}")
    if not wait:
        echo(f"sweep: follow with `jaxinfra sweep SPEC --status --out {plan.out}`, or wait with --submit --wait")
        return {s.run: "submitted" if s.run in todo else s.state for s in now}
    final = slurm.follow(_runs(plan), plan.out, script, retries, plan.spec.launcher.slurm.max_parallel,
                         poll_s=poll_s, echo=echo, before_retry=lambda name: set_aside_partial_metrics(by_name[name]))
    echo(format_status(final))
    return {s.run: "done" if s.state == "done" else "failed" for s in final}


def sweep_status(spec_path: str | pathlib.Path, *, out: str | pathlib.Path | None = None,
                 overrides: list[str] | None = None, echo: Echo = print) -> list[RunStatus]:
    """One line per run of a submitted sweep (state, last exit status, attempts, job id), from
    the records in its out dir and the queue: works from any process, at any time."""
    plan = expand(load_spec(spec_path, overrides), out)
    now = slurm.statuses(_runs(plan), plan.out, plan.spec.launcher.retries)
    echo(format_status(now))
    return now


def collect_results(out_dir: str | pathlib.Path, metrics: Sequence[str] = (),
                    echo: Echo = print) -> tuple[list[dict[str, Any]], pathlib.Path]:
    """Rebuild out_dir/results.csv and results.jsonl from the run directories (with each run's last task
    metrics and `metrics` from its metrics.jsonl)."""
    rows, missing = collect(out_dir, metrics)
    csv_path, jsonl_path = write_results(rows, out_dir)
    echo(f"results: {len(rows)} finished runs -> {csv_path}, {jsonl_path}"
         + (f"; not finished: {', '.join(missing)}" if missing else ""))
    return rows, csv_path


def fit_results(results: str | pathlib.Path, *, plot_dir: str | pathlib.Path | None = None,
                out: str | pathlib.Path | None = None, bootstrap: int = 100, seed: int = 0, n_column: str = "N",
                metric: str | None = None, higher_is_better: bool = False, echo: Echo = print) -> dict[str, Any]:
    """Fit a results table (approaches 3, 2 and the frontier), print it, save it as JSON. The fitted
    quantity is the final eval loss, or `metric` (a column, e.g. `eval/<task>/<metric>`); with
    `higher_is_better` (an accuracy in [0, 1]) its error 1 - metric, which falls with N and D as a loss does."""
    table, notes = read_table(results, metric or "eval_loss")
    if n_column not in table:
        raise ConfigError(f"{results}: no column {n_column!r} for --n-column (found: {', '.join(table)})")
    table, target, dropped = _fit_target(table, metric or "eval_loss", higher_is_better, results)
    fit = fitting.fit_all(table, bootstrap=bootstrap, seed=seed, n_column=n_column, target=target)
    fit.update(metric=metric or "eval_loss", higher_is_better=higher_is_better)
    fit["notes"] = notes + dropped + fit["notes"]
    fit["source"] = str(results)
    out = as_path(out) if out else as_path(results).with_name("fit.json")
    atomic_write_text(out, json.dumps(fit, indent=2) + "\n", replace=True)  # a refit replaces the fit
    echo(format_fit(fit))
    echo(f"fit: saved {out}")
    if plot_dir is not None:
        for path in _plot_all(table, fit, plot_dir):
            echo(f"fit: plot {path}")
    return fit


def _fit_target(table: dict[str, Any], metric: str, higher_is_better: bool,
                results: str | pathlib.Path) -> tuple[dict[str, Any], str, list[str]]:
    """(table with the fitted column, its name, notes): `metric` itself, or `1 - metric` when higher is
    better; rows where it is not positive (a power law's loss must be) are dropped with a note."""
    values, target = table[metric], metric
    if higher_is_better:
        if not ((values >= 0) & (values <= 1)).all():
            raise ConfigError(f"{results}: --higher-is-better fits the error 1 - {metric}, which needs scores in "
                              f"[0, 1]; found {float(values.min()):.4g} .. {float(values.max()):.4g}")
        values, target = 1.0 - values, f"1 - {metric}"
    ok = values > 0
    table = {k: v[ok] for k, v in {**table, target: values}.items()}
    bad = int((~ok).sum())
    notes = [f"dropped {bad} row(s) whose {target} is not positive"] if bad else []
    if not ok.any():
        raise ConfigError(f"{results}: no row has a positive {target} to fit")
    return table, target, notes


def _plot_all(table: dict[str, Any], fit: dict[str, Any], plot_dir: str | pathlib.Path) -> list[Any]:
    """plots.plot_all; for a gs:// / s3:// plot_dir drawn in a local temporary directory, then uploaded."""
    from jaxinfra.scaling.plots import plot_all

    if not is_url(plot_dir):
        return plot_all(table, fit, plot_dir)
    import tempfile

    remote = as_path(plot_dir)
    remote.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        drawn = plot_all(table, fit, tmp)
        for path in drawn:
            atomic_write_bytes(remote / path.name, path.read_bytes(), replace=True)
    return [remote / path.name for path in drawn]


def format_fit(fit: dict[str, Any]) -> str:
    """The fitted parameters with their intervals, as printed by `jaxinfra scaling fit`."""
    target = fit.get("target", "eval_loss")
    lines = [f"{fit['n_points']} runs (N = column {fit['n_column']}"
             + (f"; fitted as the loss: {target})" if target != "eval_loss" else ")")]
    p = fit.get("approach3")
    if p:
        lines.append(f"approach 3 (Hoffmann et al. 2022): L(N, D) = E + A/N^alpha + B/D^beta, Huber "
                     f"delta={p['huber_delta']:g} on log L, {p['n_bootstrap']} bootstrap resamples (95% CI)")
        for k in fitting.PARAM_NAMES:
            ci = p["ci"].get(k)
            lines.append(f"  {k:<6}{p[k]:>12.5g}" + (f"   [{ci[0]:.5g}, {ci[1]:.5g}]" if ci else ""))
        lines.append(f"  N_opt ∝ C^{p['a']:.4f}, D_opt ∝ C^{p['b']:.4f} (C = 6 N D)")
    p = fit.get("approach2")
    if p:
        def ci(c: list[float] | None) -> str:
            return f" [{c[0]:.4f}, {c[1]:.4f}]" if c else ""

        lines.append(f"approach 2 (IsoFLOP profiles, {len(p['profiles'])} budgets): N_opt = {p['k_N']:.4g} "
                     f"C^{p['a']:.4f}{ci(p['a_ci'])}, D_opt = {p['k_D']:.4g} C^{p['b']:.4f}{ci(p['b_ci'])}")
        for prof in p["profiles"]:
            lines.append(f"  C={prof['compute']:.4g}: N_opt={prof['n_opt']:.4g}, D_opt={prof['d_opt']:.4g}, "
                         f"loss={prof['loss_opt']:.4f}")
        if p["skipped"]:  # one line however many budgets the sweep has
            lines.append(f"  skipped {len(p['skipped'])} of {len(p['skipped']) + len(p['profiles'])} budgets: "
                         f"{fitting.first_few(p['skipped'])}")
    p = fit.get("frontier")
    if p:
        ci = f" [{p['gamma_ci'][0]:.4f}, {p['gamma_ci'][1]:.4f}]" if p["gamma_ci"] else ""
        lines.append(f"frontier: L(C) = {p['k']:.4g} C^-{p['gamma']:.4f}{ci} over {len(p['points'])} runs")
    lines += [f"note: {n}" for n in fit.get("notes", [])]
    return "\n".join(lines)


def predict_from_file(fit_path: str | pathlib.Path, compute: float, echo: Echo = print) -> dict[str, Any]:
    """N_opt, D_opt and the predicted loss at compute C from a saved fit.json."""
    path = as_path(fit_path)
    require_file(path, "fit file", str(fit_path))
    try:
        fit = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{fit_path}: not a JSON fit (write one with jaxinfra scaling fit)") from None
    if not compute > 0:
        raise ConfigError(f"--compute must be a positive number of FLOPs, got {compute}")
    try:
        pred = fitting.predict(fit, compute)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{fit_path}: {e}") from None
    lines = [f"compute C = {compute:.4g} FLOPs"]
    if "approach3" in pred:
        p = pred["approach3"]
        lines.append(f"approach 3 (C = 6 N D): N_opt = {p['N_opt']:.4g}, D_opt = {p['D_opt']:.4g} "
                     f"({p['tokens_per_param']:.1f} tokens/param), loss = {p['loss']:.4f}")
    if "approach2" in pred:
        p = pred["approach2"]
        lines.append(f"approach 2 (C as in the table): N_opt = {p['N_opt']:.4g}, D_opt = {p['D_opt']:.4g} "
                     f"({p['tokens_per_param']:.1f} tokens/param)")
    if "frontier" in pred:
        lines.append(f"frontier: loss = {pred['frontier']['loss']:.4f}")
    echo("\n".join(lines))
    return pred
