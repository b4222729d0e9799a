"""What the speed policy's tests share (core/test_speed.py, core/test_speed_loop.py): a gate that
learns in a few samples, and a response's sample at a rate."""

from ace_mw import GateConfig
from ace_mw.decide.samples import SpeedSample

GATE = GateConfig(speed_min_samples=3, speed_half_life=4, speed_half_life_s=100.0, speed_max_misses=5)


def sample(rate: float, tokens: float = 100.0) -> SpeedSample:
    """`tokens` decoded at `rate` tokens per second, timed from the stream."""
    return SpeedSample(tokens, tokens / rate, "stream")
