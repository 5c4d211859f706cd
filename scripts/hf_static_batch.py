"""The "HF naive" baseline: Hugging Face transformers ``generate`` on one static batch of the bundled GGUF model
(prompts of equal length, greedy, no early stop), timed per decode step. Same shapes as
``python -m reference_server.bench_engine`` (prompt 32 tokens, output 128), so their ms/step compare.

    python scripts/hf_static_batch.py --batch 64 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from reference_server.model_files import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = p.parse_args()
    path = default_model_path()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model = model.to(args.device).eval()
    print(f"transformers {transformers.__version__}, device {args.device}, dtype {dtype}")
    for b in args.batch:
        ids = torch.tensor([[(7 * i + j) % 4000 + 100 for j in range(args.prompt_tokens)] for i in range(b)],
                           device=args.device)
        times = []
        for n in (1, args.output_tokens + 1):  # prefill + first token, then the whole run: the difference is decode
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step = (times[1] - times[0]) / args.output_tokens
        print(f"batch {b:3d}: {b / step:8.1f} output tok/s in decode, {step * 1000:6.2f} ms/step")


if __name__ == "__main__":
    main()
