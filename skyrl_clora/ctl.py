"""Command line of a live run's control endpoint (``skyrl_clora.control``).

    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] list
    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] add '{name: t9, lr: 1e-3, seed: 9}'
    python -m skyrl_clora.ctl [--dir OUTPUT_DIR] stop t3

``--dir`` is the run's ``clora.output_dir`` (default ``outputs/run``). Prints the endpoint's answer as JSON; a
refused request prints its one-line error and exits with status 2, a run that is not going with status 1.
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

from skyrl_clora.control import CONTROL_FILE


def request(output_dir: Path, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """``method path`` on the control endpoint of the run in ``output_dir``: (HTTP status, JSON answer)."""
    url = json.loads((output_dir / CONTROL_FILE).read_text())["url"]
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=120) as answer:
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
    if not (args.dir / CONTROL_FILE).is_file():
        print(f"error: no run is going in {args.dir} (no {CONTROL_FILE}); pass the run's clora.output_dir as --dir",
              file=sys.stderr)
        return 1
    if args.command == "list":
        status, answer = request(args.dir, "GET", "/tenants")
    elif args.command == "add":
        try:
            spec = yaml.safe_load(args.spec)
        except yaml.YAMLError as error:
            print(f"error: the tenant spec is not YAML ({str(error).splitlines()[0]}); write e.g. '{{name: t9, lr: 1e-3}}'",
                  file=sys.stderr)
            return 2
        status, answer = request(args.dir, "POST", "/tenants", spec)
    else:
        status, answer = request(args.dir, "POST", f"/tenants/{args.name}/stop")
    if status != 200:
        print(f"error: {answer['error']}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
