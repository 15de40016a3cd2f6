"""The one settings class of the server (pydantic-settings, prefix DPTRAIN_): API, workers, server commands.

The client (`dptrain.Client`, the CLI's client commands) has its own: dptrain/settings.py.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration from the environment; unset URLs fall back to the embedded default under `home`."""

    model_config = SettingsConfigDict(env_prefix="DPTRAIN_", extra="ignore")

    home: Path = Path(".dptrain")
    database_url: str = ""
    broker_url: str = ""
    artifact_root: Path | None = None
    queue: str = "dptrain"
    bootstrap_token: SecretStr | None = None
    # A token for the Prometheus scrape (`GET /metrics`) alone, so the scraper needs no admin's:
    # it reads no other route and sees worker names as non-admins do. 16+ characters; unset: only
    # admins' tokens scrape.
    metrics_token: SecretStr | None = None

    # Worker: how often the launcher ships events to SQL and looks for a cancel request.
    report_interval_seconds: float = 0.5
    cancel_grace_seconds: float = 5.0
    # Node jobs this worker process supervises at once (Celery threads); 0: as many as it has slots.
    worker_concurrency: int = Field(0, ge=0)
    # This worker node as placement sees it: its name (its queue is `<queue>.node.<name>`), the
    # address other nodes reach it at (empty: the address its host name resolves to), and the rank
    # processes it runs at once (0: one per GPU on a cuda node, one per core on a cpu node).
    node_name: str = ""
    node_address: str = ""
    node_slots: int = Field(0, ge=0)
    # Rendezvous ports handed to multi-node jobs (node 0 listens on one); see docs/cluster.md.
    rendezvous_port_min: int = Field(29400, ge=1024, le=65535)
    rendezvous_port_max: int = Field(29499, ge=1024, le=65535)
    # A rendezvous that has not gathered every node in this long ends the attempt and frees its nodes.
    rendezvous_timeout_seconds: float = Field(120.0, gt=0)
    # Placement runs when a job is submitted or ends, and at least this often in every process.
    schedule_interval_seconds: float = Field(2.0, gt=0)
    # Publish a placed node's start message again if its worker has not started it after this long
    # (a lost publish); checked this often.
    republish_after_seconds: float = 600.0
    reconcile_interval_seconds: float = 60.0
    # How often each worker process refreshes its row in `workers`; lost after 3 missed beats.
    worker_heartbeat_seconds: float = 5.0
    # The attempt lease: a running job whose worker has not beaten for this long (or whose worker row
    # is gone) is taken from it by any worker's reconciler, fenced, and restarted or failed.
    worker_lease_seconds: float = 60.0
    # Log lines and metric points of jobs finished more than this many days ago are deleted (the job
    # row, its timeline, latest metrics, error and checkpoints stay). 0 keeps everything.
    history_retention_days: float = 0.0
    # The most a job's log lines take in the database (UTF-8 bytes, all attempts and ranks together);
    # past it a worker drops further lines, with a line saying so and, at the end of the attempt, one
    # counting what was dropped. One line keeps at most 8000 characters (the rest is cut, and says so).
    max_log_bytes_per_job: int = Field(64 << 20, ge=1024)
    # The most metric points a job stores (all attempts and nodes together); past it a worker drops
    # further points, saying so once on the job's timeline and in its log, and the job runs on. Also
    # what bounds an answer to a metrics read without `max_points`.
    max_metric_points_per_job: int = Field(1_000_000, ge=1)
    # The most a job's DPTRAIN_OUTPUT_DIR may hold (bytes; names: files, folders, links), checked every few
    # seconds while its ranks run and at each attempt's end: past either the job fails
    # (OutputTooLarge, not retried), naming the size and the limit.
    max_output_bytes_per_job: int = Field(10 << 30, ge=1)
    max_output_files_per_job: int = Field(10_000, ge=1)
    # The most a job's checkpoint folder may hold (bytes, every entry: checkpoints, sidecars, temp
    # files and whatever else its ranks put there; workers/attempt/checkpoint_cap.py), checked like the
    # outputs: past it the job fails (CheckpointTooLarge, not retried), naming the size and the cap.
    max_checkpoint_bytes_per_job: int = Field(50 << 30, ge=1)

    # Module prefixes whose `package.module:function` a job's `entrypoint` may name without uploaded
    # code (modules an operator installed on every worker), comma-separated.
    allowed_entrypoints: str = ""
    # Which user code runs, and only for admins and users granted `can_run_code` (docs/security.md):
    # `off` none; `allowlist` only entrypoints under DPTRAIN_ALLOWED_ENTRYPOINTS; `uploaded` also
    # uploaded code trees and commands.
    user_code: Literal["off", "allowlist", "uploaded"] = "uploaded"
    # Largest code archive `PUT /v1/code/{sha256}` stores (413 above), and the most its files may
    # take unpacked on a worker.
    code_max_bytes: int = Field(100 << 20, ge=1024)
    code_max_unpacked_bytes: int = Field(1 << 30, ge=1024)
    # Where a worker unpacks code archives, once per sha256, read-only (default: HOME/code-cache).
    code_cache_dir: Path | None = None
    # The operator's read-only data root on every worker (the same tree on each): a spec's data paths
    # (`data.train`, `data.eval`) are relative to it. Where the API has it too, submit checks that
    # those paths exist in it; the workers pass it to the ranks (dptrain.data.data_path).
    data_root: Path | None = None
    # Run the ranks of every job as this unprivileged user (the worker must be root), each attempt in
    # a directory of its own that only it and the worker can read (docs/security.md).
    run_as: str = ""
    # Without DPTRAIN_RUN_AS, a root worker runs each attempt's sandboxed ranks (and its environment's
    # build) as a uid of its own, leased from this range ("first-last"; gid the same number) for the
    # attempt's life and free again once its processes are gone and its files are the worker's
    # (workers/sandbox/rank_uids.py, docs/security.md). The default lies above the 16-bit ids that
    # distributions, systemd's DynamicUser (61184-65519) and nobody (65534) use, and below useradd's
    # subordinate ids (100000 up); a container that maps only 65536 ids needs one below 65534.
    rank_uid_range: str = "65536-66559"
    # A multi-node attempt's ranks run as one uid on every node (they share one checkpoint folder):
    # placement gives each running multi-node attempt a uid of this range that no other holds in the
    # cluster, and each of its nodes leases that uid as above. Kept apart from DPTRAIN_RANK_UID_RANGE,
    # whose uids each host leases on its own; every API and worker process must agree on it.
    cluster_rank_uid_range: str = "66560-67583"
    # Every attempt's ranks run in a bubblewrap sandbox (workers/sandbox/bubblewrap.py, docs/security.md):
    # `required` refuses to start a worker where bwrap or namespaces are missing; `auto` too, except
    # for `dptrain up`'s embedded worker, which then runs them unsandboxed with a warning; `off`
    # never sandboxes (the same warning). Either way each unsandboxed job's timeline says so.
    sandbox: Literal["auto", "required", "off"] = "auto"
    # A job's `environment` (docs/code.md#python-packages): where its packages come from (pip's
    # --index-url; --find-links, a wheelhouse folder or page, comma-separated; empty: pip's own
    # defaults), whether its requirements may carry pip options, URLs and local paths, how long a
    # build may take (past it the job fails, EnvironmentBuildFailed), and where built environments
    # are cached (default HOME/env-cache), least recently used evicted past the size cap.
    pip_index_url: str = ""
    pip_find_links: str = ""
    pip_allow_options: bool = False
    env_build_timeout_seconds: float = Field(900.0, gt=0)
    env_cache_dir: Path | None = None
    env_cache_max_bytes: int = Field(20 << 30, ge=0)
    # The most one environment's folder may hold while it is built (bytes, links not followed,
    # the installer's temporary files included), measured every second: past it the build is killed
    # and the job fails (EnvironmentTooLarge, not retried); nothing is cached.
    max_env_bytes: int = Field(10 << 30, ge=1 << 20)

    # Webhooks (docs/api.md#webhooks): each delivery is a POST of at most this long; a failed one is
    # tried again after `webhook_backoff_seconds`, doubling up to `webhook_backoff_max_seconds`, until
    # `webhook_max_attempts` attempts (then `failed`). The webhook worker (`dptrain webhooks`) also
    # sends, every `webhook_sweep_seconds`, the pending deliveries that are due (their publish lost).
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=300)
    webhook_backoff_seconds: float = Field(2.0, gt=0)
    webhook_backoff_max_seconds: float = Field(600.0, gt=0)
    webhook_max_attempts: int = Field(15, ge=1)
    webhook_sweep_seconds: float = Field(30.0, gt=0)
    # Sends to one receiver (scheme, host, port) at once in a webhook worker process; its other
    # deliveries wait their turn without a thread, so a receiver that hangs delays only its own
    # (service/webhooks/lanes.py). `dptrain webhook-worker -c` threads serve every receiver.
    webhook_sends_per_receiver: int = Field(2, ge=1)
    # Networks (CIDRs, comma-separated) a webhook URL may reach although they are refused by default:
    # loopback (the service itself and its database and broker), link-local and the clouds' metadata
    # addresses, unspecified ones, and every address of the checking host (service/webhooks/urls.py
    # has the list), each also when carried in an IPv6 address (mapped, NAT64, 6to4, Teredo...). For
    # example `127.0.0.1/32` for a receiver on this host. Checked at registration and at each
    # delivery, after DNS resolution (docs/security.md).
    webhook_allow_networks: str = ""

    # API
    # `limit` above these answers 422 (jobs pages; log pages).
    max_page_size: int = Field(200, ge=1)
    default_page_size: int = Field(50, ge=1)
    max_log_page_size: int = Field(10_000, ge=1)
    # Larger request bodies answer 413; the bytes are counted, not just Content-Length.
    max_request_body_bytes: int = Field(1 << 20, ge=1024)
    # Per-user token bucket (all of a user's tokens share it), in this API process:
    # `rate_limit_per_second` sustained, bursts up to `rate_limit_burst`; beyond it 429 with
    # Retry-After. 0 turns it off.
    rate_limit_per_second: float = Field(20.0, ge=0)
    rate_limit_burst: int = Field(100, ge=1)
    # Bearer tokens this API process does not know yet cost a database lookup each, so each client
    # address may try them at `auth_failures_per_second`, bursts up to `auth_failure_burst`; beyond it
    # 429 with Retry-After, before any lookup. A token that turns out valid gives its try back, so
    # only invalid ones count. Behind a reverse proxy the address is the proxy's unless the server
    # trusts its X-Forwarded-For (`dptrain api` runs uvicorn with proxy headers from
    # FORWARDED_ALLOW_IPS). 0 turns it off.
    auth_failures_per_second: float = Field(1.0, ge=0)
    auth_failure_burst: int = Field(30, ge=1)
    # Live (unrevoked) tokens a user may hold; minting another answers 409 until some are revoked.
    max_tokens_per_user: int = Field(20, ge=1)
    # A user's jobs running at once (admins included); placement leaves the rest queued, with a reason.
    max_running_jobs_per_user: int = Field(4, ge=1)
    # A user's jobs queued at once (admins included); a submit beyond it answers 409 with the reason.
    # It bounds what one user's flood costs every placement round and every queue position. 0: no cap.
    max_queued_per_user: int = Field(100, ge=0)
    # uvicorn's access log, a line per request (`dptrain api`).
    access_log: bool = False
    # Database connections each process keeps open (as many again may open for bursts). The API
    # also runs at most this many requests' database work at once (its threadpool): more threads
    # than connections would only queue on the pool, and open and close connections as they do.
    db_pool_size: int = Field(16, ge=1, le=256)
    # Each API process remembers token -> user this long, so a poll costs no user lookup. A token
    # revoked through this process is refused at once; through another (the CLI, another API
    # process) within this many seconds. 0 looks the token up at every request.
    auth_cache_seconds: float = Field(1.0, ge=0, le=60)
    # Each API process keeps the JSON of the jobs it served and answers polls of them without a
    # query, dropping a job's entry when PostgreSQL notifies a committed change (migration 0006;
    # `service.jobs.poll_cache`). PostgreSQL only; off, every poll reads the database.
    poll_cache: bool = True
    # How often an open `GET /v1/jobs/{id}/events` stream looks at the database.
    sse_poll_seconds: float = 1.0
    # The interactive API pages `/docs` (Swagger UI) and `/redoc`: they load their scripts from a CDN
    # (jsDelivr), which could then run code on the dashboard's origin, where its token lives. Unset:
    # on for the embedded service (SQLite, a laptop), off otherwise. `/openapi.json` is always served.
    api_docs: bool | None = None

    @field_validator("data_root", "metrics_token", mode="before")
    @classmethod
    def _unset_when_empty(cls, v: object) -> object:
        # DPTRAIN_DATA_ROOT= (empty) means no data root, not the current directory; an empty
        # DPTRAIN_METRICS_TOKEN (docker-compose passes one through unset) means no scrape token.
        return None if v == "" else v

    @field_validator("rank_uid_range", "cluster_rank_uid_range")
    @classmethod
    def _uid_range(cls, v: str, info: ValidationInfo) -> str:
        name = f"DPTRAIN_{str(info.field_name).upper()}"
        first, sep, last = v.partition("-")
        if not (sep and first.strip().isdigit() and last.strip().isdigit()):
            raise ValueError(f"{name} must be two uids like 65536-66559, not {v!r}")
        low, high = int(first), int(last)
        # Below 1000 are the system's accounts; nobody (65534), 65535 and (uid_t)-1 are never a rank's.
        if not 1000 <= low <= high < 2**32 - 1 or low <= 65534 <= high or low <= 65535 <= high:
            raise ValueError(
                f"{name} {v!r} must be first-last within 1000-4294967294, first not above "
                "last, without 65534 (nobody) and 65535"
            )
        return f"{low}-{high}"

    @field_validator("bootstrap_token", "metrics_token")
    @classmethod
    def _strong_token(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        # Refuse an obviously guessable token rather than run with it.
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError(f"DPTRAIN_{str(info.field_name).upper()} must be at least 16 characters")
        return v

    @model_validator(mode="after")
    def _embedded_defaults(self) -> Settings:
        home = self.home.resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{home / 'dptrain.db'}"
        if not self.broker_url:
            # kombu's SQLAlchemy transport: a queue in a SQLite file, no broker server needed.
            self.broker_url = f"sqla+sqlite:///{home / 'broker.db'}"
        if self.artifact_root is None:
            self.artifact_root = home / "artifacts"
        self.artifact_root = self.artifact_root.resolve()
        if self.code_cache_dir is None:
            self.code_cache_dir = home / "code-cache"
        self.code_cache_dir = self.code_cache_dir.resolve()
        self.env_cache_dir = (self.env_cache_dir or home / "env-cache").resolve()
        if self.data_root is not None:
            self.data_root = self.data_root.resolve()
        if self.api_docs is None:
            self.api_docs = self.is_sqlite
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError("DPTRAIN_RENDEZVOUS_PORT_MIN must not exceed DPTRAIN_RENDEZVOUS_PORT_MAX")
        (low, high), (c_low, c_high) = self.rank_uids, self.cluster_rank_uids
        if low <= c_high and c_low <= high:
            # A host's own leases and the cluster's must never hand one uid to two attempts.
            raise ValueError("DPTRAIN_RANK_UID_RANGE and DPTRAIN_CLUSTER_RANK_UID_RANGE must not overlap")
        if self.default_page_size > self.max_page_size:
            raise ValueError("DPTRAIN_DEFAULT_PAGE_SIZE must not exceed DPTRAIN_MAX_PAGE_SIZE")
        return self

    @property
    def node(self) -> str:
        """This worker's node name: DPTRAIN_NODE_NAME, else the host name."""
        return self.node_name or socket.gethostname()

    @property
    def webhook_queue(self) -> str:
        """The queue of webhook deliveries: its own, so a slow receiver never holds a node's start."""
        return f"{self.queue}.webhooks"

    @property
    def entrypoint_prefixes(self) -> list[str]:
        """DPTRAIN_ALLOWED_ENTRYPOINTS as a list."""
        return [p.strip() for p in self.allowed_entrypoints.split(",") if p.strip()]

    @property
    def code_cache(self) -> Path:
        """Where unpacked code trees live on this worker, always set after validation."""
        assert self.code_cache_dir is not None
        return self.code_cache_dir

    @property
    def rank_uids(self) -> tuple[int, int]:
        """DPTRAIN_RANK_UID_RANGE as (first, last), both included."""
        first, _, last = self.rank_uid_range.partition("-")
        return int(first), int(last)

    @property
    def cluster_rank_uids(self) -> tuple[int, int]:
        """DPTRAIN_CLUSTER_RANK_UID_RANGE as (first, last), both included."""
        first, _, last = self.cluster_rank_uid_range.partition("-")
        return int(first), int(last)

    @property
    def env_cache(self) -> Path:
        """Where built job environments live on this worker, always set after validation."""
        assert self.env_cache_dir is not None
        return self.env_cache_dir

    @property
    def is_sqlite(self) -> bool:
        """True for the embedded SQLite database."""
        return self.database_url.startswith("sqlite")

    @property
    def artifacts(self) -> Path:
        """The artifact root, always set after validation."""
        assert self.artifact_root is not None
        return self.artifact_root


@lru_cache
def get_settings() -> Settings:
    """Settings read once per process."""
    return Settings()
