"""backend=skyrl's driver (skyrl_clora.backends.skyrl.backend): its training step is SkyRL's: it recomputes the
behaviour log-probs through the policy worker's ``forward`` (not the sampler's), adds the KL reference's (the base: the
adapter disabled, scored at temperature 1) when ``use_kl_loss`` is on, penalises the rewards with ``use_kl_in_reward``,
steps the optimizer per mini-batch and epoch, and checks the worker's reports of the step (``check_step_report``:
``policy_lr`` within float32 rounding of the scheduled LR, the embedded worker's grad norm exactly);
``clora.step_style=tinker`` sends the sampler's log-probs instead. A step's update reports the seconds of its parts
(``STEP_PHASES``; in a whole run's step records: ``tests/system/test_isolation.py``)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_advantages_and_returns
from skyrl.train.config import AlgorithmConfig, SkyRLTrainConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.backends.skyrl import backend as backend_module
from skyrl_clora.backends.skyrl.backend import STEP_PHASES, SkyRLBackend, Tenant, check_step_report, training_input
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.config.compose import compose_config
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.backends.skyrl.stack import SkyRLStack, build_stack
from skyrl_clora.skyrl.worker import REFERENCE_MODEL_ID, EmbeddedPolicyWorker, training_batch_to_train_batch
from skyrl_clora.tenant_loop import Rollout, Update
from skyrl_clora.trainer.lr_schedule import LRSchedule

pytestmark = pytest.mark.usefixtures("without_production_extras")

PROMPT = list(range(5, 25))


def _output(rollout_shift: float) -> tuple[dict, list[str]]:
    """Two GRPO groups of two episodes; the sampler's log-probs are ``rollout_shift`` (deliberately wrong)."""
    responses = [[30, 31, 32, 2], [40, 41, 2], [50, 51, 52, 53, 2], [60, 2]]
    return {
        "prompt_token_ids": [PROMPT, PROMPT, PROMPT[:12], PROMPT[:12]], "response_ids": responses,
        "loss_masks": [[1] * len(r) for r in responses], "rewards": [1.0, 0.0, 1.0, 0.0],
        "rollout_logprobs": [[rollout_shift] * len(r) for r in responses],
    }, ["g0", "g0", "g1", "g1"]


