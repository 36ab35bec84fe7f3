"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded per token index."""

from worker.sampling.randomness import fresh_seed, uniform
from worker.sampling.sampler import Sampler, SampleRequest

__all__ = ["SampleRequest", "Sampler", "fresh_seed", "uniform"]
