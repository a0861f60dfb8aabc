"""`dflash2 convert`: a Hugging Face / CUDA drafter (or a GGUF target) to an MLX folder."""

from __future__ import annotations

import sys

from dflash2_apps import common
from dflash2_mlx.convert import convert
from dflash2_mlx.formats.gguf import convert_gguf
from dflash2_mlx.formats.quantize import DraftQuant


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="Hugging Face / CUDA drafter (or GGUF target) -> MLX folder",
        description="Convert a DFlash v1 / DFlash 2 / Muse-style drafter in the Hugging Face layout (the one "
        "the CUDA engines use) to an MLX folder, optionally quantized; or a GGUF target to an mlx-lm folder.",
    )
    p.add_argument("--hf-path", required=True, help="drafter folder, hub id, or a .gguf target file")
    p.add_argument("--mlx-path", required=True, help="output folder")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "float16"],
        help="weights dtype (drafters: default bfloat16; GGUF: default keeps quantized tensors)",
    )
    p.add_argument("--force-float16", action="store_true", help="allow a float16 drafter (NaN-prone)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the drafter (mlx-lm format)")
    q = DraftQuant()
    p.add_argument("--q-bits", type=int, default=q.bits, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--q-group-size", type=int, default=q.group_size, choices=[32, 64, 128])
    p.add_argument(
        "--activation-bits",
        type=int,
        default=q.activation_bits,
        choices=[16, 32],
        help="compute dtype of the quantized drafter at run time: 16 = bfloat16, 32 = float32",
    )
    common.add_draft_vocab_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    if args.hf_path.endswith(".gguf"):
        if args.quantize:
            raise ValueError("-q applies to drafters; a GGUF target keeps its own quantization (or --dtype)")
        out = convert_gguf(args.hf_path, args.mlx_path, args.dtype)
    else:
        quant = DraftQuant(args.q_bits, args.activation_bits, args.q_group_size) if args.quantize else None
        out = convert(
            args.hf_path,
            args.mlx_path,
            args.dtype or "bfloat16",
            quant,
            args.force_float16,
            draft_vocab=args.draft_vocab,
            vocab_counts=args.draft_vocab_counts,
        )
    print(f"wrote {out}", file=sys.stderr)
    return 0
