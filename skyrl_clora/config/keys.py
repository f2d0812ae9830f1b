"""SkyRL's key tree inside the plugin's config, and what each SkyRL key does on each backend.

The composed config holds SkyRL 0.4's whole ``SkyRLTrainConfig`` tree (``data``, ``trainer``, ``generator``,
``environment``; its defaults registered in Hydra's ConfigStore as ``skyrl_defaults``), so every key of SkyRL's
entry point is accepted with SkyRL's meaning. The plugin's own keys live beside it: ``clora``, ``sampler``,
``model``, ``recipe`` and ``backend``.

- ``backend=skyrl``: the SkyRL tree, as given, is the translated ``SkyRLTrainConfig``
  (``skyrl.config_translation``); only the keys of :data:`SKYRL_SET` are set by the plugin, and a value given
  for one of them that the plugin cannot keep is refused there. The keys only SkyRL's trainer loop reads
  (:data:`SKYRL_RULES`), given on the command line, are refused unless their value is what the tenant loop does,
  or ignored with a line saying so (:func:`check_skyrl_keys`).
- ``backend=embedded``: a SkyRL key given on the command line must be one of :data:`KEY_RULES`: honoured
  (it acts where the rule says), ignored (it only places work on machines, which one process replaces) or
  accepted only with the values the embedded trainer implements. Any other SkyRL key is refused with a
  one-line reason (:func:`check_embedded_keys`). docs/config.md is this table (``python -m
  skyrl_clora.config.keys`` writes it; a test checks it is current).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields
from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf

SKYRL_GROUPS = ("data", "trainer", "generator", "environment")
"""The top-level keys of SkyRL's ``SkyRLTrainConfig``."""

FREE_FORM_KEYS = (
    "generator.chat_template_kwargs", "generator.sampling_params.additional_kwargs",
    "generator.eval_sampling_params.additional_kwargs", "generator.inference_engine.engine_init_kwargs",
    "generator.inference_engine.prefill_init_kwargs", "generator.inference_engine.decode_init_kwargs",
    "generator.inference_engine.router_init_kwargs", "trainer.policy.model_config_kwargs",
    "trainer.ref.model_config_kwargs", "trainer.critic.model_config_kwargs",
    "trainer.policy.megatron_config.model_config_kwargs", "trainer.ref.megatron_config.model_config_kwargs",
)
"""SkyRL's free-form dicts (``dict`` fields, empty or null by default): any key under them is SkyRL's to take, set as
SkyRL's command line sets it (``generator.chat_template_kwargs.enable_thinking=false``)."""

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"


@dataclass(frozen=True)
class KeyRule:
    """What ``backend=embedded`` does with SkyRL key ``key`` (``prefix.*``: every key under ``prefix``).

    ``action`` is :data:`HONOURED` (``detail``: where it acts), :data:`IGNORED` (``detail``: why it changes
    nothing here) or :data:`REFUSED` (``detail``: the fix); ``accepts(value, cfg)``, when given, is the values a
    refused key is nevertheless run with (those equal to what the embedded trainer does)."""

    key: str
    action: str
    detail: str
    accepts: Callable[[Any, DictConfig], bool] | None = None

    def matches(self, key: str) -> bool:
        """``key`` is the rule's key, or under its ``prefix.*``, or starts with its ``prefix_*``."""
        return key == self.key or (self.key.endswith("*") and key.startswith(self.key[:-1]))


def _equals(expected: Any) -> Callable[[Any, DictConfig], bool]:
    return lambda value, cfg: value == expected


def _false(value: Any, cfg: DictConfig) -> bool:
    return value in (False, None)


def _empty(value: Any, cfg: DictConfig) -> bool:
    return value is None or (OmegaConf.is_dict(value) or isinstance(value, dict)) and len(value) == 0


