"""Training P-EAGLE drafters and EAGLE-3 heads (SPEC.md §8); the CLI is ``peagle train``.

Modules, one job each:

* :mod:`~peagle.train.corpus` — text / JSONL documents → token sequences, resumable order.
* :mod:`~peagle.train.target_features` — online target forward: 3 auxiliary hidden states and
  the target distribution; :class:`~peagle.train.layout.ShiftedSequence` (EAGLE shift, §8.1).
* :mod:`~peagle.train.cod` — COD sampling of the N×K layout (§8.4).
* :mod:`~peagle.train.layout` — per-element inputs of the N×K layout (§8.2).
* :mod:`~peagle.train.mask` — the attention rule (§8.3): dense, chunked and FlexAttention forms.
* :mod:`~peagle.train.partition` — sequence partitioning, paper Algorithm 1 (§8.5).
* :mod:`~peagle.train.forward` — the drafter forward under an element mask.
* :mod:`~peagle.train.loss` — soft-label loss against the target distribution (§8.6).
* :mod:`~peagle.train.steps` — one sequence's forward/backward (P-EAGLE, EAGLE-3 TTT).
* :mod:`~peagle.train.init` — a fresh drafter for a target; draft vocabulary (``d2t``/``t2d``).
* :mod:`~peagle.train.trainer` — the loop: optimiser, schedule, checkpoints, resume, progress.
"""
