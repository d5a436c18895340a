import time, torch, statistics, threading
torch.set_num_threads(2)
buf = torch.ones(270 << 20, dtype=torch.uint8)
pages = buf[::4096]
def read(): t = time.perf_counter(); buf.view(torch.float32).sum(); return time.perf_counter() - t
def sweep():
    t = time.perf_counter(); pages.sum(); return time.perf_counter() - t
for period in (None, 0.5, 0.25, 0.1, 0.05):
    r, sw = [], []
    for rep in range(4):
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            if period is None: time.sleep(t_end - time.perf_counter()); break
            sw.append(sweep()); time.sleep(period)
        r.append(read())
    print(f"period {period}: read after 1 s idle {statistics.median(r)*1e3:.0f} ms {[round(x*1e3) for x in r]}; sweep median {statistics.median(sw)*1e3 if sw else 0:.1f} ms max {max(sw)*1e3 if sw else 0:.1f}", flush=True)