def _direct_logprobs(model_dir: Path, adapter_dir: Path | None, data, temperature: float = 1.0) -> torch.Tensor:
    """The response log-probs ``[B, R]`` (right-aligned) of a plain HF forward per row, the adapter (if any)
    merged into the base weights, of ``log_softmax(logits / temperature)``: independent of the trainer's LoRA
    layers and batching."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        adapter = load_peft_adapter(adapter_dir)
        with torch.no_grad():
            for path, a in adapter.a.items():
                model.get_submodule(path).weight += adapter.scale * adapter.b[path] @ a
    width = data.metadata["response_length"]
    out = torch.zeros(data["sequences"].shape[0], width)
    with torch.no_grad():
        for i in range(out.shape[0]):
            tokens = data["sequences"][i][data["attention_mask"][i].bool()]
            logits = (model(input_ids=tokens[None]).logits[0].float() / temperature).log_softmax(-1)
            scored = logits[:-1].gather(1, tokens[1:, None])[:, 0]
            length = int(data["response_mask"][i].sum())
            out[i, width - length:] = scored[-length:]
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.ray
def test_driver_recomputes_log_probs_and_adds_the_base_as_kl_reference(micro_model_dir: Path, tmp_path: Path,
                                                                       temperature: float) -> None:
    """Through the Ray stack: the behaviour log-probs are the tenant's at the sampling temperature (SkyRL's
    ``trainer.algorithm.temperature``), the KL reference's the base's at temperature 1 (SkyRL's ref worker)."""
    cfg = compose_config([
        "backend=skyrl", f"trainer.policy.model.path={micro_model_dir}", f"clora.output_dir={tmp_path}",
        "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
        "trainer.max_prompt_length=120", "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        "trainer.policy.optimizer_config.lr=5e-2", "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0.5",
        f"generator.sampling_params.temperature={temperature}",
    ])
    run, plan = plan_steps(build_run_config(cfg), train_rows=8), translate(cfg)
    stack = build_stack(run, plan, str(micro_model_dir))
    backend = SkyRLBackend(run, plan, stack)
    spec = plan.tenants[0]
    pad = stack.tokenizer.pad_token_id
    algorithm = plan.base.trainer.algorithm
    after_step_1 = tmp_path / "after_step_1"

    async def steps() -> list:
        await backend.register(spec)
        results = []
        for step in range(2):
            data = training_input(*_output(rollout_shift=-50.0), pad, algorithm)
            metrics = await asyncio.to_thread(backend._train, backend.tenants[spec.name], data)
            await backend.publish(spec.name, Update(metrics))
            results.append((data, metrics))
            if step == 0:  # the adapter the worker holds for step 2
                shutil.copytree(Path(stack.sync_path) / spec.name, after_step_1)
        return results

    try:
        (first, first_metrics), (second, second_metrics) = asyncio.run(steps())
    finally:
        asyncio.run(_close(stack))
        stack.shutdown()
    assert plan.base.trainer.algorithm.temperature == temperature  # SkyRL's rule: the sampling temperature
    mask = second["response_mask"].bool()
    # Step 2 scores with the adapter published after step 1 (what the worker then holds): a direct forward agrees.
    trained = _direct_logprobs(micro_model_dir, after_step_1, second, temperature)
    base = _direct_logprobs(micro_model_dir, None, second)
    assert torch.allclose(second["action_log_probs"][mask], trained[mask], atol=1e-4)
    assert torch.allclose(second["base_action_log_probs"][mask], base[mask], atol=1e-4)
    assert (second["action_log_probs"][mask] - second["rollout_logprobs"][mask]).abs().min() > 1.0, \
        "the sampler's (corrupted) log-probs must not be the behaviour log-probs"
    assert (trained[mask] - _direct_logprobs(micro_model_dir, None, second, temperature)[mask]).abs().max() > 1e-3, \
        "after an update the policy is no longer the base"
    # Step 1: a fresh adapter (B = 0) is the base at the sampling temperature; step 2: the policy moved, KL > 0.
    tempered_base = _direct_logprobs(micro_model_dir, None, first, temperature)
    assert torch.allclose(first["action_log_probs"][mask], tempered_base[mask], atol=1e-4)
    assert torch.allclose(first["base_action_log_probs"][mask], _direct_logprobs(micro_model_dir, None, first)[mask],
                          atol=1e-4)
    if temperature == 1.0:  # the reference is the policy itself: no KL
        assert first_metrics["policy_kl"] == pytest.approx(0.0, abs=1e-7)
    else:  # SkyRL's KL of the tempered policy against the untempered reference
        assert (tempered_base[mask] - first["base_action_log_probs"][mask]).abs().max() > 1e-2
        assert first_metrics["policy_kl"] > 1e-4
    assert second_metrics["policy_kl"] > 1e-6


async def _close(stack) -> None:
    for client in [stack.client, *stack.views.values()]:
        await client.teardown()


class _Dispatch:
    """What ``SkyRLBackend._train`` calls on a ``WorkerDispatch``, recording the mini-batches it trains on and the
    LRs it sets, and answering with the reports a worker would give (``policy_lr``: the LR its optimizer runs the
    step with: the one set, unless ``reported_lr`` says otherwise)."""

    LOGPROB = {"t": -0.5, REFERENCE_MODEL_ID: -1.5}  # what the policy forward scores under each adapter

    def __init__(self, reported_lr: float | None = None, mini_batch_prompts: int = 2, epochs: int = 1,
                 **algorithm: object) -> None:
        self.cfg = SkyRLTrainConfig()
        self.cfg.trainer.algorithm = AlgorithmConfig(**{"use_kl_loss": False, **algorithm})
        self.cfg.trainer.train_batch_size, self.cfg.generator.n_samples_per_prompt = 2, 2
        self.cfg.trainer.policy_mini_batch_size, self.cfg.trainer.update_epochs_per_batch = mini_batch_prompts, epochs
        self.reported_lr = reported_lr
        self.trained: list = []
        self.lrs: list[float] = []
        self.forwards: list[str] = []
        self.forward_temperatures: list[float | None] = []  # the workers' algorithm temperature at each forward
        self.worker_temperature = self.cfg.trainer.algorithm.temperature
        self.fail_forward_of: str | None = None
        self.staged_forward_rows: list[int] = []
        self.swaps: list[str] = []

    def ensure_active_adapter(self, model: str, model_id: str) -> None:
        self.swaps.append(model_id)

    def set_algorithm_config(self, model: str, **kwargs: object) -> None:
        """``WorkerDispatch.set_algorithm_config``: sets the workers' algorithm config (not the dispatch's cfg)."""
        assert model == "policy" and set(kwargs) == {"temperature"}
        self.worker_temperature = kwargs["temperature"]

    def forward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.forwards.append(model_id)
        self.forward_temperatures.append(self.worker_temperature)
        if model_id == self.fail_forward_of:
            raise RuntimeError(f"forward of {model_id} failed")
        width = data.metadata["response_length"]
        rows = [{"logprobs": [self.LOGPROB[model_id]] * width}] * data["sequences"].shape[0]
        return WorkerOutput(loss_fn_outputs=rows, metrics={})

    def stage_data(self, model: str, data, boundaries: list[tuple[int, int]]) -> list[list]:
        """``WorkerDispatch.stage_data`` at DP size 1: each mini-batch one chunk."""
        return [[data[start:end]] for start, end in boundaries]

    def forward_from_staged(self, model: str, chunk_refs: list, model_id: str) -> WorkerOutput:
        self.staged_forward_rows.append(chunk_refs[0]["sequences"].shape[0])
        return self.forward(model, chunk_refs[0], model_id)

    def set_lr(self, model: str, lr: float, model_id: str) -> None:
        self.lrs.append(lr)

    def forward_backward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.trained.append(data)
        lr = self.lrs[-1] if self.reported_lr is None else self.reported_lr
        return WorkerOutput(metrics={"policy_loss": 0.1, "policy_lr": lr})

    def optim_step(self, model: str, model_id: str) -> float:
        return 2.0


def _megatron_backend(step_style: str, tmp_path: Path) -> SkyRLBackend:
    run = SimpleNamespace(trainer=SimpleNamespace(step_style=step_style))
    stack = SkyRLStack(tokenizer=None, client=None, views={}, policy_group=None, strategy="megatron", sync_path="",
                       owns_ray=False)
    return SkyRLBackend(run, plan=None, stack=stack)


@pytest.mark.parametrize("step_style", ["skyrl", "tinker"])
def test_step_style_picks_the_behaviour_log_probs(step_style: str, tmp_path: Path) -> None:
    backend = _megatron_backend(step_style, tmp_path)
    dispatch = _Dispatch(reported_lr=1e-3)
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=LRSchedule(1e-3))
    data = training_input(*_output(rollout_shift=-9.0), 0, translate(compose_config(
        ["backend=skyrl", f"trainer.policy.model.path={tmp_path}"])).base.trainer.algorithm)
    metrics = backend._train(tenant, data)
    sent = dispatch.trained[-1]["action_log_probs"][dispatch.trained[-1]["response_mask"].bool()]
    if step_style == "tinker":
        assert dispatch.forwards == [] and torch.all(sent == -9.0)
    else:
        assert dispatch.forwards == ["t"] and torch.all(sent == -0.5)
    assert metrics["lr"] == 1e-3 and metrics["grad_norm"] == 2.0
    output, groups = _output(rollout_shift=-9.0)
    without = training_input({**output, "rollout_logprobs": None}, groups, 0, dispatch.cfg.trainer.algorithm)
    if step_style == "tinker":
        with pytest.raises(RuntimeError, match="clora.step_style=tinker needs the sampler's log-probs"):
            backend._train(tenant, without)
    else:
        assert backend._train(tenant, without)["grad_norm"] == 2.0


