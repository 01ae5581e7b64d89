"""The connector's scheduler side on its own (no vLLM needed): which span it claims, for which requests."""

from __future__ import annotations

import pytest

from cachetune.vllm.config import (ConnectorSettings, RequestParams, blend_salt, check_parallelism,
                                   connector_config, salt_for)
from cachetune.vllm.scheduler import SchedulerSide

SALT = blend_salt("cachetune")
DOC_A = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]
DOC_B = [201, 202, 203, 204, 205, 206]
HEAD, QUESTION = [1, 2, 3], [7, 8, 9]


def side(**settings) -> SchedulerSide:
    stored = {"shared": [301, 302, 303, 304]}
    scheduler = SchedulerSide(ConnectorSettings(**settings), lambda: "fingerprint", stored.get)
    scheduler.remember("a", DOC_A)
    scheduler.remember("b", DOC_B)
    return scheduler


def test_the_claim_runs_from_vllms_computed_prefix_to_the_prompts_last_token():
    prompt = HEAD + DOC_B + [5] + DOC_A + QUESTION
    scheduler = side()
    last = len(prompt) - 1
    assert scheduler.matched("r", prompt, None, SALT, 0) == last
    assert scheduler.matched("r", prompt, None, SALT, 4) == last - 4
    scheduler.allocated("r", prompt, [7, 9], last - 4)
    [job] = scheduler.step_jobs([], [], {}).blends
    assert (job.start, job.end) == (4, last)
    assert job.documents == [(len(HEAD), "b"), (len(HEAD + DOC_B) + 1, "a")]
    assert job.block_ids == [7, 9] and job.method == "cachetune"
    assert scheduler.step_jobs([], [], {}).blends == []  # a job goes to the worker once


def test_nothing_is_claimed_without_a_blend_salt_or_when_vllm_has_it_all():
    prompt = HEAD + DOC_A + QUESTION
    scheduler = side()
    assert scheduler.matched("r", prompt, None, None, 0) == 0
    assert scheduler.matched("r", prompt, None, "tenant-7", 0) == 0
    assert scheduler.matched("r", prompt, None, SALT, len(prompt) - 1) == 0
    assert scheduler.counters["unsalted_with_documents"] == 2


def test_the_prompts_last_token_is_never_claimed():
    scheduler = side()
    assert scheduler.matched("r", HEAD + DOC_A, None, SALT, 0) == 0  # the document ends the prompt
    assert scheduler.matched("r", HEAD + DOC_A + [9], None, SALT, 0) == len(HEAD + DOC_A)
    assert scheduler.matched("r", HEAD + DOC_A + QUESTION, None, SALT, 0) == len(HEAD + DOC_A + QUESTION) - 1


def test_named_documents_are_used_in_any_order_only_where_their_tokens_are():
    prompt = HEAD + DOC_A + DOC_B + [5] + DOC_A + QUESTION
    scheduler = side()
    named = {"cachetune": {"documents": ["b", "a"]}}
    assert scheduler.matched("r", prompt, named, SALT, 0) == len(prompt) - 1
    scheduler.allocated("r", prompt, [0], len(prompt) - 1)
    [job] = scheduler.step_jobs([], [], {}).blends
    assert job.documents == [(3, "a"), (3 + len(DOC_A), "b"), (4 + len(DOC_A + DOC_B), "a")]
    only_b = {"cachetune": {"documents": ["b"]}}
    assert scheduler.matched("o", prompt, only_b, SALT, 0) == len(prompt) - 1
    shared = HEAD + [301, 302, 303, 304] + QUESTION  # a document only a shared tier knows
    assert scheduler.matched("s", shared, {"cachetune": {"documents": ["shared"]}}, SALT, 0) == len(shared) - 1
    assert scheduler.matched("t", prompt, {"cachetune": {"documents": ["unknown"]}}, SALT, 0) == 0


def test_without_find_documents_only_requests_with_parameters_are_looked_at():
    prompt = HEAD + DOC_A + QUESTION
    scheduler = side(find_documents=False)
    assert scheduler.matched("r", prompt, None, SALT, 0) == 0
    assert scheduler.matched("r", prompt, {"cachetune": {}}, SALT, 0) == len(prompt) - 1


