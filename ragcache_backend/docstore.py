"""Alias kept for the public API: ``ragcache_backend.docstore`` is ``ragcache_backend.retrieval.docstore``."""

import sys

from ragcache_backend.retrieval import docstore as _target

sys.modules[__name__] = _target
