#!/usr/bin/env bash
# Installs everything orepa, its applications and its tests need on a fresh Debian machine, into a
# virtual environment: .venv (or $OREPA_VENV), made by $PYTHON (default python3). A virtual
# environment works with a distribution's own "externally managed" Python too (PEP 668: pip refuses
# to install into it), and --system-site-packages lets it reuse a torch the interpreter already has
# (e.g. a GPU build). Idempotent: skips what is already there. Then run orepa as .venv/bin/python -m orepa.
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
VENV=${OREPA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    # Debian and Ubuntu ship the venv module separately (python3.X-venv)
    if command -v apt-get >/dev/null 2>&1; then
      ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
      (apt-get update -qq && { apt-get install -y -qq "python$ver-venv" || apt-get install -y -qq python3-venv; }) \
        >/dev/null 2>&1 || true
    fi
    "$PY" -m venv --system-site-packages "$VENV" || {
      echo "error: '$PY -m venv' cannot create $VENV; install the venv module (Debian: apt-get install python3-venv)" >&2
      exit 1
    }
  fi
fi
VPY="$VENV/bin/python"
# torch + torchvision: these pinned versions install from local disk here; elsewhere any torch>=2.4 works
if ! "$VPY" -c "import torch, torchvision" >/dev/null 2>&1; then
  "$VPY" -m pip install -q torch==2.14.1 torchvision==0.29.1
fi
"$VPY" -m pip install -q -e ".[apps,test]"
echo "set up: $VPY (run: $VPY -m orepa demo)"
