"""The one thread that owns the decoder: it takes requests from a bounded queue into free slots and
steps every active slot at once (continuous batching); each token goes to its request's stream.

    worker = Worker(decoder, queue_size=64)    # decoder: andrea.use.batch.BatchDecoder
    worker.start()
    job = worker.submit(Job(request, AnswerText(tok, stops), deliver))   # QueueFull: slots and queue full
    ... deliver(("text", "hel")), deliver(("text", "lo")), deliver(("end", "stop", 2)) from the thread
    job.cancel()                       # the client is gone: its slot is released at the next step
    worker.stop(); worker.join()       # once nothing is active or waiting

The thread never waits on a client: `deliver` only hands an event to the client's event loop, so a
slow reader piles up its own (bounded: max_tokens) events and a vanished one is cancelled by its
handler. An event is ("text", str), ("end", finish_reason, completion_tokens) or ("error", message,
status); finish_reason is "stop" at a stop id or a stop string, else "length".
"""
from __future__ import annotations

import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional


IDLE_WAKE_S = 0.5  # how often an idle loop looks whether it is asked to stop
CANCELLED = ("error", "the request was cancelled", 499)  # its handler may still be waiting for an end


def failure(e: Exception) -> str:
    return f"the decoder failed: {type(e).__name__}: {e}"


class QueueFull(Exception):
    """Every slot is busy and queue_size requests already wait."""


@dataclass
class Job:
    request: object                   # andrea.use.batch.Request
    text: object                      # prompt.AnswerText
    deliver: Callable[[tuple], None]  # thread-safe: hands an event to the client's side
    tokens: int = 0                   # generated so far
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Worker(threading.Thread):
    """The decode loop of one BatchDecoder, fed by a queue of Jobs."""

    def __init__(self, decoder, queue_size: int):
        super().__init__(name="andrea-serve-decoder", daemon=True)
        self.dec = decoder
        self.pending: "queue.Queue[Job]" = queue.Queue()
        self.capacity = decoder.slots + queue_size  # requests held at once: decoding and waiting
        self.held = 0  # requests submitted and not yet ended (one terminal event each)
        self.lock = threading.Lock()
        self.active: Dict[int, Job] = {}
        self.stopping = threading.Event()
        self.broken: Optional[str] = None  # why the decoder failed; requests are then refused
        self.cancelled = self.finished = 0  # requests ended by their client, and answered in full

    def submit(self, job: Job) -> Job:
        with self.lock:  # broken is set under the lock: a job queued here is drained by _fail_waiting
            if self.broken:
                raise RuntimeError(self.broken)
            if self.held >= self.capacity:
                raise QueueFull(f"all {self.dec.slots} slots are busy and {self.capacity - self.dec.slots} "
                                "requests wait for one")
            self.held += 1
            self.pending.put_nowait(job)
        return job

    def status(self) -> dict:
        """What the loop holds now (read from another thread: counts only)."""
        jobs = list(self.active.values())
        return {"slots": self.dec.slots, "active": len(jobs), "waiting": self.pending.qsize(),
                "leaving": sum(j.cancelled.is_set() for j in jobs), "cancelled": self.cancelled,
                "finished": self.finished, "failed": self.broken}

    def stop(self) -> None:
        """End the loop once nothing is active or waiting."""
        self.stopping.set()

    def run(self) -> None:
        try:
            while True:
                if not self.active:
                    try:
                        self._admit(self.pending.get(timeout=IDLE_WAKE_S))
                    except queue.Empty:
                        if self.stopping.is_set():
                            return
                        continue
                self._admit_waiting()
                self._drop_cancelled()
                if self.active:
                    self._step()
        except Exception as e:  # a failing decoder: every request is told, later ones refused
            with self.lock:
                self.broken = failure(e)
            traceback.print_exc(file=sys.stderr)
            for job in list(self.active.values()):
                self._send(job, ("error", self.broken, 500))
            self.active.clear()
            self._fail_waiting()

    def _admit_waiting(self) -> None:
        while self.dec.free() > 0:
            try:
                job = self.pending.get_nowait()
            except queue.Empty:
                return
            self._admit(job)

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.cancelled += 1
            self._send(job, CANCELLED)
            return
        try:
            slot = self.dec.admit(job.request)
        except ValueError as e:  # the decoder's own check of the request
            self._send(job, ("error", str(e), 400))
            return
        except Exception as e:  # the decoder failed (prefill): this job is in no slot, so told here
            self._send(job, ("error", failure(e), 500))
            raise
        self.active[slot] = job

    def _drop_cancelled(self) -> None:
        for slot, job in list(self.active.items()):
            if job.cancelled.is_set():
                self.dec.release(slot)
                del self.active[slot]
                self.cancelled += 1
                self._send(job, CANCELLED)

    def _step(self) -> None:
        for slot, token, finished in self.dec.step():
            job = self.active.get(slot)
            if job is None:
                continue
            job.tokens += 1
            piece = job.text.push(token)
            if piece:
                self._send(job, ("text", piece))
            if job.text.stopped and not finished:
                self.dec.release(slot)
                finished = True
            if finished:
                del self.active[slot]
                rest = job.text.rest()
                if rest:
                    self._send(job, ("text", rest))
                stop = job.text.stopped or token in job.request.stop_ids
                self.finished += 1
                self._send(job, ("end", "stop" if stop else "length", job.tokens))

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self.pending.get_nowait()
            except queue.Empty:
                return
            self._send(job, ("error", self.broken, 500))

    def _send(self, job: Job, event: tuple) -> None:
        if event[0] != "text":  # the job's end
            with self.lock:
                self.held -= 1
        try:
            job.deliver(event)
        except RuntimeError:  # the client's event loop is gone (the server is closing)
            job.cancel()