_PLACEMENT = "placement only: one process runs the engine and the trainer"
KEY_RULES: tuple[KeyRule, ...] = (
    KeyRule("data.train_data", HONOURED, "the recipe's training rows (every file, concatenated); []: synthetic"),
    KeyRule("data.val_data", HONOURED, "evaluation rows: every row, as SkyRL ([]: recipe.eval_prompts synthetic "
            "held-out problems)"),
    KeyRule("environment.env_class", HONOURED, "picks the recipe serving that env (any env registered with skyrl-gym: "
            "rows from data.train_data), and the env of every row without an env_class of its own (SkyRL's rule)"),
    KeyRule("trainer.policy.model.path", HONOURED, "the shared base model: a folder, or a hub id resolved in the Hugging "
            "Face cache (downloaded unless offline; null: the tiny base)"),
    KeyRule("trainer.policy.model.lora.rank", HONOURED, "every tenant's LoRA rank (tenant override: rank)"),
    KeyRule("trainer.policy.model.lora.alpha", HONOURED, "every tenant's LoRA alpha (tenant override: alpha)"),
    KeyRule("trainer.policy.model.lora.target_modules", REFUSED,
            "the embedded LoRA layers target every linear layer: use all-linear", _equals("all-linear")),
    KeyRule("trainer.policy.model.lora.dropout", REFUSED, "the embedded LoRA layers have no dropout: use 0",
            _equals(0)),
    KeyRule("trainer.policy.optimizer_config.lr", HONOURED, "every tenant's peak AdamW learning rate (tenant override: lr)"),
    KeyRule("trainer.policy.optimizer_config.weight_decay", HONOURED,
            "AdamW's decoupled weight decay (tenant override: weight_decay)"),
    KeyRule("trainer.policy.optimizer_config.max_grad_norm", HONOURED,
            "per-tenant gradient clipping (tenant override: max_grad_norm)"),
    KeyRule("trainer.policy.optimizer_config.num_warmup_steps", HONOURED,
            "linear warm-up over optimizer steps, SkyRL's: step k at lr * k / num_warmup_steps (the first at 0)"),
    KeyRule("trainer.policy.optimizer_config.scheduler", HONOURED,
            "constant_with_warmup, constant (no warm-up) and cosine, each as SkyRL's (HF get_scheduler); others are "
            "refused"),
    KeyRule("trainer.policy.optimizer_config.offload_after_step", IGNORED, "memory placement only"),
    KeyRule("trainer.seed", HONOURED, "tenant i's seed is seed + i (tenant override: seed)"),
    KeyRule("trainer.epochs", HONOURED, "RL steps = epochs * (training rows // train_batch_size), at most max_training_steps"),
    KeyRule("trainer.max_training_steps", HONOURED, "RL steps per tenant at most"),
    KeyRule("trainer.train_batch_size", HONOURED, "prompts per RL step per tenant"),
    KeyRule("trainer.policy_mini_batch_size", HONOURED,
            "prompts per optimizer step (a divisor of train_batch_size): train_batch_size // it steps per RL step"),
    KeyRule("trainer.update_epochs_per_batch", HONOURED, "passes over each RL step's mini-batches (steps multiply)"),
    KeyRule("trainer.micro_train_batch_size_per_gpu", HONOURED, "sequences per forward/backward micro-batch"),
    KeyRule("trainer.max_tokens_per_microbatch", HONOURED, "token-bounded micro-batches"),
    KeyRule("trainer.micro_forward_batch_size_per_gpu", IGNORED, "batching only: the step recomputes no forward pass"),
    KeyRule("trainer.eval_batch_size", IGNORED, "batching only: every evaluation row is sent to the engine at once "
            "(each request's sampling is seeded by its trajectory, not its batch)"),
    KeyRule("trainer.eval_interval", HONOURED, "evaluate every k RL steps and after the last (<= 0: never)"),
    KeyRule("trainer.eval_before_train", HONOURED, "evaluate before step 1 (with eval_interval > 0)"),
    KeyRule("trainer.ckpt_interval", HONOURED, "a checkpoint per tenant every k steps and at its end"),
    KeyRule("trainer.ckpt_path", HONOURED, "checkpoints under <ckpt_path>/<tenant>/ (null: <clora.output_dir>/checkpoints)"),
    KeyRule("trainer.max_ckpts_to_keep", HONOURED, "per tenant"),
    KeyRule("trainer.resume_mode", HONOURED, "latest | none (null) | from_path"),
    KeyRule("trainer.resume_path", HONOURED, "with resume_mode=from_path"),
    KeyRule("trainer.logger", HONOURED, "SkyRL's Tracking, one run per tenant: console, tensorboard, wandb"),
    KeyRule("trainer.project_name", HONOURED, "the trackers' project"),
    KeyRule("trainer.run_name", HONOURED, "the trackers' run prefix (<run_name>/<tenant>)"),
    KeyRule("trainer.log_path", IGNORED, "SkyRL's inference-server logs: no server runs"),
    KeyRule("trainer.strategy", IGNORED, "the embedded trainer replaces FSDP2/Megatron (SkyRL's values: fsdp, fsdp2, "
            "megatron)"),
    KeyRule("trainer.placement.*", IGNORED, _PLACEMENT),
    KeyRule("trainer.bf16", IGNORED, "precision is model.dtype"),
    KeyRule("trainer.gradient_checkpointing", IGNORED, "memory only"),
    KeyRule("trainer.use_expandable_segments", IGNORED, "memory only"),
    KeyRule("trainer.max_prompt_length", HONOURED,
            "rows whose prompt is longer (chat template included) are dropped at load, as SkyRL's PromptDataset does; "
            "generator.max_input_length when that is null (SkyRL's default)"),
    KeyRule("trainer.algorithm.use_kl_loss", HONOURED,
            "SkyRL's KL loss against the frozen base (each tenant's adapter disabled): one more forward per micro-batch"),
    KeyRule("trainer.algorithm.use_kl_in_reward", HONOURED,
            "SkyRL's KL penalty on the rewards (each tenant's own kl_ctrl controller; exclusive with use_kl_loss)"),
    KeyRule("trainer.algorithm.dynamic_sampling.*", REFUSED, "no dynamic sampling: leave dynamic_sampling.type null",
            lambda value, cfg: cfg.trainer.algorithm.dynamic_sampling.type is None),
    KeyRule("trainer.algorithm.advantage_estimator", REFUSED,
            "gae needs a critic, which the tenants' step has not: use a critic-free estimator (grpo, rloo, ...)",
            lambda value, cfg: value != "gae"),
    KeyRule("trainer.algorithm.use_entropy_loss", REFUSED, "the tenants' step has no entropy term: set it to false",
            _false),
    KeyRule("trainer.algorithm.advantage_batch_normalize", REFUSED,
            "advantages are normalised per GRPO group only: set it to false", _false),
    KeyRule("trainer.algorithm.zero_variance_filter", REFUSED, "no zero-variance filter: set it to false", _false),
    KeyRule("trainer.algorithm.enable_sample_support_replay", REFUSED, "no sample-support replay: set it to false",
            _false),
    KeyRule("trainer.algorithm.kl_*", HONOURED, "kl_loss_coef, kl_estimator_type (k1, k2, k3, abs), kl_ctrl (fixed or "
            "adaptive: SkyRL's controller per tenant, its value in the tenant's checkpoint; tenant override: kl_loss_coef)"),
    KeyRule("trainer.algorithm.loss_reduction", HONOURED,
            "each of SkyRL's (token_mean, token_mean_legacy, sequence_mean, seq_mean_token_sum_norm, prompt_mean), "
            "folded into each mini-batch's advantages as SkyRL's _normalize_advantages does"),
    KeyRule("trainer.algorithm.max_seq_len", HONOURED,
            "seq_mean_token_sum_norm's normalising length (required with it, as SkyRL requires)"),
    KeyRule("trainer.algorithm.entropy_loss_coef", IGNORED, "the entropy term is off (use_entropy_loss must be false)"),
    KeyRule("trainer.algorithm.value_*", IGNORED, "critic settings: the tenants' step has no critic"),
    KeyRule("trainer.algorithm.*", HONOURED, "SkyRL's advantage estimator and policy loss (its registries and their "
            "settings: loss_reduction, eps_clip_*, off_policy_correction, sapo, cispo, ...; tenant overrides: eps_clip_low, "
            "eps_clip_high, advantage_estimator, policy_loss_type)"),
    KeyRule("generator.n_samples_per_prompt", HONOURED, "GRPO group size (tenant override: samples_per_prompt)"),
    KeyRule("generator.max_turns", HONOURED, "assistant turns per episode"),
    KeyRule("generator.max_input_length", HONOURED, "prompt + history tokens before a turn"),
    KeyRule("generator.sampling_params.max_generate_length", HONOURED, "tokens per assistant turn"),
    KeyRule("generator.sampling_params.temperature", HONOURED,
            "every tenant's sampling temperature, and the one its policy log-probs are computed at (logits / T, as "
            "SkyRL's; 0, greedy: untempered; tenant override: temperature)"),
    KeyRule("generator.sampling_params.top_p", HONOURED, "nucleus sampling (tenant override: top_p)"),
    KeyRule("generator.batched", IGNORED, "the engine batches every tenant's requests either way (true refuses "
            "chat_template_kwargs, SkyRL's rule)"),
    KeyRule("generator.chat_template_kwargs*", HONOURED,
            "passed to the tokenizer's apply_chat_template by SkyRL's generator (with generator.batched=false)"),
    *(KeyRule(f"{group}.additional_kwargs*", REFUSED, f"the embedded engine samples with temperature, top_p and max "
              f"tokens only: drop {group}.additional_kwargs (backend=skyrl passes it to vLLM)", _empty)
      for group in ("generator.sampling_params", "generator.eval_sampling_params")),
    *(KeyRule(f"{group}.{name}", REFUSED, f"the embedded engine samples without {name}: leave it "
              f"{'null' if default is None else default}",
              _equals(default))
      for group in ("generator.sampling_params", "generator.eval_sampling_params")
      for name, default in (("top_k", -1), ("min_p", 0.0), ("repetition_penalty", 1.0), ("stop", None))),
    KeyRule("generator.eval_n_samples_per_prompt", HONOURED, "evaluation episodes per row (SkyRL's pass@n is over them)"),
    KeyRule("generator.eval_sampling_params.max_generate_length", HONOURED,
            "tokens per evaluation turn (SkyRL's rule: training's when no eval_sampling_params key is given, else "
            "SamplingParams' 1024 unless given)"),
    KeyRule("generator.eval_sampling_params.temperature", HONOURED,
            "evaluation's temperature (SkyRL's rule: 0, greedy, when no eval_sampling_params key is given, else "
            "SamplingParams' 1.0 unless given)"),
    KeyRule("generator.eval_sampling_params.top_p", HONOURED, "evaluation's nucleus sampling"),
    KeyRule("generator.eval_sampling_params.logprobs", IGNORED, "evaluation trains nothing: no log-probs are read"),
    KeyRule("trainer.policy.model_config_kwargs*", REFUSED, "the embedded engine and trainer build the model from its "
            "folder's config as it is: drop it (backend=skyrl's policy workers apply it)", _empty),
    KeyRule("generator.inference_engine.engine_init_kwargs.kv_cache_dtype", HONOURED,
            "the embedded engine's KV cache: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3, scale 1.0: "
            "half the bytes per KV block and per decode read)"),
    KeyRule("generator.inference_engine.enable_prefix_caching", HONOURED,
            "the embedded engine's prefix cache: prompt blocks stay shared with later prompts of the same prefix and "
            "adapter version (LRU-evicted from the KV pool)"),
    KeyRule("generator.inference_engine.gpu_memory_utilization", IGNORED,
            "the embedded engine's budget is sampler.gpu_memory_utilization, a share of the GPU for the engine and the "
            "trainer resident beside it (its measured peak taken out); SkyRL's is a vLLM engine's own share"),
    KeyRule("generator.inference_engine.max_num_seqs", IGNORED,
            "the embedded engine's rows are sampler.max_rows (its 0, the default: every tenant's whole step batch, "
            "which a fixed cap cannot say)"),
    KeyRule("generator.inference_engine.*", IGNORED, "vLLM server settings: the embedded engine replaces the servers"),
)

