"""Cluster engines: SLURM job arrays submitted and followed, Kubernetes JobSets, per-run attempt records.

Modules: `slurm` (sbatch/squeue/sacct: submit, follow, retry by exit status), `attempts` (what every
attempt of every run of a sweep ended with, kept in the sweep's out dir so `--status` works from any
process), `jobset` (Kubernetes JobSet manifests for one multi-host run or a sweep).
"""
