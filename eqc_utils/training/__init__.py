"""The skeleton both training loops stand on (QAD: eqc_utils.quant.qad; the drafter: eqc_utils.drafter.train):
the learning-rate schedule, the step-indexed JSONL logs, the checkpoint layout and the resume rule. The loops
keep only what is theirs: models, data, the loss, and what their checkpoints export."""
from eqc_utils.training.checkpoints import CheckpointDir, ResumePlan, estimated_bytes, plan_resume
from eqc_utils.training.log import JsonlLog
from eqc_utils.training.schedule import apply_schedule, warmup_cosine

__all__ = ["CheckpointDir", "JsonlLog", "ResumePlan", "apply_schedule", "estimated_bytes", "plan_resume",
           "warmup_cosine"]
