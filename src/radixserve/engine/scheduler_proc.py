"""The scheduler process: owns one Scheduler and one Runner and loops step -> run -> on_output,
taking requests from the API process and sending tokens to the detokenizer over ZeroMQ.

An idle process blocks in a poll, so an idle (simulated or real) worker uses no CPU. The
control ops are in engine/worker_control.py, the optional planes' start in engine/worker_planes.py.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.engine import pd_worker
from radixserve.engine.kv_events import KVEventPlane
from radixserve.engine.load_meter import LoadRatioMeter, ratio_fields
from radixserve.engine.messages import (
    AbortReq,
    CloseStream,
    ControlOut,
    ControlReq,
    ErrorOut,
    GenerateReq,
    OpenStream,
    StopReq,
    TokenBatch,
    TokenOut,
)
from radixserve.engine.pd_rooms import make_role
from radixserve.engine.procutil import Endpoints, exit_with_parent, omp_wait_settings
from radixserve.engine.trace_spans import record_request
from radixserve.engine.worker_control import ControlOps
from radixserve.engine.worker_planes import open_host_pool, open_kv_events, open_storage_tier
from radixserve.sched.batch import Batch, StepResult, TokenLogprob
from radixserve.sched.request import FinishReason, Req, TokenOutput
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.validate import check_request
from radixserve.tracing import open_tracer


@dataclass(slots=True)
class Worker(ControlOps):
    """The scheduler, its runner, and the sockets; ``realtime`` sleeps out simulated steps."""

    scheduler: Scheduler
    runner: Any
    pull: zmq.Socket
    push: zmq.Socket
    realtime: bool
    events: KVEventPlane | None = None  # KV-cache events of the tree, published per step
    tiers: Any = (
        None  # model.host_pool.HostKVPool: the host tier's bytes (None: no tier, or simulated)
    )
    store: Any = None  # --sim-kv-store: SimStoreWriter, fed each finished prompt
    storage: Any = None  # --hicache-storage-backend: engine.storage_tier.StorageTier
    # the load-to-prefill ratios it reports: measured (a real engine with a host tier: the
    # meter, fed here and by the storage tier) or fixed (a simulated engine's cost model's;
    # None without a tier to load from)
    meter: LoadRatioMeter | None = None
    ratios: dict[str, Any] = field(default_factory=lambda: ratio_fields(None, None))
    live: dict[str, Req] = field(default_factory=dict)  # requests whose tokens go out
    # prompt logprobs computed by prefill chunks, by position, until the first token goes out
    prompt_lp: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    pd: Any = None  # engine.pd_rooms.PrefillRooms | DecodeRooms: a disaggregated engine's rooms
    tracer: Any = None  # --enable-trace: radixserve.tracing.Tracer
    traces: dict[str, str] = field(default_factory=dict)  # rid -> its request span's traceparent
    # where a step's wall time goes: the runner's part (forward, logits, sampling; a simulated
    # engine's sleep) against the whole step (scheduling, batch building, on_output, sending)
    steps: int = 0
    step_s: float = 0.0
    runner_s: float = 0.0

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            self._add(msg)
        elif isinstance(msg, pd_worker.PEER_MESSAGES):
            if self.pd is not None:
                pd_worker.on_peer(self, msg)
        elif isinstance(msg, (AbortReq, StopReq)):
            held = self.pd is not None and pd_worker.forget(self, msg.rid)
            if self.storage is not None:  # waiting on its prefetch: not handed back
                self.storage.cancel(msg.rid)
            if held:  # the rooms free it once no page can land in its slots
                pass
            elif isinstance(msg, AbortReq):
                self.scheduler.abort(msg.rid)
            else:
                self.scheduler.finish(msg.rid, FinishReason.STOP)
                self._traced(self.live.get(msg.rid))
            self.traces.pop(msg.rid, None)
            self.live.pop(msg.rid, None)
            self.prompt_lp.pop(msg.rid, None)
            # after every token already sent for it, on the same socket: the detokenizer
            # can forget the request (always sent: it may have finished here meanwhile)
            self.push.send_pyobj(CloseStream(msg.rid))
        elif isinstance(msg, ControlReq):
            self.push.send_pyobj(ControlOut(msg.req_id, self._control(msg)))

    def _add(self, msg: GenerateReq) -> None:
        req = Req(
            msg.rid, msg.input_ids, msg.sampling, msg.priority, msg.routing_key, msg.namespace
        )
        check = getattr(self.runner, "check_request", None)
        try:
            if check is not None:  # a grammar that does not compile, for one
                check(msg.sampling)
        except ValueError as e:
            grammar = msg.sampling.grammar
            self.push.send_pyobj(ErrorOut(msg.rid, str(e), 400, grammar and grammar[0]))
            return
        s = self.scheduler
        try:
            if req.rid in self.live:
                raise ValueError(f"request id {req.rid!r} is already in use")
            if self.pd is not None:
                if not pd_worker.add(self, msg, req):
                    return
            elif self.storage is None:
                s.add_request(req)
            else:  # checked now: a request that waits on its prefetch is queued later
                check_request(req, s.context_length, s.kv.total, s.kv.page)
                if not self.storage.lookup(req, s.cache):
                    s.add_request(req)
        except ValueError as e:
            self.push.send_pyobj(ErrorOut(msg.rid, str(e), 400))
            return
        self.live[msg.rid] = req
        if msg.trace is not None and self.tracer is not None:
            self.traces[msg.rid] = msg.trace
        sp = req.sampling  # a prefill engine's: up to the first token
        self.push.send_pyobj(OpenStream(msg.rid, sp.stop, sp.skip_special_tokens, sp.no_stop_trim,
                                        sp.min_new_tokens))  # fmt: skip

    def drain(self, block_ms: int | None) -> None:
        """Handle every message waiting; block up to ``block_ms`` for the first one."""
        if block_ms and not self.pull.poll(block_ms):
            return
        while True:
            try:
                msg = self.pull.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(msg)

    def step(self) -> bool:
        """One scheduling step; False when there was nothing to run."""
        t0 = time.perf_counter()
        batch = self.scheduler.step()
        if batch is None:
            return False
        result = self._run(batch)
        prompts = self._completed_prompts(batch) if self.storage is not None else []
        lps = self._logprobs(batch, result)
        sends = pd_worker.send_pages(self, batch, result, lps) if self.pd is not None else {}
        outs = self.scheduler.on_output(batch, result)
        if sends:  # written off the loop; their first tokens go out once written
            outs = pd_worker.start_sends(self, sends, outs)
        for req in prompts:  # now in the tree: pinned there for the writer thread, not read here
            self.storage.offer_write(req.input_ids, req.namespace, self.scheduler.kv)
        sent = [t for t in (self._token_out(o, lps.get(o.rid)) for o in outs) if t is not None]
        if sent:
            self.push.send_pyobj(TokenBatch(sent))
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        return True

    def _run(self, batch: Batch) -> StepResult:
        """The batch's page copies, then its forward; both timed where the meter is on."""
        meter = self.meter
        if batch.kv_copies and self.tiers is not None:
            # before the forward may overwrite a slot they read
            seconds, loaded = self.tiers.apply(batch.kv_copies)
            if loaded and meter is not None:
                meter.host_loaded(seconds, loaded)
        t0 = time.perf_counter()
        result = self.runner.run(batch)
        # a step that samples nothing may return before a GPU has finished it: not timed
        if meter is not None and batch.is_prefill and any(e.sample for e in batch.entries):
            meter.prefilled(time.perf_counter() - t0, batch.num_tokens)
        if self.realtime and result.duration:
            time.sleep(result.duration)
        self.runner_s += time.perf_counter() - t0
        return result

    def _completed_prompts(self, batch: Batch) -> list[Req]:
        """Requests whose prompt this forward completed (their pages go to the storage tier
        once ``on_output`` has put them in the tree)."""
        done = []
        for e in batch.entries:
            if e.is_prefill and e.sample and e.start_pos + len(e.token_ids) >= len(e.prompt_ids):
                req = self.live.get(e.rid)
                if req is not None:
                    done.append(req)
        return done

    def _queue_fetched(self) -> None:
        """Unpin the pages the writer has read; land finished prefetches; queue the requests
        that waited on them."""
        self.storage.release_pins(self.scheduler.kv)
        for req in self.storage.poll(self.scheduler.cache):
            if self.live.get(req.rid) is not req:  # aborted meanwhile
                continue
            try:
                self.scheduler.add_request(req)
            except ValueError as e:  # checked before it waited: not expected
                del self.live[req.rid]
                self.push.send_pyobj(ErrorOut(req.rid, str(e), 400))

    def _logprobs(self, batch: Batch, result: StepResult) -> dict[str, TokenLogprob]:
        """The sampled tokens' logprobs by request; prompt logprobs go to ``prompt_lp``."""
        sampled = {}
        for i, lp in result.logprobs.items():
            rid = batch.entries[i].rid
            if lp.prompt and rid in self.live:
                at = self.prompt_lp.setdefault(rid, {})
                at.update(enumerate(lp.prompt, lp.prompt_start))
            if lp.sampled is not None:
                sampled[rid] = lp.sampled
        return sampled

    def _token_out(self, o: TokenOutput, logprob: TokenLogprob | None) -> TokenOut | None:
        req = self.live.get(o.rid)
        if req is None:  # stopped or aborted meanwhile
            return None
        reason = o.finish_reason.value if o.finish_reason is not None else None
        stops = req.sampling.stop_token_ids
        matched = o.token_id if o.finished and o.token_id in stops else None
        if o.finished:
            del self.live[o.rid]
            self._traced(req)
            if self.store is not None:  # queued for the writer thread: never waits here
                self.store.submit(req.input_ids, req.namespace)
        out = TokenOut(o.rid, [o.token_id], o.finished, reason, len(req.input_ids),
                       o.cached_tokens, req.num_generated, matched)  # fmt: skip
        out.host_cached_tokens = o.host_cached_tokens
        if self.storage is not None:
            out.host_cached_tokens, out.storage_cached_tokens = self.storage.split_cached(
                o.rid, o.host_cached_tokens, o.finished
            )
        if logprob is not None:
            out.logprobs = [logprob]
        prompt = self.prompt_lp.pop(o.rid, None)
        if prompt:
            out.prompt_logprob_start = min(prompt)
            out.prompt_logprobs = [prompt[p] for p in sorted(prompt)]
        return out

    def _traced(self, req: Req | None) -> None:
        """A finished request's queue, prefill and decode spans (--enable-trace)."""
        parent = self.traces.pop(req.rid, None) if req is not None else None
        if parent is not None:
            record_request(self.tracer, parent, req, self.scheduler.clock)

    def loop(self) -> None:
        busy = False
        while True:
            storage = self.storage
            idle_ms = 1000
            if storage is not None:  # prefetches to land soon; pins to release now and then
                idle_ms = 2 if storage.waiting() else 50 if storage.pinning() else 1000
            if self.pd is not None:
                idle_ms = pd_worker.tick(self) or idle_ms
            self.drain(None if busy else idle_ms)
            if storage is not None:
                self._queue_fetched()
            busy = self.step()
            if self.events is not None:  # what the tree did this turn, as one batch
                self.events.flush()


