"""Alias kept for the public API: ``ragcache_backend.sampling`` is ``ragcache_backend.model.sampling``."""

import sys

from ragcache_backend.model import sampling as _target

sys.modules[__name__] = _target
