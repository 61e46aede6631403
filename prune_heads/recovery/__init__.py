"""Retraining-free recovery after removal, each step decided on held-out calibration data.

`gated` (the unpruned model with gates and added biases, where candidates are tried without a copy),
`holdout` (the held-out split and the one-standard-error rule), `tuning` (head scales and output biases
tuned to the unpruned outputs), `reconstruction` (least-squares fits of what the removed heads wrote),
`search` (a plan chosen by measured removals, in rounds), `prefixes` (the plans along one nested order of
units, and the deepest a bound allows), `candidates`, `generated` (the model's own written text) and
`sharing_statistics` (what shared KV heads would give, recorded so that any sharing of a layer is refitted in
closed form).
"""

from .reconstruction import reconstruct
from .tuning import tune_gates

__all__ = ["reconstruct", "tune_gates"]
