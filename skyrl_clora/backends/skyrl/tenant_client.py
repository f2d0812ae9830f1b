"""Per-tenant views of SkyRL's ``RemoteInferenceClient``: own cache-salt version, own in-flight bound.

Why views: skyrl 0.4's ``SkyRLGymGenerator._compute_cache_salt`` salts vLLM's prefix cache with
``build_vllm_cache_salt(client.weight_version, policy_model_name)``, and ``WorkerDispatch.save_weights_for_sampler``
bumps that one ``weight_version`` after *any* adapter's sync. With one client shared by every tenant, one
tenant's update changes every tenant's salt, so every tenant loses its cached prefixes. And the client's
generate semaphore (``SKYRL_GENERATE_CONCURRENCY_PER_ENGINE x engines`` permits, FIFO) is shared by all
callers, so one tenant's big batch can hold every permit while the others wait.

A :class:`TenantInferenceClient` is a ``RemoteInferenceClient`` for one tenant, pointed at the same servers (with
the shared client's ``api_key`` when it is a :class:`~skyrl_clora.backends.skyrl.bearer_client.BearerInferenceClient`):

- ``weight_version`` is that tenant's adapter version (-1 until its adapter is first loaded): set from the server's answer to a LoRA load of the
  tenant's adapter (``version`` in the embedded server's body; one more per load with vLLM's), or advanced
  by :meth:`increment_weight_version` by a sync hook that loads through another client. The stock
  generator's salt is then ``<tenant>:<tenant's version>``: a tenant's update re-salts only its own prefixes.
  (integration/patches/0001-per-adapter-cache-salt-and-prefix-cache-reset.patch is the upstream form; the view
  also answers that patch's ``increment_weight_version(model_id)`` and ``weight_version_for``.)
- :meth:`prefix_cache_salted` says whether every request of the tenant so far carried a cache salt (and at
  least one did), as the patched client does: a dispatch from
  :func:`~skyrl_clora.skyrl.worker_patches.with_salt_gated_lora_sync` then lets the worker skip the global
  prefix-cache reset of the tenant's sync. A ``sample``/``chat_completion``/``completion`` call counts as
  unsalted.
- its generate semaphore has ``max_in_flight`` permits (see :func:`tenant_views` for the default split), so
  each tenant's in-flight requests are bounded on their own and no tenant can starve another.
- it refuses a generate batch without sampling params (the stock client would send ``{}``, and vLLM's
  defaults stop after 16 tokens; kept here rather than proposed upstream, see integration/patches/README.md).
- it only generates for its own adapter (``model`` omitted or equal to the tenant), and records for each
  request of a session the adapter version it was sampled with (:meth:`versions_for`), so a trajectory can be
  checked against it: the version the server reports (the embedded server does), else (vLLM reports none) the
  view's own ``weight_version`` if it was the same when the request went out and when its answer came back,
  and ``UNKNOWN_VERSION`` if a load of the tenant's adapter completed in between.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Dict, Optional

from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInput, InferenceEngineOutput
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.env_vars import SKYRL_GENERATE_CONCURRENCY_PER_ENGINE

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.backends.skyrl.bearer_client import BearerInferenceClient
from skyrl_clora.lora.peft_export import save_peft_adapter



# What a view records for a request whose server reports no version while a load of its tenant's adapter
# completed during the request: it may have been sampled with either version (no tenant version is negative).
UNKNOWN_VERSION = -2

@dataclass
class TenantInferenceClient(BearerInferenceClient):
    """``RemoteInferenceClient`` scoped to one tenant's adapter (see module docstring)."""

    tenant: str = ""
    """The tenant's LoRA adapter name on the inference servers."""

    max_in_flight: int = 0
    """Most generate requests of this tenant in flight at once; 0: unbounded."""

    _session_versions: Dict[str, list] = field(default_factory=lambda: defaultdict(list), repr=False)
    _tenant_semaphores: Optional[tuple] = field(default=None, repr=False)  # (event loop, generate, detokenize)
    _recorder: Optional["_VersionRecorder"] = field(default=None, repr=False)
    _clora_salted: bool = field(default=False, repr=False)
    _clora_unsalted: bool = field(default=False, repr=False)
    _batch_sessions: Optional[list] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tenant or self.tenant == self.model_name:
            raise ValueError(f"a tenant view needs its adapter name as tenant (got {self.tenant!r})")
        if self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight}")
        self._weight_version = -1  # no adapter loaded yet; its first load (version 0) or sync makes it 0

    def increment_weight_version(self, model_id: Optional[str] = None) -> None:
        """Advances the tenant's version (a sync of its adapter; ``model_id``, as patch 0001's dispatch passes it,
        can only be the tenant)."""
        if model_id is not None and model_id != self.tenant:
            raise ValueError(f"the view of tenant {self.tenant!r} cannot count a sync of {model_id!r}")
        self._weight_version += 1

    def weight_version_for(self, model: Optional[str]) -> int:
        """Patch 0001's per-adapter version: the tenant's version (the view serves only its tenant)."""
        return self._weight_version

    def prefix_cache_salted(self, model: str) -> bool:
        """Whether every request of the tenant so far carried a cache salt, and at least one did."""
        return model == self.tenant and self._clora_salted and not self._clora_unsalted

    def expect_batch(self, session_ids: list[str]) -> None:
        """The session ids of the next generate batch that carries none (SkyRL's batched generator sends its
        single-turn prompts without them), one per prompt in order: its requests are sent and recorded under them, as
        the agent loop's are (the embedded server also derives each request's sampling seed from its session)."""
        self._batch_sessions = list(session_ids)

    def versions_for(self, session_id: str) -> list[int]:
        """The adapter version each request of ``session_id`` was sampled with so far (one per turn; see the
        module docstring for what the view knows when the server reports none)."""
        return list(self._session_versions.get(str(session_id), []))

    def _get_semaphores(self) -> tuple[Optional[asyncio.Semaphore], Optional[asyncio.Semaphore]]:
        """This tenant's own generate/detokenize semaphores (``max_in_flight`` permits), per event loop (in fields
        of the view's own, not the stock client's)."""
        if self.max_in_flight == 0:
            return super()._get_semaphores()
        current_loop = asyncio.get_running_loop()
        if self._tenant_semaphores is None or self._tenant_semaphores[0] is not current_loop:
            self._tenant_semaphores = (current_loop, asyncio.Semaphore(self.max_in_flight),
                                       asyncio.Semaphore(self.max_in_flight))
        return self._tenant_semaphores[1], self._tenant_semaphores[2]

    async def generate(self, input_batch: InferenceEngineInput, model: Optional[str] = None) -> InferenceEngineOutput:
        """``RemoteInferenceClient.generate``, refusing a batch without sampling params (the stock client
        sends ``{}`` for them, and vLLM's defaults then stop after 16 tokens); notes whether the batch is salted."""
        if input_batch.get("sampling_params") is None:
            raise ValueError(f"generate for tenant {self.tenant!r} needs input_batch['sampling_params'] (at least "
                             "max_tokens; SkyRL's trainer passes generator.sampling_params): without them vLLM "
                             "stops after 16 tokens")
        self._resolve_model(model, "generate")
        if input_batch.get("session_ids") is None and self._batch_sessions is not None:
            sessions, self._batch_sessions = self._batch_sessions, None
            if len(sessions) != len(input_batch["prompt_token_ids"]):
                raise ValueError(f"tenant {self.tenant!r} expected a batch of {len(sessions)} prompts, got "
                                 f"{len(input_batch['prompt_token_ids'])}")
            input_batch = InferenceEngineInput(**input_batch, session_ids=sessions)
        if input_batch.get("cache_salt") is None:
            self._clora_unsalted = True
        else:
            self._clora_salted = True
        return await super().generate(input_batch, model=model)

    def _resolve_model(self, model: Optional[str], method_name: str) -> str:
        if model and model != self.tenant:
            raise ValueError(f"{method_name}: the view of tenant {self.tenant!r} cannot generate for model {model!r}")
        if method_name in ("sample", "chat_completion", "completion"):
            self._clora_unsalted = True  # counted as unsalted (Tinker samples carry no salt)
        return self.tenant

    def _get_generate_client(self) -> Any:
        """The stock generate client behind a recorder of the adapter version each response reports (per
        session): the stock ``_generate_single`` then runs unchanged through it."""
        client = super()._get_generate_client()
        if self._recorder is None or self._recorder.client is not client:
            self._recorder = _VersionRecorder(client, self._session_versions, lambda: self._weight_version)
        return self._recorder

    async def load_lora_adapter(
        self, lora_name: str, lora_path: Optional[str] = None, *, in_memory: bool = False
    ) -> Dict[str, Any]:
        """Loads the adapter on every server (in place under its name: no pause, no prefix-cache reset);
        for the tenant's own adapter, ``weight_version`` becomes the version the servers report."""
        results = await super().load_lora_adapter(lora_name, lora_path, in_memory=in_memory)
        if lora_name == self.tenant:
            reported = [_reported_version(r.get("body")) for r in results.values()]
            if reported and all(v is not None for v in reported):
                self._weight_version = max(reported)
            else:
                self.increment_weight_version()
        return results

    def resume_weight_version(self, version: int) -> None:
        """Sets ``weight_version`` to a resumed tenant's checkpointed version (its adapter was just loaded)."""
        self._weight_version = version

    async def publish(self, weights: AdapterWeights, sync_dir: Path, base_model_path: str) -> int:
        """The sync hook: writes ``weights`` as a PEFT folder under ``sync_dir/<tenant>`` and loads it in
        place under the tenant's name; returns the tenant's new version. Nothing is paused and no prefix
        cache is reset: other tenants' in-flight requests and cached prefixes are untouched."""
        path = sync_dir / self.tenant
        await asyncio.to_thread(save_peft_adapter, weights, path, base_model_path)
        await self.load_lora_adapter(self.tenant, str(path))
        return self.weight_version


