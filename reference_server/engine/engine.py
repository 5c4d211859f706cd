"""The step loop: admit/abort, schedule, run the model, detokenize, hand outputs to the caller.

``Engine.step`` is synchronous (tests drive it directly); ``Engine.start`` runs it in a background
thread that sleeps while idle (``Engine.on_own_thread`` builds the engine on that thread in the first
place, which the server does). Outputs go to one sink callback per step (the server bridges them onto
its asyncio loop in a single thread-safe call).

Faults are contained at the smallest scope that holds them: an exception while emitting one request's
tokens (detokenizer, stop strings) fails that request alone; one that spoils the step (scheduling, the
forward pass, sampling: a kernel error, out of memory) fails the step's requests; both free the blocks
and the loop goes on. Anything else ends the loop: every request in flight then gets an error output,
``alive`` turns False and ``add_request`` raises ``EngineDead``, so that callers answer at once.

Size: the engine loop (schedule, run, emit), its own-thread driver and its death handling share the engine
state, as in nano-vllm's engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from reference_server.config import EngineConfig
from reference_server.engine import cpu_memory
from reference_server.engine.batching import BatchGate
from reference_server.engine.block_manager import BlockManager
from reference_server.engine.iteration import IterationRecord
from reference_server.engine.policies import make_policy
from reference_server.engine.scheduler import Policy, ScheduledBatch, Scheduler
from reference_server.engine.sequence import SamplingParams, SeqStatus, Sequence
from reference_server.model.gguf_loader import gguf_reader
from reference_server.model.logprobs import TokenLogprobs
from reference_server.model.model_runner import ModelRunner
from reference_server.model.text import Detokenizer, TextCodec
from reference_server.speculation.spec_decode import make_spec_decoder


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    seq_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec_drafted: int = 0  # speculative decoding: draft tokens verified for this request so far
    spec_accepted: int = 0  # of which accepted
    error: str | None = None  # set when the request failed (finish_reason "error"): what went wrong
    embedding: list[float] | None = None  # a pooling request's result (finish_reason "pooled")
    logprobs: list[TokenLogprobs] | None = None  # of ``token_ids``, when the request asked (SamplingParams.logprobs)


OutputSink = Callable[[list[RequestOutput]], None]
log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine loop has ended after an unexpected error; no request can be served."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, codec: TextCodec | None = None,
                 policy: Policy | None = None) -> None:
        cpu_memory.bound_onednn_caches()  # before the model's first matmul: read once per process
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.codec = codec or TextCodec(config.model)
        spec_len = self.runner.spec.context_length  # a context cannot outgrow the pool (sized from memory on CUDA)
        self.max_model_len = min(config.max_model_len or spec_len, spec_len, self.runner.num_blocks * config.block_size)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        gate = BatchGate(config.batching, config.batch_size, config.batch_max_delay_ms / 1000, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.max_model_len, config.enable_chunked_prefill,
                                   policy or make_policy(config.policy, config.aging_s), gate)
        self.spec = make_spec_decoder(config, self.runner, self.block_manager)
        self.iterations: deque[IterationRecord] = deque(maxlen=config.iteration_log_size)
        self.num_iterations = 0
        self.on_iteration: list[Callable[[IterationRecord], None]] = []
        if self.spec is not None and self.spec.governor is not None:  # drafting on or off by measured speed
            self.on_iteration.append(self.spec.governor.observe)
        self.on_finish: list[Callable[[str], None]] = []  # called with the finish reason of every request
        self.num_finished: Counter[str] = Counter()  # requests ended, by reason (stop/length/pooled/abort/error)
        self.fatal: str | None = None  # why the loop died, once it has
        self._lock = threading.Lock()  # orders add_request against the loop's death
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._stop_ids: dict[str, set[int]] = {}
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by on_own_thread
        self._running = False
        self._sink: OutputSink | None = None
        gguf_reader.cache_clear()  # the GGUF file's reader is for loading: ~500k objects and its memory map
        cpu_memory.release_free_heap()  # the loader's freed temporaries

    # -- requests (thread-safe) ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None, seq_id: str | None = None,
                    priority: int = 0) -> Sequence:
        """Queue a request: generation with ``params``, or with None a pooling request (an embedding input,
        see ``Sequence``), which needs no room for output: its prompt may fill the context."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.max_model_len - (params is not None):
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}")
        seq = Sequence(prompt_ids, params, seq_id, priority)
        with self._lock:
            if self.fatal is not None:
                raise EngineDead(f"the engine has stopped after an error ({self.fatal})")
            self._commands.put(("add", seq))
        self._wake.set()
        return seq

    def abort(self, seq_id: str) -> None:
        self._commands.put(("abort", seq_id))
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache on the loop's thread, in order: a request added after this call finds
        nothing that was cached before it."""
        self._commands.put(("reset_prefix_cache", None))
        self._wake.set()

    @property
    def alive(self) -> bool:
        """Whether the loop is running and can serve requests."""
        return self.fatal is None and self._running and self._thread is not None and self._thread.is_alive()

    def num_waiting(self) -> int:
        """Requests not yet admitted to the running batch (including ones not yet seen by the loop)."""
        return len(self.scheduler.waiting) + self._commands.qsize()

    # -- the loop --------------------------------------------------------------------------------------
    def _queued(self) -> Iterator[tuple[str, object]]:
        """The commands queued so far (add / abort / reset_prefix_cache), taken without waiting."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for cmd, arg in self._queued():
            if cmd == "add":
                assert isinstance(arg, Sequence)
                self._seqs[arg.seq_id] = arg
                if arg.pooling:  # emits no tokens
                    self.scheduler.add(arg)
                    continue
                self._detok[arg.seq_id] = Detokenizer(self.codec.tokenizer, list(arg.params.stop))
                stops = set(arg.params.stop_token_ids)
                if not arg.params.ignore_eos:
                    stops |= self.codec.stop_ids
                self._stop_ids[arg.seq_id] = stops
                self.scheduler.add(arg)
            elif cmd == "reset_prefix_cache":
                self.block_manager.reset_prefix_cache()
            else:
                seq = self._seqs.get(str(arg))
                if seq is not None and seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (stop, length, abort, error): free its blocks and per-request state, count it."""
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.release(seq)
        self._seqs.pop(seq.seq_id, None)
        self._detok.pop(seq.seq_id, None)
        self._stop_ids.pop(seq.seq_id, None)
        self.num_finished[reason] += 1
        for hook in self.on_finish:
            hook(reason)

    def _failed(self, seq: Sequence, error: str) -> RequestOutput:
        return RequestOutput(seq.seq_id, "", [], True, "error", seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.num_cached_tokens, seq.spec_drafted, seq.spec_accepted, error=error)

    def _fail(self, seq: Sequence, exc: Exception, scope: str) -> RequestOutput:
        """End ``seq`` because of ``exc`` (raised while handling ``scope``); its error output."""
        log.error("request %s failed (%s): %s", seq.seq_id, scope, _describe(exc), exc_info=exc)
        if seq.status is not SeqStatus.FINISHED:
            self._finish(seq, "error")
        return self._failed(seq, f"internal error in {scope}: {_describe(exc)}")

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the outputs of the requests that produced a token or failed."""
        self._drain()
        if not self.scheduler.has_work():
            return []
        start = time.time()
        batch = ScheduledBatch()
        try:
            if self.spec is not None:  # drafts first: the scheduler gives each a 1 + k token gap
                self.spec.propose([s for s in self.scheduler.running
                                   if s.num_tokens - s.num_computed_tokens == 1 and not s.pooling])
            batch = self.scheduler.schedule()
            decode = sum(n for s, n in batch.items if s.num_computed_tokens >= s.num_prompt_tokens)
            results = self.runner.step(batch, self.spec)
        except Exception as e:  # the step is spoilt: its requests fail (all in flight if it never formed)
            victims = [s for s, _ in batch.items] or self.scheduler.running + self.scheduler.waiting
            return [self._fail(s, e, "the engine step") for s in list(victims)]
        emitted: list[tuple[Sequence, RequestOutput]] = []
        for seq, toks, logprobs in results:
            try:
                out = self._pooled(seq) if seq.pooling else self._emit(seq, toks, logprobs)
            except Exception as e:  # this request's own fault (detokenizer, stop strings): it alone fails
                out = self._fail(seq, e, "its output")
            emitted.append((seq, out))
        self.scheduler.advance(batch)  # after the new tokens are appended: full blocks hash their tokens
        for seq, out in emitted:
            if out.finish_reason in ("stop", "length", "pooled"):
                self._finish(seq, out.finish_reason)
        outputs = [out for _, out in emitted]
        self._record(batch, start, decode, sum(len(o.token_ids) for o in outputs if o.error is None))
        if self.config.step_sleep_ms > 0:
            time.sleep(self.config.step_sleep_ms / 1000)
        return outputs

    @staticmethod
    def _pooled(seq: Sequence) -> RequestOutput:
        """A pooling request's one output: its embedding, its prompt now computed."""
        assert seq.embedding is not None
        return RequestOutput(seq.seq_id, "", [], True, "pooled", seq.num_prompt_tokens, 0, 0,
                             embedding=seq.embedding.tolist())

    def _emit(self, seq: Sequence, toks: list[int], logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Append this step's tokens (several when a draft was accepted) up to the first stop, with their
        ``logprobs``; a request that stops is finished by the caller once the step's blocks are published."""
        detok = self._detok[seq.seq_id]
        reason = None
        text = ""
        emitted: list[int] = []
        for tok in toks:
            seq.token_ids.append(tok)
            emitted.append(tok)
            if tok in self._stop_ids[seq.seq_id]:
                reason = "stop"
            else:
                text += detok.add(tok)
                if detok.stopped:
                    reason = "stop"
                elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                    reason = "length"
            if reason is not None:
                break
        if reason is not None:
            text += detok.flush()
        return RequestOutput(seq.seq_id, text, emitted, reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens, seq.spec_drafted, seq.spec_accepted,
                             logprobs=None if logprobs is None else logprobs[: len(emitted)])

    def _record(self, batch: ScheduledBatch, start: float, decode: int, output_tokens: int) -> None:
        """``decode``: tokens computed for rows past their prompt (a decode, or a draft being verified)."""
        rec = IterationRecord(
            i=self.num_iterations, t_unix=start, t_end_unix=time.time(), seq_ids=[s.seq_id for s, _ in batch.items],
            prefill_tokens=batch.num_tokens - decode, decode_tokens=decode,
            kv_blocks_used=self.block_manager.num_used, kv_blocks_total=self.block_manager.num_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            preempted=[s.seq_id for s in batch.preempted], padding_tokens=len(batch.padding),
            output_tokens=output_tokens,
        )
        self.num_iterations += 1
        self.iterations.append(rec)
        for hook in self.on_iteration:
            try:
                hook(rec)
            except Exception:  # an observer's bug must not stop serving
                log.exception("iteration hook %r failed", hook)

    def iterations_since(self, since: int, limit: int = 1000) -> list[IterationRecord]:
        """Records with index >= ``since`` still in the ring buffer (oldest first, at most ``limit``)."""
        out = []
        for r in list(self.iterations):
            if r.i >= since:
                out.append(r)
                if len(out) == limit:
                    break
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion synchronously (tests, offline use); returns output token ids."""
        seqs = [self.add_request(p, params) for p in prompts]
        while any(s.status is not SeqStatus.FINISHED for s in seqs):
            self.step()
        return [s.output_token_ids for s in seqs]

    # -- background thread -------------------------------------------------------------------------------
    @classmethod
    def on_own_thread(cls, config: EngineConfig) -> Engine:
        """Build the engine on a new thread, which then waits for ``start`` and runs the loop.

        PyTorch's CPU ops run on an OpenMP team owned by the calling thread. Loaded on one thread and
        stepped on another, the model ran with two teams, and a decode step on this 2-core machine took
        1.5-1.8x as long (measured, bf16, 2 threads: 45-50 vs 28-33 ms at 1 stream, 80 vs 41-50 ms at 16)."""
        built: list[Engine | BaseException] = []
        ready, go = threading.Event(), threading.Event()

        def main() -> None:
            try:
                built.append(cls(config))
            except BaseException as e:  # handed to the caller
                built.append(e)
                return
            finally:
                ready.set()
            go.wait()
            engine = built[0]
            assert isinstance(engine, Engine)
            if engine._running:  # else stopped before it was started
                engine._loop()

        thread = threading.Thread(target=main, name="engine", daemon=True)
        thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        built[0]._thread, built[0]._go = thread, go
        return built[0]

    def start(self, sink: OutputSink) -> None:
        self._sink = sink
        self._running = True
        if self._go is not None:  # built by on_own_thread: its thread waits for this
            self._go.set()
            return
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._go is not None:
            self._go.set()  # a thread that was never started exits at once
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        assert self._sink is not None
        try:
            while self._running:
                if not self.scheduler.has_work() and self._commands.empty():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.step()
                if outputs:
                    self._sink(outputs)
        except BaseException as e:
            self._die(e)
            if not isinstance(e, Exception):
                raise

    def _die(self, exc: BaseException) -> None:
        """The loop cannot go on: refuse new requests, and fail every request in flight (no one waits)."""
        with self._lock:
            self.fatal = _describe(exc)
        log.critical("the engine loop died; every request in flight fails: %s", self.fatal, exc_info=exc)
        seqs = list(self._seqs.values())
        for cmd, arg in self._queued():
            if cmd == "add":
                assert isinstance(arg, Sequence)
                seqs.append(arg)
        if seqs and self._sink is not None:
            try:
                self._sink([self._failed(s, f"the engine stopped: {self.fatal}") for s in seqs])
            except Exception:
                log.exception("could not hand the failed requests back")
