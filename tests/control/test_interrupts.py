"""The stop request: a library that replaces the signal handlers (``ray.init`` makes SIGTERM exit at once) does
not keep a run from stopping cleanly once :meth:`StopRequest.reclaim` took them back."""

from __future__ import annotations

import os
import signal

from skyrl_clora.control.interrupts import STOP


def test_reclaim_takes_sigterm_back_from_a_library_that_replaced_its_handler() -> None:
    def library_exit(number: int, frame: object) -> None:
        raise SystemExit(number)

    with STOP.installed():
        signal.signal(signal.SIGTERM, library_exit)
        STOP.reclaim()
        os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread before the next line runs
        assert STOP.requested() and STOP.exit_status() == 143
    assert signal.getsignal(signal.SIGTERM) is not library_exit, "the handler from before installed() comes back"


def test_request_stops_a_process_as_its_first_signal_would() -> None:
    with STOP.installed():
        STOP.request(signal.SIGINT)
        assert STOP.requested() and STOP.exit_status() == 130
