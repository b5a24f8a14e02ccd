"""The OpenAI-compatible endpoint over a real local Ray cluster, Serve on 127.0.0.1, MLflow in a tmp dir.

One app for the module: a registered, promoted (randomly initialised) drafter, bearer-token auth on, and tiny
overload limits (1 running + 1 queued request per engine replica) so a burst must get 503s.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import free_port
from draftline.tracking import GATE_TAG
from registry_helpers import mlflow_test_config, random_drafter, register_drafter
from serve_helpers import start_serving, stop_serving


TOKEN = "test-token-123"
TOKEN_ENV = "DRAFTLINE_TEST_SERVE_TOKEN"


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, tiny_target_dir):
    from draftline.registry import promote

    tmp_path = tmp_path_factory.mktemp("serve-api")
    cfg = mlflow_test_config(
        tmp_path,
        [
            f"serve.port={free_port()}",
            f"serve.auth_token_env={TOKEN_ENV}",
            "serve.max_ongoing_requests=1",
            "serve.max_queued_requests=1",
            "serve.max_tokens_limit=64",
            "serve.retry_after_s=2",
        ],
    )
    version = register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "passed"})
    promote(cfg, version)
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_ENV, TOKEN)
    started = time.monotonic()
    url = start_serving(cfg)
    print(f"serve up in {time.monotonic() - started:.1f} s at {url}")
    yield cfg, url, version
    stop_serving()
    mp.undo()


@pytest.fixture()
def auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def openai_client(url: str, token: str = TOKEN):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)


def test_chat_completion_with_the_openai_client(served):
    cfg, url, version = served
    client = openai_client(url)
    response = client.chat.completions.create(
        model=cfg.registered_model_name,
        messages=[{"role": "user", "content": "Tell me about lists."}],
        max_tokens=12,
        temperature=0,
    )
    assert response.system_fingerprint == f"{cfg.registered_model_name}:{version}"
    assert response.model_extra["draftline"]["model_version"] == version
    assert isinstance(response.choices[0].message.content, str)
    assert response.choices[0].finish_reason in ("stop", "length")
    usage = response.usage
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stats = usage.model_extra
    assert stats["spec_verify_steps"] >= 1
    # Accept length counts the bonus token: emitted tokens per verify step, at least 1.
    assert stats["spec_accept_length"] >= 1.0
    assert stats["spec_accept_length"] == pytest.approx(usage.completion_tokens / stats["spec_verify_steps"], abs=1e-3)


def test_streamed_chat_matches_the_non_streamed_greedy_answer(served):
    cfg, url, version = served
    client = openai_client(url)
    request = dict(
        model=cfg.registered_model_name,
        messages=[{"role": "user", "content": "What is a dictionary?"}],
        max_tokens=16,
        temperature=0,
    )
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.system_fingerprint for c in chunks} == {f"{cfg.registered_model_name}:{version}"}


def test_completions_stream_and_not(served, auth):
    cfg, url, version = served
    body = {"prompt": "def main():", "max_tokens": 10, "temperature": 0}
    whole = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)
    assert whole.status_code == 200, whole.text
    payload = whole.json()
    assert payload["object"] == "text_completion" and payload["draftline"]["model_version"] == version
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=auth, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == payload["choices"][0]["text"]


def test_stop_string_cuts_the_output(served, auth):
    _, url, _ = served
    body = {"prompt": "The", "max_tokens": 24, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120).json()["choices"][0]["text"]
    if len(full) < 4:
        pytest.skip(f"greedy output {full!r} too short to pick a stop string from")
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, headers=auth, timeout=120).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_models_and_healthz(served, auth):
    cfg, url, version = served
    models = httpx.get(f"{url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == [cfg.registered_model_name]
    assert models["data"][0]["draftline"]["model_version"] == version
    health = httpx.get(f"{url}/healthz")  # no token: health probes are not authenticated
    assert health.status_code == 200 and health.json()["served"]["model_version"] == version


def _assert_openai_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"], "every error carries a code clients can branch on"
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_bad_input_is_a_400_with_a_clear_message(served, auth):
    cfg, url, _ = served
    chat = f"{url}/v1/chat/completions"
    message = [{"role": "user", "content": "hi"}]
    bad_json = httpx.post(chat, content=b'{"messages": [', headers={**auth, "content-type": "application/json"})
    assert "not valid JSON" in _assert_openai_error(bad_json, 400, code="invalid_json")["message"]
    unknown = httpx.post(chat, json={"messages": message, "functions": []}, headers=auth)
    assert "functions" in _assert_openai_error(unknown, 400, param="functions", code="unknown_field")["message"]
    too_many = httpx.post(chat, json={"messages": message, "max_tokens": cfg.serve.max_tokens_limit + 1}, headers=auth)
    assert str(cfg.serve.max_tokens_limit) in _assert_openai_error(too_many, 400, param="max_tokens")["message"]
    zero = httpx.post(chat, json={"messages": message, "max_tokens": 0}, headers=auth)
    _assert_openai_error(zero, 400, param="max_tokens")
    long_prompt = [{"role": "user", "content": "lorem ipsum " * 2000}]
    too_long = httpx.post(chat, json={"messages": long_prompt, "max_tokens": 4}, headers=auth)
    _assert_openai_error(too_long, 400, param="messages", code="context_length_exceeded")
    wrong_type = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "temperature": "hot"}, headers=auth)
    _assert_openai_error(wrong_type, 400, param="temperature")


def test_tools_are_refused_by_a_template_without_them_and_chat_template_kwargs_reach_the_template(
        served, auth, tiny_target_dir):
    """The tiny target's template (draftline's own) has no tool support: tools are a 400 naming the field. A
    chat_template_kwargs argument reaches the template (its bos_token, set empty) and the served answer is the
    target's own greedy answer to that prompt (transformers' generate, target only): lossless."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, url, _ = served
    chat = f"{url}/v1/chat/completions"
    messages = [{"role": "user", "content": "What is a list?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    refused = httpx.post(chat, json={"messages": messages, "tools": tools}, headers=auth)
    assert "no tool support" in _assert_openai_error(refused, 400, param="tools", code="tools_not_supported")["message"]
    choice = httpx.post(chat, json={"messages": messages, "tools": tools, "tool_choice": "required"}, headers=auth)
    assert '"auto"' in _assert_openai_error(choice, 400, param="tool_choice")["message"]
    reserved = httpx.post(chat, json={"messages": messages, "chat_template_kwargs": {"tokenize": True}}, headers=auth)
    _assert_openai_error(reserved, 400, param="chat_template_kwargs.tokenize")

    response = openai_client(url).chat.completions.create(
        model=cfg.registered_model_name, messages=messages, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"bos_token": ""}})
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, bos_token="", tokenize=True,
                                        return_dict=False)
    assert response.usage.prompt_tokens == len(ids) == len(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)) - 1
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    generated = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               attention_mask=torch.ones(1, len(ids)))[0, len(ids):].tolist()
    if tokenizer.eos_token_id in generated:
        generated = generated[: generated.index(tokenizer.eos_token_id)]
    message = response.choices[0].message
    assert message.content == tokenizer.decode(generated, skip_special_tokens=True)
    assert message.tool_calls in (None, []) and response.choices[0].finish_reason in ("stop", "length")