_DRIVER = "SkyRL's trainer loop (RayPPOTrainer) does this; the tenant loop replacing it does not"
SKYRL_RULES: tuple[KeyRule, ...] = (
    KeyRule("trainer.algorithm.dynamic_sampling.*", REFUSED,
            "each tenant's step trains the one batch it sampled (no dynamic sampling): leave dynamic_sampling.type null",
            lambda value, cfg: cfg.trainer.algorithm.dynamic_sampling.type is None),
    KeyRule("trainer.algorithm.zero_variance_filter", REFUSED,
            "no zero-variance groups are masked (every group trains): set it to false", _false),
    KeyRule("generator.step_wise_trajectories", REFUSED,
            "each trajectory trains as one row (no step-wise rows): set it to false", _false),
    KeyRule("generator.merge_stepwise_output", REFUSED,
            "each trajectory trains as one row (no step-wise rows): set it to false", _false),
    KeyRule("trainer.hf_save_interval", REFUSED, "no Hugging Face model exports during a run (each tenant's adapter is "
            "exported in PEFT format to <clora.output_dir>/adapters/<tenant> when it finishes): set it to -1",
            lambda value, cfg: value is None or value <= 0),
    KeyRule("trainer.dump_data_batch", REFUSED, "no training batches are dumped: set it to false", _false),
    KeyRule("trainer.update_ref_every_epoch", REFUSED,
            "the KL reference is the frozen base (each tenant's adapter disabled): set it to false", _false),
    KeyRule("trainer.critic.model.path", REFUSED,
            "the tenants' step has no critic: leave it null and use a critic-free estimator (grpo, rloo, ...)",
            lambda value, cfg: value is None),
    KeyRule("trainer.export_path", IGNORED, "nothing is written there: no Hugging Face exports (hf_save_interval) and no "
            "evaluation dumps; adapters go to <clora.output_dir>/adapters, evaluations to metrics.jsonl"),
    KeyRule("trainer.dump_eval_results", IGNORED, "evaluation records go to <clora.output_dir>/metrics.jsonl"),
    KeyRule("trainer.eval_batch_size", IGNORED, "batching only: every evaluation row is sent to the servers at once"),
    KeyRule("trainer.print_example_interval", IGNORED, f"example printing: {_DRIVER}"),
    KeyRule("trainer.log_example_interval", IGNORED, f"example logging: {_DRIVER}"),
    KeyRule("trainer.num_logger_*", IGNORED, f"example logging: {_DRIVER}"),
    KeyRule("trainer.enable_ray_gpu_monitor", IGNORED, f"GPU monitoring: {_DRIVER}"),
    KeyRule("trainer.tags", IGNORED, "the trackers are given no tags"),
    KeyRule("data.dataloader.*", IGNORED, "the recipe reads each tenant's rows at start (no dataloader workers)"),
)
"""``backend=skyrl``: the SkyRL keys its driver (the tenant loop, in place of SkyRL's ``RayPPOTrainer``) does not act
on, given on the command line: refused (one line) unless the value is what the driver does (``accepts``), or
ignored (logged once). Every other SkyRL key reaches SkyRL's config, where its generator and workers read it."""

