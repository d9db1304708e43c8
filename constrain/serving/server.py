"""An OpenAI-compatible HTTP server: ``constrain serve`` (FastAPI + uvicorn) over one :class:`Engine`.

``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming as Server-Sent Events in
OpenAI's chunk format), ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``. Concurrent requests
share the engine's running batch (continuous batching). A client that disconnects has its request cancelled.

Errors are OpenAI's bodies (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request
(malformed body, unknown field, out-of-range sampling value, bad schema/regex/grammar/tools, naming
the culprit), 404 for an unknown model or path, and 500 without a stack trace for a failure of ours
(logged). Every request is checked and its constraint compiled before it joins the batch, so a bad
request cannot disturb the others; only errors raised while admitting a request are the client's (a
``ValueError`` from anywhere else is a bug of ours, and answered as one).

One request never breaks another: a fault inside the decode step that is one request's (its masking,
sampling, value checks, detokenizing) ends that request alone, answered with a 500 (an error event
when streaming, the stream then ends) and logged with its response id; its batch neighbours finish
as they would have (:class:`~constrain.serving.engine.Engine`). ``create_app(faults=...)`` injects such
faults for drills (:mod:`constrain.testing.faults`; off by default, and no request can turn it on).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from constrain.decode.request import InFlight
from constrain.errors import BudgetError, ConstraintError, ContextWindowError, ReasoningError
from constrain.generation import Request, admit, admit_beam_search
from constrain.models.loading import ModelHandle, model_handle
from constrain.results import GenerationResult, StreamEvent
from constrain.sampler.errors import SamplerError
from constrain.serving.engine import Engine
from constrain.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_message,
    chat_requests,
    completion_logprobs,
    completion_requests,
    delta_json,
    envelope,
    finish_fields,
    new_id,
    request_labels,
    usage_json,
)
from constrain.tools.calling import ToolCalling
from constrain.tools.reply import assistant_reply

__all__ = ["create_app", "serve"]

log = logging.getLogger("constrain.serving.server")
T = TypeVar("T")


class _UnknownModel(Exception):
    pass


class _Disconnected(Exception):
    pass


class _BadRequest(Exception):
    """A user error found while admitting a request (its ``__cause__``): a 400 whose ``param`` names the
    field at fault. A ``ValueError`` raised anywhere else is a failure of ours, a 500."""

    def __init__(self, param: str | None) -> None:
        super().__init__(param)
        self.param = param


async def _admit(build: Callable[[], T], body: ChatCompletionRequest | CompletionRequest) -> T:
    """``build()`` on a worker thread (it may compile), its user errors raised as :class:`_BadRequest`
    naming the field of ``body`` at fault."""
    try:
        return await asyncio.to_thread(build)
    except (ConstraintError, SamplerError, ValueError) as err:
        raise _BadRequest(_param(err, body)) from err


def _body_param(loc: Sequence[int | str], body: Any, *, missing: bool) -> str | None:
    """The dotted path (``messages.0.role``) of the field a validation error's ``loc`` (after ``"body"``)
    points at in the request ``body``, without the names pydantic gives the members of a union
    (``stop.str`` is ``stop``): the steps that are not in the body are left out, but for a missing
    field's name at the end."""
    path, here = [], body
    for at, step in enumerate(loc):
        if isinstance(here, dict) and isinstance(step, str) and step in here:
            here = here[step]
        elif isinstance(here, list) and isinstance(step, int) and 0 <= step < len(here):
            here = here[step]
        elif not (missing and at == len(loc) - 1):
            continue  # a union member's name, or a step into a value of another type
        path.append(str(step))
    return ".".join(path) or None


