"""Settings of ``ragcache serve``: command-line flags over ``RAGCACHE_*`` environment variables over
a config file (TOML or JSON, flat keys named as the fields below).

Every value is checked (pydantic) before the model loads; a bad one is a
:class:`~ragcache_backend.errors.InvalidRequestError` whose message names the field.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ragcache_backend.config import MiB, EngineConfig, default_disk_dir, ragcache_home
from ragcache_backend.errors import InvalidRequestError

__all__ = ["LOG_LEVELS", "CacheSettings", "ServerSettings", "default_learned_documents_file", "load_settings", "read_config_file"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def default_learned_documents_file() -> Path:
    """Where ``ragcache serve`` keeps the documents it learned: ``ragcache_home()/learned_documents.jsonl``."""
    return ragcache_home() / "learned_documents.jsonl"


class CacheSettings(BaseSettings):
    """The cache's tiers below the device and their policy: the settings ``ragcache serve`` and the
    vLLM connector (:mod:`ragcache_integrations.vllm.settings`) share, by name, meaning and default.

    Environment variables: ``RAGCACHE_`` + the field name in upper case (``RAGCACHE_HOST_MIB=4096``).
    """

    model_config = SettingsConfigDict(env_prefix="RAGCACHE_", extra="forbid", frozen=True)

    policy: Literal["pgdsf", "gdsf", "lru", "lfu"] = Field("pgdsf", description="cache replacement policy")
    host_mib: int = Field(2048, ge=0, description="host tier budget, MiB (0 disables it)")
    cache_dir: Path | None = Field(None, description="disk tier folder; None = ragcache_home()/kv")
    disk_cache: bool = Field(True, description="False disables the disk tier")
    disk_budget_mib: int = Field(4096, ge=0, description="disk tier budget, MiB")
    remote_url: str | None = Field(None, description="remote KV tier shared by replicas: a Redis URL "
                                                     "(redis://host:port/db); None = off")

    @property
    def disk_dir(self) -> Path | None:
        """The disk tier's folder, or None when the tier is off."""
        if not self.disk_cache:
            return None
        return (self.cache_dir or default_disk_dir()).expanduser()


class ServerSettings(CacheSettings):
    """What ``ragcache serve`` runs: the engine's knobs and the HTTP server's (the cache tiers' from
    :class:`CacheSettings`).

    Environment variables: ``RAGCACHE_`` + the field name in upper case (``RAGCACHE_PORT=9000``).
    """

    host: str = Field("127.0.0.1", description="interface to listen on")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    model: str | None = Field(None, description="GGUF file, HF folder or packaged model name; None = SmolLM2-135M-Instruct")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights and KV dtype; auto: bfloat16 where the native bf16 kernels run the model, else float32 (EngineConfig.dtype)")
    threads: int | None = Field(None, ge=1, description="torch threads; None = torch's default")
    device_mib: int = Field(512, ge=1, description="device tier (KV arena) budget, MiB")
    host_commit: Literal["background", "lazy"] = Field("background", description="the host tier's memory (on a CPU, part of the KV arena): background = committed from start by a low-priority thread, so requests never wait on its first-touch page faults (the server then holds its whole host budget from start); lazy = as the host tier fills (EngineConfig.host_commit)")
    reuse: Literal["exact", "chunk", "auto"] = Field("exact", description="default reuse mode of a request")
    max_batch_size: int = Field(8, ge=1, description="sequences in one forward step")
    max_batch_tokens: int = Field(4096, ge=1, description="new tokens (rows) in one forward step: one per decode "
                                                          "plus prefill chunks (vLLM's max_num_batched_tokens); a "
                                                          "longer prompt is prefilled in chunks over several steps")
    max_queue: int = Field(64, ge=0, description="requests that may wait beyond a full batch; more get 503")
    served_model_name: str | None = Field(None, description="model name clients use; None = the engine's")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that gives none (capped by the window)")
    drain_timeout: float = Field(30.0, ge=0.0, description="seconds in-flight requests get to finish on shutdown")
    log_level: Literal[LOG_LEVELS] = Field("info", description="log level (uvicorn's names)")  # type: ignore[valid-type]
    api_key: SecretStr | None = Field(None, description="if set, /v1 requests need 'Authorization: Bearer <key>'")
    index: Path | None = Field(None, description="a folder written by `ragcache index` (or the corpus folder it "
                                                 "indexed): its documents are recognised inside plain chat messages, "
                                                 "without the request's documents field")
    learned_documents: Path | None = Field(None, description="file keeping the documents learned from requests' "
                                                             "documents field across restarts (JSON lines); "
                                                             "None = ragcache_home()/learned_documents.jsonl")
    remember_documents: bool = Field(True, description="False: learned documents are recognised until the server "
                                                       "stops only (the file is neither read nor written)")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Flags (init arguments) over environment; no dotenv or secrets files."""
        return (init_settings, env_settings)

    @property
    def learned_documents_path(self) -> Path | None:
        """The learned documents' file, or None when they are not kept across restarts."""
        if not self.remember_documents:
            return None
        return (self.learned_documents or default_learned_documents_file()).expanduser()

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` these settings describe.

        Raises:
            InvalidRequestError: a value the engine refuses.
        """
        try:
            return EngineConfig(
                model=self.model, dtype=self.dtype, threads=self.threads, policy=self.policy, reuse=self.reuse,
                device_budget_bytes=self.device_mib * MiB, host_budget_bytes=self.host_mib * MiB, host_commit=self.host_commit,
                disk_dir=self.disk_dir, disk_budget_bytes=self.disk_budget_mib * MiB, remote_url=self.remote_url,
                max_batch_size=self.max_batch_size, max_batch_tokens=self.max_batch_tokens,
            )
        except ValidationError as exc:
            raise InvalidRequestError(f"invalid engine configuration: {validation_message(exc)}") from None


class _MappingSource(PydanticBaseSettingsSource):
    """Settings from a mapping (a config file's contents): the lowest-priority source."""

    def __init__(self, settings_cls: type[BaseSettings], values: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self._values = dict(values)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def validation_message(exc: ValidationError) -> str:
    """A pydantic ``ValidationError`` on one line: ``field: message; field: message``."""
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'settings'}: {e.get('msg', '')}"
                     for e in exc.errors())


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in a ``.toml`` or ``.json`` file (flat keys; ``-`` in a key read as ``_``).

    Raises:
        InvalidRequestError: missing or unreadable file, bad syntax, not a table/object, unknown keys.
    """
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequestError(f"config file {path} is not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"config file {path} must hold a table of settings")
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - set(ServerSettings.model_fields))
    if unknown:
        raise InvalidRequestError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(ServerSettings.model_fields)}")
    return values


def load_settings(config_file: Path | None = None, **flags: Any) -> ServerSettings:
    """Settings from ``flags`` (None = not given) over ``RAGCACHE_*`` variables over ``config_file``.

    Raises:
        InvalidRequestError: an unreadable config file or any invalid value (message names the field).
    """
    file_values = read_config_file(config_file) if config_file is not None else {}

    class _Layered(ServerSettings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                       file_secret_settings):
            return (init_settings, env_settings, _MappingSource(settings_cls, file_values))

    try:
        layered = _Layered(**{k: v for k, v in flags.items() if v is not None})
        return ServerSettings.model_validate(
            {name: getattr(layered, name) for name in ServerSettings.model_fields})
    except ValidationError as exc:
        raise InvalidRequestError(f"invalid setting: {validation_message(exc)}") from None
