"""`diffspec serve`: an OpenAI-compatible HTTP server over one SpeculativeEngine.

    diffspec serve --model M --drafter D --policy P --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-queue N]

Layout:
- protocol.py - request validation (nothing silently ignored) and OpenAI response shapes;
- stops.py    - stop strings over text arriving one accepted block per round (never leaked);
- worker.py   - the bounded FIFO queue and the one thread that owns the engine;
- metrics.py  - Prometheus text for GET /metrics;
- app.py      - the FastAPI routes, auth, SSE streaming, disconnect -> cancel;
- run.py      - binding, startup message, uvicorn; `ServerThread` runs one in the background.

Design: the engine serves one request at a time (its target holds one KV cache), so the server
keeps exactly one engine, and requests wait in a FIFO queue bounded by --max-queue (429 past it).
Each job talks to its HTTP handler only through an event channel (started / delta / done /
error), so the HTTP layer does not know how generation is scheduled.

Batching (out of scope, kept open): several requests could share one verify pass. It would fit
behind the same job channel by replacing `EngineWorker._loop`, which now runs one
`GenerationStream` to the end, with a scheduler that keeps up to B active jobs, each with its own
KV cache and drafter state, and per step drafts for every active job, verifies all drafts in one
padded target forward (one row per job, ragged lengths masked), accepts per job, and emits each
job's block to its channel; new jobs join between steps, cancelled or finished ones leave. The
queue, the stop-string matcher (one per job), cancellation, usage accounting and the HTTP layer
stay as they are; only the engine needs a batched `step` next to today's per-request generator.
"""

from .app import ServerConfig, create_app
from .run import ServerThread, serve

__all__ = ["ServerConfig", "create_app", "serve", "ServerThread"]