def test_a_step_the_worker_ran_with_another_lr_fails(tmp_path: Path) -> None:
    """Megatron's step metrics are checked against the LR its optimizer reports, not the driver's own value."""
    backend = _megatron_backend("skyrl", tmp_path)
    dispatch = _Dispatch(reported_lr=3e-3)  # e.g. another tenant's LR left in the optimizer
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=LRSchedule(1e-3))
    data = training_input(*_output(rollout_shift=-9.0), 0, translate(compose_config(
        ["backend=skyrl", f"trainer.policy.model.path={tmp_path}"])).base.trainer.algorithm)
    with pytest.raises(RuntimeError, match="the worker reports .*policy_lr.*0.003"):
        backend._train(tenant, data)


def test_kl_in_reward_penalises_the_rewards_before_the_advantages(tmp_path: Path) -> None:
    """``use_kl_in_reward``: the rewards sent lose ``kl * kl_loss_coef`` per trained token (k1: policy - base = 1.0
    here) and the advantages are SkyRL's of those rewards; the step reports SkyRL's ``avg_kl``."""
    backend = _megatron_backend("skyrl", tmp_path)
    dispatch = _Dispatch(reported_lr=1e-3, use_kl_in_reward=True, kl_loss_coef=0.25, kl_estimator_type="k1")
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=LRSchedule(1e-3))
    algorithm = dispatch.cfg.trainer.algorithm
    output, groups = _output(rollout_shift=-9.0)
    output["rewards"] = [1.0, 1.0, 0.0, 0.0]  # equal within each group: zero advantages without the penalty
    data = training_input(output, groups, 0, algorithm)
    before = data["rewards"].clone()
    metrics = backend._train(tenant, data)
    sent = dispatch.trained[-1]
    assert dispatch.forwards == ["t", REFERENCE_MODEL_ID]
    assert torch.allclose(sent["rewards"], before - 0.25 * sent["loss_mask"])
    expected, _ = compute_advantages_and_returns(
        token_level_rewards=sent["rewards"], response_mask=sent["response_mask"], index=groups,
        adv_estimator=algorithm.advantage_estimator, config=algorithm, values=None, gamma=algorithm.gamma,
        lambd=algorithm.lambd, grpo_norm_by_std=algorithm.grpo_norm_by_std)
    expected = expected / sent["loss_mask"].sum()  # token_mean over the step's one mini-batch
    assert torch.allclose(sent["advantages"], expected) and sent["advantages"].abs().sum() > 0
    assert metrics["avg_kl"] == pytest.approx(1.0)


