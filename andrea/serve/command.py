"""`andrea serve`: a trained model behind OpenAI's HTTP API, with a chat page at `/`.

    andrea serve RUN [--host 127.0.0.1] [--port 8000] [--slots 8] [--queue 64] [--backend auto|numpy|cuda]

RUN is any path `andrea generate` takes (a run folder, an archive, a checkpoint). The model is
loaded into a BatchDecoder of --slots sequences; one worker thread owns it (worker.py) and uvicorn
serves the app (app.py) on the main thread. Once the port listens, one line is printed on stdout:

    serving RUN on http://127.0.0.1:8000 (8 slots)

(--port 0 takes a free port, named there.) SIGTERM or Ctrl-C: the port is closed, the answers
in flight are finished, then the process exits 0; answers still going after --grace seconds (a
client that stopped reading) are cut and their slots freed, so a stop always ends. Bad input (no model at RUN, a port in use) is
one line on stderr and exit 2.
"""
from __future__ import annotations

import signal
import socket
import sys
import time

from ..paths import CHAT_PAGE


def add_arguments(p) -> None:
    p.add_argument("path", help="run folder (results/<exp>), archive folder or step_XXXXXXXX.bin checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed when ready)")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a slot when all are busy; more are answered 429 (default 64)")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    p.add_argument("--precision", default="", choices=("", "fp32", "fp16", "bf16"),
                   help="compute dtype (default: fp32 on NumPy, the training precision on CUDA)")
    p.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (default: as andrea generate)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a stop (SIGTERM, Ctrl-C) waits for the answers in flight before it cuts them "
                        "(default 30)")
    p.set_defaults(fn=cmd_serve)


def load_model(a):
    """(cfg, tokenizer, BatchDecoder of --slots slots with the weights) as `andrea generate` loads them."""
    from ..use.generate import load_batch

    cfg, tok, dec, _ = load_batch(a.path, a.backend, a.tokenizer, a.precision, prog="andrea serve", slots=a.slots)
    return cfg, tok, dec


def request_maker(tok):
    """(ids, max_new, ask, seed) -> a decoder Request ending at any special token, as `andrea generate`."""
    from ..use.batch import Request

    stops = frozenset(tok.special_ids.values())

    def make(ids, max_new, ask, seed):
        return Request(prompt_ids=list(ids), max_new=max_new, temperature=ask.temperature, top_p=ask.top_p,
                       top_k=ask.top_k, seed=seed, stop_ids=stops)
    return make


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (uvicorn listens on it), or ValueError naming the address."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); expected a "
                         "free port on an address of this machine") from None
    return sock


def cmd_serve(a) -> int:
    try:
        import uvicorn

        from .app import Served, Server, make_app
    except ImportError as e:
        raise ValueError(f"andrea serve needs starlette and uvicorn ({e}); pip install 'andrea[serve]'") from None
    from .worker import Worker

    if a.slots < 1:
        raise ValueError(f"--slots {a.slots}: expected at least 1")
    if a.queue < 0:
        raise ValueError(f"--queue {a.queue}: expected 0 or more")
    if not a.grace > 0:
        raise ValueError(f"--grace {a.grace}: expected a positive number of seconds")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port}: expected 0 (any free port) to 65535")
    cfg, tok, dec = load_model(a)
    sock = listen(a.host, a.port)
    worker = Worker(dec, a.queue)
    served = Served(model_id=cfg.exp, tok=tok, vocab_size=cfg.model.vocab_size, window=dec.context, worker=worker,
                    page=CHAT_PAGE.read_bytes(), make_request=request_maker(tok), created=int(time.time()))
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    server = Server(uvicorn.Config(make_app(served), log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=a.grace),
                    ready=f"serving {a.path} on {url} ({a.slots} slot{'s' if a.slots != 1 else ''})")
    worker.start()
    # uvicorn takes SIGTERM and SIGINT while it serves and raises them again afterwards against the
    # handlers it found: ignored, so a graceful stop ends with exit 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.run(sockets=[sock])
    worker.stop()
    worker.join()
    print("andrea serve: stopped", file=sys.stderr, flush=True)
    return 0
