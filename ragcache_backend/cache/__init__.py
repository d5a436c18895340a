"""The cache: knowledge tree, replacement policies (PGDSF), prefill profile, block arena, tiers."""
