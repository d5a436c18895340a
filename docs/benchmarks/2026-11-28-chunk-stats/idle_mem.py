import time, torch, statistics
torch.set_num_threads(2)
buf = torch.ones(270 << 20, dtype=torch.uint8).view(torch.float32)
small = torch.randn(256, 256)
def read(): t = time.perf_counter(); buf.sum(); return time.perf_counter() - t
def compute():
    t = time.perf_counter()
    for _ in range(200): small @ small
    return time.perf_counter() - t
for sleep in (0.0, 0.3, 1.0, 2.0, 0.0):
    r, c = [], []
    for rep in range(4):
        time.sleep(sleep); r.append(read())
        time.sleep(sleep); c.append(compute())
    print(f"sleep {sleep}: read 270MB {statistics.median(r)*1e3:.0f} ms ({[round(x*1e3) for x in r]}), compute {statistics.median(c)*1e3:.0f} ms ({[round(x*1e3) for x in c]})", flush=True)
