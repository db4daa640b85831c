"""Run the guide's commands and write their real output into the pages (docs/guide/*.md).

    python scripts/build_guide.py               # every runnable block of every page: run, rewrite outputs
    python scripts/build_guide.py --page 4      # one page (repeat --page for more)
    python scripts/build_guide.py --check       # re-run the blocks marked `check`; fail when an output's
                                                # shape changed (numbers are not compared); writes nothing
    python scripts/build_guide.py --list        # the runnable blocks, with their attributes
    python scripts/build_guide.py --page 15 --match num_layerz   # only the blocks whose command contains this

A runnable block is a fenced block whose info string starts with `bash run`, followed by a
fenced `text` block holding its output (inserted when missing):

    ```bash run devices=8 check timeout=120 figure=docs/guide/figures/x.png
    jaxinfra info tiny mesh.fsdp=8
    ```

    ```text
    (rewritten by this script)
    ```

Attributes: `devices=N` runs the command with N fake CPU devices (XLA_FLAGS for the child
process; a reader exports the same variable, as each page says), `check` puts the block in
the `--check` subset (keep those fast: seconds), `timeout=S` (default 600), `figure=PATH`
(comma-separated) names files the command must write, `env=NAME=VALUE` (repeatable) sets a
variable. A page may set defaults for all its blocks with a comment line
`<!-- guide: devices=8 -->`. Commands run with `bash -e` in the repository root, stdout and
stderr together; a block that fails (non-zero status) fails the build. To show a failure, write
it the way a reader would check one: `jaxinfra train ... || echo "exit status $?"`.

Outputs are cleaned before they are written: ANSI colours dropped, carriage-return progress
redraws reduced to their last state, trailing spaces stripped, the repository's absolute path
written as `.` and the home directory as `~`.

`--check` also checks, without running anything, that every page's code references resolve
(markdown links to files; `path.py: name` mentions name a def or class in that file) and that
every measured-looking number in a page's prose (a decimal, a number with thousands separators,
or one followed by a unit such as MiB, GB/s, ms or %) either appears in an output block of the
same page or sits in a paragraph that cites benchmarks/RESULTS.md or links an outside source
(`[NVIDIA H100 data sheet](https://...)`). In a table each row is judged alone: a row of
data-sheet figures links its source in a cell of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide"
FENCE = re.compile(r"^(`{3,})(.*)$")
DEFAULTS = re.compile(r"^<!--\s*guide:(.*?)-->\s*$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    start: int  # line index of the opening fence of the command
    end: int  # line index of its closing fence
    command: str
    attrs: dict[str, list[str]]
    out_start: int | None  # opening fence of the output block, if present
    out_end: int | None
    output: str  # the output currently in the page

    @property
    def label(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.start + 1}"

    def flag(self, name: str) -> bool:
        return name in self.attrs

    def value(self, name: str, default: str) -> str:
        return self.attrs.get(name, [default])[-1]


def parse_attrs(text: str) -> dict[str, list[str]]:
    attrs: dict[str, list[str]] = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        attrs.setdefault(key, []).append(value)
    return attrs


def _fences(lines: list[str]) -> list[tuple[int, int, str]]:
    """(open index, close index, info string) of every fenced block."""
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != ticks:
            j += 1
        if j == len(lines):
            raise SystemExit(f"build_guide: unclosed code fence at line {i + 1}")
        out.append((i, j, info))
        i = j + 1
    return out


def parse_page(page: pathlib.Path) -> list[Block]:
    lines = page.read_text().splitlines()
    defaults: dict[str, list[str]] = {}
    for line in lines:
        m = DEFAULTS.match(line)
        if m:
            defaults.update(parse_attrs(m.group(1)))
    fences = _fences(lines)
    blocks = []
    for k, (i, j, info) in enumerate(fences):
        words = info.split(None, 2)
        if words[:2] != ["bash", "run"]:
            continue
        attrs = {**defaults, **parse_attrs(words[2] if len(words) > 2 else "")}
        nxt = fences[k + 1] if k + 1 < len(fences) else None
        between = lines[j + 1:nxt[0]] if nxt else []
        has_out = nxt is not None and nxt[2] == "text" and not any(s.strip() for s in between)
        out = "\n".join(lines[nxt[0] + 1:nxt[1]]) if has_out else ""
        blocks.append(Block(page, i, j, "\n".join(lines[i + 1:j]), attrs, nxt[0] if has_out else None,
                            nxt[1] if has_out else None, out))
    return blocks


def child_env(block: Block) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if block.flag("devices"):
        flags.append(f"--xla_force_host_platform_device_count={block.value('devices', '1')}")
    env["XLA_FLAGS"] = " ".join(flags)
    for pair in block.attrs.get("env", []):
        name, _, value = pair.partition("=")
        env[name] = value
    return env


def clean(text: str) -> str:
    text = ANSI.sub("", text).replace(str(REPO), ".").replace(str(pathlib.Path.home()), "~")
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append((parts[-1] if parts else "").rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def run_block(block: Block) -> tuple[str, float]:
    """(cleaned output, seconds); raises SystemExit naming the block when the command fails."""
    timeout = float(block.value("timeout", "600"))
    figures = [REPO / f for spec in block.attrs.get("figure", []) for f in spec.split(",") if f]
    before = {f: f.stat().st_mtime if f.exists() else None for f in figures}
    t0 = time.monotonic()
    # bytes, not text=True: universal newlines would turn a progress bar's \r redraws into lines
    proc = subprocess.Popen(["bash", "-e", "-c", block.command], cwd=REPO, env=child_env(block),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        raw, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command's own children too (its own process group)
        raw, _ = proc.communicate()
        text = clean(raw.decode("utf-8", "replace"))
        raise SystemExit(f"build_guide: {block.label}: timed out after {timeout:g}s\n{text[-4000:]}") from None
    seconds = time.monotonic() - t0
    output = clean(raw.decode("utf-8", "replace"))
    if proc.returncode != 0:
        raise SystemExit(f"build_guide: {block.label}: exit status {proc.returncode}\n{output[-4000:]}")
    stale = [str(f.relative_to(REPO)) for f in figures if not f.exists() or f.stat().st_mtime == before[f]]
    if stale:
        raise SystemExit(f"build_guide: {block.label}: the command did not write {', '.join(stale)}")
    return output, seconds


def shape(text: str) -> list[str]:
    """An output's structure: every number replaced by N, runs of spaces collapsed."""
    return [" ".join(NUMBER.sub("N", line).split()) for line in text.splitlines() if line.strip()]


