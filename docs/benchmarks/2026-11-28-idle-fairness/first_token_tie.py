"""The one cold prompt of forward_vs_vllm.py (seed 0, with the warm-up passes' ids) whose greedy first
token differs between ours and vLLM (387 / 332 in both runs): a near-tie. Printed that day:
ours bf16 top3 [387, 332, 2432] [27.875, 27.75, 27.25]
transformers fp32 top3 [387, 332, 2432] [27.7532, 27.7229, 27.1738]
(ours agrees with the float32 reference; vLLM's bf16 took the runner-up, 0.03 behind).
"""
import random, sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from forward_vs_vllm import MODEL_DIR
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner
loaded = load_model(str(MODEL_DIR), dtype="bfloat16")
vocab = loaded.model.config.vocab_size
rng = random.Random(0)
ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]
colds = []
for rnd in range(-1, 5):
    colds.append(ids(1000)); ids(1000)
    ids(1024); ids(30)
    for b in (1, 4, 8, 16):
        for _ in range(b): ids(1024)
p = colds[3]
r = ModelRunner(loaded, num_device_blocks=80, block_size=16)
lg = r.forward([ForwardInput(tuple(p), (), (KVRun(tuple(range(63)), 0, 1000),))])[0]
top = torch.topk(lg, 3)
print("ours bf16 top3", top.indices.tolist(), [round(x, 4) for x in top.values.tolist()], "logit[332]", round(float(lg[332]), 4), "logit[387]", round(float(lg[387]), 4))
m = load_model(str(MODEL_DIR), dtype="float32").model
with torch.inference_mode():
    ref = m(torch.tensor([p])).logits[0, -1]
t = torch.topk(ref, 3)
print("transformers fp32 top3", t.indices.tolist(), [round(x, 4) for x in t.values.tolist()])
for i, c in enumerate(colds[:6]):
    print(i, c[:3])
