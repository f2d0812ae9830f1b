"""What the tinker SDK 0.38 asks of a Tinker server beyond SkyRL 0.4's API (which speaks to the 0.25 SDK), added to
SkyRL's app by :func:`install`:

- ``POST /api/v1/sessions/{session_id}/finish`` (``ServiceClient.close()``, so the exit of ``with
  tinker.ServiceClient(...)``): the session's first finish marks it ``finished`` and queues an unload of each of its
  models not yet unloaded (what SkyRL's stale-session cleanup does 300 s after the last heartbeat, done at once);
  a later finish changes nothing. 404 for an unknown session.
- ``POST /api/v1/asample`` answers SkyRL's future plus ``sample_sequence_ids``: ``"<request_id>:<i>"`` for each of
  the ``num_samples`` sequences (unique on this server's database; the SDK gives them to the sequences it returns).
- ``POST /api/v1/load_weights`` also takes the SDK's create-via-load body (``session_id`` and ``model_seq_id``, no
  ``model_id``; what ``create_training_client_from_state[_with_optimizer]`` sends): it creates model
  ``"<session_id>:train:<model_seq_id>"`` (the id the SDK derives) with the source model's LoRA config and base model
  (or the body's ``base_model``), then loads the checkpoint into it. A retry of the same body returns the same future.
  A body with ``model_id`` is SkyRL's load as before. The SDK's ``optimizer_config`` and ``weights_access_token`` are
  not read.
- Sample results with top-k prompt log-probs serialize with the 0.38 SDK's protobuf, where SkyRL's
  ``TopkPromptLogprobs(prompt_length=...)`` became ``TopkLogprobs(length=...)``.

Not covered: SkyRL's checkpoint routes (``/api/v1/training_runs/{unique_id}/checkpoints...``) refuse a model id with
``:``, so a model created by load cannot list, download or delete its checkpoints here (422 naming ``unique_id``'s
pattern); integration/patches/0007 lets them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Literal

import skyrl.tinker.api as api
import skyrl.tinker.proto_serialization as proto_serialization
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel
from skyrl.tinker import types
from skyrl.tinker.db_models import ModelDB, SessionDB
from sqlmodel import select
from sqlmodel.ext.asyncio.session import AsyncSession

FINISH = "/api/v1/sessions/{session_id}/finish"


class SampleFutureResponse(api.FutureResponse):
    """SkyRL's future of an ``asample`` with the ids of its sequences."""

    sample_sequence_ids: list[str]


class LoadWeightsRequest(BaseModel):
    """``load_weights``'s body: SkyRL's (``model_id``, ``seq_id``) or the 0.38 SDK's create-via-load (``session_id``,
    ``model_seq_id``, optional ``base_model``)."""

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    path: str
    optimizer: bool = True
    type: Literal["load_weights"] | None = None


async def finish_session(session_id: str, session: AsyncSession = Depends(api.get_session)) -> None:
    """Finishes session ``session_id`` (module docstring)."""
    session_db = await session.get(SessionDB, session_id)
    if session_db is None:
        raise HTTPException(status_code=404, detail=f"Session not found: {session_id}")
    if session_db.status != "active":
        return
    session_db.status = "finished"
    models = await session.exec(select(ModelDB).where(ModelDB.session_id == session_id,
                                                      ModelDB.status.not_in(("unloading", "unloaded"))))
    for model in models.all():
        model.status = "unloading"
        await api.create_future(session, types.RequestType.UNLOAD_MODEL, model.model_id, types.UnloadModelInput())
    await session.commit()


async def asample(request: api.SampleRequest, req: Request,
                  session: AsyncSession = Depends(api.get_session)) -> SampleFutureResponse:
    """SkyRL's ``asample`` with the sequences' ids."""
    future = await api.asample(request, req, session)
    return SampleFutureResponse(**future.model_dump(),
                                sample_sequence_ids=[f"{future.request_id}:{i}" for i in range(request.num_samples)])


async def load_weights(request: LoadWeightsRequest, req: Request,
                       session: AsyncSession = Depends(api.get_session)) -> api.FutureResponse:
    """SkyRL's load into ``model_id``, or a create-via-load (module docstring); 400 for a body with neither."""
    if request.model_id is not None:
        skyrl_request = api.LoadWeightsRequest(model_id=request.model_id, path=request.path,
                                               optimizer=request.optimizer, seq_id=request.seq_id)
        return await api.load_weights(skyrl_request, req, session)
    if request.session_id is None or request.model_seq_id is None:
        raise HTTPException(status_code=400, detail="load_weights needs model_id, or session_id and model_seq_id "
                                                    "(create-via-load)")
    if await session.get(SessionDB, request.session_id) is None:
        raise HTTPException(status_code=404, detail=f"Session not found: {request.session_id}")
    path = types.TinkerPath.parse(request.path)
    if not path or path.kind != "weights" or not path.primary_id or not path.secondary_id:
        raise HTTPException(status_code=400, detail="path must be tinker://<model_id>/weights/<checkpoint_id>")
    await api.validate_checkpoint(req, path.primary_id, path.secondary_id, types.CheckpointType.TRAINING, session)
    source = await api.get_model(session, path.primary_id)
    model_id = f"{request.session_id}:train:{request.model_seq_id}"
    if await session.get(ModelDB, model_id) is None:
        lora_config = types.LoraConfig.model_validate(source.lora_config)
        create_id = await api.create_future(session, types.RequestType.CREATE_MODEL, model_id,
                                            types.CreateModelInput(lora_config=lora_config))
        session.add(ModelDB(model_id=model_id, base_model=request.base_model or source.base_model,
                            lora_config=lora_config.model_dump(), status="created", request_id=create_id,
                            session_id=request.session_id))
    load = types.LoadWeightsInput(source_model_id=path.primary_id, checkpoint_id=path.secondary_id,
                                  load_optimizer=request.optimizer)
    request_id = await api.create_future(session, types.RequestType.LOAD_WEIGHTS, model_id, load, seq_id=0)
    await session.commit()
    return api.FutureResponse(future_id=str(request_id), status="pending", request_id=str(request_id))


class TopkProto:
    """tinker's protobuf module as SkyRL 0.4's serializer uses it: every name of ``module``, and
    ``TopkPromptLogprobs(prompt_length=n, ...)`` building the 0.38 SDK's ``TopkLogprobs(length=n, ...)``."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def TopkPromptLogprobs(self, *, prompt_length: int, **fields: Any) -> Any:  # noqa: N802 - SkyRL's name
        return self._module.TopkLogprobs(length=prompt_length, **fields)


def install(app: FastAPI) -> None:
    """Adds the module docstring's routes to SkyRL's ``app`` (replacing its ``asample`` and ``load_weights``) and
    gives SkyRL's serializer :class:`TopkProto`. Call once, before the app serves."""
    replaced = {("/api/v1/asample", "POST"), ("/api/v1/load_weights", "POST")}
    app.router.routes[:] = [route for route in app.router.routes if not (
        isinstance(route, APIRoute) and any((route.path, method) in replaced for method in route.methods))]
    app.add_api_route(FINISH, finish_session, methods=["POST"], response_model=None)
    app.add_api_route("/api/v1/asample", asample, methods=["POST"], response_model=SampleFutureResponse)
    app.add_api_route("/api/v1/load_weights", load_weights, methods=["POST"], response_model=api.FutureResponse)
    proto_serialization.pb = TopkProto(proto_serialization.pb)
