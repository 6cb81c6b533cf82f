"""The FastAPI application: long-lived parts opened in the lifespan, closed in `finally`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute

from chat_api import metrics
from chat_api.admission import Admission, BodyLimit, LargeBody, unguarded_routes
from chat_api.auth import TokenVerifier
from chat_api.errors import install_error_handlers
from chat_api.observability import install_observability
from chat_api.protocols.ag_ui import routes as ag_ui_routes
from chat_api.protocols.ai_sdk import routes as ai_sdk_routes
from chat_api.protocols.mcp.server import MCP_PATH, install_mcp
from chat_api.protocols.mcp.server import too_large as mcp_too_large
from chat_api.protocols.openai import responses_compaction as compaction_routes
from chat_api.protocols.openai import responses_routes, responses_websocket
from chat_api.protocols.openai import routes as openai_routes
from chat_api.providers.base import ChatProvider
from chat_api.replies.approve import ApprovalTimeouts
from chat_api.replies.checkpoint import Checkpointer
from chat_api.replies.drain import Drain
from chat_api.replies.prompt import Prompter
from chat_api.replies.queue import watch_client
from chat_api.replies.reaper import Reaper
from chat_api.replies.registry import ReplyRegistry
from chat_api.replies.run import ReplyRunner
from chat_api.replies.signals import Signals
from chat_api.response_headers import ResponseHeaders
from chat_api.routes import (
    branches,
    conversations,
    health,
    imports,
    keys,
    messages,
    page,
    turns,
    users,
)
from chat_api.routes import memory as memory_routes
from chat_api.routes import memory_items as memory_item_routes
from chat_api.routes.docs import install_docs
from chat_api.services import Services, process_id
from chat_api.tools import ToolRegistry, configured_registry
from memory.config import Settings
from memory.prompt.templates import load_prompts
from memory.recall.access import MemoryAccess
from memory.recall.embeddings import Embedder, load_embedder
from memory.recall.fact_keys import FactAsker
from memory.recall.index import open_index
from memory.recall.recaller import Recaller
from memory.storage.db import Database
from memory.storage.retention import RetentionJob, RetentionPolicy

log = logging.getLogger(__name__)

# A background part of the process: given the services and a stop event, runs until stopped.
Worker = Callable[[Services, asyncio.Event], Coroutine[Any, Any, None]]


def make_provider(settings: Settings) -> ChatProvider:
    """The configured chat model provider."""
    if settings.llm_provider == "openai":
        from chat_api.providers.openai_provider import OpenAIProvider

        return OpenAIProvider.from_settings(settings)
    from chat_api.providers.demo import DemoProvider

    return DemoProvider(
        tokens_per_second=settings.demo_tokens_per_second,
        first_token_delay=settings.demo_first_token_delay_seconds,
        reply_words=settings.demo_reply_words,
    )


def fact_asker(settings: Settings, provider: ChatProvider) -> FactAsker | None:
    """The indexer's fact-key requests through the rewrite model: None unless FACT_KEYS=model and a
    real model is configured (the demo provider never makes keys)."""
    if settings.fact_keys != "model" or settings.llm_provider != "openai":
        return None
    return FactAsker(
        complete=partial(
            provider.complete, model=settings.rewrite_model, timeout=settings.fact_keys_timeout_seconds
        ),
        prompts=load_prompts(settings.prompt_language),
        timeout=settings.fact_keys_timeout_seconds,
    )


def create_app(
    settings: Settings,
    *,
    provider: ChatProvider | None = None,
    tools: ToolRegistry | None = None,
    workers: list[Worker] | None = None,
    ui_token: str | None = None,
    embedder: Embedder | None = None,
    freeze_startup_objects: bool = False,
) -> FastAPI:
    """Build the app. `settings.database_url` must be set (the CLI sets it for the embedded server).

    `freeze_startup_objects` (the server processes of the CLI): once everything is loaded,
    move the objects that live as long as the process out of the garbage collector's reach
    (`gc.freeze()`), and collect less often (`GC_THRESHOLDS`). Imports and the embedding
    model leave ~540,000 objects and 1,000 open streams ~450 more each; with Python's
    defaults a full collection walked them all every 2-5 s under load, a 250-500 ms pause
    that every stream felt as late tokens (bench/load_streams.py: lag p99 627 ms at 1,000
    streams; frozen, 367 ms; frozen with these thresholds, 85 ms, with no full collection
    during the run).

    `embedder` defaults to the configured sentence-transformers model, loaded once at start
    and shared by retrieval and an in-process indexer; tests pass a deterministic one.
    """
    if settings.database_url is None:
        raise ValueError("create_app needs settings.database_url")
    database_url = settings.database_url
    prompts = load_prompts(settings.prompt_language)
    verifier = TokenVerifier(settings)
    # Built before serving, so a bad TOOL_MODULES or approval setting stops the start.
    tool_registry = tools or configured_registry(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pid = process_id()
        db = Database(database_url, pool_size=settings.db_pool_size)
        # Checkpoints are the heartbeat: they get their own connections, so a burst of
        # requests that drains the main pool cannot make live replies look dead.
        upkeep_db = Database(database_url, pool_size=2)
        encoder = embedder or await load_embedder(settings)
        metrics.observe_encoder(encoder)
        # Searches and writes use the encoder of the index generation they touch (never mixed).
        model = await open_index(
            db,
            settings,
            encoder,
            threads=settings.embedding_threads,
            on_refused=metrics.observe_memory_refused,  # /metrics; /readyz reads model.refused
        )
        chat_provider = provider or make_provider(settings)
        registry = ReplyRegistry()
        checkpointer = Checkpointer(
            upkeep_db, registry, interval_ms=settings.checkpoint_interval_ms, chars=settings.checkpoint_chars
        )
        recaller = Recaller(
            db,
            model,
            complete=partial(
                chat_provider.complete, model=settings.rewrite_model, timeout=settings.rewrite_timeout_seconds
            )
            if settings.query_rewrite == "model"
            else None,
            prompts=prompts,
            settings=settings,
        )
        prompter = Prompter(db, settings, prompts, recaller)
        runner = ReplyRunner(
            db=db,
            settings=settings,
            provider=chat_provider,
            tools=tool_registry,
            prompter=prompter,
            checkpointer=checkpointer,
            registry=registry,
            process_id=pid,
            recaller=recaller,
        )
        admission = Admission(settings, registry)
        services = Services(
            settings=settings,
            db=db,
            verifier=verifier,
            provider=chat_provider,
            tools=tool_registry,
            registry=registry,
            signals=Signals(database_url, registry, pid),
            checkpointer=checkpointer,
            reaper=Reaper(
                upkeep_db,
                timeout_seconds=settings.heartbeat_timeout_seconds,
                interval_seconds=settings.reaper_interval_seconds,
                registry=registry,
            ),
            prompter=prompter,
            runner=runner,
            process_id=pid,
            admission=admission,
            embedder=model,
            recaller=recaller,
            memory_access=MemoryAccess(db, model, recaller, settings),
            drain=Drain(
                runner, registry, seconds=settings.shutdown_drain_seconds, refuse_replies=admission.close
            ),
        )
        app.state.services = services
        stop = asyncio.Event()
        loops = [
            asyncio.create_task(services.checkpointer.run(stop), name="checkpointer"),
            asyncio.create_task(services.signals.run(stop), name="signals"),
            asyncio.create_task(services.reaper.run(stop), name="reaper"),
            asyncio.create_task(
                ApprovalTimeouts(services, interval_seconds=settings.approval_sweep_seconds).run(stop),
                name="approval-timeouts",
            ),
            asyncio.create_task(
                RetentionJob(
                    db,
                    RetentionPolicy.from_settings(settings),
                    interval_seconds=settings.retention_interval_seconds,
                    lock_timeout_ms=settings.background_lock_timeout_ms,
                ).run(stop),
                name="retention",
            ),
        ]
        # Moves this process to a new index generation soon after a reindex switches, traffic or not.
        loops.append(asyncio.create_task(model.follow(stop), name="memory-index"))
        loops.append(asyncio.create_task(app.state.mcp.run(stop), name="mcp"))
        loops += [asyncio.create_task(worker(services, stop)) for worker in workers or []]
        # SIGTERM begins the drain at once, while the streams are still connected (chat_api/replies/drain.py).
        stop_watching_signals = services.drain.on_stop_signals()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(services.signals.connected.wait(), timeout=5)
            if freeze_startup_objects:
                gc.collect()
                gc.freeze()
                gc.set_threshold(*settings.gc_thresholds)
            yield
        finally:
            stop_watching_signals()
            # Replies still running end as interrupted_by_error with what they streamed. A stop
            # signal began the drain while their streams were connected: it goes on to its end
            # (a reply nobody listens to may still finish). Without one, they are stopped now.
            if not services.drain.draining:
                services.drain.begin(now=True)
            await services.drain.wait()
            stop.set()
            await asyncio.wait(loops, timeout=10)
            for task in loops:
                task.cancel()
            await chat_provider.aclose()
            close_encoder = getattr(encoder, "aclose", None)  # an embedding service's connections
            if close_encoder is not None:
                await close_encoder()
            await db.dispose()
            metrics.process_exited()
            await upkeep_db.dispose()

    app = FastAPI(
        title="chatmem",
        version="0.1.0",
        description="Chat backend for web chat frontends: SSE streaming, stop that works, long-term memory.",
        lifespan=lifespan,
        docs_url=None,  # served by chat_api.routes.docs with local assets, not from a CDN
        redoc_url=None,
    )
    # The chat page picks this token up by itself only on the embedded installation, and
    # never one this server would refuse (an HS256 token while RS256 keys are configured).
    app.state.ui_token = ui_token if ui_token is not None and verifier.accepts(ui_token) else None
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After", ai_sdk_routes.NEXT_CURSOR_HEADER],
        )

    for public in (health.router, page.router):
        app.include_router(public)
    install_docs(app)
    routers = (
        conversations,
        messages,
        turns,
        branches,
        memory_routes,
        memory_item_routes,
        imports,
        users,
        ai_sdk_routes,
        ag_ui_routes,
        keys,
        openai_routes,
        responses_routes,
        compaction_routes,
    )
    # Every router here is a door_router: authenticated, rate-limited and input-bounded
    # before a body is read (chat_api.admission.door).
    unguarded = unguarded_routes(module.router for module in routers)
    if unguarded:
        raise RuntimeError(f"routes that read the caller without passing the door: {unguarded}")
    for module in routers:
        app.include_router(module.router, dependencies=[Depends(watch_client)])
    # WebSocket mode passes the door itself, per connection and per message.
    app.include_router(responses_websocket.router)
    app.state.mcp = install_mcp(app)
    # Only these routes take a body larger than MAX_BODY_BYTES: the import, and the doors whose
    # clients send the whole history with every message (read after the door, like every body).
    larger = {
        imports.import_conversation_turns: settings.import_max_body_bytes,
        ai_sdk_routes.chat: settings.max_history_body_bytes,
        ag_ui_routes.run: settings.max_history_body_bytes,
        ag_ui_routes.connect: settings.max_history_body_bytes,
        openai_routes.chat_completions: settings.max_history_body_bytes,
        responses_routes.create_response: settings.max_history_body_bytes,
    }
    large = [
        LargeBody.of(route, larger[route.endpoint])
        for module in (imports, ai_sdk_routes, ag_ui_routes, openai_routes, responses_routes)
        for route in module.router.routes
        if isinstance(route, APIRoute) and route.endpoint in larger
    ]
    if len(large) != len(larger):
        raise RuntimeError("a route given a larger body limit is not among these routers")
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, large=large, answers={MCP_PATH: mcp_too_large}
    )
    app.add_middleware(ResponseHeaders)
    install_observability(app, settings)
    return app
