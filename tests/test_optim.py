"""The learning-rate schedule on its own."""

import pytest

from titan_exp.optim.config import LRSchedulerConfig, lr_factor


def test_lr_schedule_warms_up_holds_and_decays():
    cfg = LRSchedulerConfig(warmup_steps=10, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)
    factors = [lr_factor(step, 100, cfg) for step in range(100)]
    assert factors[0] == pytest.approx(1 / 11) and factors[9] == pytest.approx(10 / 11)
    assert factors[10:55] == [1.0] * 45  # stable until the decay window (last 45 steps)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
