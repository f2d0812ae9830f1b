"""Command line of a live run's control endpoint (``skyrl_clora.control.server``).

    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] list
    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] add '{name: t9, lr: 1e-3, seed: 9}'
    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] stop t3

``--dir`` is the run's ``clora.output_dir`` (default ``outputs/run``); the endpoint's URL and token are read from
its ``control.json`` (mode 0600: only the run's owner can read them). Prints the endpoint's answer as JSON; a
refused request prints its one-line error and exits with status 2, a run that is not going (or whose
``control.json`` cannot be read) with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from skyrl_clora.control.server import CONTROL_FILE
from skyrl_clora.control.auth import authorization


def request(endpoint: dict[str, str], method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """``method path`` on the control endpoint ``endpoint`` (``control.json``'s ``{"url", "token"}``), with its
    token: (HTTP status, JSON answer). No client timeout: the run answers once the work is done (an ``add`` returns
    after the tenant registered, which on a busy machine or a starting replica takes as long as it takes); a run that
    ends closes the connection. ``urllib.error.URLError`` when the endpoint cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(endpoint["url"] + path, data=data, method=method,
                                  headers={"Content-Type": "application/json", **authorization(endpoint["token"])})
    try:
        with urllib.request.urlopen(call) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyrl_clora.ctl", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("outputs/run"), help="the run's clora.output_dir")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the running tenants and their steps")
    add = commands.add_parser("add", help="add a tenant: its overrides as YAML/JSON, name required")
    add.add_argument("spec")
    stop = commands.add_parser("stop", help="stop a tenant after its current step (checkpointed, exported)")
    stop.add_argument("name")
    args = parser.parse_args(argv)
    control_file = args.dir / CONTROL_FILE
    if not control_file.is_file():
        print(f"error: no run is going in {args.dir} (no {CONTROL_FILE}); pass the run's clora.output_dir as --dir",
              file=sys.stderr)
        return 1
    try:
        endpoint = json.loads(control_file.read_text())
    except OSError as error:
        print(f"error: cannot read {control_file} ({error.strerror}); run ctl as the user who started the run",
              file=sys.stderr)
        return 1
    method, path, body = "GET", "/tenants", None
    if args.command == "add":
        try:
            method, path, body = "POST", "/tenants", yaml.safe_load(args.spec)
        except yaml.YAMLError as error:
            print(f"error: the tenant spec is not YAML ({str(error).splitlines()[0]}); write e.g. '{{name: t9, lr: 1e-3}}'",
                  file=sys.stderr)
            return 2
    elif args.command == "stop":
        method, path = "POST", f"/tenants/{args.name}/stop"
    try:
        status, answer = request(endpoint, method, path, body)
    except (urllib.error.URLError, ConnectionError) as error:
        reason = getattr(error, "reason", error)
        print(f"error: the run in {args.dir} does not answer at {endpoint['url']} ({reason}); it has ended or is "
              "ending: check its output", file=sys.stderr)
        return 1
    if status != 200:
        print(f"error: {answer['error']}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