def test_one_optimizer_step_per_mini_batch_and_epoch_with_the_lr_schedule_over_optimizer_steps(tmp_path: Path) -> None:
    """SkyRL's ``_execute_training_step``: ``policy_mini_batch_size=1`` of 2 prompts and 2 epochs make 4
    ``forward_backward`` + ``optim_step`` pairs over the prompts' rows in batch order, each mini-batch's advantages
    scaled by its own token count (token_mean), the LR stepping per optimizer step."""
    backend = _megatron_backend("skyrl", tmp_path)
    dispatch = _Dispatch(mini_batch_prompts=1, epochs=2)
    schedule = LRSchedule(1e-3, warmup_steps=4, total_steps=8, kind="cosine")
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=schedule)
    algorithm = dispatch.cfg.trainer.algorithm
    data = training_input(*_output(rollout_shift=-9.0), 0, algorithm)
    raw = data["advantages"].clone()
    metrics = backend._train(tenant, data)
    assert [mini.metadata["uids"] for mini in dispatch.trained] == [["g0", "g0"], ["g1", "g1"]] * 2
    assert [mini["sequences"].shape[0] for mini in dispatch.trained] == [2, 2, 2, 2]
    for mini, rows in zip(dispatch.trained, [slice(0, 2), slice(2, 4)] * 2):
        assert torch.equal(mini["sequences"], data["sequences"][rows])
        assert torch.allclose(mini["advantages"], raw[rows] / data["loss_mask"][rows].sum())
    assert dispatch.lrs == [schedule.lr(k) for k in range(4)] and len(set(dispatch.lrs)) == 4
    assert tenant.steps_done == 4 and metrics["optimizer_steps"] == 4.0
    assert metrics["lr"] == pytest.approx(sum(dispatch.lrs) / 4)


