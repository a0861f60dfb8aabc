"""`dflash2 export`: an MLX drafter folder back in the Hugging Face layout the CUDA engines load."""

from __future__ import annotations

import sys

from dflash2_mlx.convert import export


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="MLX drafter folder -> Hugging Face layout for the CUDA engines",
        description="Write an MLX drafter back in the Hugging Face layout (names, config, safetensors) that "
        "SGLang, vLLM and the authors' PyTorch code load. Quantized drafters are written dequantized.",
    )
    p.add_argument("--mlx-path", required=True)
    p.add_argument("--hf-path", required=True)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.set_defaults(run=run)


def run(args) -> int:
    print(f"wrote {export(args.mlx_path, args.hf_path, args.dtype)}", file=sys.stderr)
    return 0
