"""Per-token mask time of the two constrained-decoding libraries vLLM uses, llguidance and xgrammar,
over SmolLM2's tokenizer and one small JSON Schema (the choice behind ragcache_backend/model/grammar.py).

    benchmarks/.venv-vllm/bin/python benchmarks/grammar_backends.py benchmarks/models/smollm2-135m-bf16

Run in the vLLM venv (bash benchmarks/setup_peers.sh vllm), which has both libraries. Each library
runs twice, alternating; the first llguidance run includes its torch.compile of the mask kernel
(ragcache unpacks the mask with numpy instead).
"""
import json, time, statistics, sys
import torch
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"], "additionalProperties": False}
answer = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]})
ids = tok.encode(answer, add_special_tokens=False)
V = len(tok)
def run_llg():
    import llguidance, llguidance.hf, llguidance.torch as lt
    t0 = time.perf_counter(); lltok = llguidance.hf.from_tokenizer(tok, V); t_tok = time.perf_counter() - t0
    t0 = time.perf_counter(); m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema)); t_c = time.perf_counter() - t0
    bm = lt.allocate_token_bitmask(1, lltok.vocab_size); logits = torch.randn(1, V)
    ts = []
    for t in ids:
        t0 = time.perf_counter(); lt.fill_next_token_bitmask(m, bm, 0); lt.apply_token_bitmask_inplace(logits, bm); ts.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_c, ts
def run_xgr():
    import xgrammar as xgr
    t0 = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); comp = xgr.GrammarCompiler(info); t_tok = time.perf_counter() - t0
    t0 = time.perf_counter(); g = comp.compile_json_schema(json.dumps(schema)); m = xgr.GrammarMatcher(g); t_c = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, info.vocab_size); logits = torch.randn(1, V)
    ts = []
    for t in ids:
        t0 = time.perf_counter(); m.fill_next_token_bitmask(bm, 0); xgr.apply_token_bitmask_inplace(logits, bm); ts.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return t_tok, t_c, ts
for name, fn in (("llguidance", run_llg), ("xgrammar", run_xgr), ("llguidance", run_llg), ("xgrammar", run_xgr)):
    t_tok, t_c, ts = fn()
    print(f"{name:11s} tokenizer {t_tok*1e3:7.1f} ms  compile {t_c*1e3:7.2f} ms  mask per token median {statistics.median(ts)*1e6:7.0f} us  max {max(ts)*1e6:7.0f} us  ({len(ts)} tokens)")