class _Clock:
    """A ``perf_counter`` that moves only when told to: the seconds each timed call takes are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedDispatch(_Dispatch):
    """:class:`_Dispatch` whose calls each take a distinct power of two of ``clock``'s seconds: a phase's total
    names the calls it covers."""

    COST = {"swap": 1.0, "forward t": 2.0, f"forward {REFERENCE_MODEL_ID}": 4.0, "set_lr": 8.0,
            "forward_backward": 16.0, "optim_step": 32.0}

    def __init__(self, clock: _Clock, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    def ensure_active_adapter(self, model: str, model_id: str) -> None:
        self.clock.now += self.COST["swap"]
        super().ensure_active_adapter(model, model_id)

    def forward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.clock.now += self.COST[f"forward {model_id}"]
        return super().forward(model, data, model_id)

    def set_lr(self, model: str, lr: float, model_id: str) -> None:
        self.clock.now += self.COST["set_lr"]
        super().set_lr(model, lr, model_id)

    def forward_backward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.clock.now += self.COST["forward_backward"]
        return super().forward_backward(model, data, model_id)

    def optim_step(self, model: str, model_id: str) -> float:
        self.clock.now += self.COST["optim_step"]
        return super().optim_step(model, model_id)


def test_a_steps_update_reports_the_seconds_of_each_of_its_parts(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each phase is the seconds of its own calls: the swap once, the behaviour and reference forwards, and per
    optimizer step (2 epochs here) ``forward_backward`` and Megatron's ``set_lr`` + ``optim_step``; ``lock_wait_s``
    is how long the tenant's ``exclusive_update`` waited while another tenant held it."""
    clock = _Clock()
    monkeypatch.setattr(backend_module, "time", SimpleNamespace(perf_counter=clock))
    backend = _megatron_backend("skyrl", tmp_path)
    backend.stack.tokenizer = SimpleNamespace(pad_token_id=0)
    dispatch = _TimedDispatch(clock, reported_lr=1e-3, epochs=2, use_kl_loss=True)
    backend.tenants["t"] = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None,
                                  schedule=LRSchedule(1e-3))
    output, groups = _output(rollout_shift=-9.0)

    async def step_behind_another_tenant() -> Update:
        async def step() -> Update:
            async with backend.exclusive_update("t"):
                return await backend.train("t", Rollout(output, groups, [], []))

        async with backend.exclusive_update("other"):
            stepping = asyncio.create_task(step())
            await asyncio.sleep(0)  # "t" asks for the lock while "other" holds it
            clock.now += 64.0
        return await stepping

    metrics = asyncio.run(step_behind_another_tenant()).metrics
    assert {phase: metrics[phase] for phase in STEP_PHASES} == {
        "lock_wait_s": 64.0, "swap_s": 1.0, "recompute_s": 2.0, "reference_s": 4.0, "forward_backward_s": 2 * 16.0,
        "optim_s": 2 * (8.0 + 32.0)}
    assert dispatch.swaps == ["t"] and dispatch.forwards == ["t", REFERENCE_MODEL_ID]
    assert metrics["optimizer_steps"] == 2
    assert backend._lock_waits == {"other": 0.0}  # "t"'s wait went into its update