SKYRL_SET: dict[str, str] = {
    "trainer.policy.model.path": "null: the tiny base's folder; a hub id: its snapshot folder in the Hugging Face cache",
    "trainer.policy.model.lora.rank": "the tenants' common rank (as given unless every tenant overrides it)",
    "trainer.policy.model.lora.alpha": "the tenants' common alpha (as given unless every tenant overrides it)",
    "trainer.policy.model.lora.max_loras": "null: the tenants sampling at once",
    "trainer.policy.model.lora.max_cpu_loras": "null: every tenant",
    "trainer.policy.model.lora.lora_sync_path": "null: <clora.output_dir>/lora_sync",
    "trainer.strategy": "as given (fsdp2 written fsdp, as SkyRL reads it); it names the policy workers backend.strategy=auto "
                        "runs (their embedded stand-in where this machine cannot); a backend.strategy naming others is "
                        "refused",
    "generator.inference_engine.backend": "vllm (the embedded stand-in speaks its protocol; other values are refused)",
    "generator.sampling_params.logprobs": "1: the step needs the sampled tokens' log-probs",
    "generator.inference_engine.engine_init_kwargs.logprobs_mode":
        "processed_logprobs when the sampling temperature is not 1 or 0 (in both PD roles' kwargs when given): vLLM "
        "then reports the log-probs of logits / T, as the trainer computes them (with top_p < 1 renormalised over the "
        "nucleus, the trainer's not); another value given is refused",
    "trainer.seed": "per tenant: seed + i (or its override)",
    "trainer.policy.optimizer_config.lr": "per tenant: the tenant's lr",
    "generator.n_samples_per_prompt": "per tenant: the tenant's samples_per_prompt",
    "environment.env_class": "per tenant: the tenant's env_class override",
    "trainer.ckpt_path": "null: <clora.output_dir>/checkpoints (the plugin writes the checkpoints)",
    "trainer.run_name": "null: the output folder's name",
    "trainer.micro_train_batch_size_per_gpu": "not given: the largest divisor of the rows per GPU it holds",
    "trainer.micro_forward_batch_size_per_gpu": ("not given: trainer.micro_train_batch_size_per_gpu as set (SkyRL's 1 "
                                                 "makes the log-prob recompute one forward per sequence; a forward "
                                                 "holds less memory than the training pass)"),
}
"""``backend=skyrl``: SkyRL keys the translation sets, with what it sets them to; every other key reaches SkyRL's
config as given."""


