"""Compiles past their time budget (runaways): bounded, reported, and a slot freed when one ends."""

from __future__ import annotations

import threading
import time

import pytest

import constrain
from constrain import caches
from constrain.compiler import background, compiler
from constrain.compiler.background import RunawayCompiles

BOUND = 2


@pytest.fixture
def runaways(monkeypatch):
    """A fresh bound of :data:`BOUND` runaways as the process's (other tests leave runaways of their own)."""
    fresh = RunawayCompiles(BOUND)
    monkeypatch.setattr(background, "runaway_compiles", fresh)
    return fresh


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_runaways_are_bounded_and_reported_and_a_slot_frees_when_one_ends(runaways):
    gates = [threading.Event() for _ in range(BOUND)]
    started = []

    def slow(gate):
        def work():
            started.append(gate)
            gate.wait()
            return "done"

        return work

    for i, gate in enumerate(gates):
        with pytest.raises(constrain.CompileError, match=r"budget of 0\.01 s"):
            background.in_background(slow(gate), 0.01)
        assert runaways.stats()["entries"] == i + 1
    assert caches.stats()["compile.runaway"] == {
        "entries": BOUND, "maxsize": BOUND, "in_flight": 0, "hits": 0, "misses": BOUND, "refused": 0,
    }  # fmt: skip

    refused_work = threading.Event()
    begun = time.monotonic()
    with pytest.raises(constrain.CompileError, match=f"{BOUND} compiles that ran past their time budget") as info:
        background.in_background(refused_work.set, 10.0)
    assert time.monotonic() - begun < 1.0, "refused at once, not after the budget"
    assert f"MAX_RUNAWAY_COMPILES = {BOUND}" in str(info.value)
    assert not refused_work.is_set(), "nothing started"
    assert runaways.stats()["refused"] == 1 and len(started) == BOUND

    gates[0].set()  # one runaway ends: its slot is free
    wait_for(lambda: runaways.stats()["entries"] == BOUND - 1)
    assert background.in_background(lambda: 42, 10.0) == 42
    gates[1].set()
    wait_for(lambda: runaways.stats()["entries"] == 0)
    assert runaways.stats() == {
        "entries": 0,
        "maxsize": BOUND,
        "in_flight": 0,
        "hits": 1,
        "misses": BOUND,
        "refused": 1,
    }


def test_within_the_budget_the_result_or_the_error_comes_back(runaways):
    assert background.in_background(lambda: "fast", 10.0) == "fast"

    def broken():
        raise constrain.CompileError("the engine failed")

    with pytest.raises(constrain.CompileError, match="the engine failed"):
        background.in_background(broken, 10.0)
    assert runaways.stats() == {"entries": 0, "maxsize": BOUND, "in_flight": 0, "hits": 2, "misses": 0, "refused": 0}


def test_compile_refuses_at_the_bound_but_serves_a_cached_constraint(runaways, monkeypatch, smol_tokenizer):
    gate = threading.Event()
    build = compiler._BUILDERS["xgrammar"]

    def slow_build(constraint, info):
        gate.wait()
        return build(constraint, info)

    monkeypatch.setitem(compiler._BUILDERS, "xgrammar", slow_build)
    slow = [constrain.regex(f"runaway-{i}-[0-9]+") for i in range(BOUND)]
    try:
        for constraint in slow:
            with pytest.raises(constrain.CompileError, match="budget"):
                constrain.compile(constraint, smol_tokenizer, engine="xgrammar", timeout_s=0.01)
        with pytest.raises(constrain.CompileError, match="still running"):
            constrain.compile(constrain.regex("runaway-other"), smol_tokenizer, engine="xgrammar", timeout_s=5.0)
    finally:
        gate.set()
    wait_for(lambda: runaways.stats()["entries"] == 0)
    # the runaways' grammars were cached: at the bound again, they still come back (a hit takes no thread)
    monkeypatch.setattr(runaways, "bound", 1)
    held = threading.Event()
    with pytest.raises(constrain.CompileError, match="budget"):
        background.in_background(held.wait, 0.01)
    try:
        compiled = constrain.compile(slow[0], smol_tokenizer, engine="xgrammar", timeout_s=5.0)
        assert compiled.constraint == slow[0]
        with pytest.raises(constrain.CompileError, match="still running"):
            constrain.compile(constrain.regex("runaway-other"), smol_tokenizer, engine="xgrammar", timeout_s=5.0)
    finally:
        held.set()
    wait_for(lambda: runaways.stats()["entries"] == 0)


def test_the_bound_is_positive():
    with pytest.raises(ValueError, match="positive"):
        RunawayCompiles(0)


def test_alongside_gives_both_results_and_the_native_calls_error_first():
    here = threading.get_ident()
    native_thread, python_thread = background.alongside(threading.get_ident, threading.get_ident)
    assert python_thread == here and native_thread != here

    def fails(message: str):
        def run():
            raise ValueError(message)

        return run

    with pytest.raises(ValueError, match="native"):
        background.alongside(fails("native"), fails("python"))
    with pytest.raises(ValueError, match="python"):
        background.alongside(lambda: 1, fails("python"))
    with pytest.raises(ValueError, match="native"):
        background.alongside(fails("native"), lambda: 1)
