"""Numeric command-line flags with a declared range: the CLI's side of sharding/ranges.py.

Every `type=int` / `type=float` flag of every subcommand is added with `number_flag(parser, "--x", lo=...)`,
so a value outside its range is refused while the command line is parsed, before any work, in the one line
the config uses: `jaxinfra: error: plan: --devices=0 is invalid: must be >= 1` (exit 2; the CLI's main turns
the ConfigError into it). argparse's own type errors ("invalid int value") are left as argparse words them.
tests/test_config_ranges.py fails on a numeric flag added without one.
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxinfra.config import ConfigError
from sharding.ranges import Range

INT64 = (-(2**63), 2**63 - 1)  # seeds: any integer a 64-bit seed holds


class _InRange(argparse.Action):
    """Stores the converted value after checking it against `allowed`; a ConfigError otherwise.

    A ConfigError (not argparse's error(), which prints the usage block and exits) so the message is one
    line and `cli.main` returns 2 like every other bad input."""

    def __init__(self, option_strings: list[str], dest: str, allowed: Range, sep: str = "=", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.allowed, self.sep = allowed, sep

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if not self.allowed.holds(values):
            command = parser.prog.removeprefix("jaxinfra").strip()
            where = f"{command}: " if command else ""
            raise ConfigError(f"{where}{option_string}{self.sep}{values} is invalid: must be {self.allowed.describe()}")
        setattr(namespace, self.dest, values)


def number_flag(parser: argparse.ArgumentParser, *names: str, kind: type = int, lo: float | None = None,
                hi: float | None = None, lo_open: bool = False, hi_open: bool = False, note: str = "",
                sep: str = "=", **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(*names, type=kind, **kwargs)` whose value must lie in the range (lo, hi, open
    ends as sharding/ranges.py Range; `note` says what a special value means, e.g. "0: off"). `sep` joins
    flag and value in the message: " " where the command's own messages already write `--steps 0`."""
    allowed = Range(lo, hi, lo_open, hi_open, note=note)
    return parser.add_argument(*names, type=kind, action=_InRange, allowed=allowed, sep=sep, **kwargs)
