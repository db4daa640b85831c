"""Numeric command-line flags with a declared range: the CLI's side of sharding/ranges.py.

Every `type=int` / `type=float` flag of every subcommand is added with `number_flag(parser, "--x", lo=...)`,
so a value outside its range is refused while the command line is parsed, before any work, in the one line
the config uses: `jaxinfra: error: plan: --devices=0 is invalid: must be >= 1` (exit 2; the CLI's main turns
the ConfigError into it). The flag converts its own text too, so `--top-k x` is the same one line ("must be an
integer >= 0"), not argparse's usage block.
tests/test_config_ranges.py fails on a numeric flag added without one.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from jaxinfra.config import ConfigError
from sharding.ranges import Range

INT64 = (-(2**63), 2**63 - 1)  # seeds: any integer a 64-bit seed holds


class _InRange(argparse.Action):
    """Stores the converted value after checking it against `allowed`; a ConfigError otherwise.

    A ConfigError (not argparse's error(), which prints the usage block and exits) so the message is one
    line and `cli.main` returns 2 like every other bad input."""

    def __init__(self, option_strings: list[str], dest: str, kind: type, allowed: Range, sep: str = "=",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.kind, self.allowed, self.sep = kind, allowed, sep

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            value = self.kind(values)
        except ValueError:
            value = values  # refused below, with what the flag takes
        if isinstance(value, str) or not self.allowed.holds(value):
            self._refuse(parser.prog, option_string, value)
        setattr(namespace, self.dest, value)

    def _refuse(self, prog: str, option_string: str | None, value: Any) -> NoReturn:
        command = prog.removeprefix("jaxinfra").strip()
        where = f"{command}: " if command else ""
        what = ("an integer " if self.kind is int else "a number ") if isinstance(value, str) else ""
        shown = repr(value) if isinstance(value, str) else value
        allowed = what + self.allowed.describe()
        raise ConfigError(f"{where}{option_string}{self.sep}{shown} is invalid: must be {allowed}")


def number_flag(parser: argparse.ArgumentParser, *names: str, kind: type = int, lo: float | None = None,
                hi: float | None = None, lo_open: bool = False, hi_open: bool = False, note: str = "",
                sep: str = "=", **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(*names, type=kind, **kwargs)` whose value must lie in the range (lo, hi, open
    ends as sharding/ranges.py Range; `note` says what a special value means, e.g. "0: off"). `sep` joins
    flag and value in the message: " " where the command's own messages already write `--steps 0`."""
    allowed = Range(lo, hi, lo_open, hi_open, note=note)
    # No type=: the action converts, so a word where a number belongs is refused in the same one line.
    return parser.add_argument(*names, action=_InRange, kind=kind, allowed=allowed, sep=sep, **kwargs)
