"""Settings of the vLLM connector: the names and defaults of ``ragcache serve``'s cache settings.

Read, in order of precedence, from the ``kv_connector_extra_config`` of vLLM's
``--kv-transfer-config``, then ``RAGCACHE_*`` environment variables, then the defaults, so the
connector works with no extra config at all (a host tier of 2 GiB and a disk tier of 4 GiB under
``$RAGCACHE_HOME/kv``, as ``ragcache serve``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragcache_backend.errors import InvalidRequestError

__all__ = ["ConnectorSettings", "settings_from_extra_config"]

MiB = 1 << 20


class ConnectorSettings(BaseSettings):
    """The connector's cache settings (same names, meanings and defaults as ``ragcache serve``).

    Attributes:
        policy: replacement policy of the host and disk tiers (RAGCache §5.1; PGDSF by default).
        host_mib: host tier budget, MiB (0: no host tier).
        cache_dir: disk tier folder; None = ``$RAGCACHE_HOME/kv``.
        disk_cache: False disables the disk tier.
        disk_budget_mib: disk tier budget, MiB.
        remote_url: Redis URL of the remote tier shared by replicas; None: none.
    """

    model_config = SettingsConfigDict(env_prefix="RAGCACHE_", extra="forbid", frozen=True)

    policy: Literal["pgdsf", "gdsf", "lru", "lfu"] = Field("pgdsf", description="cache replacement policy")
    host_mib: int = Field(2048, ge=0, description="host tier budget, MiB (0 disables it)")
    cache_dir: Path | None = Field(None, description="disk tier folder; None = ragcache_home()/kv")
    disk_cache: bool = Field(True, description="False disables the disk tier")
    disk_budget_mib: int = Field(4096, ge=0, description="disk tier budget, MiB")
    remote_url: str | None = Field(None, description="Redis URL of the remote tier shared by replicas "
                                                     "(redis://host:port/db); None = no remote tier")

    @property
    def host_bytes(self) -> int:
        """The host tier's budget in bytes."""
        return self.host_mib * MiB

    @property
    def disk_enabled(self) -> bool:
        """Whether the disk tier is on (enabled and a budget above 0)."""
        return self.disk_cache and self.disk_budget_mib > 0

    def disk_root(self) -> Path:
        """The disk tier's folder: ``cache_dir`` or ``$RAGCACHE_HOME/kv``."""
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        from ragcache_backend.config import default_disk_dir  # pydantic only; cheap

        return default_disk_dir()


def settings_from_extra_config(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Settings from vLLM's ``kv_connector_extra_config`` over ``RAGCACHE_*`` variables and defaults.

    Raises:
        InvalidRequestError: an unknown key or a bad value (the message names it and lists the keys).
    """
    try:
        return ConnectorSettings(**dict(extra or {}))
    except ValidationError as exc:
        keys = ", ".join(ConnectorSettings.model_fields)
        raise InvalidRequestError(f"ragcache connector: bad kv_connector_extra_config ({exc.errors()[0]['loc']}: "
                                  f"{exc.errors()[0]['msg']}); its keys: {keys}") from None