def shape_diff(old: str, new: str) -> str | None:
    a, b = shape(old), shape(new)
    if a == b:
        return None
    diff = difflib.unified_diff(a, b, "page output (shape)", "new output (shape)", lineterm="", n=1)
    return "\n".join(list(diff)[:40])


def fence_for(text: str) -> str:
    longest = max((len(m.group(0)) for m in re.finditer(r"`{3,}", text)), default=2)
    return "`" * max(3, longest + 1)


def write_output(page: pathlib.Path, index: int, output: str) -> None:
    """Replace (or insert) the output block after the page's index-th run block."""
    lines = page.read_text().splitlines()
    block = parse_page(page)[index]
    fence = fence_for(output)
    new = [fence + "text", *output.splitlines(), fence]
    if block.out_start is not None:
        lines[block.out_start:block.out_end + 1] = new
    else:
        lines[block.end + 1:block.end + 1] = ["", *new]
    page.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- static checks (no command runs)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"`([\w./-]+\.(?:py|md|yaml|yml|sh|sbatch))(?::\s?([\w.]+))?`")
INLINE_CODE = re.compile(r"`[^`]*`")
# A decimal, a number with thousands separators, or a number with a unit ("3x" and "3×" only unspaced:
# "4 x 2" is a mesh shape, not a ratio).
MEASURED = re.compile(r"(?<![\w.])(\d+\.\d+|\d{1,3}(?:,\d{3})+|\d+(?=(?:\s?(?:MiB|GiB|KiB|MB|GB|KB|TB|ms|µs|us|s|%)"
                      r"|x|×)(?![\w])))")


