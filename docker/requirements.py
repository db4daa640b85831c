"""Prints the pip requirements of the jaxinfra image for one variant, from pyproject.toml alone.

    python docker/requirements.py cpu|cuda|tpu [--extras tokenizers,parquet] [--pyproject PATH]

The pinned `jax==X` of [project].dependencies becomes `jax[cuda12]==X` (the CUDA 12 wheels, no local
CUDA needed) or `jax[tpu]==X` (libtpu); all from PyPI, no other index: jax 0.10.2's `tpu` extra pins
`libtpu==0.0.42.*`, which PyPI serves (the old find-links page on storage.googleapis.com is not needed,
and a build that cannot reach it stalls). Every other pin is kept as written, and the
optional-dependency groups named by --extras are added. The Dockerfile installs this list in
a layer of its own, before the source is copied, so editing the code does not reinstall jax.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib

VARIANTS = {"cpu": "", "cuda": "[cuda12]", "tpu": "[tpu]"}


def requirements(project: dict, variant: str, extras: list[str]) -> list[str]:
    """The requirement lines for `variant`; raises ValueError on an unknown variant, extra or a jax without pin."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    deps = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"extra {extra!r} is not in pyproject's optional-dependencies ({', '.join(optional)})")
        deps += optional[extra]
    jax = [i for i, d in enumerate(deps) if re.match(r"jax\s*==", d)]
    if len(jax) != 1:
        raise ValueError("pyproject.toml must pin jax exactly once (jax==X.Y.Z)")
    deps[jax[0]] = re.sub(r"^jax", f"jax{VARIANTS[variant]}", deps[jax[0]])
    return deps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--extras", default="", help="comma-separated optional-dependency groups")
    p.add_argument("--pyproject", default="pyproject.toml")
    args = p.parse_args(argv)
    with open(args.pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    try:
        lines = requirements(project, args.variant, [e for e in args.extras.split(",") if e])
    except ValueError as e:
        print(f"requirements.py: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
