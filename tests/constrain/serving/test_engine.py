"""The engine: continuous batching from many threads, a batch cap, cancellation, and failure isolation."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import constrain
from constrain.decode.loop import run
from constrain.generation import admit
from constrain.serving.engine import Engine

SPECS = [
    constrain.Request("Code:", regex=r"[a-z]{3}-\d{3}", sampling={"seed": k}) if k % 2 else
    constrain.Request("Story:", max_tokens=8 + k, sampling={"seed": k})
    for k in range(6)
]  # fmt: skip


class Collector:
    """``on_done`` for an engine: keeps the results and signals when ``expected`` have arrived."""

    def __init__(self, expected: int) -> None:
        self.results: dict[int, object] = {}
        self.expected = expected
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, request, result) -> None:
        with self.lock:
            self.results[id(request)] = result
            if len(self.results) == self.expected:
                self.done.set()


def _alone(handle, spec):
    requests = admit(handle, spec)
    run(handle, requests)
    return requests[0].output_ids


@pytest.fixture
def engine(tiny):
    e = Engine(tiny, max_batch=2)
    yield e
    e.close()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_more_requests_than_the_batch_cap_all_finish_with_their_own_tokens(tiny, max_batch):
    engine = Engine(tiny, max_batch=max_batch)
    requests = [admit(tiny, spec)[0] for spec in SPECS]
    collect = Collector(len(requests))
    for r in requests:  # from several threads at once
        threading.Thread(target=engine.submit, args=([r], collect)).start()
    assert collect.done.wait(60)
    engine.close()
    assert engine.peak_batch == max_batch
    for r, spec in zip(requests, SPECS, strict=True):
        result = collect.results[id(r)]
        assert isinstance(result, constrain.GenerationResult) and result.valid
        assert result.token_ids == _alone(tiny, spec)


def test_cancel_a_waiting_and_a_running_request(tiny, engine):
    long = [admit(tiny, constrain.Request("Go:", max_tokens=500, sampling={"seed": k}))[0] for k in range(3)]
    collect = Collector(3)
    engine.submit(long, collect)
    for r in long:
        engine.cancel(r)
    assert collect.done.wait(60)
    assert all(collect.results[id(r)].finish_reason == "cancelled" for r in long)
    assert all(len(r.output_ids) < 500 for r in long)


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tiny, engine):
    original = tiny.model.forward
    calls = []

    def failing(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("out of memory (simulated)")
        return original(*args, **kwargs)

    tiny.model.forward = failing
    try:
        first = admit(tiny, SPECS[0])
        collect = Collector(1)
        engine.submit(first, collect)
        assert collect.done.wait(60)
        assert isinstance(collect.results[id(first[0])], RuntimeError)
        second = admit(tiny, SPECS[1])
        collect = Collector(1)
        engine.submit(second, collect)
        assert collect.done.wait(60)
        assert collect.results[id(second[0])].valid
    finally:
        del tiny.model.forward


def test_bad_arguments_and_a_closed_engine(tiny):
    with pytest.raises(ValueError, match="max_batch"):
        Engine(tiny, max_batch=0)
    e = Engine(tiny)
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.submit(admit(tiny, SPECS[0]), lambda r, res: None)


def test_a_fault_in_one_request_of_eight_ends_it_alone(tiny):
    """7 of 8 finish with their own tokens, the faulty one gets its exception, the next is served."""
    from constrain.testing.faults import InjectedFault, inject

    specs = [constrain.Request("Code:", regex=r"[a-z]{3}-\d{3}", sampling={"seed": k}) for k in range(8)]
    alone = [_alone(tiny, spec) for spec in specs]
    engine = Engine(tiny, max_batch=8)
    try:
        requests = [admit(tiny, spec)[0] for spec in specs]
        inject(requests[3], "advance", tiny.vocab_size)
        collect = Collector(8)
        engine.submit(requests, collect)
        assert collect.done.wait(120)
        assert isinstance(collect.results[id(requests[3])], InjectedFault)
        for k, r in enumerate(requests):
            if k != 3:
                assert collect.results[id(r)].valid and r.output_ids == alone[k], k
        assert engine.failures == 1 and engine.wait_idle(10) and engine.running == engine.waiting == 0
        after = admit(tiny, specs[0])
        collect = Collector(1)
        engine.submit(after, collect)
        assert collect.done.wait(60) and after[0].output_ids == alone[0]
    finally:
        engine.close()


def test_a_fault_keeps_no_frame_of_the_step_alive(tiny):
    """The exception that ended a request holds none of the locals of the decode step it went through
    (the step's logits, its rows: the request, whose ``fault`` it is): the request goes with its last
    reference, without waiting for the garbage collector."""
    from constrain.testing.faults import InjectedFault, inject

    specs = [constrain.Request("Code:", regex=r"[a-z]{3}-\d{3}", sampling={"seed": k}) for k in range(4)]
    engine = Engine(tiny, max_batch=4)
    gc.disable()
    try:
        requests = [admit(tiny, spec)[0] for spec in specs]
        inject(requests[1], "mask", tiny.vocab_size)  # the batched masking fails, then the row alone
        collect = Collector(4)
        engine.submit(requests, collect)
        assert collect.done.wait(120) and engine.wait_idle(10)
        fault = collect.results.pop(id(requests[1]))
        assert isinstance(fault, InjectedFault) and isinstance(fault.__context__, InjectedFault)
        assert fault.__traceback__ is not None  # kept, for the log
        gone = weakref.ref(requests[1])
        del requests, fault
        collect = Collector(1)
        engine.submit(admit(tiny, specs[0]), collect)  # (the engine thread's own locals move on to it)
        assert collect.done.wait(60) and engine.wait_idle(10)
        assert gone() is None
    finally:
        gc.enable()
        engine.close()


def test_a_raising_callback_never_ends_the_engine_thread(tiny, engine):
    def broken(request, result):
        raise RuntimeError("a caller's bug")

    engine.submit(admit(tiny, SPECS[1]), broken)
    assert engine.wait_idle(60)
    collect = Collector(1)
    second = admit(tiny, SPECS[1])
    engine.submit(second, collect)
    assert collect.done.wait(60) and collect.results[id(second[0])].valid
    assert engine.callback_errors == 1 and engine._thread.is_alive()


def test_the_engine_hands_free_heap_memory_back(tiny, monkeypatch):
    import constrain.serving.engine as engine_module

    assert engine_module.heap_trimmer() is not None  # glibc, as on every machine the tests run on
    calls = []
    monkeypatch.setattr(engine_module, "heap_trimmer", lambda: lambda: calls.append(1))
    monkeypatch.setattr(engine_module, "TRIM_EVERY", 2)
    engine = Engine(tiny, max_batch=4)
    try:
        collect = Collector(5)
        engine.submit([r for spec in SPECS[:5] for r in admit(tiny, spec)], collect)
        assert collect.done.wait(60)
        assert engine.wait_idle(10) and engine.finished == 5
        assert len(calls) == 3  # after the 2nd and 4th requests, and once idle after the 5th
    finally:
        engine.close()