def run_scheduler(engine_config: Any, endpoints: Endpoints, ready: Any, parent_pid: int) -> None:
    """Process entry: build the runner and scheduler, report ready (or the error), then loop."""
    exit_with_parent(parent_pid)
    omp = omp_wait_settings()  # before build_worker imports torch (tp ranks inherit the env)
    try:
        runner, scheduler, info = engine_config.build_worker()
        info["omp"] = omp
        if hasattr(runner, "death_note"):  # tensor-parallel ranks: why_dead tells the server
            runner.death_note = endpoints.died
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoints.sched)
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints.detok)
    except ValueError as e:  # a setting the runner refused (names it): one line for the user
        ready.send(("error", f"{e}"))
        return
    except Exception as e:  # the parent shows this to the user and exits
        ready.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        events = open_kv_events(engine_config, scheduler)
    except (zmq.ZMQError, ValueError) as e:  # an address in use, say: one line for the user
        ready.send(("error", f"--kv-events-config: {e}"))
        return
    if events is not None:
        info["kv_events"] = events.info()
    store = None
    if engine_config.sim_kv_store is not None:
        try:
            from radixserve.engine.sim_store import SimStoreWriter

            store = SimStoreWriter(engine_config.sim_kv_store, engine_config.sim,
                                   scheduler.cache.page_size)  # fmt: skip
        except (ValueError, ImportError, OSError) as e:
            ready.send(("error", f"--sim-kv-store: {e}"))
            return
        info["kv_store"] = store.info()
    tiers = open_host_pool(runner, scheduler)
    # a real engine with a host tier measures its ratios from its start-up sample on
    meter = LoadRatioMeter.seeded(info.get("kv_load_sample")) if tiers is not None else None
    storage = None
    settings = engine_config.storage_settings()
    if settings is not None and tiers is not None:
        try:
            storage = open_storage_tier(settings, info, runner, tiers, engine_config.model, meter)
        except (ValueError, RuntimeError, OSError) as e:
            ready.send(("error", f"--hicache-storage-backend: {e}"))
            return
        info["kv_store"] = storage.info()
    try:
        pd = make_role(engine_config.disagg, runner, pull)
    except (ValueError, zmq.ZMQError) as e:
        ready.send(("error", f"--disaggregation-mode: {e}"))
        return
    if pd is not None:
        info["disaggregation"] = pd.info()
    ready.send(("ready", {"pid": os.getpid(), **info}))
    worker = Worker(scheduler, runner, pull, push, engine_config.sim is not None, events, tiers)
    worker.pd = pd
    worker.store = store
    worker.storage = storage
    worker.meter = meter
    worker.tracer = open_tracer(engine_config.trace, "radixserve-engine")
    worker.ratios = ratio_fields(info.get("kv_load_to_prefill_ratio"),
                                 info.get("kv_store_load_to_prefill_ratio"))  # fmt: skip
    try:
        worker.loop()
    finally:  # the writer's jobs dropped, their pins released; buffered spans sent
        if storage is not None:
            storage.close(scheduler.kv)
        if worker.tracer is not None:
            worker.tracer.close()
