"""An HTTP proxy in front of one `vllm serve` process (docs/serving.md).

    python -m eqc_utils.serving --config configs/serve/tiny_dflash.yaml --port 8080

The proxy starts vLLM from a serve config (`eqc_utils.serving.config`) on a loopback port, answers
health checks while vLLM loads, and forwards requests to it:

    GET  /ping          200 {"status": "ok"} once vLLM is ready and healthy; 503 while it loads or
                        restarts; 500 with a detail when it could not be started (or restarted)
    GET  /status        state, vLLM's pid and port, restarts so far, the model served
    POST /invocations   `messages` -> /v1/chat/completions (with `thinking` folded into
                        chat_template_kwargs.enable_thinking, off unless asked), `prompt` -> /v1/completions
    ANY  /v1/...        passed through as it is, streaming responses (SSE) relayed chunk by chunk
    GET  /metrics       vLLM's Prometheus text

Robustness: a request that meets a connection error or a 5xx from vLLM is retried a bounded number
of times with exponential backoff; while vLLM is not ready the answer is 503 (with Retry-After); a
malformed JSON body gets 400 with a message. A vLLM that dies after it was ready is restarted, at most
`proxy.max_restarts` times. vLLM runs in its own process group and is stopped (SIGTERM, then SIGKILL
to the whole group) when the proxy stops for any reason: SIGTERM/SIGINT, an exception, or the proxy's
own death (the kernel's parent-death signal, see `launcher`).

`ProxyProcess` runs the proxy as a child process from Python (notebooks, the latency harness, tests).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eqc_utils.serving.config import ServeConfig, load_serve_config
from eqc_utils.serving.launcher import (ServerStartError, VLLMServers, _die_with_parent, cuda_device_count,
                                        free_port, log_tail)

log = logging.getLogger("eqc.serving")

RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ReadError,
                    httpx.WriteError, httpx.RemoteProtocolError)
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "authorization", "x-request-id")
FORWARDED_RESPONSE_HEADERS = ("x-request-id",)
RETRY_AFTER_S = "5"
SUPERVISE_INTERVAL_S = 0.5


def error_body(message: str, status: int, kind: str = "proxy_error") -> dict:
    """OpenAI-style error object, as vLLM answers errors."""
    return {"error": {"message": message, "type": kind, "code": status}}


def unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, 503, "service_unavailable"), status_code=503,
                        headers={"Retry-After": RETRY_AFTER_S})


# ---------------------------------------------------------------- the vLLM process

class VLLMBackend:
    """One `vllm serve` process from a serve config: spawned on start, watched, restarted (bounded)
    when it dies after having been ready, stopped on `stop()`.

    state: "idle" -> "starting" -> "ready" [-> "restarting" -> "ready" ...] -> "stopped";
    "failed" when it could not start, or died more than `proxy.max_restarts` times.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        proxy = config.proxy
        self.internal_port = int(proxy["internal_port"]) if proxy["internal_port"] else None   # null: a free one
        self.max_restarts = int(proxy["max_restarts"])
        self.state = "idle"
        self.detail: str | None = None
        self.restarts = 0
        self.servers: VLLMServers | None = None
        self.log_dir = Path(config["log_dir"] or tempfile.mkdtemp(prefix="eqc-serve-logs-"))
        self._task: asyncio.Task | None = None

    @property
    def port(self) -> int | None:
        return self.servers.ports[0] if self.servers and self.servers.ports else self.internal_port

    @property
    def base_url(self) -> str | None:
        return f"http://127.0.0.1:{self.port}" if self.port else None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        return self.servers.pids[0] if self.servers and self.servers.pids else None

    @property
    def log_path(self) -> Path | None:
        return self.servers.log_paths[-1] if self.servers and self.servers.log_paths else None

    def _env(self) -> dict[str, str]:
        env = {str(k): str(v) for k, v in self.config["env"].items()}
        # The launcher pins a single-GPU server to CUDA_VISIBLE_DEVICES=0 (an index among the visible
        # devices); keep the device this proxy was given instead, e.g. by a GPU lock script.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = visible
        dp = self.config["vllm_args"].get("data_parallel_size")
        if dp and int(dp) > 1 and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(cuda_device_count()))
        return env

    def _spawn(self) -> None:
        """Start vLLM without waiting (called on the event loop's thread, the process's main thread:
        the parent-death signal is tied to the thread that spawned the child)."""
        log_dir = self.log_dir / f"restart_{self.restarts}" if self.restarts else self.log_dir   # keep each log
        self.servers = VLLMServers(self.config.model, n=1, served_name=self.config.served_model_name,
                                   extra_args=self.config.vllm_flags(), env=self._env(), port_base=self.internal_port,
                                   startup_timeout=float(self.config["startup_timeout"]), log_dir=log_dir,
                                   device=self.config["device"])
        self.servers.start(wait=False)
        log.info("vLLM started: pid %s, port %s, log %s", self.pid, self.port, self.log_path)

    def _missing_folders(self) -> list[str]:
        """Local model folders named by the config that do not exist (hub ids are not checked)."""
        spec = self.config["speculative_config"] or {}
        named = [self.config.model, self.config["tokenizer"], spec.get("model")]
        return [p for p in named if p and Path(p).is_absolute() and not Path(p).exists()]

    async def start(self) -> None:
        self.state = "starting"
        missing = self._missing_folders()
        if missing:
            self._fail(f"no such folder: {', '.join(missing)} (run the stage that writes it, or fix the serve config)")
            return
        try:
            self._spawn()
        except (ServerStartError, OSError) as err:
            self._fail(f"vLLM could not be started: {err}")
            return
        self._task = asyncio.create_task(self._supervise_safely(), name="vllm-supervisor")

    async def _supervise_safely(self) -> None:
        try:
            await self._supervise()
        except asyncio.CancelledError:
            raise
        except Exception as err:   # a bug here must not leave the proxy claiming a state it lost track of
            log.exception("vLLM supervision failed")
            self._fail(f"vLLM supervision failed: {type(err).__name__}: {err}")

    def _fail(self, detail: str) -> None:
        self.state, self.detail = "failed", detail
        log.error(detail)
        if self.servers:
            self.servers.stop(grace=5.0)

    async def _wait_ready(self) -> bool:
        """True once vLLM answers /health and a one-token completion (vLLM answers /health before the
        engine can serve); False if it exits or the startup timeout passes (state becomes failed)."""
        deadline = time.monotonic() + float(self.config["startup_timeout"])
        body = {"model": self.config.served_model_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
            while time.monotonic() < deadline:
                if self.servers.restart_if_port_taken(0):
                    log.warning("vLLM could not bind its port (taken meanwhile); started again on port %s", self.port)
                    continue
                proc = self.servers.procs[0]
                if proc.poll() is not None:
                    self._fail(f"vLLM exited with code {proc.returncode} while starting; log {self.log_path}, "
                               f"last lines:\n{log_tail(self.log_path)}")
                    return False
                try:
                    if (await client.get(f"{self.base_url}/health", timeout=5.0)).status_code == 200:
                        if (await client.post(f"{self.base_url}/v1/completions", json=body)).status_code == 200:
                            return True
                except httpx.HTTPError:
                    pass   # not listening yet
                await asyncio.sleep(1.0)
        self._fail(f"vLLM not ready after {self.config['startup_timeout']} s (startup_timeout); log "
                   f"{self.log_path}, last lines:\n{log_tail(self.log_path)}")
        return False

    async def _supervise(self) -> None:
        while True:
            if not await self._wait_ready():
                return
            self.state, self.detail = "ready", None
            log.info("vLLM is ready (pid %s)", self.pid)
            proc = self.servers.procs[0]
            while proc.poll() is None:
                await asyncio.sleep(SUPERVISE_INTERVAL_S)
            tail = log_tail(self.log_path)
            if self.restarts >= self.max_restarts:
                self._fail(f"vLLM exited with code {proc.returncode} and was already restarted {self.restarts} "
                           f"time(s) (proxy.max_restarts); log {self.log_path}, last lines:\n{tail}")
                return
            self.restarts += 1
            self.state = "restarting"
            self.detail = f"vLLM exited with code {proc.returncode}; restart {self.restarts}/{self.max_restarts}"
            log.warning("%s; log %s, last lines:\n%s", self.detail, self.log_path, tail)
            self.servers.stop(grace=5.0)      # whatever is left of its process group
            try:
                self._spawn()
            except (ServerStartError, OSError) as err:
                self._fail(f"vLLM could not be restarted: {err}")
                return

    def stop(self) -> None:
        """Stop vLLM and its whole process group (idempotent)."""
        if self._task and not self._task.done():
            self._task.cancel()
        if self.servers:
            pid = self.pid
            self.servers.stop(grace=15.0)
            if pid:
                log.info("vLLM stopped (pid %s)", pid)
        if self.state != "failed":
            self.state = "stopped"

    def status(self) -> dict:
        return {"state": self.state, "detail": self.detail, "vllm_pid": self.pid, "internal_url": self.base_url,
                "restarts": self.restarts, "max_restarts": self.max_restarts,
                "log": str(self.log_path) if self.log_path else None}


class StaticBackend:
    """An already-running OpenAI-compatible server (no process to manage): for tests, or for putting
    the proxy in front of a vLLM started by other means."""

    def __init__(self, base_url: str, state: str = "ready"):
        self.base_url = base_url.rstrip("/")
        self.state = state
        self.detail = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {"state": self.state, "detail": self.detail, "vllm_pid": None, "internal_url": self.base_url}


# ---------------------------------------------------------------- request handling

class Proxy:
    """Forwarding with bounded retries; see the module docstring."""

    def __init__(self, config: ServeConfig, backend, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.backend = backend
        settings = config.proxy
        self.max_attempts = int(settings["max_attempts"])
        self.backoff_base = float(settings["backoff_base"])
        self.health_timeout = float(settings["health_timeout"])
        limits = httpx.Limits(max_connections=int(settings["max_connections"]),
                              max_keepalive_connections=int(settings["max_connections"]))
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(float(settings["request_timeout"]), connect=float(settings["connect_timeout"])),
            transport=transport or httpx.AsyncHTTPTransport(retries=3, limits=limits), limits=limits)

    async def aclose(self) -> None:
        await self.client.aclose()

    def _not_ready(self) -> JSONResponse:
        if self.backend.state == "failed":
            return unavailable(f"vLLM is down: {self.backend.detail}")
        return unavailable(f"vLLM is {self.backend.state}; retry later")

    async def forward(self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
                      stream: bool = False, timeout: float | None = None) -> Response:
        """Send to vLLM, retrying connection errors and 5xx answers; a streamed 200 is relayed chunk by
        chunk (retries only happen before the first chunk)."""
        if not self.backend.ready:
            return self._not_ready()
        sent_headers = {k: v for k, v in (headers or {}).items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        failure = "no attempt made"
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(self.backoff_base * 2 ** (attempt - 1))
                if not self.backend.ready:
                    return self._not_ready()
            request = self.client.build_request(
                method, self.backend.base_url + path, content=body, headers=sent_headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            try:
                upstream = await self.client.send(request, stream=True)
            except RETRYABLE_ERRORS as err:
                failure = f"{type(err).__name__}: {err}"
                log.warning("%s %s: attempt %d/%d failed (%s)", method, path, attempt + 1, self.max_attempts, failure)
                continue
            except httpx.TimeoutException as err:
                return JSONResponse(error_body(f"vLLM did not answer in time ({type(err).__name__})", 504), 504)
            if upstream.status_code >= 500 and attempt + 1 < self.max_attempts:
                text = (await upstream.aread())[:300].decode(errors="replace")
                await upstream.aclose()
                failure = f"HTTP {upstream.status_code}: {text}"
                log.warning("%s %s: attempt %d/%d got %s", method, path, attempt + 1, self.max_attempts, failure)
                continue
            content_type = upstream.headers.get("content-type", "application/json")
            passed = {k: upstream.headers[k] for k in FORWARDED_RESPONSE_HEADERS if k in upstream.headers}
            if stream and upstream.status_code == 200 and content_type.startswith("text/event-stream"):
                return StreamingResponse(self._relay(upstream), status_code=200, media_type=content_type,
                                         headers={**passed, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                content = await upstream.aread()
            except RETRYABLE_ERRORS as err:
                failure = f"{type(err).__name__} while reading the answer: {err}"
                continue
            finally:
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type=content_type, headers=passed)
        return unavailable(f"vLLM failed {self.max_attempts} time(s); last: {failure}")

    @staticmethod
    async def _relay(upstream: httpx.Response):
        """Chunks as vLLM sends them; closing the upstream on any exit (a client that goes away
        cancels the generator, and vLLM then aborts the request)."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as err:
            message = f"the stream from vLLM broke off: {type(err).__name__}: {err}"
            log.warning(message)
            yield ("data: " + json.dumps(error_body(message, 502, "upstream_error")) + "\n\n").encode()
        finally:
            with anyio.CancelScope(shield=True):   # also when the client went away (the scope is cancelled)
                await upstream.aclose()

    async def ping(self) -> JSONResponse:
        state = self.backend.state
        if state == "failed":
            return JSONResponse({"status": "failed", "detail": self.backend.detail}, status_code=500)
        if state != "ready":
            return JSONResponse({"status": "loading" if state in ("idle", "starting") else state},
                                status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        try:
            health = await self.client.get(self.backend.base_url + "/health", timeout=self.health_timeout)
            if health.status_code == 200:
                return JSONResponse({"status": "ok"})
            reason = f"vLLM /health answered {health.status_code}"
        except httpx.HTTPError as err:
            reason = f"vLLM /health: {type(err).__name__}"
        return JSONResponse({"status": "unhealthy", "detail": reason}, status_code=503,
                            headers={"Retry-After": RETRY_AFTER_S})


def parse_json_object(body: bytes) -> tuple[dict | None, JSONResponse | None]:
    """(payload, None), or (None, a 400 answer saying what is wrong)."""
    if not body.strip():
        return None, JSONResponse(error_body("empty request body; expected a JSON object", 400, "invalid_request_error"), 400)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, JSONResponse(error_body(f"malformed JSON body: {err}", 400, "invalid_request_error"), 400)
    if not isinstance(payload, dict):
        return None, JSONResponse(error_body(f"the JSON body must be an object, not {type(payload).__name__}",
                                             400, "invalid_request_error"), 400)
    return payload, None


def route_invocation(payload: dict, served_model_name: str) -> tuple[str, dict]:
    """(vLLM path, rewritten payload) for /invocations. Chat when `messages` is a list, completion when
    there is a `prompt`; `thinking` (bool) becomes chat_template_kwargs.enable_thinking unless that is
    already set, and thinking is off when neither is given. Raises ValueError for an unusable payload."""
    payload = dict(payload)
    thinking = payload.pop("thinking", None)
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"'thinking' must be true or false, not {thinking!r}")
    payload.setdefault("model", served_model_name)
    if isinstance(payload.get("messages"), list):
        kwargs = payload.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        kwargs = dict(kwargs)
        kwargs.setdefault("enable_thinking", bool(thinking))
        payload["chat_template_kwargs"] = kwargs
        return "/v1/chat/completions", payload
    if "messages" in payload:
        raise ValueError("'messages' must be a list of {role, content} objects")
    if "prompt" in payload:
        return "/v1/completions", payload
    raise ValueError("expected 'messages' (chat) or 'prompt' (raw completion) in the JSON body")


def create_app(config: ServeConfig, backend=None, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app. `backend` defaults to a `VLLMBackend` (spawned at startup, stopped at shutdown);
    `transport` replaces the HTTP transport to vLLM (tests)."""
    backend = backend if backend is not None else VLLMBackend(config)
    proxy = Proxy(config, backend, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        try:
            yield
        finally:
            backend.stop()
            await proxy.aclose()

    app = FastAPI(title="eqc serving proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.state.backend = backend

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"proxy error: {type(err).__name__}: {err}", 500), status_code=500)

    @app.get("/ping")
    async def ping():
        return await proxy.ping()

    @app.get("/status")
    async def status():
        return {**backend.status(), "model": config.model, "served_model_name": config.served_model_name,
                "speculative_config": config["speculative_config"], "name": config["name"]}

    @app.get("/metrics")
    async def metrics(request: Request):
        return await proxy.forward("GET", "/metrics", headers=request.headers, timeout=30.0)

    @app.post("/invocations")
    async def invocations(request: Request):
        payload, problem = parse_json_object(await request.body())
        if problem:
            return problem
        try:
            path, payload = route_invocation(payload, config.served_model_name)
        except ValueError as err:
            return JSONResponse(error_body(str(err), 400, "invalid_request_error"), status_code=400)
        return await proxy.forward("POST", path, json.dumps(payload).encode(),
                                   {"content-type": "application/json", "accept": request.headers.get("accept", "*/*")},
                                   stream=bool(payload.get("stream")))

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def passthrough(path: str, request: Request):
        body = await request.body()
        stream = False
        if request.method != "GET" and body.strip():
            payload, problem = parse_json_object(body)
            if problem:
                return problem
            stream = bool(payload.get("stream"))
        target = f"/v1/{path}" + (f"?{request.url.query}" if request.url.query else "")
        return await proxy.forward(request.method, target, body or None, request.headers, stream=stream)

    return app


# ---------------------------------------------------------------- running it as a child process

class ProxyProcess:
    """`python -m eqc_utils.serving` as a child process, for Python callers:

        with ProxyProcess("configs/serve/tiny_dflash.yaml", overrides={"vllm_args.max_model_len": 2048}) as proxy:
            httpx.post(proxy.url + "/invocations", json={"prompt": "Hello", "max_tokens": 8})

    `start()` waits until /ping answers 200 (vLLM loaded); `stop()` sends SIGTERM (the proxy then stops
    vLLM) and, failing that, SIGKILL. The proxy also dies with this process (parent-death signal).
    """

    def __init__(self, config: str | Path, *, port: int | None = None, host: str = "127.0.0.1",
                 overrides: Mapping[str, Any] | None = None, log_path: str | Path | None = None,
                 ready_timeout: float = 900.0):
        self.config = str(config)
        self.host = host
        self.port = port or free_port()
        self.overrides = dict(overrides or {})
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="eqc-proxy-")) / "proxy.log"
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "eqc_utils.serving", "--config", self.config, "--host", self.host,
                "--port", str(self.port)]
        for key, value in self.overrides.items():
            args += ["--set", f"{key}={json.dumps(value)}"]
        return args

    def spawn(self) -> "ProxyProcess":
        """Start the proxy without waiting for vLLM."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def wait_ready(self) -> "ProxyProcess":
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"the proxy exited with code {self.proc.returncode}; log {self.log_path}, "
                                       f"last lines:\n{log_tail(self.log_path)}")
            try:
                answer = httpx.get(self.url + "/ping", timeout=5.0)
                if answer.status_code == 200:
                    return self
                if answer.status_code == 500:
                    raise ServerStartError(f"vLLM could not be started behind the proxy: {answer.json().get('detail')}")
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ServerStartError(f"the proxy was not ready after {self.ready_timeout:.0f} s; log {self.log_path}, "
                               f"last lines:\n{log_tail(self.log_path)}")

    def start(self) -> "ProxyProcess":
        try:
            return self.spawn().wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 40.0) -> int | None:
        """SIGTERM, wait up to `grace` s (the proxy stops vLLM first), then SIGKILL; returns the exit code."""
        if not self.proc:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> "ProxyProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
