"""A server that listens at once and loads its model behind: the app's service as a slot.

``ragcache serve`` binds its port and answers from the first second: ``/health`` says
``starting`` (HTTP 503) while the model loads and, on a fresh machine, its prefill profile is
measured; every API route answers 503 ``starting`` with ``Retry-After``. Once the engine is built
the slot holds the :class:`~ragcache_backend.server.service.CompletionService` and ``/health``
says ``ok``. A failure to build it (a model that does not load) stops the server with that error.
"""

from __future__ import annotations

import threading
import time

from ragcache_backend.server.errors import APIError
from ragcache_backend.server.schema import HealthResponse
from ragcache_backend.server.service import CompletionService

__all__ = ["ServiceSlot"]


class ServiceSlot:
    """The app's service, present at once (an app over a built engine) or once built.

    Args:
        service: the service when the engine is already built; None while it is being built.
        model: the name ``/health`` reports while starting.
    """

    def __init__(self, service: CompletionService | None = None, *, model: str = "") -> None:
        self._service = service
        self._model = model
        self._draining = False
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self.failure: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self._service is not None

    def get(self) -> CompletionService:
        """The service.

        Raises:
            APIError: 503 ``starting`` while the engine is being built (``shutting_down`` once draining)."""
        service = self._service
        if service is None:
            if self._draining:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            raise APIError(503, f"the server is starting: loading {self._model or 'the model'} "
                                f"({time.monotonic() - self._started:.0f} s so far); retry shortly",
                           type="server_error", code="starting")
        return service

    def set(self, service: CompletionService) -> None:
        """The engine is built: serve. A drain begun while starting carries over."""
        with self._lock:
            self._service = service
            if self._draining:
                service.begin_drain()

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True
            if self._service is not None:
                self._service.begin_drain()

    def health(self) -> HealthResponse:
        """``/health``: the service's, or ``starting`` (nothing in flight) while it is built."""
        if self._service is not None:
            return self._service.health()
        return HealthResponse(status="draining" if self._draining else "starting", model=self._model,
                              in_flight=0, waiting=0, running=0)
