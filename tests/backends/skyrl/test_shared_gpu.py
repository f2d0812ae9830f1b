"""The batch the FSDP2 policy workers measure their training peak with (``skyrl_clora.backends.skyrl.shared_gpu``)."""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator

from skyrl_clora.backends.skyrl.shared_gpu import peak_pass_batch


def test_the_peak_pass_batch_is_every_row_at_the_longest_sequence_in_skyrls_form() -> None:
    data = peak_pass_batch(3, 11, 50, 0, with_reference=True)
    experience = BaseBatchIterator.batch_to_experience(data)
    assert experience.sequences.shape == (3, 11)
    assert experience.num_actions == 6 and experience.loss_mask.shape == (3, 6)
    assert bool(experience.loss_mask.all()) and bool(experience.attention_mask.all())
    assert experience.base_action_log_probs is not None and experience.action_log_probs.shape == (3, 6)
    assert int(experience.sequences.max()) < 50
    assert not torch.equal(experience.sequences[0], experience.sequences[1])


def test_the_reference_log_probs_are_there_only_when_the_loss_reads_them() -> None:
    assert peak_pass_batch(2, 8, 50, 0, with_reference=False).get("base_action_log_probs") is None
