"""The serve stage's port check, against real sockets and a real HTTP server on 127.0.0.1 (no Ray needed).

The liveness of a recorded endpoint (same cluster, app running, champion's version) is tested end to end in
tests/e2e/test_pipeline.py, where real clusters come and go.
"""

from __future__ import annotations

import http.server
import threading

import pytest

from draftline.serving.control import ServingError
from draftline.serving.liveness import refuse_foreign_port, start_command
from conftest import free_port, make_test_config


def test_a_free_serve_port_passes(tmp_path):
    refuse_foreign_port(make_test_config(data_dir=tmp_path, extra=[f"serve.port={free_port()}"]))


def test_a_serve_port_held_by_another_server_is_refused_with_the_fix(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        with pytest.raises(ServingError) as raised:
            refuse_foreign_port(make_test_config(data_dir=tmp_path, extra=[f"serve.port={port}"]))
    finally:
        server.shutdown()
        server.server_close()
    message = str(raised.value)
    assert f"serve.port {port} on 127.0.0.1 is already taken by something that is not this run's Serve" in message
    assert "/v1/models answered HTTP 404" in message
    assert "RAY_ADDRESS=" in message and "serve.port=N" in message


def test_start_command_quotes_overrides_and_detaches_only_on_a_cluster():
    local = start_command("draftline", "configs/tiny-cpu.yaml", ["bench.concurrency=[1, 4]"], local=True)
    assert local == "draftline serve --config configs/tiny-cpu.yaml 'bench.concurrency=[1, 4]'"
    assert start_command("draftline", "c.yaml", [], local=False) == "draftline serve --detach --config c.yaml"
