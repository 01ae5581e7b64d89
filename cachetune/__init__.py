"""cachetune: non-prefix KV-cache reuse with selective recompute for Hugging Face causal LMs."""

from cachetune.config import EngineConfig
from cachetune.engine.engine import Engine, StepResult
from cachetune.engine.request import GenerationResult, Request, RequestStatus
from cachetune.errors import CachetuneError, RequestError
from cachetune.methods import make_method, method_names, register
from cachetune.runtime.decode import SamplingConfig

__all__ = ["CachetuneError", "Engine", "EngineConfig", "GenerationResult", "Request", "RequestError",
           "RequestStatus", "SamplingConfig", "StepResult", "make_method", "method_names", "register"]
