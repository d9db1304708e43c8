"""One request never breaks another: a fault in one row of a batch ends that row alone."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

import constrain
from constrain.decode.loop import DecodeLoop
from constrain.generation import admit
from constrain.testing.faults import STAGES, InjectedFault, inject

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "tag": {"type": "string",
          "maxLength": 6}}, "required": ["n", "tag"], "additionalProperties": False}  # fmt: skip


def _specs() -> list[constrain.Request]:
    """8 constrained requests: greedy and seeded sampling, with and without filters."""
    sampling = [{"temperature": 0}, {"seed": 1}, {"seed": 2, "top_p": 0.9}, {"seed": 3, "top_k": 20},
                {"temperature": 0, "repetition_penalty": 1.3}, {"seed": 5}, {"seed": 6, "min_p": 0.05},
                {"seed": 7, "temperature": 0.7}]  # fmt: skip
    return [constrain.Request(f"JSON {k}:", schema=SCHEMA, max_tokens=40, sampling=s) for k, s in enumerate(sampling)]


def _run(handle, requests, loop=None):
    loop = loop or DecodeLoop(handle)
    loop.add(requests)
    while loop.busy:
        loop.step()
    return loop


@pytest.fixture(scope="module")
def alone(tiny):
    """Each request's tokens when run in a batch with no fault."""
    requests = [admit(tiny, spec)[0] for spec in _specs()]
    _run(tiny, requests)
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "check"])
@pytest.mark.parametrize("culprit", [0, 5])
def test_a_fault_in_one_row_ends_that_row_alone(tiny, alone, stage, culprit, caplog):
    requests = [admit(tiny, spec)[0] for spec in _specs()]
    for k, r in enumerate(requests):
        r.request_id = f"req-{k}"
    inject(requests[culprit], stage, tiny.vocab_size)
    with caplog.at_level(logging.ERROR, logger="constrain.decode.loop"):
        loop = _run(tiny, requests)
    failed = requests[culprit]
    expected = ValueError if stage == "sample" else InjectedFault  # the sampler's own refusal of the bias
    assert failed.finish_reason == "error" and isinstance(failed.fault, expected)
    assert failed.result().finish_reason == "error"
    doing = {"mask": "masking", "sample": "sampling", "advance": "advancing", "detokenize": "advancing"}[stage]
    logged = [rec.getMessage() for rec in caplog.records]
    assert logged == [f"request req-{culprit} failed while {doing}; its batch goes on"]
    for k, r in enumerate(requests):
        if k != culprit:
            assert r.output_ids == alone[k], k  # its neighbours write what they would have written
            result = r.result()
            assert result.finish_reason in ("stop", "length") and result.valid
            jsonschema.validate(json.loads(result.text), SCHEMA)
    assert not loop.busy and loop.active == []
    after = admit(tiny, _specs()[1])[0]  # the loop goes on serving
    _run(tiny, [after], loop)
    assert after.output_ids == alone[1]


def test_a_fault_in_a_value_check_ends_its_row_alone(tiny):
    """The drawn token's check (a uniqueItems array, greedy) raises in one row: the others settle."""
    unique = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4}, "uniqueItems": True,
              "maxItems": 3}  # fmt: skip
    specs = [constrain.Request(f"Numbers {k}:", schema=unique, max_tokens=24, sampling={"temperature": 0})
             for k in range(4)]  # fmt: skip
    alone = [admit(tiny, spec)[0] for spec in specs]
    _run(tiny, alone)
    requests = [admit(tiny, spec)[0] for spec in specs]
    inject(requests[2], "check", tiny.vocab_size)
    _run(tiny, requests)
    assert requests[2].finish_reason == "error" and isinstance(requests[2].fault, InjectedFault)
    assert "checking values" in (requests[2].error or "")
    for k in (0, 1, 3):
        assert requests[k].output_ids == alone[k].output_ids and requests[k].result().valid


def test_a_raising_event_callback_ends_its_own_request(tiny, alone):
    requests = [admit(tiny, spec)[0] for spec in _specs()[:3]]

    def broken(event):
        raise RuntimeError("a client's callback")

    requests[1].on_event = broken
    _run(tiny, requests)
    assert requests[1].finish_reason == "error" and isinstance(requests[1].fault, RuntimeError)
    assert [requests[k].output_ids for k in (0, 2)] == [alone[0], alone[2]]


def test_a_fault_that_is_no_rows_propagates(tiny, monkeypatch):
    """Where every row alone succeeds, the failure is not one row's: the step raises."""
    import constrain.decode.loop as loop_module

    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the whole batch")
        return real(*args, **kwargs)

    real = loop_module.slot_masks
    monkeypatch.setattr(loop_module, "slot_masks", flaky)
    requests = [admit(tiny, spec)[0] for spec in _specs()[:2]]
    loop = DecodeLoop(tiny)
    loop.add(requests)
    with pytest.raises(RuntimeError, match="the whole batch"):
        loop.step()
    assert all(r.finish_reason is None for r in requests)
