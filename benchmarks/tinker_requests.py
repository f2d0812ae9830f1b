"""Capacity of the Tinker request path: one-token samples through the ``tinker`` SDK against ``python -m
skyrl_clora.tinker.server`` (``clora`` backend), at several numbers of requests in flight, with the CPU each
process spends per request.

Each sample is what a recipe's turn costs the path apart from decoding: the SDK's ``asample`` and
``retrieve_future`` calls, the server's database rows, its engine loop. One process (this one) sends every request
from one event loop, as :mod:`benchmarks.tinker_clients` does. Per number in flight: requests per second, latency
p50 / p90, and CPU milliseconds per request of this process (``clients``), the server's API process (``server_api``)
and its engine subprocess (``server_engine``). A process whose CPU per request times the request rate nears one
second per second is the path's bound (each is one Python thread of work at a time).

Usage (GPU): python -m benchmarks.tinker_requests --out $OUT/requests [--in-flight 1 16 128 512] [--requests 2048]
On the CPU add ``--device cpu``. ``--model PATH`` serves that model folder instead of the tiny base.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import tinker
from benchmarks.tinker_clients import cpu_seconds, start_server
from tinker import types

from skyrl_clora.tinker.server import base_model_folder

PROMPT_TOKENS = 16


async def send(sampler: tinker.SamplingClient, in_flight: int, requests: int) -> list[float]:
    """``requests`` one-token samples, ``in_flight`` at a time; their latencies (seconds)."""
    gate, latencies = asyncio.Semaphore(in_flight), []

    async def one(index: int) -> None:
        prompt = types.ModelInput.from_ints([(index + k) % 200 + 3 for k in range(PROMPT_TOKENS)])
        async with gate:
            started = time.perf_counter()
            await sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=index))
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*[one(index) for index in range(requests)])
    return latencies


def measure(sampler: tinker.SamplingClient, server: psutil.Process, in_flight: int, requests: int) -> dict[str, Any]:
    """One table row: ``requests`` samples at ``in_flight`` (after a warm-up of ``in_flight`` samples)."""
    asyncio.run(send(sampler, in_flight, in_flight))
    before, started = cpu_seconds(server), time.perf_counter()
    latencies = sorted(asyncio.run(send(sampler, in_flight, requests)))
    wall, after = time.perf_counter() - started, cpu_seconds(server)
    return {"in_flight": in_flight, "requests": requests, "requests_per_s": requests / wall,
            "latency_p50_ms": 1e3 * latencies[len(latencies) // 2],
            "latency_p90_ms": 1e3 * latencies[int(0.9 * (len(latencies) - 1))],
            "cpu_ms_per_request": {part: 1e3 * (after[part] - before[part]) / requests for part in after}}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny base)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_tinker_requests"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_tinker_requests_"))
    model = base_model_folder(args.model)
    server, url, key, cold_start = start_server(model, 1, max(args.in_flight), 8, args.device, args.out, work)
    try:
        with tinker.ServiceClient(base_url=url, api_key=key) as service:
            sampler = service.create_sampling_client(base_model=model).result()
            rows = [measure(sampler, psutil.Process(server.pid), in_flight, args.requests)
                    for in_flight in args.in_flight]
    finally:
        server.terminate()
        server.wait(timeout=120)
        shutil.rmtree(work)
    report = {"model": model, "device": args.device, "prompt_tokens": PROMPT_TOKENS, "max_tokens": 1, "rows": rows}
    (args.out / "tinker_requests.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"Tinker server cold start {cold_start:.1f} s; one-token samples of {PROMPT_TOKENS}-token prompts")
    print(f"{'in flight':>9} {'req/s':>7} {'p50 ms':>7} {'p90 ms':>7}   CPU ms per request: clients, server_api, "
          "server_engine")
    for row in rows:
        cpu = row["cpu_ms_per_request"]
        print(f"{row['in_flight']:>9} {row['requests_per_s']:>7.0f} {row['latency_p50_ms']:>7.1f} "
              f"{row['latency_p90_ms']:>7.1f}   {cpu['clients']:.2f}, {cpu['server_api']:.2f}, {cpu['server_engine']:.2f}")


if __name__ == "__main__":
    main()
