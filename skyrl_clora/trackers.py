"""Each tenant's metrics in the experiment trackers SkyRL users follow, through SkyRL's own ``Tracking``.

``trainer.logger`` lists the backends (``console``, ``tensorboard``, ``wandb``) of project
``trainer.project_name``. TensorBoard and the console get one tracker per tenant, a run named
``<trainer.run_name>/<tenant>`` (TensorBoard's under ``<output_dir>/tensorboard/<tenant>/``), so that the
tenants' curves of one metric overlay. wandb keeps one run per process (its ``wandb.log`` acts on the global
run), so the run ``<trainer.run_name>`` holds every tenant, each in its own namespace ``<tenant>/...`` with its
own step axis ``<tenant>/step`` (tenants reach their steps in any order); ``WANDB_MODE=offline`` writes it
under ``<output_dir>/wandb`` without a network. Each step record is logged at its RL step with its numeric
values under their own names (``reward_mean``, ``train/policy_loss``, ...), each evaluation's SkyRL metrics under
their SkyRL names (``eval/all/avg_score``, ``eval/all/pass_at_<n>``, ...) and its other values as ``eval/<name>``
(``eval/accuracy``). Records carried over from checkpoints on resume were logged by the run that made them.
"""

from __future__ import annotations

import contextlib
import netrc
import os
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from skyrl_clora.config.schema import ConfigError, RunConfig

# SkyRL's tensorboard adapter reads its folder from this variable when it is built.
_TENSORBOARD_DIR = "TENSORBOARD_DIR"


def check_trackers(run: RunConfig) -> None:
    """Refuses, before anything is loaded, a ``trainer.logger`` with wandb (SkyRL's default) that wandb could not start:
    no ``WANDB_API_KEY``, no netrc entry for the wandb host (``WANDB_BASE_URL``'s, else api.wandb.ai) and a
    ``WANDB_MODE`` other than offline or disabled."""
    if "wandb" not in run.trainer.logger:
        return
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    with contextlib.suppress(OSError, netrc.NetrcParseError):
        if netrc.netrc().authenticators(host):
            return
    raise ConfigError("trainer.logger includes wandb (SkyRL's default) but wandb has no API key: run `wandb login`, set "
                      "WANDB_API_KEY or WANDB_MODE=offline, or pass trainer.logger=[console]")


class TenantTrackers:
    """The run's trackers, built for each tenant at its first record (see the module docstring)."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.run_name = run.trainer.run_name or run.output_dir.resolve().name
        self._trackers: dict[str, list[Any]] = {}
        self._wandb: Any = None
        self._wandb_axes: set[str] = set()
        self._lock = threading.Lock()

    def log(self, record: dict[str, Any]) -> None:
        """Logs a ``step`` or ``eval`` record to its tenant's trackers (other events are not metrics)."""
        event = record.get("event")
        if event not in ("step", "eval"):
            return
        values = {key: float(value) for key, value in record.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if event == "eval":
            values = {key if key.startswith("eval/") else f"eval/{key}": value for key, value in values.items()}
        tenant = record["tenant"]
        with self._lock:
            for tracker in self._for(tenant):
                tracker.log(values, step=record["step"], commit=True)
            if "wandb" in self.run.trainer.logger:
                self._wandb_log(tenant, values, record["step"])

    def close(self) -> None:
        with self._lock:
            for tracker in [t for trackers in self._trackers.values() for t in trackers] + [self._wandb]:
                if tracker is not None:
                    tracker.finish()
            self._trackers.clear()
            self._wandb = None

    def _for(self, tenant: str) -> list[Any]:
        if tenant not in self._trackers:
            self._trackers[tenant] = [self._build(tenant, backend) for backend in self.run.trainer.logger
                                      if backend != "wandb"]
        return self._trackers[tenant]

    def _wandb_log(self, tenant: str, values: dict[str, float], step: int) -> None:
        """Logs through the wandb module the shared Tracking holds, on the tenant's own step axis."""
        from skyrl.train.utils.tracking import Tracking

        if self._wandb is None:
            with _environment("WANDB_DIR", str(self.run.output_dir)):
                self._wandb = Tracking(self.run.trainer.project_name, self.run_name, backend="wandb",
                                       config=self.run.identity)
        wandb = self._wandb.logger
        if tenant not in self._wandb_axes:
            wandb.define_metric(f"{tenant}/step")
            wandb.define_metric(f"{tenant}/*", step_metric=f"{tenant}/step")
            self._wandb_axes.add(tenant)
        wandb.log({f"{tenant}/step": step, **{f"{tenant}/{key}": value for key, value in values.items()}})

    def _build(self, tenant: str, backend: str) -> Any:
        from skyrl.train.utils.tracking import Tracking

        name = f"{self.run_name}/{tenant}"
        if backend == "tensorboard":
            with _environment(_TENSORBOARD_DIR, str(self.run.output_dir / "tensorboard" / tenant)):
                return Tracking(self.run.trainer.project_name, name, backend="tensorboard")
        return Tracking(self.run.trainer.project_name, name, backend=backend)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """Within: environment variable ``name`` set to ``value`` (SkyRL's trackers read their folders from it)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name)
        else:
            os.environ[name] = previous
