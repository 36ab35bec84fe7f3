"""The worker side of conveyor: the engine, model runner and (later) the fleet process."""

from producer.completion import Completion, FinishReason, Usage
from producer.params import SamplingParams
from worker.engine import Engine
from worker.output_processor import StepOutput

__all__ = ["Completion", "Engine", "FinishReason", "SamplingParams", "StepOutput", "Usage"]