def prose_paragraphs(lines: list[str]) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph outside fenced blocks."""
    inside, paragraphs, current, first = set(), [], [], 0
    for i, j, _ in _fences(lines):
        inside.update(range(i, j + 1))
    for n, line in enumerate(lines + [""]):
        if n in inside or not line.strip() or line.lstrip().startswith("<!--"):
            if current:
                paragraphs.append((first + 1, "\n".join(current)))
            current = []
            continue
        if not current:
            first = n
        current.append(line.strip())
    return paragraphs


def _defines(path: pathlib.Path, name: str) -> bool:
    text = path.read_text()
    return all(re.search(rf"^\s*(?:def|class|async def)\s+{re.escape(part)}\b|^{re.escape(part)}\s*[:=]", text, re.M)
               for part in name.split("."))


def reference_problems(page: pathlib.Path) -> list[str]:
    text = page.read_text()
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        if not (page.parent / target.split("#")[0]).resolve().exists():
            problems.append(f"{page.name}: link to a missing file: {target}")
    for path, name in CODE_REF.findall(text):
        file = REPO / path
        if "/" not in path and not file.exists():
            continue  # a bare file name (config.yaml) is not a reference to this repository
        if not file.exists():
            problems.append(f"{page.name}: `{path}` does not exist")
        elif name and file.suffix == ".py" and not _defines(file, name):
            problems.append(f"{page.name}: `{path}: {name}`: no def/class {name} in {path}")
    return problems


OUTSIDE_SOURCE = re.compile(r"\]\(https?://")


def cited(text: str) -> bool:
    """Whether a paragraph (or one table row) cites where its numbers come from: benchmarks/RESULTS.md
    or an outside source linked by its address (a data sheet, a paper, a report)."""
    return "RESULTS.md" in text or OUTSIDE_SOURCE.search(text) is not None


def _claims(para: str) -> list[str]:
    """The parts of a paragraph judged one by one: each row of a table, else the whole paragraph."""
    return para.splitlines() if para.startswith("|") else [para]


def number_problems(page: pathlib.Path) -> list[str]:
    """Measured-looking numbers in prose that no output block of the page prints and no citation backs
    (benchmarks/RESULTS.md, or an outside source linked in the same paragraph or table row)."""
    lines = page.read_text().splitlines()
    outputs = "\n".join(b.output for b in parse_page(page))
    problems = []
    for line_no, para in prose_paragraphs(lines):
        for claim in _claims(para):
            if not cited(claim):
                problems += _unbacked(page, line_no, claim, outputs)
    return problems


def _unbacked(page: pathlib.Path, line_no: int, para: str, outputs: str) -> list[str]:
    prose = INLINE_CODE.sub(" ", LINK.sub(lambda m: m.group(0).split("](")[0], " ".join(para.split())))
    return [f"{page.name}:{line_no}: {number!r} is in the prose but in no output on the page (quote an output, "
            "cite benchmarks/RESULTS.md, or link the outside source in the same paragraph or table row)"
            for number in MEASURED.findall(prose) if number not in outputs and number.replace(",", "") not in outputs]


# ---------------------------------------------------------------- main


def pages(numbers: list[int] | None) -> list[pathlib.Path]:
    found = sorted(GUIDE.glob("[0-9][0-9]-*.md"))
    if numbers:
        found = [p for p in found if int(p.name[:2]) in numbers]
        missing = set(numbers) - {int(p.name[:2]) for p in found}
        if missing:
            raise SystemExit(f"build_guide: no page {', '.join(map(str, sorted(missing)))} in {GUIDE}")
    return found


def build(selected: list[pathlib.Path], match: str | None = None) -> None:
    total, timings = time.monotonic(), []
    for page in selected:
        for index, block in enumerate(parse_page(page)):
            if match is not None and match not in block.command:
                continue
            print(f"{block.label}: {block.command.splitlines()[0][:90]}", flush=True)
            output, seconds = run_block(block)
            write_output(page, index, output)
            timings.append((block.label, seconds))
            print(f"    {seconds:.1f}s, {len(output.splitlines())} lines", flush=True)
    print(f"build_guide: {len(timings)} blocks in {time.monotonic() - total:.0f}s")


def check(selected: list[pathlib.Path]) -> int:
    failures = [p for page in selected for p in reference_problems(page) + number_problems(page)]
    t0, ran = time.monotonic(), 0
    for page in selected:
        for block in parse_page(page):
            if not block.flag("check"):
                continue
            if not block.output.strip():
                failures.append(f"{block.label}: no output in the page yet: run scripts/build_guide.py --page "
                                f"{int(page.name[:2])}")
                continue
            output, _ = run_block(block)
            ran += 1
            diff = shape_diff(block.output, output)
            if diff:
                failures.append(f"{block.label}: the output's shape changed (rebuild the page if this is meant):\n"
                                f"{diff}")
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"build_guide --check: {ran} blocks re-run in {time.monotonic() - t0:.0f}s, {len(failures)} problem(s)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, action="append", help="page number (repeatable); default all")
    parser.add_argument("--check", action="store_true", help="re-run the `check` blocks, compare shapes, write nothing")
    parser.add_argument("--list", action="store_true", help="list the runnable blocks")
    parser.add_argument("--match", metavar="TEXT", help="build only the blocks whose command contains TEXT")
    args = parser.parse_args(argv)
    selected = pages(args.page)
    if args.list:
        for page in selected:
            for block in parse_page(page):
                attrs = " ".join(f"{k}={v}" if v else k for k, vs in block.attrs.items() for v in vs)
                print(f"{block.label}  [{attrs}]  {block.command.splitlines()[0][:80]}")
        return 0
    if args.check:
        return check(selected)
    build(selected, args.match)
    return check_static(selected)


def check_static(selected: list[pathlib.Path]) -> int:
    problems = [p for page in selected for p in reference_problems(page) + number_problems(page)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