def _reported_version(body: Any) -> Optional[int]:
    """The ``version`` field of a load answer's JSON text (the embedded server's), else None (vLLM's)."""
    try:
        value = json.loads(body).get("version") if isinstance(body, str) else None
    except (ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def tenant_views(
    shared: RemoteInferenceClient, tenants: list[str], max_in_flight: Optional[int] = None
) -> dict[str, TenantInferenceClient]:
    """One :class:`TenantInferenceClient` per tenant, on ``shared``'s servers and settings.

    Fair sharing: by default each tenant gets an equal share of the engines' generate concurrency,
    ``max(1, SKYRL_GENERATE_CONCURRENCY_PER_ENGINE * len(server_urls) // len(tenants))`` permits, so all
    tenants together never exceed what one shared client would allow, and a tenant with a large batch only
    queues behind its own requests. Pass ``max_in_flight`` to set the per-tenant bound explicitly.
    """
    if not tenants or len(set(tenants)) != len(tenants):
        raise ValueError(f"tenants must be distinct adapter names, got {tenants}")
    if max_in_flight is None:
        total = SKYRL_GENERATE_CONCURRENCY_PER_ENGINE * len(shared.server_urls)
        max_in_flight = max(1, total // len(tenants)) if total > 0 else 0
    return {
        tenant: TenantInferenceClient(
            proxy_url=shared.proxy_url,
            server_urls=list(shared.server_urls),
            data_parallel_size=shared.data_parallel_size,
            model_name=shared.model_name,
            enable_return_routed_experts=shared.enable_return_routed_experts,
            enable_return_sample_support_set=shared.enable_return_sample_support_set,
            uses_lora_weight_sync=shared.uses_lora_weight_sync,
            tokenizer=shared.tokenizer,
            api_key=shared.api_key if isinstance(shared, BearerInferenceClient) else None,
            tenant=tenant,
            max_in_flight=max_in_flight,
        )
        for tenant in tenants
    }


class _VersionRecorder:
    """A generate client whose ``generate`` records under its ``session_id`` the adapter version a response was
    sampled with: the ``adapter_version`` it reports (the embedded server's), else the view's version
    (``current_version()``) when that was the same before and after the request, else ``UNKNOWN_VERSION``;
    everything else is the client's."""

    def __init__(self, client: Any, versions: Dict[str, list], current_version: Callable[[], int]) -> None:
        self.client = client
        self._versions = versions
        self._current_version = current_version

    async def generate(self, **kwargs: Any) -> Any:
        sent = self._current_version()
        result = await self.client.generate(**kwargs)
        version = result.raw_response["choices"][0].get("adapter_version")
        if version is None:
            version = sent if self._current_version() == sent else UNKNOWN_VERSION
        if kwargs.get("session_id") is not None:
            self._versions[str(kwargs["session_id"])].append(int(version))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