def _param(err: Exception, body: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The field of ``body`` an admission error is about: the one it names, else ``max_tokens`` where no
    output fits, else the constraint's field (the first given) for an error in the constraint."""
    if isinstance(err, ContextWindowError) and err.field == "prompt":
        return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if field := getattr(err, "field", None):
        return str(field)
    if isinstance(err, BudgetError):
        return "max_tokens"
    if isinstance(err, ReasoningError):
        return "reasoning"
    if isinstance(err, ConstraintError) and (fields := body.constraint_fields()):
        return "response_format.json_schema.schema" if fields[0] == "response_format" else fields[0]
    return None


def _drop_traceback(err: BaseException) -> None:
    """Once ``err`` is logged: drop its traceback, and those of the exceptions it was raised in handling of.
    A request's fault (:attr:`InFlight.fault <constrain.decode.request.InFlight.fault>`), raised again
    here, gained this server's frames, whose locals hold the request: a cycle, left to the garbage
    collector's seldom full passes, with everything the request holds."""
    seen: set[int] = set()
    found: BaseException | None = err
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        found.__traceback__ = None
        found = found.__cause__ or found.__context__


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class _Submission:
    """The requests of one HTTP call in the engine: results (and stream events) arrive on the event loop."""

    def __init__(self, engine: Engine, *, stream: bool) -> None:
        """Made on the event loop; :meth:`admit` then :meth:`submit` (admission runs on a worker thread)."""
        self.engine, self.stream = engine, stream
        self.requests: list[InFlight] = []
        self._index: dict[int, int] = {}
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Any, Any]] = asyncio.Queue()
        self.finished = 0

    def admit(self, handle: ModelHandle, specs: list[Request]) -> list[list[InFlight]]:
        """Each spec's requests (:func:`constrain.generation.admit`), their events (when streaming, without
        partial values: the wire format has none) numbered in order across the specs."""
        groups: list[list[InFlight]] = []
        for spec in specs:
            base = sum(map(len, groups))
            listener = functools.partial(self._on_event, base) if self.stream else None
            groups.append(admit(handle, spec, on_event=listener, partials=False))
        return groups

    def submit(self, requests: list[InFlight], request_id: str) -> None:
        """Hand the admitted ``requests`` (all of :meth:`admit`'s, in order) to the engine, named
        ``request_id#k`` in its logs."""
        self.requests = requests
        self._index = {id(r): i for i, r in enumerate(requests)}
        for i, r in enumerate(requests):
            r.request_id = f"{request_id}#{i}"
        self.engine.submit(requests, self._on_done)

    def _on_event(self, base: int, k: int, event: StreamEvent) -> None:  # on the engine thread
        scores = (event.token_ids, event.logprobs, event.top_logprobs) if event.token_ids and event.logprobs else None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (base + k, event, scores))

    def _on_done(self, r: InFlight, result: GenerationResult | BaseException) -> None:  # on the engine thread
        r.on_event = None  # (its last event is out; it held this submission, which holds the request: a cycle)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (self._index[id(r)], result, None))

    async def items(self, http: HttpRequest | None = None) -> AsyncIterator[tuple[int, Any, Any]]:
        """Events and results as they come, until every request is done; with ``http``, checks every
        half second that the client is still there (``_Disconnected`` when not)."""
        while self.finished < len(self.requests):
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout=0.5)
            except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
                if http is not None and await http.is_disconnected():
                    raise _Disconnected from None
                continue
            if isinstance(item[1], BaseException):
                raise item[1]
            if isinstance(item[1], GenerationResult):
                self.finished += 1
            yield item

    async def results(self, http: HttpRequest) -> list[GenerationResult] | None:
        """Every request's result; None (and the requests cancelled) when the client went away. A request
        that a fault ended raises its exception, the others cancelled."""
        out: list[Any] = [None] * len(self.requests)
        try:
            async for index, item, _ in self.items(http):
                out[index] = item
        except _Disconnected:
            self.cancel()
            return None
        except BaseException:
            self.cancel()
            raise
        return out

    def cancel(self) -> None:
        for r in self.requests:
            self.engine.cancel(r)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Route(APIRoute):
    """A route whose failures of ours are a 500 (logged) on a connection kept open. (An exception handler
    for ``Exception`` would answer, then re-raise into uvicorn, which resets the connection; an HTTP
    middleware runs every request through another task.) The client's errors pass to their handlers."""

    def get_route_handler(self) -> Callable[[HttpRequest], Any]:
        handler = super().get_route_handler()

        async def guarded(request: HttpRequest) -> Any:
            try:
                return await handler(request)
            except (HTTPException, RequestValidationError, _BadRequest, _UnknownModel):
                raise
            except Exception as err:
                log.exception("request failed")
                _drop_traceback(err)
                return _error(500, f"internal error ({type(err).__name__}); the server logged it")

        return guarded


