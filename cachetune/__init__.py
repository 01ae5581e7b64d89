"""cachetune: non-prefix KV-cache reuse with selective recompute for Hugging Face causal LMs."""

from cachetune.config import EngineConfig
from cachetune.engine.decode import SamplingConfig
from cachetune.engine.engine import METHODS, Engine, GenerationResult

__all__ = ["METHODS", "Engine", "EngineConfig", "GenerationResult", "SamplingConfig"]
