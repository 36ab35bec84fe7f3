"""Small deterministic Hugging Face-format checkpoints, written locally for tests and benchmarks."""

from worker.modelgen.make_model import make_model
from worker.modelgen.presets import ARCHS, LLAMA3_ROPE_SCALING, PRESETS

__all__ = ["ARCHS", "LLAMA3_ROPE_SCALING", "PRESETS", "make_model"]
