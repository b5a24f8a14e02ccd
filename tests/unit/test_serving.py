"""Serving units without a Ray cluster: request schema, validation messages, stop strings, Serve configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from draftline.engines.base import SpecStats
from draftline.serving.app import ENGINE_APPS, build_app, engine_options
from draftline.serving.control import app_config, engine_app_config
from draftline.serving.engine_server import ENGINE_DEPLOYMENT
from draftline.serving.openai_api import (
    INGRESS_DEPLOYMENT,
    ApiError,
    RequestValidator,
    _Progress,
    StopMatcher,
    replica_died,
    token_hash,
    validation_error,
)
from draftline.serving.openai_schema import ChatCompletionRequest, CompletionRequest, Usage
from draftline.serving.served_model import ServedModel

REPO = Path(__file__).resolve().parents[2]


def test_unknown_field_is_rejected_and_named():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    err = validation_error(info.value)
    assert err.status == 400 and err.param == "logprobs" and "unknown field 'logprobs'" in err.message


def test_unknown_field_inside_a_message_is_rejected():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi", "function_call": {}}]})
    assert validation_error(info.value).param == "messages.0.function_call"


def test_missing_and_invalid_values_name_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"max_tokens": 4})
    assert validation_error(info.value).param == "prompt"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "temperature": 7})
    err = validation_error(info.value)
    assert err.param == "temperature" and err.code == "invalid_value"


def test_error_response_has_openai_shape():
    body = ApiError(400, "bad", param="max_tokens", code="invalid_value").response().body
    import json

    assert json.loads(body) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}
    }


def test_usage_carries_speculative_stats():
    usage = Usage.from_stats(10, 9, SpecStats(verify_steps=4, accepted_draft_tokens=5, output_tokens=9))
    assert usage.total_tokens == 19
    assert usage.spec_accept_length == pytest.approx(2.25)
    assert usage.spec_verify_steps == 4 and usage.spec_accepted_draft_tokens == 5


@pytest.mark.parametrize("keep_token_ids", [False, True])
def test_a_request_keeps_its_token_ids_only_when_something_reads_them(keep_token_ids):
    """With serve.traffic off and no reply read back from tokens, nobody reads a request's token ids, so they are
    counted, not held; its text is the reply either way."""
    progress = _Progress(keep_token_ids=keep_token_ids)
    progress.add_tokens([5, 6])
    progress.add_text("hi")
    progress.add_text(" there")
    progress.add_tokens([7])
    assert progress.completion_tokens == 3
    assert progress.token_ids == ([5, 6, 7] if keep_token_ids else [])
    assert progress.reply_text() == "hi there"


@pytest.mark.parametrize(
    "pieces, stop, expected_text, stopped",
    [
        (["hello wor", "ld. bye"], ["world"], "hello ", True),
        (["ab", "c", "d"], ["cd"], "ab", True),
        (["no stop ", "here"], ["zz"], "no stop here", False),
        (["x<|e", "nd|>y"], ["<|end|>", "q"], "x", True),
    ],
)
def test_stop_matcher_cuts_at_first_stop_string_across_chunks(pieces, stop, expected_text, stopped):
    matcher = StopMatcher(stop)
    emitted = ""
    for piece in pieces:
        emitted += matcher.feed(piece)
        if matcher.stopped:
            break
    if not matcher.stopped:
        emitted += matcher.flush()
    assert emitted == expected_text and matcher.stopped is stopped


def test_serve_config_yaml_is_a_valid_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text()))
    (application,) = schema.applications
    assert application.import_path == "serve.app:app"
    assert {d.name for d in application.deployments} == {ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT}


def test_app_config_and_engine_options_are_accepted_by_serve(tiny_cfg):
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema

    served = ServedModel(registered_model="draftline-tiny-llama", model_version="3", export_dir="/x")
    schema = ServeApplicationSchema.model_validate(app_config(tiny_cfg, served))
    assert schema.deployments[0].user_config == served.model_dump()
    options = engine_options(tiny_cfg, served)
    deployment = DeploymentSchema.model_validate({"name": ENGINE_DEPLOYMENT, **options})
    assert deployment.max_ongoing_requests == tiny_cfg.serve.max_ongoing_requests
    assert deployment.max_queued_requests == tiny_cfg.serve.max_queued_requests


def test_blue_green_app_configs_are_accepted_by_serve(tiny_cfg):
    """serve.rollout=blue_green: the ingress app names the engine set's app in its user_config; each set is an app of
    its own with no HTTP route. `serve run` (imperative, one app) is refused with the fix."""
    from ray.serve.schema import ServeDeploySchema

    cfg = tiny_cfg.model_copy(update={"serve": tiny_cfg.serve.model_copy(update={"rollout": "blue_green"})})
    served = ServedModel(registered_model="draftline-tiny-llama", model_version="3", export_dir="/x")
    schema = ServeDeploySchema.model_validate(
        {"applications": [app_config(cfg, served, ENGINE_APPS[1]), engine_app_config(cfg, served, ENGINE_APPS[1])]})
    ingress_app, engine_app = schema.applications
    assert [(d.name, d.user_config) for d in ingress_app.deployments] == [(INGRESS_DEPLOYMENT, {"engine_app": ENGINE_APPS[1]})]
    assert engine_app.name == ENGINE_APPS[1] and engine_app.route_prefix is None
    assert [(d.name, d.user_config) for d in engine_app.deployments] == [(ENGINE_DEPLOYMENT, served.model_dump())]
    with pytest.raises(ValueError, match="blue_green .* `draftline serve`"):
        build_app(cfg, served, auth_token_sha256=None)


def test_a_dead_engine_replica_is_told_from_other_engine_errors():
    """Only a replica that died (or cannot be reached) makes the ingress send a request again."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    assert replica_died(ActorDiedError()) and replica_died(ActorUnavailableError("unreachable", None))
    assert replica_died(RayTaskError("generate", "traceback", ActorDiedError()))
    assert not replica_died(RuntimeError("engine is not loaded")) and not replica_died(RayTaskError("generate", "tb", ValueError("x")))


