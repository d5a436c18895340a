"""The host-arena copy alone, in a process of its own (2026-11-27 02:1x UTC, Zen 5): 27 blocks of 30 layers x 24 KiB
copied into a 1,456-slot arena right after touching it, then after 240 s idle, then again (python coldmem.py 240)."""
import numpy as np, time, sys
L=30; row=24576; slots=1456; nb=4096
arena=[np.zeros((slots,row),dtype=np.uint8) for _ in range(L)]
for a in arena: a[:] = 1   # touch every page now
src=[np.random.randint(0,255,(nb,row),dtype=np.uint8) for _ in range(L)]
def copy(s0, n=27):
    t=time.perf_counter()
    for i in range(L): arena[i][s0:s0+n]=src[i][100:100+n]
    return (time.perf_counter()-t)/n*1e6
print("right after touch, us/block:", ["%.0f"%copy(s) for s in range(0, 270, 27)], flush=True)
wait=float(sys.argv[1])
time.sleep(wait)
print(f"after {wait:.0f} s idle, untouched since: ", ["%.0f"%copy(s) for s in range(300, 570, 27)], flush=True)
print("same slots again:", ["%.0f"%copy(s) for s in range(300, 570, 27)], flush=True)
