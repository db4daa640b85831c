"""The `sweep` and `scaling` subcommands (registered by jaxinfra/cli.py's build_parser).

    jaxinfra sweep SPEC [--dry-run] [--launcher local|slurm|k8s|jobset] [--out DIR] [--no-fit] [KEY=VALUE ...]
    jaxinfra sweep SPEC --launcher slurm --submit [--wait]     # sbatch; follow, retry, collect + fit
    jaxinfra sweep SPEC --status [--out DIR]                   # one line per run, from any process
    jaxinfra scaling collect OUT_DIR [--metric NAME ...]
    jaxinfra scaling fit RESULTS [--plot DIR] [--out FIT.json] [--bootstrap N] [--n-column N_nonemb]
                                 [--metric eval/<task>/<metric> [--higher-is-better]]
    jaxinfra scaling predict --fit FIT.json --compute C

KEY=VALUE after `sweep SPEC` are overrides of the spec's base config. Bad input raises
ConfigError, which jaxinfra.cli.main turns into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os

from jaxinfra.config import ConfigError
from jaxinfra.flags import INT64, number_flag
from jaxinfra.scaling.runner import LAUNCHERS


def _no_overrides(args: argparse.Namespace) -> None:
    extra = getattr(args, "overrides", None)
    if extra:
        raise ConfigError(f"unexpected arguments: {' '.join(extra)}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from jaxinfra.scaling.workflow import sweep, sweep_status

    if args.status:
        if args.submit or args.wait or args.dry_run:
            raise ConfigError("--status only reads: give it without --submit, --wait or --dry-run")
        sweep_status(args.spec, out=args.out, overrides=list(args.overrides))
        return 0
    result = sweep(args.spec, launcher=args.launcher, out=args.out, dry_run=args.dry_run,
                   overrides=list(args.overrides), fit=not args.no_fit, bootstrap=args.bootstrap,
                   submit=args.submit, wait=args.wait, poll_s=_poll_s())
    return 1 if "failed" in result["status"].values() else 0


def _poll_s() -> float:
    """Seconds between squeue polls of `--wait` (JAXINFRA_SLURM_POLL_S, default 10)."""
    text = os.environ.get("JAXINFRA_SLURM_POLL_S", "10")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"JAXINFRA_SLURM_POLL_S={text!r} is invalid: must be a positive number of seconds")
    return value


def cmd_collect(args: argparse.Namespace) -> int:
    _no_overrides(args)
    from jaxinfra.scaling.workflow import collect_results

    collect_results(args.out_dir, metrics=args.metric)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    _no_overrides(args)
    from jaxinfra.scaling.workflow import fit_results

    if args.higher_is_better and not args.metric:
        raise ConfigError("--higher-is-better goes with --metric NAME (the final eval loss is lower-is-better)")
    fit_results(args.results, plot_dir=args.plot, out=args.out, bootstrap=args.bootstrap, seed=args.seed,
                n_column=args.n_column, metric=args.metric, higher_is_better=args.higher_is_better)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    _no_overrides(args)
    from jaxinfra.scaling.workflow import predict_from_file

    predict_from_file(args.fit, args.compute)
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `sweep` and `scaling {collect,fit,predict}` to the jaxinfra parser."""
    p = sub.add_parser("sweep", help="expand a scaling-law sweep spec into runs; run them or write job files")
    p.add_argument("spec", help="sweep spec YAML (see examples/sweeps/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the spec's base config")
    p.add_argument("--dry-run", action="store_true", help="print the table of runs and stop")
    p.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: run here one after another; slurm / k8s / jobset: write a job array / an Indexed "
                   "Job / one Kubernetes JobSet per run (launcher.jobset.hosts pods each)")
    p.add_argument("--out", help="sweep directory (default: the spec's `out`, else sweeps/<name>)")
    p.add_argument("--no-fit", action="store_true", help="local: collect results but do not fit or plot")
    p.add_argument("--submit", action="store_true",
                   help="slurm: sbatch the job array (runs not finished and not already queued); record the job ids")
    p.add_argument("--wait", action="store_true",
                   help="with --submit: follow the jobs, resubmit runs that ended 75 / 70 (launcher.retries "
                        "times), then collect and fit; exit 1 if a run failed")
    p.add_argument("--status", action="store_true",
                   help="print one line per run of a submitted sweep (state, exit, attempts, job) and stop")
    number_flag(p, "--bootstrap", lo=0, note="0: no bootstrap", default=100,
                help="bootstrap resamples of the fit (default 100)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("scaling", help="scaling-law fits: collect results, fit, predict")
    ssub = p.add_subparsers(dest="scaling_command", required=True)
    q = ssub.add_parser("collect", help="rebuild OUT_DIR/results.csv and .jsonl from its run directories")
    q.add_argument("out_dir")
    q.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="also collect this metrics.jsonl key's last value (task metrics eval/... always are)")
    q.set_defaults(func=cmd_collect)

    q = ssub.add_parser("fit", help="fit approaches 3 and 2 of Hoffmann et al. 2022 and an L(C) frontier")
    q.add_argument("results", help="CSV or JSONL with at least the columns N, D and eval_loss (C, C_budget optional)")
    q.add_argument("--plot", metavar="DIR", help="write isoflop.png, frontier.png, predicted_vs_observed.png here")
    q.add_argument("--out", metavar="FIT.json", help="where to save the fit (default: fit.json beside RESULTS)")
    number_flag(q, "--bootstrap", lo=0, note="0: no bootstrap", default=100, help="bootstrap resamples (default 100)")
    number_flag(q, "--seed", lo=INT64[0], hi=INT64[1], default=0)
    q.add_argument("--n-column", default="N", help="the parameter-count column (default N; e.g. N_nonemb)")
    q.add_argument("--metric", metavar="NAME", help="fit this column (e.g. eval/<task>/<metric>, collected from "
                   "the runs' metrics.jsonl) in place of eval_loss")
    q.add_argument("--higher-is-better", action="store_true",
                   help="the metric is a score in [0, 1] (accuracy): fit its error 1 - metric")
    q.set_defaults(func=cmd_fit)

    q = ssub.add_parser("predict", help="compute-optimal N, D and loss at a compute budget from a saved fit")
    q.add_argument("--fit", required=True, metavar="FIT.json")
    number_flag(q, "--compute", kind=float, lo=0, lo_open=True, required=True, metavar="C", help="FLOPs, e.g. 5.76e23")
    q.set_defaults(func=cmd_predict)