@cache
def skyrl_defaults() -> dict[str, Any]:
    """The defaults of SkyRL's ``SkyRLTrainConfig`` fields as a plain dict: each group's dataclass defaults, as SkyRL
    declares them (before its root ``__post_init__`` derives e.g. ``trainer.algorithm.temperature`` from the
    sampling temperature, which SkyRL's builder does again over the given tree)."""
    from skyrl.train.config import SkyRLTrainConfig

    return {f.name: asdict(f.default_factory()) for f in fields(SkyRLTrainConfig)}


@cache
def register_skyrl_defaults() -> None:
    """Stores :func:`skyrl_defaults` in Hydra's ConfigStore as ``skyrl_defaults`` (conf/config.yaml's first
    default), so that every SkyRL key can be overridden; once per process (the store keeps it).
    ``generator.eval_sampling_params.max_generate_length`` is ``${generator.sampling_params.max_generate_length}``:
    SkyRL's ``GeneratorConfig.__post_init__`` gives evaluation the training length when no ``eval_sampling_params``
    is given (``config.skyrl_cli`` keeps SkyRL's rule when some are)."""
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.create(skyrl_defaults())
    node.generator.eval_sampling_params.max_generate_length = "${generator.sampling_params.max_generate_length}"
    ConfigStore.instance().store(name="skyrl_defaults", node=node)


