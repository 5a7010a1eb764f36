"""Rejection sampling of drafts that a draft model sampled from its own distribution ``q``.

Leviathan et al. 2023 / Chen et al. 2023: draft ``x_j`` was drawn from ``q_j``; the target's
distribution at that row is ``p_j``. Accept ``x_j`` with probability ``min(1, p_j(x) /
q_j(x))``; on the first rejection draw the step's last token from the residual
``normalize(max(0, p_j - q_j))``; after ``k`` acceptances draw a bonus token from ``p_k``. Each
token the step yields is then distributed exactly as ``p`` (the target without speculation):
the accepted mass at ``x`` is ``q(x) min(1, p(x)/q(x)) = min(p(x), q(x))``, and the residual
brings every token up to ``p(x)``.

Unlike prompt lookup (``speculation.verify_sampled``, ``q`` one-hot, where one draw of ``p``
decides), this takes a uniform draw per draft and a residual or bonus draw at the end, so a
seeded request gets the target's distribution but not the very tokens it gets without
speculation. A rejected ``x`` has ``p(x) < q(x)``, so the residual is 0 at ``x`` and the step's
last token never equals its draft: ``speculation.accepted`` counts acceptances from the
returned tokens alone.
"""

from __future__ import annotations

import torch

from kernels_runtime.inference.sampling import draw, probabilities
from kernels_runtime.inference.sequence import Sequence


def verify_with_draft(logits: torch.Tensor, draft: list[int], q: torch.Tensor,
                      seq: Sequence) -> list[int]:
    """Rejection sampling of ``draft`` (k) drawn from ``q`` (>= k, V), against the target's
    ``logits`` (k + 1, V): ``k + 1`` tokens, the first ``a`` the accepted drafts, the next the
    residual's or the bonus, -1 past it (never drawn). Draws use ``seq.generator``."""
    out: list[int] = []
    for j, x in enumerate(draft):
        p = probabilities(logits[j], seq.params).cpu()  # (V,) float64
        qj = q[j].to(p)  # (V,)
        u = float(torch.rand((), dtype=torch.float64, generator=seq.generator))
        if u * float(qj[x]) < float(p[x]):  # probability min(1, p(x) / q(x))
            out.append(x)
            continue
        residual = (p - qj).clamp_(min=0.0)  # (V,), 0 at x: rejected only where p(x) < q(x)
        if not float(residual.sum()) > 0:  # p == q but at x (rounding): p without x
            residual = p.index_fill(0, torch.tensor([x]), 0.0)
        out.append(draw(residual, seq.generator))
        break
    else:  # every draft accepted: the bonus token from the row after the last
        out.append(draw(probabilities(logits[len(draft)], seq.params), seq.generator))
    return out + [-1] * (len(draft) + 1 - len(out))