class _DirectDispatch:
    """``WorkerDispatch``'s calls made on an :class:`EmbeddedPolicyWorker` in this process (no Ray)."""

    def __init__(self, cfg: SkyRLTrainConfig, worker: EmbeddedPolicyWorker) -> None:
        self.cfg, self.worker = cfg, worker

    def ensure_active_adapter(self, model: str, model_id: str) -> None:
        self.worker.swap_to_adapter(model_id)

    def forward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.worker.swap_to_adapter(model_id)
        return self.worker.forward(data)

    def set_algorithm_config(self, model: str, **kwargs: object) -> None:
        self.worker.set_algorithm_config(**kwargs)

    def stage_data(self, model: str, data, boundaries: list[tuple[int, int]]) -> list[list]:
        return [[data[start:end]] for start, end in boundaries]

    def forward_from_staged(self, model: str, chunk_refs: list, model_id: str) -> WorkerOutput:
        return self.forward(model, chunk_refs[0], model_id)

    def forward_backward(self, model: str, data, model_id: str) -> WorkerOutput:
        self.worker.swap_to_adapter(model_id)
        return self.worker.forward_backward(data)

    def optim_step(self, model: str, model_id: str) -> float:
        self.worker.swap_to_adapter(model_id)
        return self.worker.optim_step()


def _worker(cfg: SkyRLTrainConfig, model_dir: Path) -> EmbeddedPolicyWorker:
    worker = EmbeddedPolicyWorker(cfg.trainer, 1, 0, 0, None, None)
    worker.init_model(str(model_dir), num_training_steps=8, tenants={"t": {"seed": 3, "lr": 5e-2, "rank": 8, "alpha": 16}},
                      max_rank=8)
    worker.register_adapter("t")
    return worker


def test_mini_batch_steps_on_the_embedded_worker_equal_the_embedded_trainers(micro_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """The driver's mini-batch steps through the stand-in worker update the tenant as the embedded trainer's own
    ``policy_mini_batch_size`` / ``update_epochs_per_batch`` steps do (one scoring of the behaviour log-probs,
    each mini-batch its own normaliser and LR step)."""
    cfg = SkyRLTrainConfig()
    cfg.trainer.algorithm = AlgorithmConfig(use_kl_loss=False)
    cfg.trainer.train_batch_size, cfg.generator.n_samples_per_prompt = 2, 2
    cfg.trainer.policy_mini_batch_size, cfg.trainer.update_epochs_per_batch = 1, 2
    cfg.trainer.micro_train_batch_size_per_gpu = 2
    cfg.trainer.policy.optimizer_config.scheduler, cfg.trainer.policy.optimizer_config.num_warmup_steps = "cosine", 1
    driven, reference = _worker(cfg, micro_model_dir), _worker(cfg, micro_model_dir)
    stack = SimpleNamespace(strategy="embedded", step_metrics=lambda name, output, grad_norm: driven.step_metrics(name))
    backend = SkyRLBackend(SimpleNamespace(trainer=SimpleNamespace(step_style="skyrl")), plan=None, stack=stack)
    schedule = driven.store.tenants["t"].schedule
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=_DirectDispatch(cfg, driven), generator=None, view=None,
                    schedule=schedule)
    output, groups = _output(rollout_shift=-9.0)
    output["rewards"] = [1.0, 0.0, 0.0, 1.0]
    data = training_input(output, groups, 0, cfg.trainer.algorithm)
    batch = training_batch_to_train_batch(data.select(["sequences", "attention_mask", "response_mask", "loss_mask",
                                                       "rewards", "rollout_logprobs"], ["uids", "response_length"]))
    initial = {key: value.clone() for key, value in driven.store.tenants["t"].master.items()}
    metrics = backend._train(tenant, data)
    reference.trainer.mini_batch_prompts, reference.trainer.update_epochs = 1, 2
    _, expected = reference.trainer.train_step("t", batch)
    assert metrics["optimizer_steps"] == expected["optimizer_steps"] == 4
    assert metrics["lr"] == pytest.approx(expected["lr"])
    assert metrics["policy_loss"] == pytest.approx(expected["policy_loss"], abs=1e-6)
    for key, value in driven.store.tenants["t"].flat.items():
        assert torch.allclose(value, reference.store.tenants["t"].flat[key], atol=1e-6), key
    assert max((value - initial[key]).abs().max().item() for key, value in driven.store.tenants["t"].master.items()) > 1e-3
    assert driven.store.tenants["t"].step == 4


