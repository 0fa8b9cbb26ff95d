"""The dashboard server: what it serves, and the 404 for everything else (traversal, symlinks)."""
import http.client
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from andrea.pipeline.dashboard import PAGE, DashboardServer, build_routes
from andrea.util.atomic import atomic_write_json

REPO = Path(__file__).resolve().parent.parent


def make_records(run: Path, n: int = 5, kinds=("loss", "state", "samples")):
    run.mkdir(parents=True, exist_ok=True)
    name = run.name
    if "loss" in kinds:
        atomic_write_json(run / f"{name}.loss.json", {"format": "andrea-loss/1", "exp": name, "total_steps": 50,
                                                      "history": [{"step": i, "loss": 5.0 - 0.1 * i, "lr": 1e-3}
                                                                  for i in range(1, n + 1)]})
    if "state" in kinds:
        atomic_write_json(run / f"{name}.state.json", {"exp": name, "status": "running", "step": n})
    if "samples" in kinds:
        atomic_write_json(run / f"{name}.samples.json", {"exp": name, "samples": []})


@pytest.fixture
def server(tmp_path):
    """A dashboard on a free port over two run folders; yields (server, [run folders])."""
    runs = [tmp_path / "results" / "ANDREA-a", tmp_path / "results" / "ANDREA-b"]
    make_records(runs[0])
    make_records(runs[1], kinds=("loss",))
    (runs[0] / "config.yaml").write_text("exp: ANDREA-a\n")
    (runs[0] / "checkpoints").mkdir()
    (runs[0] / "checkpoints" / "step_00000004.bin").write_bytes(b"\0" * 16)
    srv = DashboardServer(runs, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, runs
    srv.shutdown()
    srv.server_close()


def get(srv, path: str, method: str = "GET", headers=None):
    """A raw request: http.client sends the path exactly as given (no normalisation, no quoting)."""
    c = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    c.request(method, path, headers=headers or {})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, dict(r.getheaders()), body


def test_serves_page_index_and_records(server):
    srv, runs = server
    st, h, body = get(srv, "/")
    assert st == 200 and body == PAGE.read_bytes() and h["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in h["Content-Security-Policy"]
    st, _, body = get(srv, "/runs.json")
    index = json.loads(body)
    assert [r["name"] for r in index["runs"]] == ["ANDREA-a", "ANDREA-b"]
    assert index["runs"][1]["loss"] == "/runs/1/ANDREA-b.loss.json"
    for kind in ("loss", "state", "samples"):
        st, h, body = get(srv, f"/runs/0/ANDREA-a.{kind}.json")
        assert st == 200 and body == (runs[0] / f"ANDREA-a.{kind}.json").read_bytes()
        assert h["Content-Type"] == "application/json"
    st, _, body = get(srv, "/runs/0/ANDREA-a.loss.json?t=123")  # a cache-busting query is fine
    assert st == 200 and len(json.loads(body)["history"]) == 5
    assert get(srv, "/runs/1/ANDREA-b.state.json")[0] == 404  # not written yet


@pytest.mark.parametrize("path", [
    "/../pyproject.toml", "/%2e%2e/pyproject.toml", "/%2E%2E/%2E%2E/etc/passwd", "/..%2fpyproject.toml",
    "/runs/0/../../../pyproject.toml", "/runs/0/%2e%2e/%2e%2e/%2e%2e/pyproject.toml",
    "/runs/0/..%2f..%2f..%2fpyproject.toml", "/etc/passwd", "//etc/passwd", "/" + str(REPO / "pyproject.toml"),
    "http://127.0.0.1/etc/passwd", "/runs/0/config.yaml", "/runs/0/checkpoints/step_00000004.bin",
    "/runs/0/", "/runs/2/ANDREA-a.loss.json", "/runs/1/ANDREA-a.loss.json", "/runs/0/ANDREA-a.loss.json/",
    "/runs/0/ANDREA-a.loss.json%00", "/runs/0/./ANDREA-a.loss.json", "/runs/0/ANDREA-a.LOSS.json",
    "/scripts/live-loss-dashboard.html", "/andrea/proxy.py", "/runs.json/../pyproject.toml", "/.git/config",
])
def test_everything_else_is_404(server, path):
    srv, _ = server
    st, _, body = get(srv, path)
    assert st == 404, path
    assert b"[project]" not in body and b"root:" not in body and b"exp:" not in body


def test_symlinked_record_is_404(server, tmp_path):
    srv, runs = server
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": true}')
    target = runs[0] / "ANDREA-a.samples.json"
    target.unlink()
    target.symlink_to(secret)
    assert get(srv, "/runs/0/ANDREA-a.samples.json")[0] == 404
    assert get(srv, "/runs/0/ANDREA-a.loss.json")[0] == 200


def test_unchanged_record_revalidates_to_304(server):
    srv, runs = server
    st, h, _ = get(srv, "/runs/0/ANDREA-a.loss.json")
    etag = h["ETag"]
    st, h2, body = get(srv, "/runs/0/ANDREA-a.loss.json", headers={"If-None-Match": etag})
    assert st == 304 and body == b"" and h2["ETag"] == etag
    make_records(runs[0], n=9, kinds=("loss",))  # the proxy rewrites the file
    st, h3, body = get(srv, "/runs/0/ANDREA-a.loss.json", headers={"If-None-Match": etag})
    assert st == 200 and h3["ETag"] != etag and len(json.loads(body)["history"]) == 9


def test_head_and_post(server):
    srv, _ = server
    st, h, body = get(srv, "/runs/0/ANDREA-a.state.json", method="HEAD")
    assert st == 200 and body == b"" and int(h["Content-Length"]) > 0
    assert get(srv, "/runs/0/ANDREA-a.state.json", method="POST")[0] == 501


def test_cli_binds_loopback_prints_address_and_stops_on_ctrl_c(tmp_path):
    run = tmp_path / "ANDREA-tiny"
    make_records(run)
    p = subprocess.Popen([sys.executable, "-m", "andrea.pipeline.dashboard", str(run), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "ANDREA-tiny at http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/runs/0/ANDREA-tiny.state.json")
        assert json.loads(c.getresponse().read())["status"] == "running"
        c.close()
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cli_missing_run_folder_names_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "andrea.pipeline.dashboard", str(tmp_path / "nope"), "--port", "0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and f"run folder {tmp_path / 'nope'}: no such directory" in r.stderr


def test_page_is_self_contained():
    html = PAGE.read_text()
    assert "<script src" not in html and "<link" not in html and "@import" not in html
    for needle in ("http://", "https://", "//cdn"):
        # the one allowed absolute URL is the SVG namespace, which is a name, never fetched
        rest = html.replace("http://www.w3.org/2000/svg", "")
        assert needle not in rest, needle


def test_sweep_folder_serves_the_records_named_by_config_exp(tmp_path):
    """A sweep run lives in results/<exp>/sweep/<overrides>/ but its records are <exp>.*.json."""
    run = tmp_path / "ANDREA-tiny" / "sweep" / "train.lr=0.001"
    make_records(run / "x")  # records of a run named "x" in a subfolder: never served from here
    (run / "config.yaml").write_text("exp: ANDREA-tiny\ntrain:\n  lr: 0.001\n")
    atomic_write_json(run / "ANDREA-tiny.state.json", {"exp": "ANDREA-tiny", "status": "finished"})
    srv = DashboardServer([run], "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        entry = json.loads(get(srv, "/runs.json")[2])["runs"][0]
        assert entry["name"] == "ANDREA-tiny (train.lr=0.001)" and entry["exp"] == "ANDREA-tiny"
        st, _, body = get(srv, entry["state"])
        assert st == 200 and json.loads(body)["status"] == "finished"
        assert get(srv, "/runs/0/train.lr=0.001.state.json")[0] == 404
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("text", ["exp: ../../etc\n", "exp: [1, 2]\n", ": not yaml : [\n"])
def test_odd_config_exp_falls_back_to_the_folder_name(tmp_path, text):
    run = tmp_path / "ANDREA-x"
    make_records(run)
    (run / "config.yaml").write_text(text)
    index, files = build_routes([run])
    assert index["runs"][0]["name"] == "ANDREA-x"
    assert sorted(files) == [f"/runs/0/ANDREA-x.{k}.json" for k in ("loss", "samples", "state")] + [
        "/runs/0/tasks.json"]  # eval/tasks.json, whatever exp says


def test_cli_port_in_use_says_so(server, tmp_path):
    srv, runs = server
    port = srv.server_address[1]
    r = subprocess.run([sys.executable, "-m", "andrea.pipeline.dashboard", str(runs[0]), "--port", str(port)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr


def test_run_with_overrides_is_labelled_by_them(tmp_path):
    """results/ANDREA-tiny+train.lr=0.001 (the override typed as train.lr=1e-3): records <run
    name>.*.json, label 'ANDREA-tiny: train.lr=0.001', the value normalised as the run's name is
    (where its data lives, such as data.dir, is left out of the label)."""
    name = "ANDREA-tiny+train.lr=0.001"
    run = tmp_path / name
    make_records(run)
    (run / "config.yaml").write_text(f"exp: {name}\noverrides: [train.lr=1e-3, data.dir=/d]\n")
    pinned = tmp_path / "ANDREA-tiny"
    make_records(pinned)
    (pinned / "config.yaml").write_text("exp: ANDREA-tiny\noverrides: []\n")
    srv = DashboardServer([run, pinned], "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        a, b = json.loads(get(srv, "/runs.json")[2])["runs"]
        assert a["name"] == "ANDREA-tiny: train.lr=0.001" and a["exp"] == name
        assert b["name"] == "ANDREA-tiny"
        st, _, body = get(srv, a["loss"])
        assert st == 200 and json.loads(body)["exp"] == name
    finally:
        srv.shutdown()
        srv.server_close()


def test_validation_loss_carries_its_batch_count(tmp_path):
    """runs.json gives each run's train.eval_batches, and the page's table cell prints the last
    validation loss with its step and that count (the report's own figure averages eval.batches)."""
    import re
    import shutil
    run = tmp_path / "ANDREA-v"
    make_records(run)
    (run / "config.yaml").write_text("exp: ANDREA-v\ntrain:\n  eval_batches: 4\n")
    other = tmp_path / "ANDREA-w"
    make_records(other)
    index, _ = build_routes([run, other])
    assert [r["val_batches"] for r in index["runs"]] == [4, None]
    if shutil.which("node") is None:
        pytest.skip("needs node to run the page's script")
    fn = re.search(r"\nfunction valCell\(lastVal, batches\) \{.*?\n\}\n", PAGE.read_text(), re.S).group(0)
    js = tmp_path / "t.js"
    js.write_text(fn + "\nconsole.log(JSON.stringify([valCell({step: 1500, val_loss: 1.65504}, 4), "
                       "valCell({step: 10, val_loss: 2}, null), valCell(undefined, 4)]));\n")
    out = json.loads(subprocess.run(["node", str(js)], capture_output=True, text=True, check=True).stdout)
    assert out == ["1.6550 @1500 (4 batches)", "2.0000 @10", ""]
