"""Write the benchmark's model files from the default GGUF (SmolLM2-135M-Instruct Q4_1).

Outputs (under ``--out``, default ``benchmarks/models``):

* ``smollm2-135m-bf16/`` - a Hugging Face folder in bfloat16: the Q4_1 GGUF dequantised by
  transformers, cast to bf16, saved with ``save_pretrained`` (``hf_quantizer`` and
  ``quantization_config`` cleared first). ragcache and vLLM load this folder.
* ``smollm2-135m-bf16.gguf`` - the same weights for llama.cpp: every tensor of the original
  GGUF dequantised (``gguf.quants.dequantize``) and rounded to bf16, written as BF16 (matrices)
  or F32 holding the bf16-rounded values (norm vectors), in llama.cpp's own tensor layout; all
  metadata (tokenizer, chat template, hyper-parameters) copied, file type set to MOSTLY_BF16.
  Because bf16 rounding is element-wise, this is bit-for-bit the weights of the HF folder (the
  Q/K row permutation llama.cpp uses is a pure re-ordering). ``--check`` verifies that claim.

Usage: ``.venv/bin/python benchmarks/convert_model.py [--out DIR] [--check]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent


def convert_hf(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragcache_backend.model.loader import default_model_path

    gguf_path = default_model_path()
    target = out / "smollm2-135m-bf16"
    if (target / "config.json").exists():
        return target
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = model.to(torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.torch_dtype = torch.bfloat16
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    return target


def convert_gguf(out: Path) -> Path:
    import numpy as np
    import gguf
    import torch

    from ragcache_backend.model.loader import default_model_path

    target = out / "smollm2-135m-bf16.gguf"
    if target.exists():
        return target
    reader = gguf.GGUFReader(default_model_path())
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(target) + ".part", arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        bf = torch.from_numpy(data).to(torch.bfloat16)
        if data.ndim >= 2:
            raw = bf.view(torch.int16).numpy().view(np.uint8)
            tensors.append((t.name, raw, gguf.GGMLQuantizationType.BF16, shape))
        else:
            tensors.append((t.name, bf.float().numpy(), gguf.GGMLQuantizationType.F32, shape))
    for name, arr, qtype, shape in tensors:
        if qtype == gguf.GGMLQuantizationType.BF16:
            writer.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(target) + ".part", target)
    return target


def check(hf_dir: Path, gguf_file: Path) -> None:
    """Load both outputs with transformers and compare every weight exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.bfloat16)
    b = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, torch_dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    worst = 0.0
    for k, v in sa.items():
        w = sb[k].to(torch.bfloat16)
        worst = max(worst, float((v.float() - w.float()).abs().max()))
    print(f"max |hf_bf16 - gguf_bf16| over {len(sa)} tensors: {worst}")
    if worst != 0.0:
        sys.exit("the two model files do not hold the same weights")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "models")
    ap.add_argument("--check", action="store_true", help="verify that both files hold identical weights")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf = convert_hf(args.out)
    print("HF bf16 folder:", hf)
    gg = convert_gguf(args.out)
    print("bf16 GGUF:", gg)
    if args.check:
        check(hf, gg)


if __name__ == "__main__":
    main()
