"""``python -m skyrl_clora.ctl`` against a run that no longer answers: one line, exit 1, no traceback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from skyrl_clora import ctl
from skyrl_clora.control.server import CONTROL_FILE


def test_ctl_says_in_one_line_when_the_run_does_not_answer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"url": url, "token": "t"}))
    for args in (["list"], ["add", "{name: c}"], ["stop", "b"]):
        assert ctl.main(["--dir", str(tmp_path), *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: the run in {tmp_path} does not answer at {url} (") and err.count("\n") == 1, err
