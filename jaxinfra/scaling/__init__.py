"""Scaling-law sweeps and fits (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models").

    spec.py      sweep spec YAML -> SweepSpec -> Plan (one RunPlan + Config per run)
    sizes.py     the width/depth rule that generates model sizes
    runner.py    local runs, SLURM job array, Kubernetes Indexed Job
    results.py   run directories -> results.csv / results.jsonl
    fit.py       approach 3 (parametric L(N, D), Huber + L-BFGS, bootstrap), approach 2 (IsoFLOP), L(C)
    plots.py     isoflop.png, frontier.png, predicted_vs_observed.png
    workflow.py  the functions behind `jaxinfra sweep` and `jaxinfra scaling {collect,fit,predict}`
"""
