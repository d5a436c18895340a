"""Step log for serve_load.py's ragcache server (run 2026-11-29 as /tmp/steplog/sitecustomize.py, on
PYTHONPATH, so the server subprocess imports it): one line per forward step, "unix_time prompt_rows
decode_rows ms", where prompt rows are the rows of the engine's prefill inputs (a full cache hit's one
row included) and decode rows its generated tokens. RC_OLD=1 restores the runner's behaviour before
3afbc83 (a prompt's one new token runs as a prompt row) for the A/B."""
import os, time
if os.environ.get("RC_STEPLOG"):
    import ragcache_backend.model.runner as _r
    if os.environ.get("RC_OLD") == "1":
        _r.ModelRunner._as_decode = lambda self, item: item.decode
    _orig = _r.ModelRunner.forward_step
    _f = open(os.environ["RC_STEPLOG"], "a", buffering=1)
    def forward_step(self, batch, **kw):
        t = time.perf_counter()
        out = _orig(self, batch, **kw)
        dt = time.perf_counter() - t
        p = sum(len(i.new_tokens) for i in batch if not i.decode)
        d = sum(1 for i in batch if i.decode)
        _f.write(f"{time.time():.3f} {p} {d} {dt*1000:.1f}\n")
        return out
    _r.ModelRunner.forward_step = forward_step
