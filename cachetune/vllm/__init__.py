"""cachetune inside vLLM: a KV connector that fills reordered documents' KV by selective recompute.

    from vllm import LLM, SamplingParams
    from cachetune import vllm as ct

    llm = LLM(model=ct.model_dir("smollm2-135m"), **ct.llm_options(method="cachetune"))
    ct.attach(llm)                                       # the connector gets vLLM's model
    docs = ct.register_documents(llm, [tokens_1, tokens_2])   # each computed alone by vLLM, then stored
    out = llm.generate(ct.blend_prompt(prompt_tokens), ct.sampling(SamplingParams(max_tokens=32)))

Needs the `vllm` extra (`make vllm`); nothing here imports vLLM until it is used.
"""

from cachetune.vllm.config import (BLEND_SALT, PARAMS_KEY, ConnectorSettings, RequestParams, blend_salt,
                                   connector_config, may_blend, model_fingerprint_of)
from cachetune.vllm.api import attach, blend_prompt, counters, llm_options, model_dir, register_documents, sampling

__all__ = ["BLEND_SALT", "PARAMS_KEY", "ConnectorSettings", "RequestParams", "attach", "blend_prompt", "blend_salt",
           "connector_config", "counters", "llm_options", "may_blend", "model_dir", "model_fingerprint_of",
           "register_documents", "sampling"]
