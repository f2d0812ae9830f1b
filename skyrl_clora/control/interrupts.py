"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM.

The first signal asks every tenant to stop after its current RL step: it then checkpoints, exports its adapter
and records a ``stopped`` event, the run writes its summary and plot, and the process exits with 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM). A second signal aborts at once (``KeyboardInterrupt``,
same exit status): what the last checkpoints hold is what a resume continues from.

A run whose tenants live in other processes (replicas, :mod:`skyrl_clora.placement`) forwards the first signal to
them: each process's :data:`STOP` is set there with :meth:`StopRequest.request`, and its tenants stop as above.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The signal that asked the run to stop (None: none did)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._installed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within: SIGINT and SIGTERM handled as the module docstring says (call from the main thread), no
        signal received yet. After: the previous handlers again."""
        self.signal = None
        previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        self._installed = True
        try:
            yield
        finally:
            self._installed = False
            for number, handler in previous.items():
                signal.signal(number, handler)

    def reclaim(self) -> None:
        """Within :meth:`installed` (main thread): handles SIGINT and SIGTERM again after a library replaced the
        handlers (``ray.init`` makes SIGTERM exit at once). Elsewhere: nothing."""
        if self._installed and threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                signal.signal(number, self._handle)

    def request(self, number: int) -> None:
        """Asks this process's tenants to stop as the first ``number`` signal would (no message; a process that
        runs tenants for a signalled driver)."""
        self.signal = number

    def requested(self) -> bool:
        return self.signal is not None

    def exit_status(self) -> int | None:
        """128 + the signal's number once one came, else None."""
        return None if self.signal is None else 128 + self.signal

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = number
        print(f"\n[stop] {signal.Signals(number).name}: every tenant stops after its current step, checkpoints and "
              "exports; send it again to abort at once", file=sys.stderr, flush=True)


STOP = StopRequest()
