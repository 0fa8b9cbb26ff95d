"""The HTTP side of `andrea serve`: a Starlette app speaking OpenAI's API, and the chat page.

    GET  /                      the chat page (andrea/web/chat.html)
    GET  /v1/models             the one model served; GET /v1/models/{id}
    GET  /health                slots, requests active and waiting (503 once the decoder has failed)
    POST /v1/chat/completions   messages through the chat template; "stream": true for server-sent events
    POST /v1/completions        a prompt as it is (text or token ids)

A request is checked (schemas.py), turned into ids (prompt.py) and queued to the worker (worker.py);
its answer comes back as events, sent on as they arrive (`data: {chunk}` lines, then
`data: [DONE]`) or gathered into one JSON object. Every error is OpenAI's error object: 400 for a
bad body (naming the field), 404 for another model or path, 429 when the queue is full, 503 once
the decoder has failed. A client that goes away cancels its request, which frees its slot.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import sys
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import schemas
from .prompt import AnswerText, chat_ids, text_ids
from .schemas import ApiError
from .worker import Job, QueueFull, Worker

PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


@dataclass
class Served:
    """What the routes need of the model: its name, tokenizer, window and the worker."""
    model_id: str
    tok: object
    vocab_size: int
    window: int            # positions a request may use: prompt and answer together
    worker: Worker
    page: bytes
    make_request: object   # (ids, max_new, ask, seed) -> andrea.use.batch.Request
    created: int = 0


def error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def make_app(s: Served) -> Starlette:
    async def page(_):
        return Response(s.page, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-store"})

    async def models(_):
        return JSONResponse({"object": "list", "data": [model_card(s)]})

    async def model(request):
        if request.path_params["name"] != s.model_id:
            return error(ApiError(404, f"model {request.path_params['name']!r} is not served here; expected "
                                       f"{s.model_id!r}", "model", code="model_not_found"))
        return JSONResponse(model_card(s))

    async def health(_):
        st = s.worker.status()
        return JSONResponse({"status": "failed" if st["failed"] else "ok", "model": s.model_id, **st},
                            status_code=503 if st["failed"] else 200)

    async def chat(request):
        return await answer(s, request, schemas.parse_chat)

    async def completions(request):
        return await answer(s, request, schemas.parse_completion)

    async def http_error(_, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(ApiError(exc.status_code, str(exc.detail), type=kind))

    async def server_error(_, exc):  # a bug: the traceback goes to stderr, the client gets the error object
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    routes = [Route("/", page), Route("/health", health), Route("/v1/models", models), Route("/v1/models/{name:path}", model),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def model_card(s: Served) -> dict:
    return {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "andrea",
            "context_window": s.window}


async def answer(s: Served, request: HttpRequest, parse):
    try:
        ask, job, events = await start(s, request, parse)
    except ApiError as e:
        return error(e)
    if ask.stream:
        return JobStream(job, stream(request, ask, job, events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watch = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        parts, end = [], None
        while end is None:
            ev = await events.get()
            if ev[0] == "text":
                parts.append(ev[1])
            else:
                end = ev
    finally:
        watch.cancel()
        job.cancel()  # nothing left to do if it has ended; frees the slot if the handler was cancelled
    if end[0] == "error":
        return error(ApiError(end[2], end[1], type="server_error" if end[2] >= 500 else "invalid_request_error"))
    return JSONResponse(schemas.completion(ask, "".join(parts), end[1], schemas.usage(len(job.request.prompt_ids), end[2])))


MAX_BODY = 4 << 20  # bytes of a request body: a window of any served model is a few KB of text


async def read_body(request: HttpRequest) -> bytes:
    """The request's body, or a 413 once it passes MAX_BODY (read no further: a client cannot make
    the server hold an unbounded body)."""
    too_big = ApiError(413, f"request body: over {MAX_BODY:,} bytes; expected a JSON object of at most that size",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def start(s: Served, request: HttpRequest, parse):
    """(ask, job, event queue): the request checked, tokenised and queued."""
    try:
        body = json.loads(await read_body(request))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body: not valid JSON ({e}); expected a JSON object") from None
    ask = parse(body, s.model_id)
    if ask.kind == schemas.CHAT:
        reserve = min(ask.max_tokens or s.window // 2, s.window // 2)
        ids, _ = chat_ids(s.tok, ask.messages, s.window, reserve)
        where = "messages"
    else:
        ids, where = text_ids(s.tok, ask.prompt, s.vocab_size), "prompt"
    if not ids:
        raise schemas.bad("prompt", "text that gives at least one token", ask.prompt)
    if len(ids) > s.window:
        raise ApiError(400, f"{where}: {len(ids)} tokens, the model's window is {s.window}; expected a "
                            f"shorter prompt", where, code="context_length_exceeded")
    room = s.window + 1 - len(ids)  # the answer ends when the window is full (its last token is not fed)
    max_new = min(ask.max_tokens or room, room)
    seed = ask.seed if ask.seed is not None else secrets.randbits(63)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    job = Job(s.make_request(ids, max_new, ask, seed), AnswerText(s.tok, ask.stop),
              lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    try:
        s.worker.submit(job)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_exceeded",
                       code="queue_full") from None
    except RuntimeError as e:
        raise ApiError(503, str(e), type="server_error", code="decoder_failed") from None
    return ask, job, events


async def cancel_on_disconnect(request: HttpRequest, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class JobStream(StreamingResponse):
    """The event stream of one job, which is cancelled however the response ends: a client gone
    before the first byte is sent never starts the stream's generator (whose own finally would
    cancel it), and its slot would otherwise decode to max_tokens for nobody."""

    def __init__(self, job: Job, *args, **kw):
        super().__init__(*args, **kw)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(request: HttpRequest, ask, job: Job, events: asyncio.Queue):
    """The server-sent events of one answer; the job is cancelled if the client goes away (noticed
    here rather than left to the response, which under ASGI 2.4 sees it only at its next write)."""
    watch = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        if ask.kind == schemas.CHAT:
            yield sse(schemas.chunk(ask, role=True))
        while True:
            ev = await events.get()
            if ev[0] == "text":
                yield sse(schemas.chunk(ask, text=ev[1]))
                continue
            if ev[0] == "error":
                yield sse(ApiError(ev[2], ev[1], type="server_error" if ev[2] >= 500 else "invalid_request_error").body())
            else:
                yield sse(schemas.chunk(ask, finish=ev[1]))
                if ask.include_usage:
                    yield sse(schemas.chunk(ask, use=schemas.usage(len(job.request.prompt_ids), ev[2])))
            break
        yield "data: [DONE]\n\n"
    finally:
        watch.cancel()
        job.cancel()


class Server(uvicorn.Server):
    """uvicorn's server, printing the ready line on stdout once it listens, and a line on stderr
    when a stop begins (SIGTERM, Ctrl-C): the port closes, the requests in flight are finished."""

    def __init__(self, config: uvicorn.Config, ready: str):
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(self.ready, flush=True)

    async def shutdown(self, sockets=None):
        for server in self.servers:  # closed first, so that once the line is out no connection is taken
            server.close()
        busy = len(self.server_state.tasks)
        print(f"andrea serve: stopping: the port is closed, finishing {busy} request{'s' if busy != 1 else ''} "
              "in flight", file=sys.stderr, flush=True)
        await super().shutdown(sockets)
