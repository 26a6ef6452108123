"""Stage 2 of the paper: the INT4 target.

grid     modelopt INT4 weight quantisers on the modules the paper quantises, pinned to a fixed grid
ptq      the INT4 init: AWQ through modelopt (tiny/small) or a published compressed-tensors pack (paper)
kl       per-token forward KL(teacher || student), chunked over the sequence
qad      quantisation-aware distillation: data packing, the training loop, evaluation, checkpoints
pack_ct  compressed-tensors pack-quantized W4A16 export + the dense dequantised twin
"""
