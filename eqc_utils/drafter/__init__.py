"""Stage 3 of the paper: the DFlash drafter (model, anchor-strict mask, two-stage training, reference
speculative decoder, vLLM serving check)."""
