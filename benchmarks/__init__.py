"""The GPU benchmarks (and ``concurrency``, ``engine_host`` and ``planner``, which measure on the CPU), one module
per question, run from the repository root as ``python -m benchmarks.<name> --out <file or folder>``; each writes
its full numbers as JSON there and prints a short table last. ``common`` holds what they share (graph timing, copy
bandwidth, random Qwen3-shaped models and adapters). Current figures and their commands: RESULTS.md. Without a
CUDA device the GPU benchmarks run as smoke runs at tiny sizes (``common``; ``tests/benchmarks/test_benchmarks_smoke.py`` runs
every module so).

- ``kernels`` (with ``packed``): multi-LoRA ops against the base GEMM and the PEFT loop;
- ``qkv_rope``: the q/k/v block with its fused LoRA expand; ``attention``: decode and prefill attention;
- ``engine``: decode throughput, tenants mixed vs the base model (and vs HF ``generate`` + PEFT);
- ``runner``: the engine's decode and prefill passes at the end-to-end shapes; ``engine_host``: a decode
  step's host time;
- ``train``: packed vs swap training rounds; ``e2e``: N experiments, serial vs concurrent;
- ``concurrency``: ``skyrl_clora.main`` serial vs concurrent on any recipe and model;
- ``skyrl_profile``: where a tenant step's seconds go on backend=skyrl (SkyRL's FSDP2 worker) vs backend=embedded.
"""
