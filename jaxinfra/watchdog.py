"""A step watchdog: no process may hang forever on a dead peer or a collective that never ends.

The train loop reports its phase (data, step, eval, checkpoint, sync) and step; a
daemon thread checks that progress happens at least every `timeout_s`. When it does
not, the watchdog prints one line naming the step and phase, dumps every thread's
Python stack (faulthandler), and ends the process with EXIT_HUNG. It is armed after
the first step, so compilation time does not count.

`close()` must run on every way out of the loop (the Trainer's `_close` does it): an armed
watchdog left behind would end an in-process caller (a sweep, a notebook) with exit 70.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

from jaxinfra.exits import EXIT_HUNG


class Watchdog:
    def __init__(self, timeout_s: float, *, process_index: int = 0):
        self.timeout_s = timeout_s
        self.process_index = process_index
        self.step, self.phase = 0, "start"
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxinfra-watchdog", daemon=True)
        if timeout_s > 0:
            self._thread.start()

    def progress(self, step: int, phase: str) -> None:
        """Record that the loop reached `phase` of `step` (cheap: two attribute writes and a clock read)."""
        self.step, self.phase = step, phase
        self._last = time.monotonic()

    def arm(self) -> None:
        self._last = time.monotonic()
        self._armed = True

    def close(self) -> None:
        """Stop watching; returns once the thread has ended, so it can no longer end the process.
        Idempotent, and a no-op for a watchdog that never started (timeout 0)."""
        self._armed = False
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self._last
            if self._armed and stalled > self.timeout_s and not self._stop.is_set():
                print(f"jaxinfra: error: process {self.process_index} made no progress for {stalled:.0f}s at step "
                      f"{self.step}, phase '{self.phase}' (train.step_timeout_s={self.timeout_s:g}); a peer process "
                      f"may have died or a collective never completed. Python stacks follow.",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HUNG)  # a hung collective cannot be interrupted from Python
