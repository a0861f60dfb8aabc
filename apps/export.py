"""`dflash2 export`: an MLX drafter folder back in the Hugging Face layout the CUDA engines load."""

from __future__ import annotations

import json
import sys

from dflash2_mlx.convert import export, export_for
from dflash2_mlx.formats import serving


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="MLX drafter folder -> Hugging Face layout for the CUDA engines",
        description="Write an MLX drafter back in the Hugging Face layout (names, config, safetensors) that "
        "SGLang, vLLM and the authors' PyTorch code load. Quantized drafters are written dequantized. With "
        "--for sglang|vllm, the folder is the one that engine serves as a DFlash / DFlash 2 drafter "
        "(bfloat16, the whole vocabulary, the selector's tables expanded; what it would run differently is "
        "refused).",
    )
    p.add_argument("--mlx-path", required=True)
    p.add_argument("--hf-path", required=True)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default bfloat16")
    p.add_argument(
        "--for",
        dest="engine",
        choices=sorted(serving.ENGINES),
        default=None,
        help="write the folder this engine serves (its architecture names and dflash_config fields)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="with --for: the target (mlx-lm folder, hub id or GGUF file); needed to expand a factorised "
        "selector and where the drafter leaves its vocabulary or logit settings to the target",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    if args.engine is None:
        if args.model is not None:
            raise ValueError("--model is for --for sglang|vllm exports; a plain export needs no target")
        print(f"wrote {export(args.mlx_path, args.hf_path, args.dtype or 'bfloat16')}", file=sys.stderr)
        return 0
    if args.dtype not in (None, serving.DTYPE):
        raise ValueError(
            f"--for {args.engine} writes {serving.DTYPE} (what the engines serve); drop --dtype "
            f"{args.dtype}, or export without --for"
        )
    out = export_for(args.mlx_path, args.hf_path, args.engine, args.model)
    block = json.loads((out / "config.json").read_text())["dflash_config"]["block_size"]
    print(f"wrote {out}; serve it with:\n  {serving.launch_command(args.engine, out, block)}", file=sys.stderr)
    return 0
