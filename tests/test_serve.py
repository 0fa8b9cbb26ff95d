"""`andrea serve` as a user runs it: the command started as a process on a free port (its ready line
awaited), talked to with the real `openai` client and with plain HTTP, on a model trained here
(tests/trained_model.py). Its answers are checked against `andrea generate`'s for the same prompt
and seed; a stopping server is checked with the decoder held between steps (a sitecustomize gates
BatchDecoder.step on a FIFO this test writes), so the signal lands at a known token."""
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from andrea import cli
from andrea.data.chat import render_prompt
from andrea.data.tokenizer import load_tokenizer
from andrea.serve.prompt import AnswerText
from andrea.serve.worker import Job, Worker
from andrea.use.batch import Request
from andrea.use.generate import TextStream
from conftest import wait_for
from trained_model import QA, make_run

openai = pytest.importorskip("openai", reason="pip install -e '.[dev]' brings the openai client")
START_S = 60  # a server that has not said it is ready by then has failed
GATE_SITE = '''import os
if os.environ.get("ANDREA_TEST_STEP_GATE"):
    import andrea.use.batch as batch
    step, gate = batch.BatchDecoder.step, []

    def gated_step(self):
        """Each step waits for one byte of the FIFO; its end (the writer closed) opens it for good."""
        if not gate:
            gate.append(open(os.environ["ANDREA_TEST_STEP_GATE"], "rb", buffering=0))
        gate[0].read(1)
        return step(self)
    batch.BatchDecoder.step = gated_step
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tok(run):
    return load_tokenizer(run / "tokenizer.json")


class Serving:
    def __init__(self, proc, url):
        self.proc, self.url = proc, url
        self.host, self.port = re.match(r"http://([^:]+):(\d+)", url).groups()

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def post(self, path: str, body) -> tuple:
        """(status, decoded JSON body) of a POST with a raw body (bytes) or a JSON one."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def open_stream(self, body: dict):
        """(connection, response) of a streamed request whose headers have come."""
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        return conn, conn.getresponse()


def next_event(resp):
    """The next `data:` payload of a server-sent event stream (a dict, or "[DONE]")."""
    while True:
        line = resp.fp.readline()
        assert line, "the stream ended without data: [DONE]"
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            return data if data == "[DONE]" else json.loads(data)


@contextlib.contextmanager
def serving(run, *args, env=None):
    """`andrea serve RUN --port 0 ...` as a process, once its ready line is out; SIGTERM at the end."""
    cmd = [sys.executable, "-m", "andrea.cli", "serve", str(run), "--port", "0", "--backend", "numpy", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    watchdog = threading.Timer(START_S, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
        watchdog.cancel()
        m = re.fullmatch(rf"serving {re.escape(str(run))} on (http://127\.0\.0\.1:\d+) \(\d+ slots?\)\n", line)
        assert m, f"no ready line: {line!r}; exit {proc.poll()}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield Serving(proc, m.group(1))
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


@pytest.fixture(scope="module")
def server(run):
    with serving(run, "--slots", "4", "--queue", "32") as s:
        yield s


def generate(run, capsys, prompt, *options) -> str:
    """`andrea generate`'s answer, in this process."""
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", prompt, "--backend", "numpy", *map(str, options)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_chat_and_text_completions_with_the_openai_client(server, tok):
    client = server.client()
    assert [m.id for m in client.models.list()] == ["mini"]
    for q, a in QA:
        r = client.chat.completions.create(model="mini", messages=[{"role": "user", "content": q}], temperature=0)
        assert r.object == "chat.completion" and r.model == "mini"
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == a
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(tok.encode(render_prompt(q)))
        assert r.usage.completion_tokens == len(tok.encode(a)) + 1  # the answer and <|end|>
    # a text completion: the template typed out, cut by max_tokens, then by a stop string
    prompt = render_prompt("hi")
    r = client.completions.create(model="mini", prompt=prompt, max_tokens=3, temperature=0)
    first3 = tok.encode("hello there")[:3]
    assert r.choices[0].text == tok.decode(first3) and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r = client.completions.create(model="mini", prompt=prompt, max_tokens=20, temperature=0, stop=["lo th", "zz"])
    assert r.choices[0].text == "hel" and r.choices[0].finish_reason == "stop"


def test_streamed_chat_completion(server, tok):
    client = server.client()
    chunks = list(client.chat.completions.create(
        model="mini", messages=[{"role": "system", "content": "  "}, {"role": "user", "content": "Name a colour"}],
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "blue é" and len(pieces) >= 3  # streamed token by token, é whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tok.encode("blue é")) + 1
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_bad_requests_name_the_field(server):
    client = server.client()
    for kwargs, param in (({"temperature": 5}, "temperature"), ({"n": 2}, "n"), ({"top_p": 0}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"stop": ["a"] * 5}, "stop"),
                          ({"seed": -1}, "seed"), ({"messages": []}, "messages"),
                          ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
                          ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content")):
        args = {"model": "mini", "messages": [{"role": "user", "content": "hi"}], **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**args)
        err = e.value.response.json()["error"]
        assert err["param"] == param and err["message"].startswith(f"{param}: expected"), err
        assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    status, body = server.post("/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = server.post("/v1/completions", {"model": "mini", "prompt": "x" * 200})
    assert status == 400 and body["error"]["param"] == "prompt" and body["error"]["code"] == "context_length_exceeded"
    status, body = server.post("/v1/completions", {"model": "mini", "prompt": [1, 2, 999]})
    assert status == 400 and body["error"]["param"] == "prompt" and "999" in body["error"]["message"]
    assert server.health()["failed"] is None  # bad requests never reach the decoder


def test_16_concurrent_clients_get_what_generate_gives(server, run, capsys):
    """16 sampled answers at once through 4 slots (continuous batching, a queue) equal andrea
    generate's for the same question, temperature and seed."""
    asks = [(QA[i % 2][0], i) for i in range(16)]

    def ask(q_seed):
        q, seed = q_seed
        r = server.client().chat.completions.create(model="mini", messages=[{"role": "user", "content": q}],
                                                    temperature=2.0, top_p=0.95, seed=seed, max_tokens=8)
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, asks))
    want = [generate(run, capsys, q, "--temperature", 2.0, "--top-p", 0.95, "--seed", seed, "--max-tokens", 8)
            for q, seed in asks]
    assert got == want
    assert len(set(got)) > 8  # the seeds matter: a batch that mixed up slots could not pass


def test_answer_text_holds_back_a_stop_string(tok):
    ids = tok.encode("hello there")
    t = AnswerText(tok, ["o t", "xyz"])
    shown = "".join(t.push(i) for i in ids)
    assert t.stopped and shown == "hell"
    t = AnswerText(tok, ["here!"])  # "h", "he", "her", "here" might begin it: held until the end
    shown = "".join(t.push(i) for i in ids)
    assert not t.stopped and shown == "hello t" and t.rest() == "here"
    t = AnswerText(tok)
    assert "".join(t.push(i) for i in tok.encode("blue é") + [tok.eot_id]) + t.rest() == "blue é"


def test_answer_text_is_generates_text(tok):
    """Decoded piece by piece, the answer's text is what andrea generate prints (TextStream decodes
    every id at each token), also for ids that split and break characters."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, int(rng.integers(1, 30)))]
        ref, t = TextStream(tok), AnswerText(tok)
        want = "".join(ref.push(i) for i in ids)
        assert "".join(t.push(i) for i in ids) == want, ids


class FailingDecoder:
    """Two slots; fails at its first admit (a prefill out of memory: the request is in no slot yet)
    or at its first step (a lost device), as a broken device would."""
    slots = 2

    def __init__(self, where):
        self.where = where

    def free(self):
        return 2

    def admit(self, req):
        if self.where == "admit":
            raise MemoryError("out of device memory")
        return 0

    def step(self):
        raise RuntimeError("device lost")


@pytest.mark.parametrize("where,why", [("step", "RuntimeError: device lost"),
                                       ("admit", "MemoryError: out of device memory")])
def test_a_failing_decoder_ends_its_requests_and_refuses_new_ones(tok, where, why):
    events, ended = [], threading.Event()
    worker = Worker(FailingDecoder(where), 4)
    worker.start()
    worker.submit(Job(Request([1, 2], 4), AnswerText(tok), lambda ev: (events.append(ev), ended.set())))
    assert ended.wait(60)
    worker.join(60)
    assert events == [("error", f"the decoder failed: {why}", 500)] and not worker.is_alive()
    with pytest.raises(RuntimeError, match=why):
        worker.submit(Job(Request([1], 4), AnswerText(tok), events.append))
    assert worker.status()["failed"] and worker.held == 0


@contextlib.contextmanager
def gated_serving(run, tmp_path, *args):
    """A server of one slot whose every decoder step waits for a byte of a FIFO: (Serving, FIFO path)."""
    site = tmp_path / "gate-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GATE_SITE)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    env = {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "ANDREA_TEST_STEP_GATE": str(fifo)}
    with serving(run, "--slots", "1", *args, env=env) as s:
        yield s, fifo


@pytest.fixture
def gated(run, tmp_path):
    """A gated server of one slot and a queue of one."""
    with gated_serving(run, tmp_path, "--queue", "1") as sf:
        yield sf


def test_gone_client_frees_its_slot_and_a_full_queue_is_429(gated):
    s, fifo = gated
    conn, resp = s.open_stream({"model": "mini", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert resp.status == 200 and next_event(resp)["choices"][0]["delta"]["role"] == "assistant"
    gate = open(fifo, "wb", buffering=0)  # returns once the decoder waits in its first step
    try:
        assert s.health()["active"] == 1
        with ThreadPoolExecutor(1) as pool:  # a second request waits in the queue of one
            waiting = pool.submit(s.post, "/v1/chat/completions",
                                  {"model": "mini", "messages": [{"role": "user", "content": "Name a colour"}],
                                   "temperature": 0})
            wait_for(lambda: s.health()["waiting"] == 1, "the second request in the queue", proc=s.proc)
            with pytest.raises(openai.RateLimitError) as e:  # a third finds the queue full
                s.client().chat.completions.create(model="mini", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 429 and e.value.response.json()["error"]["code"] == "queue_full"
            conn.close()  # the streaming client goes away mid-answer
            wait_for(lambda: s.health()["leaving"] == 1, "the server to notice", proc=s.proc)
            gate.write(b"x")  # one step: the slot is released, the waiting request takes it
            wait_for(lambda: s.health()["cancelled"] == 1, "the slot to be released", proc=s.proc)
            gate.close()  # every step from now on runs at once
            gate = None
            status, body = waiting.result(timeout=60)
        assert status == 200 and body["choices"][0]["message"]["content"] == "blue é"
        h = s.health()
        assert (h["active"], h["waiting"], h["cancelled"], h["finished"]) == (0, 0, 1, 1), h
    finally:
        if gate:
            gate.close()


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(gated):
    s, fifo = gated
    conn, resp = s.open_stream({"model": "mini", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert next_event(resp)["choices"][0]["delta"]["role"] == "assistant"
    with ThreadPoolExecutor(1) as pool, open(fifo, "wb", buffering=0) as gate:
        waiting = pool.submit(s.post, "/v1/completions", {"model": "mini", "prompt": render_prompt("Name a colour"),
                                                          "temperature": 0, "max_tokens": 20})
        wait_for(lambda: s.health()["waiting"] == 1, "the second request in the queue", proc=s.proc)
        gate.write(b"xx")  # two tokens of eleven
        text = next_event(resp)["choices"][0]["delta"]["content"] + next_event(resp)["choices"][0]["delta"]["content"]
        s.proc.send_signal(signal.SIGTERM)
        line = s.proc.stderr.readline()
        assert line == "andrea serve: stopping: the port is closed, finishing 2 requests in flight\n"
        with pytest.raises(OSError):  # no new connection once the stop has begun
            http.client.HTTPConnection(s.host, int(s.port), timeout=10).connect()
        gate.close()  # the gate opens: both answers run to their end
        status, body = waiting.result(timeout=60)
    assert status == 200 and body["choices"][0]["text"] == "blue é" and body["choices"][0]["finish_reason"] == "stop"
    finish = None
    while (ev := next_event(resp)) != "[DONE]":
        c = ev["choices"][0]
        text += c["delta"].get("content", "")
        finish = c["finish_reason"] or finish
    assert text == "hello there" and finish == "stop"
    conn.close()
    assert s.proc.wait(timeout=60) == 0
    assert s.proc.stderr.read().endswith("andrea serve: stopped\n")


def test_a_stop_cuts_an_answer_still_going_after_the_grace(run, tmp_path):
    """--grace 1: SIGTERM while an answer cannot go on (the decoder held, as behind a client that
    stopped reading): the stream is cut once the grace has passed, without [DONE]; the held step then
    ends, the cut request's slot is freed and the process exits 0. Without the bound the stop would
    wait for the answer for ever and the read below would time out."""
    with gated_serving(run, tmp_path, "--grace", "1") as (s, fifo):
        conn, resp = s.open_stream({"model": "mini", "messages": [{"role": "user", "content": "hi"}],
                                    "temperature": 0})
        assert next_event(resp)["choices"][0]["delta"]["role"] == "assistant"
        with open(fifo, "wb", buffering=0) as gate:
            gate.write(b"x")  # one token of eleven, then the decoder waits
            assert next_event(resp)["choices"][0]["delta"]["content"]
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.stderr.readline().startswith("andrea serve: stopping")
            rest = resp.fp.read()  # returns when the server closes the stream
            assert b"[DONE]" not in rest
        conn.close()
        assert s.proc.wait(timeout=60) == 0
        assert s.proc.stderr.read().endswith("andrea serve: stopped\n")


def test_a_body_over_the_limit_is_413_without_reading_it_all():
    """app.read_body: a declared Content-Length over MAX_BODY is refused before any byte is read; a
    body without one (chunked) is refused as soon as it passes MAX_BODY, the rest never read."""
    import asyncio

    from starlette.requests import Request as HttpRequest

    from andrea.serve import app
    from andrea.serve.schemas import ApiError

    def request(headers, chunks):
        pulled = []

        async def receive():
            pulled.append(1)
            body = chunks[len(pulled) - 1] if len(pulled) <= len(chunks) else b""
            return {"type": "http.request", "body": body, "more_body": len(pulled) < len(chunks)}
        scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
        return HttpRequest(scope, receive), pulled

    r, pulled = request([(b"content-length", str(app.MAX_BODY + 1).encode())], [b"{}"])
    with pytest.raises(ApiError) as e:
        asyncio.run(app.read_body(r))
    assert e.value.status == 413 and "request body" in e.value.message and pulled == []
    half = b" " * (app.MAX_BODY // 2 + 1)
    r, pulled = request([], [half, half, half, b"{}"])
    with pytest.raises(ApiError) as e:
        asyncio.run(app.read_body(r))
    assert e.value.status == 413 and len(pulled) == 2
    r, _ = request([], [b'{"a":', b" 1}"])
    assert asyncio.run(app.read_body(r)) == b'{"a": 1}'


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_before_the_first_byte_frees_its_job(spec):
    """The streamed answer's response, its client already gone: under ASGI 2.3 the disconnect is
    received at once, under 2.4 the first send fails. Either way the event generator never starts,
    and the job must still be cancelled (its slot freed), not decoded to max_tokens."""
    import asyncio

    from andrea.serve.app import JobStream

    job = Job(Request([1], 4), None, lambda ev: None)
    started = []

    async def events():
        started.append(1)
        yield "data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        if spec == "2.4":
            raise OSError("the client is gone")
        await asyncio.sleep(0)  # 2.3: the disconnect listener wins
    scope = {"type": "http", "asgi": {"spec_version": spec}}
    try:
        asyncio.run(JobStream(job, events(), media_type="text/event-stream")(scope, receive, send))
    except Exception:  # noqa: BLE001 (2.4: Starlette raises its ClientDisconnect)
        pass
    assert job.cancelled.is_set() and not started


def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"andrea serve: {tmp_path / 'nothing'}: no such file or folder") and err.count("\n") == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", str(run), "--port", str(port), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"andrea serve: --host 127.0.0.1 --port {port}: cannot listen there") and err.count("\n") == 1
    for args, field in ((["--slots", "0"], "--slots"), (["--port", "70000"], "--port"), (["--queue", "-1"], "--queue")):
        assert cli.main(["serve", str(run), *args]) == 2
        assert capsys.readouterr().err.startswith(f"andrea serve: {field} ")