def test_a_registration_is_saved_in_the_step_that_computes_its_last_token_and_returns_its_id():
    scheduler = side()
    params = {"cachetune": {"register": True}}
    document = [11, 12, 13, 14, 15]
    cid = scheduler.registering("r", document, params)
    assert scheduler.matched("r", document, params, SALT, 0) == 0  # registrations are plain prefills
    assert scheduler.step_jobs([("r", [4], 0)], [], {"r": 3}).saves == []  # chunked: not done yet
    [save] = scheduler.step_jobs([], [("r", [6], 3)], {"r": 2}).saves
    assert (save.chunk_id, save.tokens, save.block_ids) == (cid, document, [4, 6])
    assert scheduler.finished("r") == {"cachetune": {"document": cid}}
    assert scheduler.matched("q", HEAD + document + QUESTION, None, SALT, 0) == len(HEAD + document + QUESTION) - 1


def test_bad_request_parameters_are_refused_clearly_and_counted():
    with pytest.raises(ValueError, match="documents"):
        RequestParams.of({"cachetune": {"documents": "a"}})
    with pytest.raises(ValueError, match="ratio"):
        RequestParams.of({"cachetune": {"ratio": 2}})
    with pytest.raises(ValueError, match="unknown method"):
        RequestParams.of({"cachetune": {"method": "nope"}})
    scheduler = side()
    assert scheduler.matched("r", HEAD + DOC_A + QUESTION, {"cachetune": {"extra": 1}}, SALT, 0) == 0
    assert scheduler.counters["bad_params"] == 1


def test_the_connector_config_loads_this_connector_and_recomputes_failed_loads():
    config = connector_config(ratio=0.3)
    assert config["kv_connector_module_path"] == "cachetune.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    with pytest.raises(ValueError, match="unknown cachetune connector setting"):
        connector_config(ratios=0.3)
    with pytest.raises(ValueError):
        connector_config(method="nope")


def test_blends_per_step_defers_further_claims_to_a_later_step():
    prompt = HEAD + DOC_A + QUESTION
    claim = len(prompt) - 1
    scheduler = side(blends_per_step=1)
    assert scheduler.matched("r", prompt, None, SALT, 0) == claim
    scheduler.allocated("r", prompt, [0], claim)
    assert scheduler.matched("s", prompt, None, SALT, 0) is None  # this step has its blend
    scheduler.step_jobs([], [], {})
    assert scheduler.matched("s", prompt, None, SALT, 0) == claim
    unbounded = side(blends_per_step=0)
    for name in "rst":
        assert unbounded.matched(name, prompt, None, SALT, 0) == claim
        unbounded.allocated(name, prompt, [0], claim)
    assert len(unbounded.step_jobs([], [], {}).blends) == 3
    with pytest.raises(ValueError, match="blends_per_step"):
        ConnectorSettings(blends_per_step=-1)


def test_an_openai_client_may_name_documents_at_the_top_of_kv_transfer_params():
    assert RequestParams.of({"documents": ["a"], "ratio": 0.3, "do_remote_prefill": False}) == \
        RequestParams(("a",), None, 0.3)
    assert RequestParams.of({"do_remote_prefill": False}) is None  # another connector's parameters
    scheduler = side()
    prompt = HEAD + DOC_B + DOC_A + QUESTION
    assert scheduler.matched("r", prompt, {"documents": ["a"]}, SALT, 0) == len(prompt) - 1
    scheduler.allocated("r", prompt, [0], len(prompt) - 1)
    [job] = scheduler.step_jobs([], [], {}).blends
    assert job.documents == [(len(HEAD + DOC_B), "a")]
    assert scheduler.finished("r") == {"cachetune": {"documents": ["a"], "filled_tokens": len(prompt) - 1,
                                                     "method": "cachetune"}}


def test_requests_with_cachetune_parameters_get_a_blend_salt_that_keeps_tenants_apart():
    assert salt_for({"documents": ["a"]}, None) == blend_salt("")
    assert salt_for({"cachetune": {"method": "epic"}}, "tenant-7") == blend_salt("epic", "tenant-7")
    assert salt_for({"documents": ["a"]}, "tenant-7") != salt_for({"documents": ["a"]}, "tenant-8")
    assert salt_for({"documents": ["a"]}, blend_salt("")) is None  # already blendable
    assert salt_for(None, None) is None and salt_for({"do_remote_prefill": False}, None) is None
    assert salt_for({"cachetune": {"register": True}}, None) is None  # a registration is a plain prefill
    assert salt_for({"documents": "a"}, None) is None  # bad parameters: the connector reports them


def test_pipeline_stages_are_refused_at_start_up_not_served_with_wrong_kv():
    check_parallelism(1)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_parallelism(2)
