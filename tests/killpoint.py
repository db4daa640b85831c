"""Run `jaxinfra ARGS...` and freeze it at a point of its writing, for the parent to SIGKILL it there.

    python tests/killpoint.py write K MARKER -- ARGS...   # the K-th write through jaxinfra/atomic.py is half done
    python tests/killpoint.py dir 1 MARKER -- ARGS...     # a directory output is built, not yet renamed into place

At the point, MARKER is created and the process sleeps; the parent (tests/test_atomic_writes.py) kills it
with SIGKILL, which no handler sees, as a lost node or the OOM killer would.
"""

from __future__ import annotations

import builtins
import pathlib
import sys
import time


def _freeze(marker: str) -> None:
    pathlib.Path(marker).write_text("at the point\n")
    time.sleep(600)


class _SlowFile:
    """A file whose K-th write stops halfway (its first half flushed to disk)."""

    def __init__(self, f, state: dict):
        self._f, self._state = f, state

    def write(self, data):
        self._state["writes"] += 1
        if self._state["writes"] == self._state["k"] and len(data) > 1:
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            _freeze(self._state["marker"])
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def main() -> int:
    mode, k, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = sys.argv[sys.argv.index("--") + 1:]
    from jaxinfra import atomic, cli

    if mode == "write":
        state = {"writes": 0, "k": k, "marker": marker}
        atomic.open = lambda *a, **kw: _SlowFile(builtins.open(*a, **kw), state)  # the module's own `open`
    else:
        def frozen(tmp, path, existed):
            _freeze(marker)

        atomic._put_in_place = frozen
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