def test_hostile_input_gets_an_openai_error_and_never_stalls_the_server(served, auth):
    """Faults 3, 4, 11: a 10 MB body was tokenized on the event loop (16.5 s, /healthz 8.2 s meanwhile); seed >= 2^64
    returned a 500 with a Ray traceback; a lone surrogate or 50k-deep nesting gave plain-text 500s; `true` was read
    as 1 and "10" as 10; some 400s had code null."""
    cfg, url, _ = served
    chat = f"{url}/v1/chat/completions"
    message = [{"role": "user", "content": "hi"}]
    json_headers = {**auth, "content-type": "application/json"}

    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000_000}], "max_tokens": 2}).encode()
    health_s: list[float] = []

    async def huge_request_and_healthz():
        async with httpx.AsyncClient(timeout=120) as http:
            big = asyncio.create_task(http.post(chat, content=huge, headers=json_headers))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            health = await http.get(f"{url}/healthz")
            health_s.append(time.monotonic() - started)
            return await big, health

    started = time.monotonic()
    big, health = asyncio.run(huge_request_and_healthz())
    big_s = time.monotonic() - started
    print(f"10 MB body answered in {big_s:.2f} s, /healthz meanwhile in {health_s[0]:.2f} s")
    assert str(cfg.serve.max_request_bytes) in _assert_openai_error(big, 413, code="request_too_large")["message"]
    assert health.status_code == 200

    cases = {
        "seed 2^64": ({"messages": message, "seed": 2**64}, "seed"),
        "max_tokens true": ({"messages": message, "max_tokens": True}, "max_tokens"),
        "max_tokens '10'": ({"messages": message, "max_tokens": "10"}, "max_tokens"),
    }
    for name, (body, param) in cases.items():
        response = httpx.post(chat, json=body, headers=auth, timeout=60)
        error = _assert_openai_error(response, 400, param=param, code="invalid_value")
        assert "Traceback" not in error["message"] and "ray" not in error["message"].lower(), name
    bools = httpx.post(f"{url}/v1/completions", json={"prompt": [True, False], "max_tokens": 2}, headers=auth)
    _assert_openai_error(bools, 400, code="invalid_value")
    surrogate = httpx.post(chat, content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}', headers=json_headers)
    assert "surrogate" in _assert_openai_error(surrogate, 400, param="messages", code="invalid_value")["message"]
    deep = httpx.post(chat, content=b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", headers=json_headers)
    _assert_openai_error(deep, 400, code="invalid_json")


def test_requests_without_the_token_get_401(served):
    cfg, url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=body), 401, code="invalid_api_key")
    wrong = {"Authorization": "Bearer not-the-token"}
    _assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=body, headers=wrong), 401)
    _assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        openai_client(url, token="nope").models.list()


