"""The embedded SkyRL-protocol server's GPU memory plan beside SkyRL's policy workers on the same GPU.

With ``backend=skyrl backend.inference_backend=embedded`` and a GPU-trained strategy (fsdp2), the engine in the
driver and SkyRL's policy workers (Ray actors, one GPU each) may share a GPU: on a one-GPU machine they always do.
Before the engine is planned, each worker runs one ``forward_backward`` of :func:`peak_pass_batch` (the configured
micro-batch, every row at the longest sequence) on a throwaway tenant (``FSDPTenantsMixin.measure_training_peak``)
and reports its GPU's uuid and its allocator's peak and current reservation. :func:`held_by_other_processes` is then
what the engine's plan leaves to the others: all the GPU memory other processes hold now (the workers' weights,
optimizer state, slots and CUDA contexts), plus each worker on this GPU's peak reservation above what it holds now.
"""

from __future__ import annotations

from typing import Any

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors


def peak_pass_batch(rows: int, seq_len: int, vocab_size: int, pad_token_id: int,
                    with_reference: bool) -> TrainingInputBatch:
    """A ``TrainingInputBatch`` of ``rows`` rows of random tokens, each ``seq_len`` tokens (half prompt, half
    response, every response token in the loss), with the keys SkyRL's ``forward_backward`` reads: zero
    advantages, returns and behaviour log-probs (``base_action_log_probs`` too when ``with_reference``)."""
    generator = torch.Generator().manual_seed(0)
    prompt, response = seq_len // 2, seq_len - seq_len // 2
    prompts = [torch.randint(vocab_size, (prompt,), generator=generator).tolist() for _ in range(rows)]
    responses = [torch.randint(vocab_size, (response,), generator=generator).tolist() for _ in range(rows)]
    rewards = [[0.0] * response for _ in range(rows)]
    masks = [[1] * response for _ in range(rows)]
    sequences, attention, response_mask, token_rewards, loss_mask, _, _, _ = convert_prompts_responses_to_batch_tensors(
        pad_token_id, prompts, responses, rewards, masks, None)
    zeros = torch.zeros_like(token_rewards)
    data = TrainingInputBatch({
        "sequences": sequences, "attention_mask": attention, "response_mask": response_mask,
        "rewards": token_rewards, "loss_mask": loss_mask, "advantages": zeros, "returns": zeros,
        "action_log_probs": zeros,
    })
    if with_reference:
        data["base_action_log_probs"] = zeros
    data.metadata = {"uids": [str(row // 2) for row in range(rows)], "response_length": response_mask.shape[1]}
    return data


def held_by_other_processes(device: torch.device, reports: list[dict[str, Any]]) -> int:
    """Bytes of ``device``'s memory the engine's plan leaves to other processes: what they hold now (the device's
    used memory less this process's allocator reservation; this process's CUDA context is counted with them), plus,
    for each worker report (``{"uuid", "peak_reserved", "reserved"}``) from a worker on this device, its peak
    reservation above its current one."""
    free, total = torch.cuda.mem_get_info(device)
    held_now = total - free - torch.cuda.memory_reserved(device)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    growth = sum(max(0, report["peak_reserved"] - report["reserved"]) for report in reports if report["uuid"] == uuid)
    return max(0, held_now) + growth
