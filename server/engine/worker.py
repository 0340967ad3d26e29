"""The worker: the one thread that touches MLX.

Handlers submit Jobs; the worker admits them (finds or builds their session),
then runs rounds (server/engine/batcher.py): every decoding generation advances one
token in one batched forward pass and prompts are prefilled under a per-round
token budget, so all streams progress together. Events go back to the
handler's asyncio queue. Anything else that needs MLX (deleting a session,
reading cache sizes) runs here too, between rounds, through `call`.

After SIGTERM (`begin_shutdown`) the worker drains: queued requests fail with
503 at once, in-flight ones may finish within `--shutdown-timeout`, then the
rest are cancelled (their streams end with an error event); every session is
then spilled to --spill-dir, if set.

Between rounds (at most every TICK seconds) the store spills sessions idle past
--spill-idle-seconds and those another replica asked for (server/sessions/claims.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from config.settings import ServerSettings
from server.engine.generation import Generation
from server.engine.jobs import (
    Failed,
    Finished,
    Job,
    PromptTooLong,
    QueueFull,
    SessionBusy,
    SessionClaimed,
    ShuttingDown,
    Started,
)
from server.engine.metrics import Metrics
from server.engine.registry import Loaded, ModelRegistry
from server.engine.speculation import MAX_DRAFT

log = logging.getLogger("h2o_server.worker")
TICK = 0.25  # seconds between looks for idle and wanted sessions


class Choices:
    """A job's generations: its n choices, forked from the first once its prompt is in."""

    def __init__(self, n: int, first: Generation):
        self.left = n  # choices not yet finished
        self.unforked = first if n > 1 else None  # the first, until its copies decode
        self.completion_tokens = 0
        self.first: Finished | None = None

    def done(self, gen: Generation) -> None:
        self.left -= 1
        self.completion_tokens += len(gen.generated)
        if gen.choice == 0:
            self.first = gen.finished()

    def finished(self) -> Finished:
        """The request's usage: the prompt counted once, every choice's tokens."""
        return dataclasses.replace(self.first, completion_tokens=self.completion_tokens)