def rule_for(key: str, rules: tuple[KeyRule, ...] = KEY_RULES) -> KeyRule | None:
    """The first rule of ``rules`` (:data:`KEY_RULES` or :data:`SKYRL_RULES`) matching SkyRL key ``key``."""
    return next((rule for rule in rules if rule.matches(key)), None)


def given_keys(overrides: list[str]) -> list[str]:
    """The keys of command-line ``overrides`` (``key=value``, ``+key=value``, ``~key``)."""
    return [override.lstrip("+~").split("=", 1)[0] for override in overrides]


def is_skyrl_key(key: str) -> bool:
    return key.split(".", 1)[0] in SKYRL_GROUPS and key.split(".")[1:2] != []


def embedded_refusal(key: str, cfg: DictConfig) -> str | None:
    """Why ``backend=embedded`` cannot run SkyRL key ``key`` with its value in ``cfg`` (one line), or None."""
    value = OmegaConf.select(cfg, key)
    rule = rule_for(key)
    if rule is None:
        return (f"{key} is a SkyRL key backend=embedded does not implement; drop it, or run it on backend=skyrl "
                "(docs/config.md lists what each backend takes)")
    if rule.action == REFUSED and not (rule.accepts and rule.accepts(value, cfg)):
        return f"{key}={value} on backend=embedded: {rule.detail}"
    return None


