"""bench.data_pipeline's dataset: what its loader workers rely on (no timing is asserted)."""

from __future__ import annotations

import pickle

import torch

from bench.data_pipeline import SlowSamples


class TestSlowSamples:
    def test_a_sample_is_a_pure_function_of_its_index(self) -> None:
        a, b = SlowSamples(8, 50, 6, 3), SlowSamples(8, 50, 6, 3)
        x, y = a[5]
        x2, y2 = b[5]
        assert torch.equal(x, x2) and y == y2, "the same index must give the same sample"
        assert x.shape == (6,) and x.dtype == torch.float32 and 0 <= y < 3, (x.shape, x.dtype, y)
        assert not torch.equal(a[4][0], x), "different indices should give different features"

    def test_survives_pickling_as_spawned_loader_workers_get_it(self) -> None:
        data = SlowSamples(8, 50, 6, 3)
        copy = pickle.loads(pickle.dumps(data))
        assert torch.equal(copy[3][0], data[3][0]) and copy[3][1] == data[3][1]
