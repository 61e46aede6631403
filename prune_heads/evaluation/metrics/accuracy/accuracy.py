"""Accuracy: the fraction of predictions equal to their references (local evaluate module)."""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions, references: lists of class ids; optional sample_weight",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        return {"accuracy": float((correct * weights).sum() / weights.sum())}
