"""On-policy distillation: a teacher scores the student's own samples token by token.

The per-token advantage gains ``-coef * (logp_student - logp_teacher)``: a token the teacher
finds likelier than the student did is pushed up, one it finds unlikely is pushed down (the
per-token reverse-KL estimate, as a reward).
"""

from __future__ import annotations

import torch
from torch import Tensor


def distillation_advantages(
    advantages: Tensor, student_lp: Tensor, teacher_lp: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """advantages - coef * (student_lp - teacher_lp) on masked tokens; all [B, T] (or [T])."""
    if coef < 0:
        raise ValueError(f"distillation coef must be >= 0, got {coef}")
    for name, t in (("student_lp", student_lp), ("teacher_lp", teacher_lp), ("mask", mask)):
        if t.shape != advantages.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(advantages.shape)}"
            )
    gap = torch.where(mask > 0, student_lp - teacher_lp, torch.zeros_like(advantages))
    return advantages - coef * gap
