"""Evaluate a model on a split: loss, perplexity, token accuracy, and each objective's task metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from aiayn.backends import Backend, inference_shape, model_device, select
from aiayn.data.batching import token_batches
from aiayn.data.prepare import EncodedSplit, PreparedData
from aiayn.inference.buffers import reusing_buffers
from aiayn.tasks.metrics import perplexity
from aiayn.training.loss import correct_count, label_smoothed_loss
from aiayn.training.objectives import make_batch, masking_generator, to_device


@dataclass(frozen=True)
class EvalOptions:
    """How `evaluate` runs: batching, decoding and what it reports.

    Attributes:
        max_tokens: tokens per batch. decode: also generate the predictions of a task that generates them
            (`Task.generates`: translations, for BLEU, chrF, exact match).
        num_beams, length_penalty: decoding settings. max_batches: stop after this many batches (0 = all).
        seed: what a batch corrupts at random (masked LM). precision: "fp32", "bf16" or None (the device's choice).
        examples: (input, prediction, reference) triples to return. bleu_tokenize: sacrebleu's tokenizer.
    """

    max_tokens: int = 4096
    decode: bool = True
    num_beams: int = 1
    length_penalty: float = 0.6
    max_batches: int = 0
    seed: int = 0
    precision: str | None = None
    examples: int = 0
    bleu_tokenize: str = "auto"

    @classmethod
    def from_train_config(cls, train_config, **changes) -> EvalOptions:
        """The options a run's `TrainConfig` implies, with `changes` (one place: the trainer and `aiayn eval` agree)."""
        t = train_config
        options = cls(max_tokens=t.max_tokens, num_beams=t.num_beams, length_penalty=t.length_penalty, seed=t.seed,
                      precision=t.precision, examples=t.show_examples,
                      bleu_tokenize=t.bleu_tokenize)
        return replace(options, **changes)


@torch.no_grad()
@reusing_buffers()  # each batch's search writes its cache into the memory of the one before
def evaluate(model: nn.Module, data: PreparedData, split: EncodedSplit, options: EvalOptions | None = None, *,
             backend: Backend | None = None, progress: Callable[[int], None] | None = None) -> dict:
    """Metrics of `model` on `split` (in eval mode, no dropout).

    The model runs as `backend` prepares it, once for the whole split (default: the fast inference
    path of the model's device, in `options.precision`). `progress` is called with the number
    of examples done after each batch (a progress bar).

    Returns:
        A dict with `loss` (unsmoothed NLL per token), `perplexity`, `token_accuracy` (percent), for a language
        model's text `loss_per_char` (nats) and `bits_per_char` (the split's NLL over its characters), and
        for seq2seq with `decode` `bleu`, `chrf`, `exact_match`; for sequence classification
        `accuracy`, `macro_f1`; for token classification `entity_f1` (and precision, recall);
        plus `examples`: up to `examples` (input, prediction, reference) triples.
    """
    options = options or EvalOptions()
    if not split.items:
        return {}
    if backend is None:
        backend = select(model_device(model), "inference", options.precision, inference_shape=inference_shape(model))
    was_training = model.training
    model.eval()
    prepared = backend.prepare(model)
    batches = token_batches(split.lengths, options.max_tokens, shuffle=False)
    if options.max_batches:
        batches = batches[:options.max_batches]
    task = data.task
    search = _search(options)
    nll_sum, units, correct, counted = 0.0, 0, 0, 0
    predictions: dict[int, object] = {}
    for number, indices in enumerate(batches):
        batch = to_device(make_batch(data, split, indices, generator=masking_generator(options.seed, -1, number)),
                          backend.device)
        logits, labels = task.forward(prepared, batch)
        logits = logits.float()
        _, nll = label_smoothed_loss(logits, labels, smoothing=0.0)
        c, n = correct_count(logits, labels)
        nll_sum, correct, counted = nll_sum + float(nll), correct + c, counted + n
        units += n
        predictions.update(task.predictions(logits, labels, indices))
        if options.decode:
            predictions.update(task.decode(prepared, data, batch, indices, search))
        if progress is not None:
            progress(len(indices))
    mean_nll = nll_sum / max(units, 1)
    result: dict = {"loss": mean_nll, "perplexity": perplexity(mean_nll),
                    "token_accuracy": 100.0 * correct / max(counted, 1)}
    if split.chars_per_token:  # a text: the loss per character, which models of other tokenizers compare by
        result["loss_per_char"] = mean_nll / split.chars_per_token
        result["bits_per_char"] = result["loss_per_char"] / math.log(2)
    shown: list[tuple[str, str, str]] = []
    if predictions:
        scores, shown = task.score(data, split, predictions, bleu_tokenize=options.bleu_tokenize)
        result.update(scores)
    # Show mistakes first (up to half of the examples), then correct predictions.
    wrong = [e for e in shown if e[1].strip() != e[2].strip()][: options.examples // 2]
    right = [e for e in shown if e[1].strip() == e[2].strip()]
    result["examples"] = (wrong + right)[:options.examples] if options.examples else []
    model.train(was_training)
    return result


def _search(options: EvalOptions) -> Callable[..., list[list[int]]]:
    """Generation with the options' beam: (model, inputs, bos_id=, eos_id=) -> token ids of each row."""

    def search(model: nn.Module, inputs: torch.Tensor, *, bos_id: int, eos_id: int) -> list[list[int]]:
        from aiayn.inference.generation import GenerationConfig, generate

        config = GenerationConfig(num_beams=options.num_beams, length_penalty=options.length_penalty,
                                  return_scores=False)
        return generate(model, inputs, bos_id=bos_id, eos_id=eos_id, config=config).tokens

    return search