def _run_asgi(middleware, body: bytes, disconnect_after_body: bool = False) -> list[dict]:
    """Run one POST through `middleware`; the messages it sent to the client."""
    import asyncio

    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": body[:3], "more_body": True},
                {"type": "http.request", "body": body[3:], "more_body": False}]

    async def receive():
        if incoming:
            return incoming.pop(0)
        if disconnect_after_body:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    return sent


def _proxy_app(unanswered: int, bodies: list[bytes], read_disconnect: bool = False):
    """Ray's proxy as the middleware sees it: returns without a response (its ingress replica died) `unanswered`
    times, then answers 200 with the body it read."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        if read_disconnect:
            await receive()
        if len(bodies) <= unanswered:
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def test_the_callback_every_local_cluster_names_is_the_replay_middleware():
    import importlib

    from draftline.raycluster import SERVE_PROXY_CALLBACK
    from draftline.serving.proxy_replay import middlewares

    module, name = SERVE_PROXY_CALLBACK.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is middlewares


def test_the_proxy_sends_an_unanswered_request_again_with_its_body():
    """serving/proxy_replay.py: the request runs again, with the whole body, until the proxy answers."""
    from draftline.serving.proxy_replay import ReplayUnansweredRequests

    bodies: list[bytes] = []
    sent = _run_asgi(ReplayUnansweredRequests(_proxy_app(2, bodies), retry_s=30), b'{"messages": []}')
    assert bodies == [b'{"messages": []}'] * 3
    assert [m.get("status") for m in sent] == [200, None] and sent[1]["body"] == b'{"messages": []}'


def test_the_proxy_gives_up_with_an_openai_shaped_503_and_not_for_a_gone_client():
    import json

    from draftline.serving.proxy_replay import ReplayUnansweredRequests

    bodies: list[bytes] = []
    sent = _run_asgi(ReplayUnansweredRequests(_proxy_app(99, bodies), retry_s=0.5), b"{}")
    assert len(bodies) == 2 and sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "ingress_failed"

    bodies = []  # the client disconnected: nobody to answer, nothing runs again
    sent = _run_asgi(ReplayUnansweredRequests(_proxy_app(99, bodies, read_disconnect=True), retry_s=30), b"{}",
                     disconnect_after_body=True)
    assert len(bodies) == 1 and sent == []


@pytest.mark.parametrize("name", ["qwen3-8b", "llama3.1-8b-4xgpu", "kimi-k2.5"])
def test_gpu_production_configs_state_a_rollout_that_fits(name):
    """SGLang fills mem_fraction_static of each GPU, so `beside` (two engines per replica) cannot fit; the config
    states its strategy (with the arithmetic beside it), and drain_and_swap only with a second replica to answer."""
    from draftline.config import load_config

    path = REPO / "configs" / f"{name}.yaml"
    cfg = load_config(path)
    assert cfg.serve.gpus_per_replica >= 1 and cfg.engine.backend == "sglang"
    assert f"rollout: {cfg.serve.rollout}" in path.read_text() and cfg.serve.rollout != "beside"
    assert cfg.serve.rollout == "blue_green" or cfg.serve.num_replicas >= 2


@pytest.fixture(scope="module")
def validator(tiny_cfg, tiny_target_dir):
    """The ingress's request checks, without Ray."""
    return RequestValidator(tiny_cfg)


