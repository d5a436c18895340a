"""Memory read right after an idle second, against warm (scratch script of 2026-11-28, 2-core Xeon
KVM guest, kernel 6.18 "fc"): .venv/bin/python docs/benchmarks/2026-11-28-idle-fairness/idle_read.py

Printed that day (no page faults counted in the guest either way, THP madvise):
256 MB sum: warm 13.2 ms, after 1 s idle 58.0 ms, again 13.7; 10 x 4 MB sums warm 1.33 after idle 7.72
256 MB sum: warm 13.9 ms, after 1 s idle 76.3 ms, again 14.2; 10 x 4 MB sums warm 1.57 after idle 10.94
256 MB sum: warm 13.9 ms, after 1 s idle 67.8 ms, again 16.7; 10 x 4 MB sums warm 1.42 after idle 8.37
"""
import time, torch
torch.set_num_threads(2)
big = torch.ones(64 << 20)  # 256 MB
small = torch.ones(1 << 20)  # 4 MB
def t(f):
    a = time.perf_counter(); f(); return 1e3 * (time.perf_counter() - a)
for trial in range(3):
    big.sum(); warm = t(lambda: big.sum())
    time.sleep(1.0); cold = t(lambda: big.sum()); again = t(lambda: big.sum())
    small.sum(); ws = t(lambda: [small.sum() for _ in range(10)])
    time.sleep(1.0); cs = t(lambda: [small.sum() for _ in range(10)])
    print(f"256 MB sum: warm {warm:.1f} ms, after 1 s idle {cold:.1f} ms, again {again:.1f}; 10 x 4 MB sums warm {ws:.2f} after idle {cs:.2f}")
