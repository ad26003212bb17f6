"""The HTTP layer: `create_app(engine, config)` builds the FastAPI app.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (these need
`Authorization: Bearer KEY` when `config.api_key` is set), GET /health, GET /metrics.

Per request: authenticate, parse and validate (protocol.py; 400/404 before anything is queued),
submit to the engine worker (429 + Retry-After when the queue is full), watch the connection
(a client that goes away cancels its job: dropped from the queue, or stopped at the next round),
then answer in one JSON object or as server-sent events ending with `data: [DONE]`. An error
that happens after a stream started is sent as a `data: {"error": ...}` event before [DONE].
"""

# no `from __future__ import annotations` here: FastAPI must see the real `Request` class of the
# routes defined inside create_app (fastapi is imported lazily, so `diffspec serve` can say it is missing)
import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Optional

from .metrics import Metrics
from .protocol import GenerationRequest, RequestError, chunk, error_body, new_id, parse_chat, parse_completion, \
    response, usage
from .worker import EngineWorker, Job, QueueFull


@dataclass(frozen=True)
class ServerConfig:
    """How the server behaves; host/port are only used by `run.serve`."""

    model_name: str
    api_key: Optional[str] = None
    max_queue: int = 64
    host: str = "127.0.0.1"
    port: int = 8000


def create_app(engine, config: ServerConfig):
    """A FastAPI app serving `engine` (which it owns from now on: one request at a time).

    The engine worker thread starts with the app's lifespan and stops with it; `app.state.worker`
    and `app.state.metrics` expose them (tests read them)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    metrics = Metrics()
    worker = EngineWorker(engine, metrics, config.max_queue)
    metrics.queue_depth = lambda: worker.queue_depth
    metrics.running = lambda: worker.running
    target = engine.target

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="diffspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config

    def error(endpoint: str, exc: RequestError, headers: Optional[dict] = None) -> JSONResponse:
        metrics.request(endpoint, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorized(request: Request) -> bool:
        if config.api_key is None:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), config.api_key.encode())

    def unauthorized(endpoint: str) -> JSONResponse:
        exc = RequestError("invalid or missing API key: send 'Authorization: Bearer KEY'", status=401,
                           code="invalid_api_key")
        return error(endpoint, exc, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "queue_depth": worker.queue_depth,
                "running": worker.running}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return unauthorized("models")
        metrics.request("models", 200)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "diffspec", "max_model_len": target.max_context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion", parse_completion)

    async def handle(request: Request, endpoint: str, parse):
        arrived = time.perf_counter()
        if not authorized(request):
            return unauthorized(endpoint)
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            req = parse(body, target, config.model_name)
        except RequestError as exc:
            return error(endpoint, exc)
        job = Job(req, asyncio.get_running_loop(), arrived=arrived)
        try:
            worker.submit(job)
        except QueueFull as e:
            exc = RequestError(str(e), status=429, kind="rate_limit_error", code="queue_full")
            return error(endpoint, exc, headers={"Retry-After": str(e.retry_after)})
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            first = await job.events.get()  # "started" or "error": the status code is known here
            if first[0] == "error":
                return error(endpoint, event_error(first))
            if req.stream:
                metrics.request(endpoint, 200)
                body_iter = sse(job, req, watcher)
                watcher = None  # the stream owns it now
                return StreamingResponse(body_iter, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            while True:  # deltas are skipped: the outcome carries the whole text
                event = await job.events.get()
                if event[0] == "error":
                    return error(endpoint, event_error(event))
                if event[0] == "done":
                    out = event[1]
                    metrics.request(endpoint, 200)
                    return response(endpoint, new_id(endpoint), config.model_name, out.text, out.finish_reason,
                                    usage(out.prompt_tokens, out.completion_tokens), out.speculative)
        finally:
            if watcher is not None:
                watcher.cancel()
                worker.cancel(job)  # no-op once finished; else the client is gone

    def event_error(event: tuple) -> RequestError:
        status, message = event[1], event[2]
        return RequestError(message, status=status, kind="server_error" if status >= 500 else "invalid_request_error")

    async def watch_disconnect(request: Request, job: Job) -> None:
        """The body was read: the next ASGI message is the disconnect."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                worker.cancel(job)
                return

    async def sse(job: Job, req: GenerationRequest, watcher: asyncio.Task):
        rid, model, endpoint = new_id(req.endpoint), config.model_name, req.endpoint
        with_usage = req.include_usage

        def data(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if endpoint == "chat":
                yield data(chunk(endpoint, rid, model, None, role=True, with_usage=with_usage))
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    yield data(chunk(endpoint, rid, model, event[1], with_usage=with_usage))
                elif event[0] == "error":
                    yield data(event_error(event).body())
                    break
                else:
                    out = event[1]
                    use = usage(out.prompt_tokens, out.completion_tokens)
                    yield data(chunk(endpoint, rid, model, None if endpoint == "chat" else "",
                                     finish=out.finish_reason, spec=out.speculative, with_usage=with_usage))
                    if with_usage:
                        yield data(chunk(endpoint, rid, model, None, usage_obj=use, spec=out.speculative,
                                         with_usage=True, no_choices=True))
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            worker.cancel(job)

    return app