def _api_error(call) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    return info.value


def test_prepare_chat_applies_the_chat_template(validator):
    prepared = validator.prepare("chat", b'{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}')
    expected = validator.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert validator.tokenizer.decode(prepared.prompt_ids) == expected
    assert prepared.params.max_new_tokens == 5
    assert prepared.params.stop_token_ids == [validator.tokenizer.eos_token_id]


def test_prepare_rejects_bad_input_with_400(validator, tiny_cfg):
    limit = tiny_cfg.serve.max_tokens_limit
    assert _api_error(lambda: validator.prepare("chat", b"{not json")).code == "invalid_json"
    assert _api_error(lambda: validator.prepare("chat", b"[1, 2]")).code == "invalid_json"
    err = _api_error(lambda: validator.prepare("completions", f'{{"prompt": "a", "max_tokens": {limit + 1}}}'.encode()))
    assert (err.status, err.param) == (400, "max_tokens") and str(limit) in err.message
    err = _api_error(lambda: validator.prepare("completions", b'{"prompt": "a", "max_tokens": 0}'))
    assert err.param == "max_tokens"
    context = validator.context_tokens
    long_prompt = ("word " * (context * 2)).encode()
    err = _api_error(lambda: validator.prepare("completions", b'{"prompt": "' + long_prompt + b'"}'))
    assert (err.status, err.code) == (400, "context_length_exceeded") and str(context) in err.message
    ids = list(range(context - 2))
    err = _api_error(lambda: validator.prepare("completions", f'{{"prompt": {ids}, "max_tokens": 5}}'.encode()))
    assert err.code == "context_length_exceeded" and err.param == "max_tokens"
    err = _api_error(lambda: validator.prepare("completions", f'{{"prompt": [{validator.vocab_size}]}}'.encode()))
    assert err.param == "prompt"
    err = _api_error(lambda: validator.prepare("chat", b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}'))
    assert (err.status, err.code) == (404, "model_not_found")


def test_default_max_tokens_fits_the_context(validator, tiny_cfg):
    ids = list(range(validator.context_tokens - 3))
    prepared = validator.prepare("chat", f'{{"messages": [{{"role": "user", "content": "x"}}]}}'.encode())
    assert prepared.params.max_new_tokens == tiny_cfg.serve.max_tokens_limit
    prepared = validator.prepare("completions", f'{{"prompt": {ids}}}'.encode())
    assert prepared.params.max_new_tokens == 3


def test_bearer_token_is_checked_against_its_hash(validator):
    from starlette.requests import Request

    def request(headers: dict) -> Request:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return Request({"type": "http", "headers": raw, "method": "GET", "path": "/"})

    validator.auth_token_sha256 = token_hash("s3cret")
    try:
        validator.authorize(request({"Authorization": "Bearer s3cret"}))
        assert _api_error(lambda: validator.authorize(request({}))).status == 401
        assert _api_error(lambda: validator.authorize(request({"Authorization": "Bearer nope"}))).status == 401
        assert _api_error(lambda: validator.authorize(request({"Authorization": "Basic s3cret"}))).status == 401
    finally:
        validator.auth_token_sha256 = None


def test_the_api_token_or_only_its_sha256_enables_auth(monkeypatch):
    """Fault 12: serve_config.yaml told users to put the raw token in runtime_env env_vars, which reach every
    replica's environment and the dashboard. The app now also takes the sha256 from <auth_token_env>_SHA256."""
    from draftline.config import ConfigError, load_config
    from draftline.serving.app import auth_token_sha256_env, auth_token_sha256_from_env
    from draftline.serving.openai_api import token_hash

    cfg = load_config(None, ["serve.auth_token_env=DRAFTLINE_TEST_TOKEN"])
    monkeypatch.delenv("DRAFTLINE_TEST_TOKEN", raising=False)
    monkeypatch.delenv(auth_token_sha256_env(cfg), raising=False)
    assert auth_token_sha256_from_env(cfg) is None
    monkeypatch.setenv(auth_token_sha256_env(cfg), token_hash("s3cret").upper())
    assert auth_token_sha256_from_env(cfg) == token_hash("s3cret")
    monkeypatch.setenv("DRAFTLINE_TEST_TOKEN", "other")
    assert auth_token_sha256_from_env(cfg) == token_hash("other")  # the token itself, where it is set, wins
    monkeypatch.delenv("DRAFTLINE_TEST_TOKEN")
    monkeypatch.setenv(auth_token_sha256_env(cfg), "s3cret")
    with pytest.raises(ConfigError, match="DRAFTLINE_TEST_TOKEN_SHA256 must be the sha256"):
        auth_token_sha256_from_env(cfg)
    commented = (REPO / "serve" / "serve_config.yaml").read_text()
    assert "DRAFTLINE_API_TOKEN_SHA256" in commented and "DRAFTLINE_API_TOKEN:" not in commented


def test_two_apps_served_from_one_data_dir_keep_their_own_record(tiny_cfg):
    """The record `draftline promote`/`rollback` find an app by (its Ray address, its token file) is per serve.port.
    One record per data dir let a second app (another config, or another test process on the same data dir)
    overwrite the first's: `rollback` with the first config then connected to the second's cluster and rolled it."""
    from draftline.serving.control import serve_state_dir, state_path

    first = tiny_cfg.model_copy(update={"serve": tiny_cfg.serve.model_copy(update={"port": 8001})})
    second = tiny_cfg.model_copy(update={"serve": tiny_cfg.serve.model_copy(update={"port": 8002})})
    assert first.data_dir == second.data_dir
    assert state_path(first) != state_path(second)
    assert serve_state_dir(first) != serve_state_dir(second)
    assert state_path(first).parent == serve_state_dir(first) and str(first.serve.port) in serve_state_dir(first).name


def test_an_app_recorded_before_per_port_records_is_found_on_its_own_port(tiny_cfg, tmp_path):
    """An app started by an older draftline recorded itself in `<data_dir>/serve/state.json`. `promote`/`rollback`
    (connect_to_serving) take that record for the config whose serve.port its base_url names, and for no other
    port; the per-port record wins when both exist."""
    import json

    from draftline.serving.control import serving_record, state_path

    cfg = tiny_cfg.model_copy(update={"data_dir": str(tmp_path), "serve": tiny_cfg.serve.model_copy(update={"port": 8011})})
    other = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"port": 8012})})
    legacy = cfg.data_path("serve", "state.json")
    legacy.parent.mkdir(parents=True, exist_ok=True)
    legacy.write_text(json.dumps({"base_url": "http://127.0.0.1:8011", "ray_address": "127.0.0.1:1", "pid": 1}))
    assert serving_record(cfg) == (legacy, json.loads(legacy.read_text()))
    assert serving_record(other) is None

    own = state_path(cfg)
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text(json.dumps({"base_url": "http://127.0.0.1:8011", "ray_address": "127.0.0.1:2", "pid": 2}))
    assert serving_record(cfg)[0] == own and serving_record(cfg)[1]["ray_address"] == "127.0.0.1:2"
