"""Host lists to device tensors (:mod:`skyrl_clora.device.staging`): ``lists_to_device`` gives what
``torch.tensor(values, dtype)`` gives per list (Python lists or numpy arrays, empty ones too), from one buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_clora.device.staging import lists_to_device


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.float64])
def test_each_list_becomes_its_tensor(dtype: torch.dtype) -> None:
    values = [[3, 1, 4], [], np.array([1, 5, 9, 2]), [6]]
    got = lists_to_device(values, torch.device("cpu"), dtype)
    assert len(got) == 4
    for tensor, value in zip(got, values):
        assert tensor.dtype == dtype and tensor.device.type == "cpu"
        assert torch.equal(tensor, torch.tensor(list(value), dtype=dtype))


def test_floats_keep_their_values_and_longs_are_the_default() -> None:
    floats = lists_to_device([[0.5, -1.25], [2.0]], torch.device("cpu"), torch.float32)
    assert [t.tolist() for t in floats] == [[0.5, -1.25], [2.0]]
    longs = lists_to_device([[2**40, -7]], torch.device("cpu"))
    assert longs[0].dtype == torch.long and longs[0].tolist() == [2**40, -7]
