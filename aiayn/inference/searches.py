"""The searches over a decoder's states: greedy decoding, sampling and beam search, with their settings.

Each search sees a decoder only through the start/step protocol of `aiayn.inference.steps`: `begin(steps, beams,
record)` gives the state, and each step feeds the newest tokens of every row. `start` (B, P) holds the tokens before
the first generated one (`<s>` for a translation, the prompt for a language model): the last is fed first, and all
count as what was generated so far for the repetition guards. Beam search follows Hugging Face `generate()` (score =
sum of log-probabilities / length ** length_penalty, the length counting `</s>`; the 2 x beam best candidates each
step; finished hypotheses only from the top `beam` candidates), so the same weights give the same sequences there
(tests/interop/test_marian.py).

Guards against runaway output: a length limit per row (`limits`), and Hugging Face's `repetition_penalty` and
`no_repeat_ngram_size`, applied as `generate()` applies them (to the logits for greedy decoding and sampling, to the
log-probabilities in beam search), so that the outputs stay equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.config import check_field_types, fold_old_spelling
from aiayn.inference.steps import DecodingState
from aiayn.inference.threads import check_stopped

NEG_INF = float("-inf")
# Finished sentences leave a beam search's batch once at least 1 / RETIRE_FRACTION of it (and at least one) has
# finished: each retirement copies the cross-attention cache, so a large batch waits for several to finish.
RETIRE_FRACTION = 8


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; the paper used beam 4, alpha 0.6, max length = source length + 50 (section 6.1).

    Attributes:
        max_new_tokens: most new tokens per sentence, `</s>` included (Hugging Face's name); None means
            `length_ratio` x the sentence's real (unpadded) source length + `extra_len`. Never more than
            the model's `max_len` positions.
        length_ratio: a in the limit a x source length + b when `max_new_tokens` is None (1 in the paper;
            fairseq's max_len_a); lower it to stop runaway repetitions sooner.
        extra_len: b, added to the scaled source length when `max_new_tokens` is None (50 in the paper).
        min_len: fewest tokens before `</s>` may be chosen (its log-probability is set to -inf before).
        num_beams: 1 is greedy (or sampling); more runs beam search.
        length_penalty: alpha in score = sum(log p) / length ** alpha (beam search only).
        early_stopping: False (the default, as Hugging Face's) keeps searching while the best running beam,
            scored at its length so far, beats the worst finished hypothesis. True stops a sentence once
            `num_beams` hypotheses are finished, however poor, while a far better beam may still be running:
            on a confident model the beams behind the best one are slips that end a token early, and True
            returned those (docs/notes.md, "Decoding").
        do_sample: sample instead of taking the best token (num_beams must be 1).
        temperature, top_k, top_p: sampling warpers, applied in that order (0 / 1.0 disable top-k / top-p).
        repetition_penalty: a token already generated gets its score divided by this (multiplied when
            negative), as Hugging Face's `repetition_penalty` (CTRL, Keskar et al. 2019); 1.0 is off.
        no_repeat_ngram_size: no n-gram of this size occurs twice in an output (0 is off).
        seed: seeds the sampling generator; None draws from torch's global generator.
        return_attention: also return the cross-attention weights of the chosen outputs.
        return_scores: score each output (the sum of its tokens' log-probabilities; beam search's, divided by
            its length ** `length_penalty`). False spares greedy decoding and sampling the log-softmax over the
            vocabulary at every step, which only the score reads (a twentieth of a small model's greedy step):
            their scores come back as NaN. Beam search searches by the scores and always returns them.
        max_len: the old spelling of `max_new_tokens` (the model's `max_len` is its position table), so
            that code written before still runs; `max_len=n` becomes `max_new_tokens=n` (and `max_len`
            None), and errors name the setting as the caller spelled it.
        beam_size: the old spelling of `num_beams`, so that code written before still runs; `beam_size=n`
            becomes `num_beams=n` (and `beam_size` None), refused when `num_beams` is given as another number.
    """

    max_new_tokens: int | None = None
    length_ratio: float = 1.0
    extra_len: int = 50
    min_len: int = 0
    num_beams: int = 1
    length_penalty: float = 0.6
    early_stopping: bool = False
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    seed: int | None = None
    return_attention: bool = False
    return_scores: bool = True
    max_len: int | None = field(default=None, repr=False)
    beam_size: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_field_types(self, "decoding")  # kinds first: True is not a beam size, NaN not a length penalty
        spelled = "max_new_tokens"
        if self.max_len is not None:  # the old spelling: one name, `max_new_tokens`, from here on
            spelled = "max_len"
            object.__setattr__(self, "max_new_tokens",
                               fold_old_spelling("max_new_tokens", self.max_new_tokens, "max_len", self.max_len))
            object.__setattr__(self, "max_len", None)
        beams = "num_beams"
        if self.beam_size is not None:  # the old spelling: one name, `num_beams`, from here on
            beams = "beam_size"
            given = None if self.num_beams == 1 else self.num_beams  # at its default, num_beams was not given
            object.__setattr__(self, "num_beams", fold_old_spelling("num_beams", given, "beam_size", self.beam_size))
            object.__setattr__(self, "beam_size", None)
        limit = self.max_new_tokens
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{spelled} must be a positive integer or None, got {limit!r}")
        for name in ("extra_len", "min_len", "top_k", "no_repeat_ngram_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise ValueError(f"{beams} must be a positive integer, got {self.num_beams!r}")
        for name in ("length_ratio", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if limit is not None and self.min_len > limit:
            raise ValueError(f"min_len {self.min_len} is above {spelled} {limit}: no output could end")
        if self.do_sample and self.num_beams > 1:
            raise ValueError(f"sampling draws one hypothesis per sentence: use {beams}=1 with do_sample")
        warpers = (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0))  # (name, the value that leaves it off)
        unused = [f"{name}={getattr(self, name)!r}" for name, off in warpers if getattr(self, name) != off]
        if unused and not self.do_sample:  # a warper set without sampling would be ignored without a word
            raise ValueError(f"{' and '.join(unused)} shape{'s' if len(unused) == 1 else ''} sampling only: set "
                             "do_sample=True (--sample), or leave it out")


Finished = Callable[[int, list[int], float], None]  # (sentence, its tokens, its score) once its search ended
Begin = Callable[[int, int, bool], DecodingState]  # (steps, beams, record) -> the state a search steps


def search(model: nn.Module, begin: Begin, start: torch.Tensor, limits: torch.Tensor, eos_id: int,
           config: GenerationConfig, on_finished: Finished | None = None):
    """The search `config` asks for (beam search, greedy decoding or sampling) over the states `begin` gives, from
    `start` (B, P) (the last column fed first) for up to `limits` (B,) tokens each, with `model` in eval mode.

    Returns (tokens per row, scores (B,), attention per row or None); `on_finished` as `generate`'s.
    """
    was_training = model.training
    model.eval()
    try:
        found = new_search(start, limits, eos_id, config)
        return drive(found, begin(found.steps, found.beams, config.return_attention), on_finished)
    finally:
        model.train(was_training)  # generating during training (validation) leaves the mode as it was


def drive(found: Search, state: DecodingState, on_finished: Finished | None = None):
    """Run the search `found` over the decoder state `state` (made for its rows) to its end; returns its `results`."""
    for _ in range(found.steps):
        check_stopped()  # a batch beside one that failed, or under an interrupt, ends here (`threads.side_by_side`)
        parents = found.advance(state.step(found.next_input), state.attention)
        if found.done:
            break
        if found.may_retire and found.ended >= max(1, found.batch // RETIRE_FRACTION):
            # Sentences whose search ended leave the batch, so that the steps left compute the others only.
            rows, parents = found.retire(on_finished)
            state.reorder(rows if parents is None else parents, memory_rows=rows)
        elif parents is not None:  # the memory's keys and values are the same for every beam of a sentence
            state.reorder(parents)
    return found.results()


def new_search(start: torch.Tensor, limits: torch.Tensor, eos_id: int, config: GenerationConfig) -> Search:
    """The search `config` asks for, from `start` (B, P) for up to `limits` (B,) tokens a sentence: `BeamSearch`
    for more than one beam, else `GreedySearch` (greedy decoding or sampling)."""
    return (BeamSearch if config.num_beams > 1 else GreedySearch)(start, limits, eos_id, config)


class Search(Protocol):
    """A search advanced a step at a time by whoever runs the decoder (`search` for one batch; a server's running
    batch for many requests at once).

    Its rows are `batch` sentences x `beams`, the beams of a sentence adjacent. Each step: feed `next_input` (rows, 1)
    to the decoder, give `advance` the logits; it returns None, or the rows (of those before the step) each row goes
    on from (beam search). `retire` takes the sentences whose search ended out of the search, at the runner's choice
    of time (`may_retire`), and returns the rows that go on and those rows' parents for this step's reorder.
    """

    steps: int  # the most steps the search can take
    beams: int  # rows a sentence
    batch: int  # sentences still in the search
    may_retire: bool  # whether sentences may leave before the search ends

    @property
    def next_input(self) -> torch.Tensor: ...

    @property
    def ended(self) -> int: ...

    @property
    def done(self) -> bool: ...

    def advance(self, logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def retire(self, on_finished: Finished | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def results(self) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor] | torch.Tensor | None]: ...


# -- shared steps ---------------------------------------------------------------------------------

def topk_rows(x: torch.Tensor, n: int, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(n, dim=-1)` for rows x (N, V) of a large vocabulary, faster on CPU (measured: docs/generation.md).

    The n largest entries of a row lie in the n blocks of `width` columns with the largest maxima
    (a block holding one of them has a maximum at least as large as the n-th largest entry, and at
    most n blocks can beat it), so the row's maxima per block, one cheap pass, pick n blocks, and
    topk runs on those n x width entries and the columns past the last whole block. Equal to
    `x.topk` but for the order among exactly equal values.
    """
    rows, vocab = x.shape
    blocks = vocab // width
    if blocks < 4 * n:  # too few blocks for the detour to pay
        return x.topk(n, dim=-1)
    body = x[:, : blocks * width].reshape(rows, blocks, width)  # (N, blocks, width), a view
    chosen = body.amax(dim=-1).topk(n, dim=-1).indices  # (N, n) blocks
    columns = (chosen[:, :, None] * width + torch.arange(width, device=x.device)).reshape(rows, n * width)
    columns = torch.cat([columns, torch.arange(blocks * width, vocab, device=x.device).expand(rows, -1)], dim=1)
    values, where = x.gather(1, columns).topk(n, dim=-1)  # (N, n)
    return values, columns.gather(1, where)


def argmax_rows(x: torch.Tensor, width: int = 64) -> torch.Tensor:
    """`x.argmax(dim=-1)` for rows x (N, V) of a large vocabulary, faster on CPU from 2 rows (measured:
    docs/notes.md, "Decoding").

    The same blocks as `topk_rows`: the maxima of blocks of `width` columns in one vectorised pass, then the
    first block holding the largest, the first largest entry inside it, and the columns past the last whole block,
    which win only when strictly larger. The first of equal maxima, and the first NaN, as `argmax`.
    """
    rows, vocab = x.shape
    blocks = vocab // width
    if rows == 1 or blocks < 4:  # one row: PyTorch's own reduction is as fast
        return x.max(dim=-1).indices
    body = x[:, : blocks * width].view(rows, blocks, width)  # (N, blocks, width), a view
    best = body.amax(dim=-1).max(dim=-1)  # (N,): each row's largest block maximum, and the first block holding it
    index = best.indices * width + body[torch.arange(rows, device=x.device), best.indices].max(dim=-1).indices
    if blocks * width < vocab:
        tail = x[:, blocks * width :].max(dim=-1)
        wins = (tail.values > best.values) | (tail.values.isnan() & ~best.values.isnan())
        index = torch.where(wins, tail.indices + blocks * width, index)
    return index


def _uses_history(config: GenerationConfig) -> bool:
    """Whether `_constrain` reads the tokens so far (repetition penalty or n-gram blocking)."""
    return config.repetition_penalty != 1.0 or config.no_repeat_ngram_size > 0


def _constrain(scores: torch.Tensor, history: torch.Tensor | None, step: int, eos_id: int,
               config: GenerationConfig) -> torch.Tensor:
    """Hugging Face's logits processors on (N, V) scores, given each row's tokens so far (N, t), start included
    (None where `_uses_history` says they are not read): repetition penalty, n-gram blocking, and no `</s>`
    before `min_len`. `scores` may be written in place (a step's own logits or log-probabilities: a copy is
    tens of megabytes a step at a batch of beams)."""
    if config.repetition_penalty != 1.0:
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, history, True)  # (N, V)
        penalised = torch.where(scores < 0, scores * config.repetition_penalty, scores / config.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    n = config.no_repeat_ngram_size
    if n and history.shape[1] >= n:
        vocab = scores.shape[-1]
        prefix = history[:, history.shape[1] + 1 - n :]  # (N, n-1): the n-gram the next token would complete
        windows = history.unfold(1, n, 1)  # (N, W, n): every n-gram so far
        matches = (windows[..., :-1] == prefix[:, None]).all(dim=-1)  # (N, W)
        banned = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        banned.scatter_(1, torch.where(matches, windows[..., -1], vocab), True)  # column V: no match
        scores = scores.masked_fill(banned[:, :vocab], float("-inf"))
    if step < config.min_len:
        scores[:, eos_id] = float("-inf")
    return scores


def _warp(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, as Hugging Face orders them; (N, V) -> (N, V)."""
    # The best logit moved to 0 and the temperature kept above 0 in the logits' float type, so that a tiny one
    # (1e-300 is 0 in float32) sends the others to -inf and never makes a probability NaN; softmax ignores the shift.
    temperature = max(config.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - config.top_p
        drop_sorted[:, -1] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# -- greedy and sampling --------------------------------------------------------------------------

class GreedySearch:
    """One hypothesis per sentence: the most likely token each step, or a sampled one; with `config.return_attention`,
    its cross-attention too. `start` (B, P): the tokens before the first generated one (the last is fed first; all
    count as history). Sampling keeps its rows to the end (`may_retire` False), so that its draws stay those of the
    whole batch."""

    beams = 1

    def __init__(self, start: torch.Tensor, limits: torch.Tensor, eos_id: int, config: GenerationConfig):
        batch, device = start.shape[0], start.device
        self.limits, self.start, self.eos_id, self.config = limits.to(device), start, eos_id, config
        self.steps = int(self.limits.max())
        self.step = 0
        self.sampler = None  # the random number generator of sampling
        if config.do_sample and config.seed is not None:
            self.sampler = torch.Generator(device=device).manual_seed(config.seed)
        self.out = torch.full((batch, self.steps), eos_id, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.scores = (torch.zeros(batch, device=device) if config.return_scores
                       else torch.full((batch,), float("nan"), device=device))
        self.weights: list[torch.Tensor] = []
        self.last = start[:, -1:]  # (B, 1) the newest tokens
        self.sentences = torch.arange(batch, device=device)  # (B,) each row's sentence in the first batch
        self.retired: dict[int, tuple[list[int], float]] = {}  # sentence -> its tokens and score, once it left
        self.may_retire = not config.return_attention and not config.do_sample
        self._ended = 0

    @property
    def batch(self) -> int:
        return self.out.shape[0]

    @property
    def next_input(self) -> torch.Tensor:
        return self.last

    @property
    def ended(self) -> int:
        return self._ended

    @property
    def done(self) -> bool:
        return self._ended == self.batch

    def advance(self, logits: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """One step from the logits (B, V) of the rows' newest tokens (and their cross-attention (B, n_layers, h, S)
        when recorded)."""
        config, step = self.config, self.step
        # (B, V): the score counts the model's own probabilities, before the constraints
        log_probs = F.log_softmax(logits, dim=-1) if config.return_scores else None
        history = torch.cat([self.start, self.out[:, :step]], dim=1) if _uses_history(config) else None
        logits = _constrain(logits, history, step, self.eos_id, config)
        if config.do_sample:
            best = torch.multinomial(_warp(logits, config).softmax(dim=-1), 1, generator=self.sampler)[:, 0]  # (B,)
        else:
            best = argmax_rows(logits)  # (B,)
        best = best.masked_fill(self.finished, self.eos_id)
        if log_probs is not None:
            self.scores += log_probs.gather(1, best[:, None])[:, 0].masked_fill(self.finished, 0.0)
        self.out[:, step] = best
        if weights is not None:
            self.weights.append(weights)
        self.finished |= (best == self.eos_id) | (step + 1 >= self.limits)
        self._ended = int(self.finished.sum())
        self.last = best[:, None]
        self.step += 1

    def retire(self, on_finished: Finished | None = None) -> tuple[torch.Tensor, None]:
        """Keep the finished sentences' outputs (and tell `on_finished`), drop their rows; the rows (B',) that go on."""
        done, alive = self.finished.nonzero()[:, 0], (~self.finished).nonzero()[:, 0]
        _keep(self.retired, self.sentences[done].tolist(), self.out[done].tolist(), self.scores[done].tolist(),
              self.eos_id, on_finished)
        for name in ("sentences", "out", "finished", "scores", "limits", "last", "start"):
            setattr(self, name, getattr(self, name).index_select(0, alive))
        self._ended = 0
        return alive, None

    def results(self) -> tuple[list[list[int]], torch.Tensor, torch.Tensor | None]:
        """Every sentence's tokens (to `</s>`) and score, in the first batch's order, and the attention (B, n_layers,
        h, T, S) when recorded."""
        _keep(self.retired, self.sentences.tolist(), self.out.tolist(), self.scores.tolist(), self.eos_id)
        attn = torch.stack(self.weights, dim=3).cpu() if self.weights else None  # (B, n_layers, h, T, S)
        return (*_in_order(self.retired), attn)


def _until_eos(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id)] if eos_id in row else row


def _keep(retired: dict[int, tuple[list[int], float]], sentences: list[int], rows: list[list[int]],
          scores: list[float], eos_id: int, on_finished: Finished | None = None) -> None:
    """Keep each sentence's output (its row up to `</s>`) and score in `retired`, and tell `on_finished`."""
    for sentence, row, score in zip(sentences, rows, scores):
        retired[sentence] = (_until_eos(row, eos_id), score)
        if on_finished is not None:
            on_finished(sentence, *retired[sentence])


def _in_order(retired: dict[int, tuple[list[int], float]]) -> tuple[list[list[int]], torch.Tensor]:
    """The kept outputs and scores (B,), by sentence."""
    order = sorted(retired)
    return [retired[s][0] for s in order], torch.tensor([retired[s][1] for s in order])


# -- beam search ----------------------------------------------------------------------------------

class BeamSearch:
    """Beam search with Hugging Face's rules (see the module docstring); each sentence searches alone. With
    `config.return_attention`, the chosen hypotheses' cross-attention too. `start` (B, P) as `GreedySearch`'s."""

    def __init__(self, start: torch.Tensor, limits: torch.Tensor, eos_id: int, config: GenerationConfig):
        device, self.beams = start.device, config.num_beams
        self.limits, self.config, self.eos_id = limits.to(device), config, eos_id
        self.state = _Beams(start.shape[0], self.beams, int(self.limits.max()), eos_id, config, device)
        self.steps = self.state.steps
        self.start = start.repeat_interleave(self.beams, dim=0)  # (B*k, P)
        self.step = 0
        self.parents: torch.Tensor | None = None  # the latest step's (B*k,)
        self.may_retire = not config.return_attention
        self._ended = 0

    @property
    def batch(self) -> int:
        return self.state.batch

    @property
    def next_input(self) -> torch.Tensor:
        if self.step == 0:
            return self.start[:, -1:]
        return self.state.running[:, :, self.step - 1].reshape(self.state.batch * self.beams, 1)

    @property
    def ended(self) -> int:
        return self._ended

    @property
    def done(self) -> bool:
        return self._ended == self.state.batch

    def advance(self, logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """One step from the logits (B*k, V) of the beams' newest tokens (written over); the row (B*k,) each beam
        goes on from."""
        beams, k, step = self.state, self.beams, self.step
        history = None
        if _uses_history(self.config):
            history = torch.cat([self.start, beams.running.view(beams.batch * k, -1)[:, :step]], dim=1)  # (B*k, P+t)
        # Over the step's own logits (the caller's to write): at a batch of beams a second (N, V) tensor each step
        # is tens of megabytes whose pages the system maps anew every time (docs/notes.md, "Decoding").
        log_probs = _constrain(torch.log_softmax(logits, -1, out=logits), history, step, self.eos_id, self.config)
        # Adding a beam's score keeps the order of its tokens, so the best 2k continuations of a sentence
        # are among the best 2k tokens of each of its beams: only those are scored.
        top = topk_rows(log_probs, min(2 * k, log_probs.shape[-1]))  # 2 x (B*k, 2k)
        candidates = beams.candidates(*top, step, self.limits)
        beams.finish(candidates, step, weights)
        self.parents = beams.advance(candidates, step, self.limits)
        self._ended = int(beams.sentence_done.sum())
        self.step += 1
        return self.parents

    def retire(self, on_finished: Finished | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the ended sentences' best hypotheses (and tell `on_finished`), drop their beams; the rows (B'*k,)
        that go on, and the rows (of those before the latest step) their beams go on from."""
        k = self.beams
        alive = self.state.retire(on_finished)  # (B',) the sentences still searching, as rows of the batch before
        rows = (alive[:, None] * k + torch.arange(k, device=alive.device)).view(-1)  # (B'*k,) their beams' rows
        parents = self.parents.view(-1, k).index_select(0, alive).view(-1)
        self.limits = self.limits.index_select(0, alive)
        self.start = self.start.index_select(0, rows)
        self._ended = 0
        return rows, parents

    def results(self) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor] | None]:
        return self.state.results()


@dataclass
class _Candidates:
    """The 2 x beam best continuations of each sentence at one step, best first; each (B, 2k)."""

    scores: torch.Tensor  # running score + log-probability of the token
    beam: torch.Tensor  # the beam each continues
    token: torch.Tensor  # the token it adds
    tokens: torch.Tensor  # (B, 2k, T): the beam's tokens with this one
    ends: torch.Tensor  # ends here: `</s>`, or the sentence's length limit


class _Beams:
    """Beam search's state: per sentence, k running beams and the k best finished hypotheses.

    `retire` takes the sentences whose search ended out of the state (keeping their results), so that
    `batch` counts the sentences still searching; `sentences` says which of the first batch they are.
    """

    def __init__(self, batch: int, k: int, steps: int, eos_id: int, config: GenerationConfig, device: torch.device):
        self.batch, self.k, self.steps, self.eos_id = batch, k, steps, eos_id
        self.sentences = torch.arange(batch, device=device)  # (B,) each row's sentence in the first batch
        self.retired: dict[int, tuple[list[int], float]] = {}  # sentence -> its best tokens and score
        self.alpha, self.early_stopping = config.length_penalty, config.early_stopping
        self.running = torch.full((batch, k, steps), eos_id, dtype=torch.long, device=device)
        self.running_scores = torch.zeros(batch, k, device=device)
        self.running_scores[:, 1:] = NEG_INF  # all beams start identical: expand only the first
        self.done_tokens = self.running.clone()
        self.done_scores = torch.full((batch, k), NEG_INF, device=device)
        self.done_flags = torch.zeros(batch, k, dtype=torch.bool, device=device)
        self.done_steps = torch.zeros(batch, k, dtype=torch.long, device=device)
        self.sentence_done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.in_top_k = torch.arange(2 * k, device=device) < k  # (2k,)
        self.base = torch.arange(batch, device=device)[:, None] * k  # (B, 1) first flat row of each sentence
        self.attention: torch.Tensor | None = None  # (B*k, T, n_layers, h, S) attention of the running beams
        self.done_attention: torch.Tensor | None = None

    def candidates(self, log_probs: torch.Tensor, tokens: torch.Tensor, step: int,
                   limits: torch.Tensor) -> _Candidates:
        """The best 2k continuations of each sentence's running beams, from each beam's best tokens:
        log-probabilities and ids, each (B*k, n) with n >= 2k (or the whole vocabulary)."""
        n = log_probs.shape[-1]
        totals = (log_probs.view(self.batch, self.k, n) + self.running_scores[:, :, None])  # (B, k, n)
        scores, index = totals.view(self.batch, self.k * n).topk(2 * self.k, dim=1)  # (B, 2k), best first
        beam, token = index // n, tokens.view(self.batch, self.k * n).gather(1, index)
        tokens = self.running.gather(1, beam[:, :, None].expand(-1, -1, self.steps)).clone()  # (B, 2k, T)
        tokens[:, :, step] = token
        ends = (token == self.eos_id) | (step + 1 >= limits)[:, None]
        return _Candidates(scores, beam, token, tokens, ends)

    def finish(self, cand: _Candidates, step: int, step_weights: torch.Tensor | None) -> None:
        """Candidates among the top k that end here join the finished hypotheses, ranked with the length penalty."""
        cand_attention = None
        if step_weights is not None:  # (B*k, n_layers, h, S)
            step_weights = step_weights[:, None]  # (B*k, 1, n_layers, h, S)
            self.attention = (step_weights if self.attention is None
                              else torch.cat([self.attention, step_weights], dim=1))
            cand_attention = self.attention.index_select(0, (self.base + cand.beam).view(-1))  # (B*2k, t, ...)
        new_done = cand.ends & self.in_top_k & ~self.sentence_done[:, None] & (cand.scores > NEG_INF)
        normalised = (cand.scores / (step + 1) ** self.alpha).masked_fill(~new_done, NEG_INF)
        merged_scores, keep = torch.cat([self.done_scores, normalised], dim=1).topk(self.k, dim=1)  # (B, k)
        self.done_tokens = torch.cat([self.done_tokens, cand.tokens], dim=1).gather(
            1, keep[:, :, None].expand(-1, -1, self.steps))
        self.done_flags = torch.cat([self.done_flags, new_done], dim=1).gather(1, keep)
        self.done_steps = torch.cat([self.done_steps, torch.full_like(cand.token, step + 1)], dim=1).gather(1, keep)
        self.done_scores = merged_scores
        if cand_attention is not None:
            self.done_attention = _merge_attention(self.done_attention, cand_attention, keep, self.batch, self.k)

    def advance(self, cand: _Candidates, step: int, limits: torch.Tensor) -> torch.Tensor:
        """Keep the best k candidates that did not end as the running beams; returns their parents' flat rows (B*k,)."""
        self.running_scores, pick = cand.scores.masked_fill(cand.ends, NEG_INF).topk(self.k, dim=1)  # (B, k)
        self.running = cand.tokens.gather(1, pick[:, :, None].expand(-1, -1, self.steps))
        parents = (self.base + cand.beam.gather(1, pick)).view(-1)  # (B*k,) flat rows the beams continue
        if self.attention is not None:
            self.attention = self.attention.index_select(0, parents)
        best_running = self.running_scores[:, 0] / (step + 1) ** self.alpha
        can_improve = torch.tensor(not self.early_stopping, device=best_running.device) & (
            best_running > self.done_scores.min(dim=1).values)
        self.sentence_done |= (self.done_flags.all(dim=1) & ~can_improve) | (step + 1 >= limits)
        return parents

    def retire(self, on_finished: Finished | None = None) -> torch.Tensor:
        """Keep the results of the sentences whose search ended (and tell `on_finished`) and drop them from the
        state (not with attention recorded); returns the rows (B',) of the sentences still searching, in the batch
        before."""
        alive = (~self.sentence_done).nonzero()[:, 0]
        self._keep(self.sentence_done.nonzero()[:, 0], on_finished)
        for name in ("sentences", "running", "running_scores", "done_tokens", "done_scores", "done_flags",
                     "done_steps", "sentence_done"):
            setattr(self, name, getattr(self, name).index_select(0, alive))
        self.batch = alive.numel()
        self.base = self.base[: self.batch]
        return alive

    def _keep(self, rows: torch.Tensor | slice, on_finished: Finished | None = None) -> None:
        """Keep the best finished hypothesis of the sentences at `rows` of the state (see `_keep`)."""
        tokens = [row[:n] for row, n in zip(self.done_tokens[rows, 0].tolist(), self.done_steps[rows, 0].tolist())]
        _keep(self.retired, self.sentences[rows].tolist(), tokens, self.done_scores[rows, 0].tolist(), self.eos_id,
              on_finished)

    def results(self) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor] | None]:
        """The best finished hypothesis of each sentence: tokens, score, attention (n_layers, h, T, S)."""
        self._keep(slice(None))
        attn = None
        if self.done_attention is not None:  # (T, n_layers, h, S) -> (n_layers, h, T, S)
            attn = [self.done_attention[b * self.k].permute(1, 2, 0, 3).cpu() for b in range(self.batch)]
        return (*_in_order(self.retired), attn)


def _merge_attention(done_attention: torch.Tensor | None, cand_attention: torch.Tensor, keep: torch.Tensor,
                   batch: int, k: int) -> torch.Tensor:
    """Attention of the finished hypotheses after a merge: (B*k, T, ...) old + (B*2k, t, ...) new -> (B*k, t, ...)."""
    t = cand_attention.shape[1]
    if done_attention is None:
        done_attention = cand_attention.new_zeros((batch * k, t, *cand_attention.shape[2:]))
    elif done_attention.shape[1] < t:
        pad = done_attention.new_zeros((batch * k, t - done_attention.shape[1], *done_attention.shape[2:]))
        done_attention = torch.cat([done_attention, pad], dim=1)
    merged = torch.cat([done_attention.view(batch, k, *done_attention.shape[1:]),
                        cand_attention.view(batch, 2 * k, *cand_attention.shape[1:])], dim=1)  # (B, 3k, t, ...)
    index = keep.view(batch, k, *([1] * (merged.dim() - 2))).expand(-1, -1, *merged.shape[2:])
    return merged.gather(1, index).reshape(batch * k, *merged.shape[2:])
