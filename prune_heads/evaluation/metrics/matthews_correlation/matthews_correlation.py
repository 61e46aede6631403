"""Matthews correlation coefficient, multi-class (local evaluate module)."""

import datasets
import evaluate
import numpy as np


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Matthews correlation coefficient (Gorodkin's multi-class form).",
            citation="",
            inputs_description="predictions, references: class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        labels = np.unique(np.concatenate([predictions, references]))
        index = {label: i for i, label in enumerate(labels)}
        confusion = np.zeros((len(labels), len(labels)))
        for p, r in zip(predictions, references):
            confusion[index[r], index[p]] += 1
        t, p = confusion.sum(1), confusion.sum(0)
        c, s = np.trace(confusion), confusion.sum()
        denominator = np.sqrt((s**2 - (p**2).sum()) * (s**2 - (t**2).sum()))
        return {"matthews_correlation": float((c * s - (t * p).sum()) / denominator) if denominator else 0.0}