Faults = Callable[[Any, list[InFlight]], None]
"""A fault-injection hook (:mod:`constrain.testing.faults`): called with each request's body and its
admitted requests before they join the engine."""


def create_app(
    handle: ModelHandle, *, engine: Engine | None = None, max_batch: int = 32, faults: Faults | None = None
) -> FastAPI:
    """The FastAPI app serving ``handle`` (as model ``handle.name``) through ``engine`` (default: a new
    :class:`Engine` with ``max_batch``). ``faults``: a fault-injection hook for drills (default None: off)."""
    engine = engine or Engine(handle, max_batch=max_batch)
    app = FastAPI(title="constrain", docs_url=None, redoc_url=None)
    app.router.route_class = _Route
    app.state.engine = engine
    app.router.add_event_handler("shutdown", engine.close)
    model_name = handle.name

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HttpRequest, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        if first["type"] == "json_invalid":  # loc: ("body", the character's offset)
            why = first.get("ctx", {}).get("error", first["msg"])
            return _error(400, f"the request body is not JSON: {why} (character {first['loc'][-1]})")
        param = _body_param(first["loc"][1:], err.body, missing=first["type"] == "missing")
        return _error(400, f"{param or 'body'}: {first['msg']}", param)

    @app.exception_handler(_BadRequest)
    async def bad_request(_: HttpRequest, wrapper: Exception) -> JSONResponse:
        assert isinstance(wrapper, _BadRequest)
        return _error(400, str(wrapper.__cause__), wrapper.param)

    @app.exception_handler(_UnknownModel)
    async def unknown_model(_: HttpRequest, err: _UnknownModel) -> JSONResponse:
        return _error(404, f"The model '{err}' does not exist; this server serves '{model_name}'.", "model",
                      "model_not_found")  # fmt: skip

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, err: HTTPException) -> JSONResponse:
        return _error(err.status_code, str(err.detail))

    beam_lock = asyncio.Lock()  # one beam search at a time, beside the engine's batch

    async def beam_search(
        specs: list[Request], body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[list[GenerationResult], int]:
        """(the results, the prompts' tokens) of ``specs``' beam searches (:mod:`constrain.decode.beams`), every
        one checked first, then run one by one on a worker thread, outside the engine's batch."""
        searches = await _admit(lambda: [admit_beam_search(handle, s) for s in specs], body)
        async with beam_lock:
            results = await asyncio.to_thread(lambda: [r for search in searches for r in search.run()])
        return results, sum(len(search.prompt_ids) for search in searches)

    def start(body: ChatCompletionRequest | CompletionRequest, prefix: str) -> str:
        """The request's id, once its model is known to be served; its ``user`` and ``metadata`` logged with it."""
        if body.model != model_name:
            raise _UnknownModel(body.model)
        rid = new_id(prefix)
        labels = request_labels(body)
        if labels:
            log.info("%s %s", rid, labels)
        return rid

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "constrain"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != model_name:
            raise _UnknownModel(model)
        return card

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Any:
        rid = start(body, "chatcmpl")
        spec, tools = await _admit(lambda: chat_requests(body, handle), body)
        if body.use_beam_search:  # (a tool that may be called is refused: constrain.decode.beams)
            beams, prompt_tokens = await beam_search([spec], body)
            choices = [_chat_choice(i, r, None, handle, False) for i, r in enumerate(beams)]
            usage = usage_json(prompt_tokens, beams)
            return envelope("chat.completion", rid, model_name, choices, usage=usage)
        submission = _Submission(engine, stream=body.stream)
        # compiles: a bad constraint fails here
        (requests,) = await _admit(lambda: submission.admit(handle, [spec]), body)
        if faults is not None:
            faults(body, requests)
        submission.submit(requests, rid)
        calling = tools if tools is not None and tools.callable_tools else None
        if body.stream:
            return _event_stream(submission, _chat_stream(submission, body, calling, handle, rid))
        results = await submission.results(http)
        if results is None:
            return _error(499, "client disconnected")
        choices = [_chat_choice(i, r, calling, handle, body.logprobs) for i, r in enumerate(results)]
        usage = usage_json(len(requests[0].prompt_ids), results)  # the n choices share one prompt
        return envelope("chat.completion", rid, model_name, choices, usage=usage)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Any:
        rid = start(body, "cmpl")
        specs = await _admit(lambda: completion_requests(body), body)
        if body.use_beam_search:
            beams, prompt_tokens = await beam_search(specs, body)
            choices = [_with_violations({"index": i, "text": r.text, **finish_fields(r, None), "logprobs": None},
                                        r.violations) for i, r in enumerate(beams)]  # fmt: skip
            return envelope("text_completion", rid, model_name, choices,
                            usage=usage_json(prompt_tokens, beams))  # fmt: skip
        submission = _Submission(engine, stream=body.stream)
        groups = await _admit(lambda: submission.admit(handle, specs), body)
        if faults is not None:
            faults(body, [r for group in groups for r in group])
        submission.submit([r for group in groups for r in group], rid)
        prompt_tokens = sum(len(group[0].prompt_ids) for group in groups)
        if body.stream:
            return _event_stream(submission, _completion_stream(submission, body, handle, rid, prompt_tokens))
        results = await submission.results(http)
        if results is None:
            return _error(499, "client disconnected")
        choices = []
        for i, r in enumerate(results):
            scores = None
            if body.logprobs is not None:
                scores = completion_logprobs(handle, r.token_ids, r.logprobs or [], r.top_logprobs or [])
            choice = {"index": i, "text": r.text, **finish_fields(r, None), "logprobs": scores}
            if r.reasoning is not None:
                choice["reasoning_content"] = r.reasoning
            choices.append(_with_violations(choice, r.violations))
        return envelope("text_completion", rid, model_name, choices, usage=usage_json(prompt_tokens, results))

    return app


def _with_violations(choice: dict[str, Any], violations: list[str]) -> dict[str, Any]:
    return {**choice, "violations": violations} if violations else choice


def _chat_choice(
    index: int, result: GenerationResult, tools: ToolCalling | None, handle: ModelHandle, logprobs: bool
) -> dict[str, Any]:
    parsed = tools.parse(result.text) if tools is not None else None
    reply = assistant_reply(result, parsed)
    scores = (
        chat_logprobs(handle, result.token_ids, result.logprobs or [], result.top_logprobs or []) if logprobs else None
    )
    message = chat_message(reply, result.reasoning)
    choice = {"index": index, "message": message, **finish_fields(result, parsed), "logprobs": scores}
    return _with_violations(choice, reply.violations)


async def _chat_stream(
    submission: _Submission, body: ChatCompletionRequest, tools: ToolCalling | None, handle: ModelHandle, rid: str
) -> AsyncGenerator[str, None]:
    parsers = [tools.parser() if tools is not None else None for _ in submission.requests]
    results: list[GenerationResult] = []

    def chunk(index: int, delta: dict[str, Any], finish: dict[str, Any] | None = None, scores: Any = None) -> str:
        choice = {"index": index, "delta": delta, **(finish or {"finish_reason": None}), "logprobs": scores}
        return _sse(envelope("chat.completion.chunk", rid, handle.name, [choice]))

    for i in range(len(submission.requests)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, item, scores in submission.items():
        parser = parsers[i]
        if isinstance(item, StreamEvent) and item.part == "reasoning":
            if item.delta:
                yield chunk(i, {"reasoning_content": item.delta})
            continue
        if isinstance(item, StreamEvent):
            piece = parser.feed(item.delta) if parser is not None else None
            delta: dict[str, Any] = {"content": piece.content if piece is not None else item.delta}
            if piece is not None and piece.tool_calls:
                delta["tool_calls"] = [delta_json(d) for d in piece.tool_calls]
            lp = chat_logprobs(handle, *scores) if body.logprobs and scores is not None else None
            if delta["content"] or "tool_calls" in delta or lp is not None:
                yield chunk(i, delta, scores=lp)
            continue
        results.append(item)
        reply = None
        if parser is not None:
            rest = parser.finish()
            if rest.content or rest.tool_calls:
                yield chunk(i, {"content": rest.content, "tool_calls": [delta_json(d) for d in rest.tool_calls]})
            reply = parser.result()
        yield chunk(i, {}, _with_violations(finish_fields(item, reply), assistant_reply(item, reply).violations))
    if body.stream_options is not None and body.stream_options.include_usage:
        usage = usage_json(len(submission.requests[0].prompt_ids), results)
        yield _sse(envelope("chat.completion.chunk", rid, handle.name, [], usage=usage))


async def _completion_stream(
    submission: _Submission, body: CompletionRequest, handle: ModelHandle, rid: str, prompt_tokens: int
) -> AsyncGenerator[str, None]:
    results: list[GenerationResult] = []

    def chunk(index: int, text: str, finish: dict[str, Any] | None = None, scores: Any = None) -> str:
        choice = {"index": index, "text": text, **(finish or {"finish_reason": None}), "logprobs": scores}
        return _sse(envelope("text_completion", rid, handle.name, [choice]))

    async for i, item, scores in submission.items():
        if isinstance(item, StreamEvent) and item.part == "reasoning":
            if item.delta:
                yield _sse(envelope("text_completion", rid, handle.name, [{"index": i, "text": "",
                           "reasoning_content": item.delta, "finish_reason": None, "logprobs": None}]))  # fmt: skip
        elif isinstance(item, StreamEvent):
            lp = completion_logprobs(handle, *scores) if body.logprobs is not None and scores else None
            if item.delta or lp is not None:
                yield chunk(i, item.delta, scores=lp)
        else:
            results.append(item)
            yield chunk(i, "", _with_violations(finish_fields(item, None), item.violations))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _sse(envelope("text_completion", rid, handle.name, [], usage=usage_json(prompt_tokens, results)))


def _event_stream(submission: _Submission, chunks: AsyncGenerator[str, None]) -> StreamingResponse:
    """The Server-Sent Events response of ``chunks``, then ``[DONE]``. A failure is reported in the
    stream (the headers are sent by then); requests still running when it ends (the client went
    away, or it failed) are cancelled, which frees their batch rows."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
            yield "data: [DONE]\n\n"
        except Exception as err:
            log.exception("stream failed")
            _drop_traceback(err)
            yield _sse({"error": {"message": f"internal error ({type(err).__name__})", "type": "server_error"}})
        finally:
            if submission.finished < len(submission.requests):
                submission.cancel()
            await chunks.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 32,
    prefix_cache_bytes: int | None = None,
) -> None:
    """Load ``model`` (anything :func:`constrain.load_model` takes) and serve it until interrupted
    (``prefix_cache_bytes``: as in :class:`Engine`)."""
    import uvicorn

    handle = model_handle(model)
    # Everything loaded so far (torch, transformers, the model: ~530,000 objects) lives as long as the
    # process; frozen, the collector's full passes skip it, which took 277 ms a pass and stalled every
    # request in the batch (measured with SmolLM2 loaded). Process-wide, so here and not in a library call.
    gc.collect()
    gc.freeze()
    engine = Engine(handle, max_batch=max_batch, prefix_cache_bytes=prefix_cache_bytes)
    uvicorn.run(create_app(handle, engine=engine), host=host, port=port, log_level="info")
