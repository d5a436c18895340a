# The A/B of 3afbc83 (2026-11-29 19:11-19:29 UTC, Zen 3): the same tree, the runner's one-row rule on (new)
# and off (old, RC_OLD=1 in step_log_sitecustomize.py, there as /tmp/steplog/sitecustomize.py), alternating.
cd /work/main
for r in 1 2; do for v in new old; do
  o=0; [ $v = old ] && o=1
  rm -f /tmp/ab_$v$r.log
  PYTHONPATH=/tmp/steplog RC_STEPLOG=/tmp/ab_$v$r.log RC_OLD=$o timeout 900 .venv/bin/python benchmarks/serve_load.py --clients 200 --max-tokens 16 --servers ragcache --bursts 2 --json /tmp/ab_$v$r.json > /tmp/ab_$v$r.out 2>&1
  echo "$v$r done $(date)"
done; done
