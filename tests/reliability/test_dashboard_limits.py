"""The dashboard against stalled clients and planted files: a silent connection is closed after the
idle timeout, and a record name that is a hard link to another file is not served."""
import http.client
import os
import socket
import threading
import time

import pytest

from andrea.util.atomic import atomic_write_json
from andrea.pipeline.dashboard import DashboardServer


@pytest.fixture
def server(tmp_path):
    run = tmp_path / "results" / "ANDREA-a"
    run.mkdir(parents=True)
    for kind, obj in (("loss", {"exp": "ANDREA-a", "history": []}), ("state", {"exp": "ANDREA-a"}),
                      ("samples", {"exp": "ANDREA-a", "samples": []})):
        atomic_write_json(run / f"ANDREA-a.{kind}.json", obj)
    srv = DashboardServer([run], "127.0.0.1", 0, idle_timeout=0.5)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, run
    srv.shutdown()
    srv.server_close()


def status(srv, path):
    c = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def test_stalled_connections_are_closed_after_the_idle_timeout(server):
    srv, _ = server
    stalled = []
    for i in range(8):  # half a request line, or nothing at all
        s = socket.create_connection(srv.server_address[:2], timeout=5)
        if i % 2:
            s.sendall(b"GET /runs.js")
        stalled.append(s)
    t0 = time.monotonic()
    for s in stalled:
        try:
            while s.recv(4096):  # read to the end: the server closes it (after an error reply at most)
                pass
        except socket.timeout:
            pytest.fail("a stalled connection was still open 5 s later: no idle timeout")
        finally:
            s.close()
    assert time.monotonic() - t0 < 5
    assert status(srv, "/runs.json") == 200  # the server still answers


def test_hard_linked_record_is_404(server, tmp_path):
    srv, run = server
    assert status(srv, "/runs/0/ANDREA-a.state.json") == 200
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": true}')
    target = run / "ANDREA-a.state.json"
    target.unlink()
    os.link(secret, target)
    assert status(srv, "/runs/0/ANDREA-a.state.json") == 404
    # the proxy's next atomic rewrite gives the name a file of its own again
    atomic_write_json(target, {"exp": "ANDREA-a", "status": "running"})
    assert status(srv, "/runs/0/ANDREA-a.state.json") == 200
    assert secret.read_text() == '{"secret": true}'
