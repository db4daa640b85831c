"""The guide stays true: `scripts/build_guide.py --check` re-runs the fast blocks, and the builder's
own pieces (block parsing, output rewriting, shape comparison, the prose checks) work."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "build_guide.py"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_guide", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_guide"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules["build_guide"]


def test_guide_check_passes():
    """The `check` blocks of every page still print outputs of the same shape, and every page's
    code references and quoted numbers hold (the full build: `python scripts/build_guide.py`)."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "problem(s)" in out.stdout


PAGE = """# A page

<!-- guide: devices=2 -->

Prose that quotes 2.50 MiB from the output, and 1,024 bytes.

```bash run check timeout=30 env=GREETING=hi
echo "$GREETING: $(python -c 'import os; print(os.environ["XLA_FLAGS"].split()[-1])')"
printf 'a  b\\n2.50  1024\\n'
printf '10%%|#  |\\r100%%|###|\\n' >&2
```

```bash
not run
```
"""


def test_a_block_runs_with_its_attributes_and_its_output_is_written(builder, tmp_path, monkeypatch):
    page = tmp_path / "01-a.md"
    page.write_text(PAGE)
    monkeypatch.setattr(builder, "REPO", tmp_path)
    (block,) = builder.parse_page(page)
    assert block.flag("check") and block.value("devices", "") == "2" and block.out_start is None
    output, _ = builder.run_block(block)
    assert output.splitlines() == ["hi: --xla_force_host_platform_device_count=2", "a  b", "2.50  1024",
                                   "100%|###|"]  # stderr too, a progress bar's redraws reduced to the last
    builder.write_output(page, 0, output)
    (block,) = builder.parse_page(page)
    assert block.output == output and "```text" in page.read_text()
    assert builder.number_problems(page) == []  # 2.50 and 1,024 are printed by the block
    builder.write_output(page, 0, "new\noutput")  # a second write replaces, never appends
    assert page.read_text().count("```text") == 1 and builder.parse_page(page)[0].output == "new\noutput"


def test_a_failing_block_names_itself(builder, tmp_path, monkeypatch):
    page = tmp_path / "02-b.md"
    page.write_text("```bash run\necho partial; exit 3\n```\n")
    monkeypatch.setattr(builder, "REPO", tmp_path)
    with pytest.raises(SystemExit, match=r"02-b.md:1: exit status 3\npartial"):
        builder.run_block(builder.parse_page(page)[0])


def test_shape_ignores_numbers_and_widths_but_not_structure(builder):
    old = "op        bytes   time us\nall_reduce  1,024     362.8\nstep 10: loss 4.21"
    assert builder.shape_diff(old, "op  bytes  time us\nall_reduce  4,096  12.0\nstep 20: loss 3.1e-2") is None
    assert builder.shape_diff(old, old + "\nextra line") is not None
    assert builder.shape_diff(old, old.replace("time us", "time us  busbw")) is not None


def test_cleaning_keeps_the_last_progress_redraw_and_drops_colours(builder):
    raw = f"\x1b[1mstart\x1b[0m\n 10%|#    |\r 50%|###  |\r100%|#####|  \n{builder.REPO}/runs/x\n\n"
    assert builder.clean(raw) == "start\n100%|#####|\n./runs/x"


def test_prose_checks_catch_unbacked_numbers_and_dead_references(builder, tmp_path):
    page = tmp_path / "03-c.md"
    page.write_text("It took 3.7 s and 40% less (`jaxinfra/info.py: no_such_function`).\n\n"
                    "The GPU did 203 TFLOP/s (benchmarks/RESULTS.md).\n\n[gone](missing.md)\n")
    numbers = builder.number_problems(page)
    assert len(numbers) == 2 and "'3.7'" in numbers[0] and "'40'" in numbers[1]
    refs = builder.reference_problems(page)
    assert any("no def/class no_such_function" in p for p in refs) and any("missing.md" in p for p in refs)



def test_an_outside_source_backs_the_numbers_of_its_paragraph_or_table_row_only(builder, tmp_path):
    page = tmp_path / "04-d.md"
    page.write_text("An H100 SXM has 3.35 TB/s of HBM3 ([data sheet](https://www.nvidia.com/h100)).\n\n"
                    "| part | HBM | source |\n|---|---|---|\n"
                    "| H200 | 4.8 TB/s | [data sheet](https://www.nvidia.com/h200) |\n"
                    "| B200 | 8.0 TB/s | ours |\n")
    problems = builder.number_problems(page)
    assert len(problems) == 1 and "'8.0'" in problems[0]  # the unsourced row only; the linked ones pass