class Worker:
    def __init__(self, settings: ServerSettings, load_engine: Callable[[ServerSettings], Any]):
        self.settings = settings
        self.metrics = Metrics()
        self.models = ModelRegistry(settings, load_engine)  # each loaded model's engine
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._deferred: deque[Job] = deque()  # jobs `_admit` put back to wait, while it runs
        self._active: list[tuple[Job, Generation]] = []
        self._choices: dict[Job, Choices] = {}  # jobs with generations still running
        self._pending = 0  # submitted, not yet started
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = False
        self._drain_deadline: float | None = None  # set by begin_shutdown
        self._drained = threading.Event()
        self._drain_logged = False
        self._startup_error: BaseException | None = None
        self._next_tick = 0.0
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)

    # ------------------------------------------------------------------ handler side

    def start(self) -> None:
        """Start the thread and wait until the model is loaded (raises its error)."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def begin_shutdown(self, timeout: float) -> None:
        """Stop taking requests; cancel what still runs after `timeout` s.

        Safe in a signal handler: one attribute store, no lock (the loop notices
        within its 0.25 s inbox poll).
        """
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout

    def stop(self) -> None:
        """Drain (if no signal started it), spill, and end the thread."""
        if self._thread.is_alive():
            self.begin_shutdown(self.settings.shutdown_timeout)
            self._inbox.put(None)  # wake the loop
            self._drained.wait(timeout=self.settings.shutdown_timeout + 60)
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self.models.close()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ShuttingDown
        with self._lock:
            if self._pending >= self.settings.max_queue:
                self.metrics.add("requests_rejected_total")
                raise QueueFull
            self._pending += 1
        self.metrics.add("requests_total")
        self._inbox.put(job)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the worker thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, future))
        return future

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def engine(self):
        """The default model's Engine, or while it is unloaded the latest used one (None
        before start-up)."""
        if (engine := self.models.engine(self.models.default)) is not None:
            return engine
        latest = max(self.models.snapshot(), key=lambda m: m.used, default=None)
        return latest.engine if latest else None

    def active_memory(self) -> int:
        """Bytes MLX holds now (a counter: safe to read from any thread)."""
        return mx.get_active_memory()

    def engines(self) -> list:
        """Every loaded model's Engine (from any thread: a snapshot)."""
        return [loaded.engine for loaded in self.models.snapshot()]

    def busy_models(self) -> set[str]:
        """Models with a request decoding, prefilling or waiting (never unloaded)."""
        waiting = [*self._waiting, *self._deferred]
        return {self._model_of(job) for job, _ in self._active} | {
            self._model_of(job) for job in waiting
        }

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX's streams are per thread: freed by this thread's exit, they can drop
            # Python references after the interpreter began to finalize and abort the
            # process ("terminate called without an active exception"); MLX asks threads
            # to clear their own streams before they end.
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self.models.load(self.models.default)
        except BaseException as e:  # reported by start()
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        while not self._stopping:
            self._take_inbox(block=not self._active)  # waiting jobs alone wait for a handover
            try:
                if self.draining:
                    self._drain()
                else:
                    self._admit()
                self._round()
                self._tick()
            except Exception as e:  # a fault outside any one request's: those it held end
                self._recover(e)

    def _recover(self, error: Exception) -> None:
        """A round failed outside the per-request handling (a bug): every active request
        ends with a 500 and its session is dropped (its caches may be half updated); the
        worker goes on serving, where it would otherwise leave every request hanging."""
        log.error("a round failed: its %d requests end with an error", len(self._active),
                  exc_info=error)  # fmt: skip
        failed = {}
        for job, gen in list(self._active):
            failed[id(job)] = job
            try:
                self._finish(job, gen, broken=True)
            except Exception:  # its own bookkeeping may be what failed
                if (job, gen) in self._active:
                    self._active.remove((job, gen))
        self._choices.clear()  # every choice of those requests ended with them
        for loaded in self.models.loaded.values():
            loaded.batcher.reset()
        for job in failed.values():
            self._fail(job, 500, f"the server failed this request: {type(error).__name__}: {error}")

    def _tick(self) -> None:
        if time.monotonic() < self._next_tick or self._drained.is_set():
            return
        self._next_tick = time.monotonic() + TICK
        for engine in self.engines():
            engine.store.tick(self.settings.spill_idle_seconds)
        self.models.tick(self.busy_models())

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.25) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, Job):
                    self._waiting.append(item)
                elif item is not None:
                    for loaded in self.models.snapshot():
                        loaded.batcher.lend()  # a reader may look into a decoding session
                    fn, future = item
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drain(self) -> None:
        """One round of the shutdown: fail the queue, cut what overruns, spill when idle."""
        if not self._drain_logged:
            left = max(0.0, self._drain_deadline - time.monotonic())
            log.info("shutting down: %d in-flight request(s) get %.1f s", len(self._active), left)
            self._drain_logged = True
        for job in self._waiting:
            self._started(job)
            self._fail(job, 503, "the server is shutting down", "server_shutting_down")
        self._waiting.clear()
        if self._active and time.monotonic() >= self._drain_deadline:
            cut = "the server shut down before the reply was complete"
            for job, gen in list(self._active):
                log.info(
                    "request %s cut by the shutdown after %d tokens", job.id, len(gen.generated)
                )
                self._finish(job, gen)
                self._fail(job, 503, cut, "server_shutting_down")
        if not self._active and not self._drained.is_set():
            spilled = sum(engine.store.spill_all() for engine in self.engines())
            log.info("drained; %d session(s) spilled", spilled)
            self._drained.set()

    def _cancelled(self, job: Job, gen: Generation | None = None) -> None:
        self.metrics.add("requests_cancelled_total")
        done = f" after {len(gen.generated)} tokens" if gen is not None else " while queued"
        log.info("request %s cancelled (%s)%s", job.id, job.cancel_reason, done)

    def _admit(self) -> None:
        still_waiting = self._deferred  # their models stay loaded while others load
        while self._waiting:
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                self._started(job)
                self._cancelled(job)
                continue
            if self._active and len(self._active) + job.n > self.settings.max_sessions:
                still_waiting.append(job)  # each choice decodes as a session's row
                continue
            session = None
            try:
                engine = self._loaded(job).engine
                session, reused = engine.store.acquire(
                    job.session_key,
                    job.prompt,
                    job.spec,
                    job.owner,
                    self._may_borrow(job),
                    max_new=engine.new_token_limit() if job.spec.info.reindexes else None,
                    reuse=job.reuse,
                    keep=job.keep,
                )
                gen = self._generation(job, session, reused)
            except (SessionBusy, SessionClaimed):
                still_waiting.append(job)  # one turn at a time; or another replica hands it over
                continue
            except PromptTooLong as e:  # policies whose conversations outgrow the context
                self._started(job)
                self._fail(
                    job, 400, self._too_long(job, e), "context_length_exceeded", job.prompt_field
                )
                continue
            except Exception as e:
                log.exception("could not start a request")
                if session is not None:
                    engine.store.release(session, broken=True)
                self._started(job)
                self._fail(job, 500, f"could not prepare the session: {e}")
                continue
            self._started(job)
            job.emit(Started(session.id, reused))
            self._active.append((job, gen))
            self._choices[job] = Choices(job.n, gen)
        self._waiting, self._deferred = still_waiting, deque()

    def _model_of(self, job: Job) -> str:
        return job.model or self.models.default

    def _loaded(self, job: Job) -> Loaded:
        """The job's model, loaded again if it was unloaded since its handler saw it."""
        return self.models.load(self._model_of(job), self.busy_models())

    def _generation(self, job: Job, session, reused: int, choice: int = 0) -> Generation:
        engine = self._loaded(job).engine
        store, grammars = engine.store, engine.grammars
        return Generation(
            engine.tokenizer,
            session,
            job.prompt,
            reused,
            job.params,
            job.prefix_len if choice == 0 else 0,
            store.keep_prefix if choice == 0 else None,
            grammars.constraint(job.grammar) if job.grammar else None,
            choice,
            self._draft_max(job),
            self._predicted(job, engine.tokenizer),
            engine.draft,
        )

    def _draft_max(self, job: Job) -> int:
        """The longest draft a job's reply may feed: the server's (--draft-max), unless its
        request turned speculation off, or on where the server has it off."""
        asked = job.params.speculation
        if asked is None and not job.params.prediction:
            return self.settings.draft_max
        return (self.settings.draft_max or MAX_DRAFT) if asked is not False else 0

    def _predicted(self, job: Job, tokenizer) -> list[int]:
        """The tokens of the reply's predicted text (chat's `prediction`), a draft source."""
        text = job.params.prediction
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    def _fork_choices(self) -> None:
        """A job with n > 1 whose prompt is in (all but the token that starts decoding):
        its other choices start from copies of its caches, in this round's decode pass."""
        for job, choices in self._choices.items():
            first = choices.unforked
            if first is None or first.prefilling or first.done:
                continue
            choices.unforked = None
            try:
                copies = self._loaded(job).engine.store.fork(first.session, job.n - 1)
                gens = [
                    self._generation(job, s, len(s.tokens), i + 1) for i, s in enumerate(copies)
                ]
            except Exception as e:
                log.exception("could not fork a request's choices")
                job.cancel("its choices could not be forked")
                self._fail(job, 500, f"could not fork the request's choices: {e}")
                continue
            self._active += [(job, g) for g in gens]

    def _too_long(self, job: Job, e: PromptTooLong) -> str:
        """The 400's message when the part of the prompt its session lacks is over the limit."""
        engine = self._loaded(job).engine
        limit, new = engine.new_token_limit(), e.new_tokens
        return (
            f"the prompt has {len(job.prompt)} tokens, {new} of them not in this "
            f"conversation's cache: more than the {limit} this server prefills in one request "
            f"(the context is {engine.shape.context}; --max-prompt-tokens raises the limit)"
        )

    def _may_borrow(self, job: Job) -> bool:
        """Whether the job has waited long enough for a session another replica holds."""
        now = time.monotonic()
        if job.claim_deadline is None:
            job.claim_deadline = now + self.settings.claim_wait
        return now >= job.claim_deadline

    def _started(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1

    def _round(self) -> None:
        """Cancel what was abandoned, then one Batcher round over every active generation:
        the decode pass, its tokens sent, then prompts prefilled while they stream out."""
        for job, gen in list(self._active):
            if job.cancelled.is_set():  # a draw not yet read was never fed: nothing to undo
                self._finish(job, gen)
                if job not in self._choices:  # its last choice
                    self._cancelled(job, gen)
        if not self._active:
            return
        self._fork_choices()
        # Each loaded model's requests in a round of their own batcher, one model after
        # another: a model's streams wait one round of each other model, never longer.
        for model in {self._model_of(job): None for job, _ in self._active}:
            batcher = self.models.loaded[model].batcher
            jobs = {gen: job for job, gen in self._active if self._model_of(job) == model}
            decoded = batcher.decode(list(jobs))
            self.metrics.add("decode_seconds_total", decoded.decode_seconds)
            self.metrics.add("decode_passes_total", decoded.decode_passes)
            self._deliver(jobs, decoded.outcomes)
            still = [gen for job, gen in self._active if self._model_of(job) == model]
            filled = batcher.prefill(still, decoding=bool(decoded.decoding))
            self.metrics.add("prefill_tokens_total", filled.prefill_tokens)
            self._deliver(jobs, filled.outcomes)

    def _deliver(self, jobs: dict[Generation, Job], outcomes: list) -> None:
        """Each outcome to its request: a Delta (and Finished after the last), or a 500."""
        for gen, outcome in outcomes:
            job = jobs[gen]
            if isinstance(outcome, Exception):
                log.error("generation failed", exc_info=outcome)
                self._finish(job, gen, broken=True)
                self._fail(job, 500, f"generation failed: {type(outcome).__name__}: {outcome}")
                job.cancel("another of its choices failed")  # the rest end next round
                continue
            job.emit(outcome)
            self.metrics.add("decoded_tokens_total", outcome.tokens)
            if gen.done:
                choices = self._choices[job]
                self._finish(job, gen)
                if job not in self._choices and not job.cancelled.is_set():  # its last choice
                    finished = choices.finished()
                    self.metrics.add("prompt_tokens_total", finished.prompt_tokens)
                    self.metrics.add("cached_prompt_tokens_total", finished.cached_tokens)
                    self.metrics.add("completion_tokens_total", finished.completion_tokens)
                    job.emit(finished)

    def _finish(self, job: Job, gen: Generation, broken: bool = False) -> None:
        self._active.remove((job, gen))
        loaded = self._loaded(job)
        loaded.batcher.leave(gen, broken)  # its session's caches are whole again
        turn = None if broken else gen.finished()  # a stopped turn counts too: its tokens stay
        if gen.drafter is not None:
            self.metrics.add("draft_tokens_total", gen.drafter.proposed)
            self.metrics.add("accepted_draft_tokens_total", gen.drafter.accepted)
        loaded.engine.store.release(gen.session, broken=broken, turn=turn)
        self.models.touch(self._model_of(job), job.keep_alive)
        choices = self._choices[job]
        choices.done(gen)
        if choices.left == 0 or (choices.unforked is not None and gen.choice == 0):
            del self._choices[job]  # every choice ended (or the first, before its forks)

    def _fail(
        self, job: Job, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        self.metrics.add("requests_failed_total")
        job.emit(Failed(status, message, code, param))
