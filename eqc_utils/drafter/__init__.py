"""Stage 3 of the paper: the DFlash drafter (model, anchor-strict mask with an optional sliding window,
two-stage training, reference speculative decoder, vLLM serving check) and stage 08's W4A16 GPTQ of it
(`quantize`, on the model-agnostic `eqc_utils.quant.gptq`)."""
