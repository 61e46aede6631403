"""F1 score: binary (of pos_label), or macro / micro / weighted over classes (local evaluate module)."""

import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Harmonic mean of precision and recall.",
            citation="",
            inputs_description="predictions, references: class ids; average: binary, macro, micro or weighted",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        predictions, references = np.asarray(predictions), np.asarray(references)

        def f1_of(label):
            tp = np.sum((predictions == label) & (references == label))
            fp = np.sum((predictions == label) & (references != label))
            fn = np.sum((predictions != label) & (references == label))
            return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)

        if average == "binary":
            return {"f1": float(f1_of(pos_label))}
        labels = np.unique(np.concatenate([predictions, references]))
        if average == "micro":
            return {"f1": float(np.mean(predictions == references))}
        scores = np.array([f1_of(label) for label in labels])
        if average == "macro":
            return {"f1": float(scores.mean())}
        if average == "weighted":
            support = np.array([np.sum(references == label) for label in labels])
            return {"f1": float((scores * support).sum() / support.sum())}
        raise ValueError(f"average must be binary, macro, micro or weighted, not {average!r}")
