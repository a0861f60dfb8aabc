#!/usr/bin/env bash
# Train a drafter for a wall-clock budget, here or on a machine with an NVIDIA GPU, resumably:
#
#   bash apps/train_budget.sh DATA OUT MINUTES [dflash2 train flags ...]
#
# DATA is a `dflash2 data` folder (its features-*/ cache travels with it when already computed; otherwise
# it is computed there first, much faster on a GPU), OUT the run folder. The run stops after MINUTES with a
# checkpoint in OUT/checkpoint (float32 safetensors + the step log); copy OUT back and the same
# `dflash2 train --data DATA --out OUT ...` command continues it on any machine, CPU or GPU, bit for bit
# where the backend's arithmetic allows. On a machine with nvidia-smi, MLX's CUDA backend is installed
# first (same MLX version) and checked to be the one running.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: bash apps/train_budget.sh DATA OUT MINUTES [dflash2 train flags ...]" >&2
  exit 2
fi
data=$1 out=$2 minutes=$3
shift 3

bash apps/install.sh  # into .venv (returns at once when it is installed already)
py=.venv/bin/python
if command -v nvidia-smi >/dev/null 2>&1; then
  cuda() { "$py" -c "import mlx.core as mx, sys; sys.exit(0 if mx.cuda.is_available() else 1)" 2>/dev/null; }
  if ! cuda; then
    version=$("$py" -c "import importlib.metadata as m; print(m.version('mlx'))")
    "$py" -m pip install -q "mlx[cuda12]==${version}"
  fi
  cuda || { echo "nvidia-smi sees a GPU but MLX's CUDA backend does not load ($py -m pip install 'mlx[cuda12]')" >&2
             exit 1; }
  "$py" -c "import mlx.core as mx; print('training on', mx.default_device(), file=__import__('sys').stderr)"
fi
exec .venv/bin/dflash2 train --data "$data" --out "$out" --time-budget "$minutes" "$@"
