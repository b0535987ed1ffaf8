"""Evaluation metrics: BLEU/chrF (sacrebleu), exact match, accuracy, macro-F1, entity-level F1."""

from __future__ import annotations

import math


def perplexity(nll_per_token: float) -> float:
    """exp(mean NLL), capped so a diverged model reports inf instead of overflowing."""
    return math.exp(nll_per_token) if nll_per_token < 700 else math.inf


def translation_scores(hypotheses: list[str], references: list[str], *,
                       bleu_tokenize: str = "auto") -> dict[str, float | str]:
    """Corpus BLEU and chrF (sacrebleu) and exact match (in percent), plus the BLEU tokenizer used.

    `bleu_tokenize` is sacrebleu's tokenizer: "13a" (its default), "char" for one-word references
    such as German compound numbers (word 4-grams do not exist there, so word BLEU is always 0),
    or "auto": "char" when most references are one word, else "13a".
    """
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    if bleu_tokenize == "auto":
        one_word = sum(len(r.split()) <= 1 for r in references)
        bleu_tokenize = "char" if references and one_word > len(references) / 2 else "13a"
    if not references:
        return {"bleu": 0.0, "chrf": 0.0, "exact_match": 0.0, "bleu_tokenize": bleu_tokenize}
    bleu = sacrebleu.corpus_bleu(hypotheses, [references], tokenize=bleu_tokenize)
    chrf = sacrebleu.corpus_chrf(hypotheses, [references])
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references))
    return {"bleu": bleu.score, "chrf": chrf.score, "exact_match": 100.0 * exact / len(references),
            "bleu_tokenize": bleu_tokenize}


def accuracy_and_macro_f1(predictions: list[int], labels: list[int], num_labels: int) -> dict[str, float]:
    """Accuracy and the unweighted mean of per-class F1 over classes that occur (in percent)."""
    if not labels:
        return {"accuracy": 0.0, "macro_f1": 0.0}
    correct = sum(p == t for p, t in zip(predictions, labels))
    f1s = []
    for c in range(num_labels):
        tp = sum(p == c and t == c for p, t in zip(predictions, labels))
        fp = sum(p == c and t != c for p, t in zip(predictions, labels))
        fn = sum(p != c and t == c for p, t in zip(predictions, labels))
        if tp + fp + fn == 0:
            continue
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": 100.0 * correct / len(labels), "macro_f1": 100.0 * sum(f1s) / max(len(f1s), 1)}


def entity_spans(tags: list[str]) -> set[tuple[int, int, str]]:
    """(start, end, type) spans of BIO/IOB tags: `B-X` opens, `I-X` continues (or opens after a mismatch)."""
    spans: set[tuple[int, int, str]] = set()
    start, kind = -1, ""
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, label = tag.partition("-")
        continues = prefix == "I" and label == kind and start >= 0
        if start >= 0 and not continues:
            spans.add((start, i, kind))
            start, kind = -1, ""
        if prefix in ("B", "I") and not continues and label:
            start, kind = i, label
    return spans


def entity_f1(predicted: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """Entity-level precision, recall and F1 (as conlleval/seqeval count them, in percent)."""
    tp = n_pred = n_gold = 0
    for index, (p, g) in enumerate(zip(predicted, gold)):
        p_spans = {(index, *s) for s in entity_spans(p)}
        g_spans = {(index, *s) for s in entity_spans(g)}
        tp += len(p_spans & g_spans)
        n_pred += len(p_spans)
        n_gold += len(g_spans)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_precision": 100 * precision, "entity_recall": 100 * recall, "entity_f1": 100 * f1}
