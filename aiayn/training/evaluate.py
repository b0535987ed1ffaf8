"""Evaluate a model on a split: loss, perplexity, token accuracy, and each objective's task metrics."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.batching import token_batches
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.training.loss import correct_count, label_smoothed_loss
from aiayn.training.metrics import accuracy_and_macro_f1, entity_f1, perplexity, translation_scores
from aiayn.training.objectives import forward, make_batch, masking_generator


@torch.no_grad()
def evaluate(model: nn.Module, data: PreparedData, split: EncodedSplit, *, max_tokens: int = 4096,
             decode: bool = True, beam_size: int = 1, length_penalty: float = 0.6, max_batches: int = 0,
             seed: int = 0, mlm_probability: float = 0.15, bf16: bool = False,
             examples: int = 0, bleu_tokenize: str = "13a") -> dict:
    """Metrics of `model` on `split` (in eval mode, no dropout).

    Returns:
        A dict with `loss` (unsmoothed NLL per token), `perplexity`, `token_accuracy` (percent), and
        for seq2seq with `decode` `bleu`, `chrf`, `exact_match`; for sequence classification
        `accuracy`, `macro_f1`; for token classification `entity_f1` (and precision, recall);
        plus `examples`: up to `examples` (input, prediction, reference) triples.
    """
    was_training = model.training
    model.eval()
    if not split.items:
        return {}
    batches = token_batches(split.lengths, max_tokens, shuffle=False)
    if max_batches:
        batches = batches[:max_batches]
    nll_sum, units, correct, counted = 0.0, 0, 0, 0
    predictions: dict[int, object] = {}
    for number, indices in enumerate(batches):
        batch = make_batch(data, split, indices, mlm_probability=mlm_probability,
                           generator=masking_generator(seed, -1, number))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, labels = forward(model, batch, data.objective)
        _, nll = label_smoothed_loss(logits, labels, smoothing=0.0)
        c, n = correct_count(logits, labels)
        nll_sum, correct, counted = nll_sum + float(nll), correct + c, counted + n
        units += n
        if data.objective == "sequence_classification":
            for i, p in zip(indices, logits.argmax(-1).tolist()):
                predictions[i] = p
        elif data.objective == "token_classification":
            for row, i in enumerate(indices):
                keep = labels[row] != -100
                predictions[i] = logits[row].argmax(-1)[keep].tolist()
        elif data.objective == "seq2seq" and decode:
            predictions.update(_decode(model, data, batch["src"], indices, beam_size, length_penalty))
    mean_nll = nll_sum / max(units, 1)
    result: dict = {"loss": mean_nll, "perplexity": perplexity(mean_nll),
                    "token_accuracy": 100.0 * correct / max(counted, 1)}
    order = sorted(predictions)
    shown: list[tuple[str, str, str]] = []
    if data.objective == "seq2seq" and decode:
        hyps = [predictions[i] for i in order]
        refs = [split.raw[i].target for i in order]
        result.update(translation_scores(hyps, refs, bleu_tokenize=bleu_tokenize))
        shown = [(split.raw[i].source, predictions[i], split.raw[i].target) for i in order]
    elif data.objective == "sequence_classification":
        gold = [split.items[i][1] for i in order]
        result.update(accuracy_and_macro_f1([predictions[i] for i in order], gold, len(data.labels)))
        shown = [(split.raw[i].text, data.labels[predictions[i]], split.raw[i].label) for i in order]
    elif data.objective == "token_classification":
        pred_tags = [[data.labels[t] for t in predictions[i]] for i in order]
        gold_tags = [list(split.raw[i].tags[: len(predictions[i])]) for i in order]
        result.update(entity_f1(pred_tags, gold_tags))
        shown = [(" ".join(split.raw[i].tokens), " ".join(p), " ".join(g))
                 for i, p, g in zip(order, pred_tags, gold_tags)]
    # Show mistakes first (up to half of the examples), then correct predictions.
    wrong = [e for e in shown if e[1].strip() != e[2].strip()][: examples // 2]
    right = [e for e in shown if e[1].strip() == e[2].strip()]
    result["examples"] = (wrong + right)[:examples] if examples else []
    model.train(was_training)
    return result


def _decode(model: nn.Module, data: PreparedData, src: torch.Tensor, indices: list[int], beam_size: int,
            length_penalty: float) -> dict[int, str]:
    from aiayn.inference.generation import GenerationConfig, generate

    tgt = data.target_tokenizer
    config = GenerationConfig(beam_size=beam_size, length_penalty=length_penalty)
    out = generate(model, src, bos_id=tgt.bos_id, eos_id=tgt.eos_id, config=config)
    return {i: tgt.decode(tokens) for i, tokens in zip(indices, out.tokens)}
