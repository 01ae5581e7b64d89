"""What a user of vLLM calls: options for `LLM(...)`, attaching the model, registering documents, and
the prompt and sampling parameters of a blended request."""

from __future__ import annotations

from typing import Any, Sequence

from cachetune.vllm.config import PARAMS_KEY, WORKER_EXTENSION, blend_salt, connector_config


def model_dir(spec: str | None = None) -> str:
    """The HF directory of a cachetune model spec (preset, .gguf or directory) for `LLM(model=...)`: the
    standalone engine loads the same weights, so both give documents the same chunk ids."""
    from cachetune.model.loader import model_directory

    return str(model_directory(spec))


def llm_options(**settings: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` that load the connector (settings: ConnectorSettings fields) and
    the worker extension that hands it the model. vLLM's prefix caching stays on."""
    return {"kv_transfer_config": connector_config(**settings), "worker_extension_cls": WORKER_EXTENSION,
            "enable_prefix_caching": True}


def attach(llm) -> None:
    """Give the connector in every worker the model it serves (once, after `LLM(...)`). Until then a
    claimed request is computed by vLLM."""
    llm.collective_rpc("cachetune_attach")


def counters(llm) -> dict[str, Any]:
    """The first worker's connector counters (blends, tokens, recomputes by vLLM, missing documents)."""
    return llm.collective_rpc("cachetune_counters")[0]


def sampling(params, documents: Sequence[str] | None = None, method: str | None = None,
             ratio: float | None = None, register: bool = False):
    """A copy of vLLM SamplingParams carrying this request's cachetune parameters."""
    chosen: dict[str, Any] = {}
    if documents is not None:
        chosen["documents"] = list(documents)
    if method is not None:
        chosen["method"] = method
    if ratio is not None:
        chosen["ratio"] = ratio
    if register:
        chosen["register"] = True
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": {PARAMS_KEY: chosen}}
    return params


def blend_prompt(token_ids: Sequence[int], method: str = "") -> dict[str, Any]:
    """A token prompt the connector may blend: its cache_salt keeps its blocks apart from exact ones."""
    return {"prompt_token_ids": list(token_ids), "cache_salt": blend_salt(method)}


def register_documents(llm, documents: Sequence[Sequence[int]]) -> list[str]:
    """Store each document's KV, computed alone (positions from 0) by vLLM's forward; returns their
    chunk ids. A document is later used wherever these exact token ids appear in a prompt."""
    from vllm import SamplingParams

    params = sampling(SamplingParams(max_tokens=1, temperature=0.0), register=True)
    outputs = llm.generate([{"prompt_token_ids": list(d)} for d in documents], params, use_tqdm=False)
    ids = []
    for output in outputs:
        found = (output.kv_transfer_params or {}).get(PARAMS_KEY, {}).get("document")
        if found is None:
            raise RuntimeError("vLLM did not return a document id: is it running with the cachetune connector?")
        ids.append(found)
    return ids
