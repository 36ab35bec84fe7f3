"""Llama-family decoders (Llama, Qwen2, Mistral) and their checkpoint loader."""

from worker.models.config import ModelConfig, RopeConfig
from worker.models.llama import CausalLM
from worker.models.loader import load_model

__all__ = ["CausalLM", "ModelConfig", "RopeConfig", "load_model"]