def check_embedded_keys(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The one-line refusals of the SkyRL keys in ``overrides`` that ``backend=embedded`` cannot run; the
    ignored ones are logged once."""
    problems, ignored = [], []
    for key in dict.fromkeys(given_keys(overrides)):
        if not is_skyrl_key(key):
            continue
        refusal = embedded_refusal(key, cfg)
        if refusal is not None:
            problems.append(refusal)
        elif rule_for(key).action == IGNORED:
            ignored.append(key)
    if ignored and not problems:
        print(f"[config] backend=embedded ignores {', '.join(ignored)} (docs/config.md says why)", file=sys.stderr)
    return problems


def check_skyrl_keys(cfg: DictConfig, keys: Collection[str]) -> list[str]:
    """``backend=skyrl``: the one-line refusals of the given SkyRL ``keys`` that its driver does not act on
    (:data:`SKYRL_RULES`) with their values in ``cfg``; the ignored ones are logged once."""
    problems, ignored = [], []
    for key in dict.fromkeys(keys):
        rule = rule_for(key, SKYRL_RULES) if is_skyrl_key(key) else None
        if rule is None:
            continue
        if rule.action == IGNORED:
            ignored.append(key)
        elif not (rule.accepts and rule.accepts(OmegaConf.select(cfg, key), cfg)):
            problems.append(f"{key}={OmegaConf.select(cfg, key)} on backend=skyrl: {rule.detail}")
    if ignored and not problems:
        print(f"[config] backend=skyrl ignores {', '.join(ignored)} (docs/config.md says why)", file=sys.stderr)
    return problems


def mapping_table() -> str:
    """docs/config.md's body: one row per rule of :data:`KEY_RULES`, :data:`SKYRL_RULES` and key of :data:`SKYRL_SET`."""
    lines = ["| SkyRL key | backend=embedded | backend=skyrl |", "| --- | --- | --- |"]
    for rule in KEY_RULES:
        lines.append(f"| `{rule.key}` | {embedded_refusal_summary(rule.key)} | {skyrl_summary(rule.key)} |")
    for key in dict.fromkeys([*(rule.key for rule in SKYRL_RULES), *SKYRL_SET]):
        if rule_for(key) is None or rule_for(key).key != key:
            lines.append(f"| `{key}` | {embedded_refusal_summary(key)} | {skyrl_summary(key)} |")
    lines.append("| any other SkyRL key | refused (one line naming the key) | as given |")
    return "\n".join(lines)


def rule_summary(rule: KeyRule | None) -> str:
    """A rule's cell in docs/config.md (None: no rule, refused)."""
    if rule is None:
        return "refused"
    if rule.action == REFUSED and rule.accepts is not None:
        return f"only as it runs here, else refused: {rule.detail}"
    return f"{rule.action}: {rule.detail}"


def embedded_refusal_summary(key: str) -> str:
    """The backend=embedded cell of ``key``'s row in docs/config.md."""
    return rule_summary(rule_for(key))


def skyrl_summary(key: str) -> str:
    """The backend=skyrl cell of ``key``'s row in docs/config.md."""
    if key in SKYRL_SET:
        return SKYRL_SET[key]
    rule = rule_for(key, SKYRL_RULES)
    return "as given" if rule is None else rule_summary(rule)


DOC_HEADER = """# Configuration: SkyRL's keys on each backend

`python -m skyrl_clora.main` takes SkyRL 0.4's own command line (`data.*`, `trainer.*`, `generator.*`,
`environment.*`: every key of `SkyRLTrainConfig`, with SkyRL's meaning and, under `preset=skyrl` (the default
when the command names `trainer.policy.model.path`), SkyRL's default; `preset=demo`, the default without one, is the
tiny demo's values) plus `+tenants=N` (or a list of
per-tenant overrides: name, seed, lr, rank, alpha, task_variant, samples_per_prompt, env_class, and on
backend=embedded temperature, top_p, weight_decay, max_grad_norm, kl_loss_coef, eps_clip_low, eps_clip_high,
advantage_estimator, policy_loss_type) and the
plugin's own keys (`clora.*`, `sampler.*`, `model.*`, `recipe.*`, `backend.*`); `--help` lists them.

On `backend=skyrl` every SkyRL key reaches SkyRL's `SkyRLTrainConfig` as given, except the ones the right-hand
column names: the few the plugin sets, and those only SkyRL's trainer loop reads, which the tenant loop replaces
(given on the command line, such a key is refused with a one-line reason unless its value is what runs, or ignored
with a line saying so). On `backend=embedded` a SkyRL key given on the command line is honoured, ignored (it only places
work on machines) or refused with a one-line reason (exit status 2). This table is generated by
`python -m skyrl_clora.config.keys > docs/config.md` from `skyrl_clora/config/keys.py`.

"""


if __name__ == "__main__":
    print(DOC_HEADER + mapping_table())