def test_the_embedded_worker_trains_on_the_advantages_it_is_sent(micro_model_dir: Path) -> None:
    """As SkyRL's policy workers, the stand-in reads ``advantages`` (the driver's, scaled by the loss reduction)
    rather than computing its own: all-zero advantages give a zero gradient whatever the rewards."""
    cfg = SkyRLTrainConfig()
    cfg.trainer.algorithm = AlgorithmConfig(use_kl_loss=False)
    worker = _worker(cfg, micro_model_dir)
    worker.swap_to_adapter("t")
    data = training_input(*_output(rollout_shift=-9.0), 0, cfg.trainer.algorithm)
    assert data["advantages"].abs().sum() > 0
    worker.forward_backward(data)
    assert worker.optim_step() > 0
    data["advantages"] = torch.zeros_like(data["advantages"])
    worker.forward_backward(data)
    assert worker.optim_step() == 0.0


def test_the_kl_reference_is_scored_at_temperature_1_and_the_run_temperature_restored(tmp_path: Path) -> None:
    """SkyRL's reference worker scores at temperature 1 while the policy workers' ``forward`` uses
    ``trainer.algorithm.temperature``: the driver sets 1 on the workers for the reference's forward only, and the
    run's temperature again after it, also when that forward fails."""
    backend = _megatron_backend("skyrl", tmp_path)
    dispatch = _Dispatch(reported_lr=1e-3, use_kl_loss=True, temperature=0.5)
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=LRSchedule(1e-3))
    data = training_input(*_output(rollout_shift=-9.0), 0, dispatch.cfg.trainer.algorithm)
    backend._train(tenant, data)
    assert dispatch.forwards == ["t", REFERENCE_MODEL_ID] and dispatch.forward_temperatures == [0.5, 1.0]
    assert dispatch.worker_temperature == 0.5 and dispatch.cfg.trainer.algorithm.temperature == 0.5
    dispatch.fail_forward_of = REFERENCE_MODEL_ID
    with pytest.raises(RuntimeError, match="forward of clora:reference failed"):
        backend._train(tenant, training_input(*_output(rollout_shift=-9.0), 0, dispatch.cfg.trainer.algorithm))
    assert dispatch.forward_temperatures[-1] == 1.0 and dispatch.worker_temperature == 0.5