def test_no_api_description_is_served_with_or_without_the_token(served, auth):
    """Fault 12: /docs, /redoc and /openapi.json (FastAPI's defaults) answered without the bearer token while auth
    was on. They are off (the API is docs/serving.md); the routes they would describe still need the token."""
    _, url, _ = served
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        for headers in ({}, auth):
            response = httpx.get(f"{url}{path}", headers=headers, timeout=60)
            assert response.status_code == 404, (path, bool(headers), response.status_code, response.text[:200])
            assert "openapi" not in response.text.lower() and "swagger" not in response.text.lower()
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401


def test_overload_gets_503_with_retry_after(served, auth):
    """1 running + 1 queued per engine replica: a burst of 10 long requests must see 503s, not an endless queue."""
    cfg, url, _ = served
    body = {"prompt": "Once upon a time", "max_tokens": cfg.serve.max_tokens_limit, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(
                *(http.post(f"{url}/v1/completions", json=body, headers=auth) for _ in range(10))
            )

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    print(f"burst of 10 with 1 running + 1 queued: statuses {statuses}")
    assert set(statuses) <= {200, 503}
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected and any(r.status_code == 200 for r in responses)
    for response in rejected:
        assert response.headers["retry-after"] == "2"
        _assert_openai_error(response, 503, code="overloaded")
    # Nothing was left queued: the next request is served.
    after = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, headers=auth, timeout=120)
    assert after.status_code == 200


def test_metrics_reach_ray_prometheus_endpoint(served, auth):
    import ray

    _, url, _ = served
    httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=auth, timeout=120)
    port = ray._private.worker.global_worker.node.metrics_export_port
    # Each replica process exports on its own period (the engine's gauge and the ingress's counters separately):
    # wait for all of them, not for the first to arrive.
    names = ("draftline_requests", "draftline_request_latency_s", "draftline_spec_accept_length",
             "draftline_output_tokens_per_s", "draftline_engine_serving")
    deadline = time.monotonic() + 120
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if all(name in text for name in names):
            break
        time.sleep(2)
    print("exported:", [line for line in text.splitlines() if "draftline_requests" in line and not line.startswith("#")][:2])
    for name in names:
        assert name in text, f"{name} not exported on the Ray metrics port {port} within 120 s"
