#!/usr/bin/env bash
# Installs everything orepa, its applications and its tests need on a fresh Debian machine.
# Idempotent: skips what is already there. Keeps an existing torch (e.g. a GPU build).
set -euo pipefail
cd "$(dirname "$0")/.."

# Fashion-MNIST, the embedded default data (Debian package, no download at run time)
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
      || echo "warning: could not install dataset-fashion-mnist; the demo needs it" >&2
  fi
fi

PY=${PYTHON:-python3}
# torch + torchvision: these pinned versions install from local disk here; elsewhere any torch>=2.4 works
if ! "$PY" -c "import torch, torchvision" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.14.1 torchvision==0.29.1
fi
"$PY" -m pip install -q -e ".[apps,test]"