def test_the_embedded_worker_scores_and_trains_at_its_algorithm_temperature(micro_model_dir: Path) -> None:
    """As SkyRL's policy workers: ``forward`` (any model id, the reference included) and the update compute
    ``log_softmax(logits / cfg.algorithm.temperature)``, and ``set_algorithm_config`` changes that temperature."""
    cfg = SkyRLTrainConfig()
    cfg.trainer.algorithm = AlgorithmConfig(use_kl_loss=False, temperature=0.5)
    worker = _worker(cfg, micro_model_dir)  # a fresh adapter (B = 0): the tenant's policy is the base model
    output, groups = _output(rollout_shift=-9.0)
    data = training_input(output, groups, 0, cfg.trainer.algorithm)
    mask = data["response_mask"].bool()
    tempered = _direct_logprobs(micro_model_dir, None, data, temperature=0.5)
    untempered = _direct_logprobs(micro_model_dir, None, data)
    assert (tempered[mask] - untempered[mask]).abs().max() > 1e-2

    def scored(model_id: str) -> torch.Tensor:
        worker.swap_to_adapter(model_id)
        rows = worker.forward(data.select(["sequences", "attention_mask"], ["response_length"])).loss_fn_outputs
        return torch.tensor([row["logprobs"] for row in rows])

    assert torch.allclose(scored("t")[mask], tempered[mask], atol=1e-4)
    assert torch.allclose(scored(REFERENCE_MODEL_ID)[mask], tempered[mask], atol=1e-4)
    worker.set_algorithm_config(temperature=1.0)
    assert torch.allclose(scored(REFERENCE_MODEL_ID)[mask], untempered[mask], atol=1e-4)
    assert torch.allclose(scored("t")[mask], untempered[mask], atol=1e-4)
    worker.set_algorithm_config(temperature=0.5)
    worker.swap_to_adapter("t")
    worker.forward_backward(data)
    worker.optim_step()  # one step: its forward runs with the pre-update adapter, the base at T=0.5
    assert worker.step_metrics("t")["mean_token_logprob"] == pytest.approx(tempered[mask].mean().item(), abs=1e-4)
    with pytest.raises(ValueError, match="trainer.algorithm has no field 'temprature'"):
        worker.set_algorithm_config(temprature=1.0)


@pytest.mark.parametrize("per_mini_batch", [True, False])
def test_old_log_probs_are_recomputed_per_mini_batch_as_skyrl_does(tmp_path: Path, per_mini_batch: bool) -> None:
    """SkyRL's ``trainer.recompute_old_logprobs_per_minibatch``: one forward per policy mini-batch over its staged
    chunks (rows in batch order), else one forward over the batch."""
    backend = _megatron_backend("skyrl", tmp_path)
    dispatch = _Dispatch(mini_batch_prompts=1)
    dispatch.cfg.trainer.recompute_old_logprobs_per_minibatch = per_mini_batch
    tenant = Tenant(spec=SimpleNamespace(name="t"), dispatch=dispatch, generator=None, view=None, schedule=LRSchedule(1e-3))
    data = training_input(*_output(rollout_shift=-9.0), 0, dispatch.cfg.trainer.algorithm)
    backend._train(tenant, data)
    assert dispatch.staged_forward_rows == ([2, 2] if per_mini_batch else [])
    assert dispatch.forwards == (["t", "t"] if per_mini_batch else ["t"])
    assert data["action_log_probs"].shape == data["response_mask"].shape
    assert torch.all(data["action_log_probs"] == -0.5)


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_a_float32_rounded_lr_report_is_this_steps(strategy: str) -> None:
    lr = 3e-6
    assert _float32(lr) != lr  # the exact comparison this replaces raised here
    reported = {"policy_lr": _float32(lr)}
    check_step_report("t", lr, 0.5, reported, {"lr": _float32(lr), "grad_norm": 0.5}, strategy)


@pytest.mark.parametrize("wrong", [3.1e-6, 1e-6])
def test_an_lr_report_beyond_float32_rounding_is_refused(wrong: float) -> None:
    with pytest.raises(RuntimeError, match="tenant t: the worker reports .*policy_lr"):
        check_step_report("t", 3e-6, 0.5, {"policy_lr": _float32(wrong)}, {"lr": 3e-6}, "megatron")


def test_the_embedded_workers_grad_norm_must_match_exactly() -> None:
    with pytest.raises(RuntimeError, match="grad_norm"):
        check_step_report("t", 1e-3, 0.5, {"policy_lr": 1e-3}, {"lr": 1e-3, "grad_norm": _float32(0.1)}, "embedded")
