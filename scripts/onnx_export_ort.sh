#!/usr/bin/env bash
# Exports the models of crates/stagecraft/tests/onnx_export.rs (an MLP, a CNN, a transformer block,
# If/Loop control flow) and runs them in onnxruntime, comparing every output with stagecraft's.
# onnxruntime and onnx go into a venv under the git-ignored data/ (created on first use; pip needs
# the package index). Not part of the test command: it installs Python packages.
#   STAGECRAFT_ORT_VENV=DIR   use (or create) this venv instead of data/ort-venv
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${STAGECRAFT_ORT_VENV:-data/ort-venv}"
out="data/onnx-export"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || { echo "error: cannot create a venv (install python3-venv)" >&2; exit 1; }
fi
"$venv/bin/python" -c "import onnxruntime, onnx, numpy" 2>/dev/null ||
    "$venv/bin/pip" install --quiet onnxruntime "onnx==1.22.0" numpy ||
    { echo "error: pip could not install onnxruntime (offline? point STAGECRAFT_ORT_VENV at a venv that has it)" >&2; exit 1; }
rm -rf "$out"
STAGECRAFT_ONNX_EXPORT_DIR="$PWD/$out" cargo test -q -p stagecraft --test onnx_export
"$venv/bin/python" scripts/onnx_export_ort.py "$out"
