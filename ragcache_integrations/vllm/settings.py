"""Settings of the vLLM connector: ``ragcache serve``'s cache settings, the same class.

Read, in order of precedence, from the ``kv_connector_extra_config`` of vLLM's
``--kv-transfer-config``, then ``RAGCACHE_*`` environment variables, then the defaults, so the
connector works with no extra config at all (a host tier of 2 GiB and a disk tier of 4 GiB under
``$RAGCACHE_HOME/kv``, as ``ragcache serve``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ragcache_backend.config import MiB
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.server.settings import CacheSettings

__all__ = ["ConnectorSettings", "check_world_size", "settings_from_extra_config"]


class ConnectorSettings(CacheSettings):
    """The connector's settings: :class:`~ragcache_backend.server.settings.CacheSettings` (``policy``,
    ``host_mib``, ``cache_dir``, ``disk_cache``, ``disk_budget_mib``, ``remote_url``), read as
    ``ragcache serve`` reads them."""

    @property
    def host_bytes(self) -> int:
        """The host tier's budget in bytes."""
        return self.host_mib * MiB

    @property
    def disk_enabled(self) -> bool:
        """Whether the disk tier is on (enabled and a budget above 0)."""
        return self.disk_dir is not None and self.disk_budget_mib > 0


def check_world_size(tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse more than one worker: each would hold part of every block (its KV heads or its
    layers) under the same path key, and one rank's part would be served to another.

    Raises:
        InvalidRequestError: tensor or pipeline parallelism above 1.
    """
    if tensor_parallel != 1 or pipeline_parallel != 1:
        raise InvalidRequestError(f"RAGCacheConnector supports one vLLM worker so far (tensor_parallel_size=1, "
                                  f"pipeline_parallel_size=1); this engine has {tensor_parallel} x {pipeline_parallel}")


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
