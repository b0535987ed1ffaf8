"""A running batch: the rows of many searches decoded together, one step at a time; searches join and leave it
between steps (iteration-level, or "continuous", batching: Yu et al., Orca, OSDI 2022).

A search of one batch (`aiayn.inference.searches.search`) keeps its rows until its longest sentence ends. A server
that ran each request's batch so would make a two-word request wait for other people's long sentences. Here each
request's batch is a `Part`: it joins the running batch between two steps (its sources encoded, or its prompts run,
once, by `StaticState`, and its rows appended), its search (`GreedySearch`, `BeamSearch`) advances on its own rows'
logits at every step, and its rows leave as soon as its search ends or its client goes away. Every row sits at its
own position (`SharedState`): a row's keys and values are written at its position, and it attends to its own
positions only. The arithmetic of each row is its search's alone, so a part's outputs are those of `generate` or
`continue_prompts` on the part by itself, up to the rounding of products over other numbers of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.inference.searches import RETIRE_FRACTION, GenerationConfig, Search, new_search
from aiayn.inference.steps import StaticState

Done = Callable[[list[list[int]], list[float]], None]  # (tokens a sentence, scores) once the part's search ended
Tokens = Callable[[list[int], list[int]], None]  # (sentences, the token each added) after a step, greedy or sampling


class Batch(NamedTuple):
    """A batch of a request's texts as a search takes them: which texts (their places in the request), their ids (an
    encoder-decoder model's sources, a decoder-only model's prompts), the tokens a search starts from and each one's
    limit of new tokens (`Part`'s `ids`, `start`, `limits`)."""

    indices: list[int]
    ids: torch.Tensor
    start: torch.Tensor
    limits: torch.Tensor


@dataclass(eq=False)
class Part:
    """One batch of a request, to decode in a running batch.

    Attributes:
        ids: an encoder-decoder model's sources (B, S), each with real tokens, right-padded; or a decoder-only model's
            prompts (B, P) of one length.
        start: the tokens before the first generated one (B, P0): `<s>` for a translation, the prompts for a language
            model (the searches' `start`).
        limits: each sentence's most new tokens (B,).
        config: the search (`GenerationConfig`: greedy, sampling or beam search, and its constraints).
        eos_id: the token that ends a sentence.
        on_done: told each sentence's tokens (to `</s>`) and score when the part's search ends.
        on_error: told the exception when the part fails (alone: the others go on).
        on_tokens: streaming (greedy or sampling): after each step, the sentences still running and the token each
            added.
        cancelled: set (from any thread) when nobody waits for the answer: the part's rows leave at the next step.
    """

    ids: torch.Tensor
    start: torch.Tensor
    limits: torch.Tensor
    config: GenerationConfig
    eos_id: int
    on_done: Done
    on_error: Callable[[BaseException], None]
    on_tokens: Tokens | None = None
    cancelled: bool = False
    steps_run: int = field(default=0, init=False)

    @property
    def rows(self) -> int:
        """The rows it takes in a running batch (a row a sentence, or `num_beams`)."""
        return self.ids.shape[0] * self.config.num_beams


@dataclass(eq=False)
class _Running:
    """A part in the running batch: its search (None once it left: its rows stay, unread, until the batch compacts)
    and how many rows it holds now (its rows are adjacent)."""

    part: Part
    search: Search | None
    rows: int


class RunningBatch:
    """The rows of every part that joined, decoded one step at a time (see the module docstring). Not thread-safe:
    one thread joins, steps and reads it.

    Rows whose sentence ended stay in the batch (fed a token, their logits unread) until they are at least
    1 / `RETIRE_FRACTION` of it, then all leave in one gather of the cache, as `search` retires a batch's sentences:
    each gather copies every row's keys and values.

    Args:
        model: the decoder (an encoder-decoder or a decoder-only model), as the backend prepared it.
        beams: the rows of a sentence in every part that joins (`num_beams`): its beams read its memory together.
    """

    def __init__(self, model: nn.Module, beams: int = 1):
        self.model, self.beams = model, beams
        self.state = SharedState(model, beams)
        self.running: list[_Running] = []

    @property
    def rows(self) -> int:
        """Rows of the parts still searching (those of parts that left are not counted)."""
        return sum(r.rows for r in self.running if r.search is not None)

    @property
    def searching(self) -> bool:
        """Whether a part is still searching."""
        return any(r.search is not None for r in self.running)

    def join(self, *parts: Part) -> None:
        """Encode the parts' sources (or run their prompts) and add their rows, in one copy of the cache; their first
        step is the batch's next one. A part that cannot start (a search too large, say) is told (`on_error`) and
        left out."""
        fresh = []
        for part in parts:
            try:
                if part.config.num_beams != self.beams:
                    raise ValueError(f"a part searching {part.config.num_beams} beams joined a running batch of "
                                     f"{self.beams}: each batch holds one number of beams")
                found = new_search(part.start, part.limits, part.eos_id, part.config)
                fresh.append((part, found, StaticState(self.model, part.ids, found.steps, beams=found.beams)))
            except Exception as err:  # this part fails alone
                part.on_error(err)
        self.state.append(*(state for _, _, state in fresh))
        self.running += [_Running(part, found, part.rows) for part, found, _ in fresh]

    def step(self) -> None:
        """One step of every row: each part's search advances; parts that ended are told and leave, with the parts
        cancelled meanwhile."""
        if not self.searching:
            return
        device = self.state.at.device
        tokens = torch.cat([r.search.next_input if r.search is not None
                            else torch.zeros((r.rows, 1), dtype=torch.long, device=device) for r in self.running])
        logits = self.state.step(tokens)  # (N, V)
        offset, moves, dead = 0, [], 0
        for r in self.running:
            base, offset = offset, offset + r.rows
            parents = self._advance(r, logits[base:offset]) if r.search is not None else None
            moves.append(parents)
            dead += r.rows if r.search is None else r.search.ended * r.search.beams * r.search.may_retire
        compact = dead >= max(1, len(self.state.where) // RETIRE_FRACTION)
        keep, offset, moved, going_on = [], 0, compact, []
        for r, parents in zip(self.running, moves):
            base, offset = offset, offset + r.rows
            if r.search is None:
                if not compact:  # its rows stay until the batch compacts
                    keep.append(torch.arange(base, offset, device=device))
                    going_on.append(r)
                continue
            going_on.append(r)
            if compact and r.search.may_retire and r.search.ended:
                rows, parents = r.search.retire()  # the sentences that ended are kept by the search for `results`
                if parents is None:
                    parents = rows
            if parents is None:
                keep.append(torch.arange(base, offset, device=device))
                continue
            moved = True
            r.rows = parents.numel()
            keep.append(parents + base)
        if not any(r.search is not None for r in going_on):  # every part left: the buffers go with them
            self.running, self.state = [], SharedState(self.model, self.beams)
            return
        self.running = going_on
        if moved:
            self.state.reorder(torch.cat(keep))

    def _advance(self, r: _Running, logits: torch.Tensor) -> torch.Tensor | None:
        """Advance one part's search on its rows' logits; the rows (of its own, before the step) each row goes on from
        (beam search) or None. A part that ended, failed or was cancelled leaves (`search` None)."""
        part, found = r.part, r.search
        if part.cancelled:
            r.search = None
            return None
        try:
            running = ~found.finished if part.on_tokens is not None and found.beams == 1 else None
            parents = found.advance(logits)
            part.steps_run += 1
            if running is not None:  # streaming: the token each sentence still running before the step added
                picked = running.nonzero()[:, 0]
                part.on_tokens(found.sentences[picked].tolist(), found.last[picked, 0].tolist())
            if found.done:
                r.search = None
                tokens, scores, _ = found.results()
                part.on_done(tokens, scores.tolist())
                return None
            return parents
        except Exception as err:  # this part fails alone
            r.search = None
            part.on_error(err)
            return None

    def cancel_all(self, err: BaseException) -> None:
        """Fail every part (the step itself failed): they leave, told `err`."""
        for r in self.running:
            if r.search is not None and not r.part.cancelled:
                r.part.on_error(err)
        self.running = []
        self.state = SharedState(self.model, self.beams)


def _identity(rows: torch.Tensor) -> bool:
    return bool((rows == torch.arange(rows.numel(), device=rows.device)).all())


class SharedState(StaticState):
    """The flat step (`StaticState`'s plan of the layers' parts) over rows that each sit at their own position.

    - `at` (N,): the position each row writes next; a row's keys and values go there, and it attends to the positions
      up to it (the others masked); the positional encoding is each row's own.
    - The memory's keys and values are kept per sentence (padded to the longest source, the padding masked), read
      by its `beams` adjacent rows as `StaticState` reads them, so sentences of any lengths sit side by side.
    - `append` adds the rows of a search just started (`StaticState` on its sources or prompts); `reorder` keeps,
      drops or repeats rows (parts leaving, beams moving).
    """

    def __init__(self, model: nn.Module, beams: int = 1):
        cfg = model.config
        self.model, self.beams = model, beams
        self.embed = model.tgt_embed if cfg.has_cross_attention else model.embed
        self.layers = list(model.decoder.layers)
        self.heads, self.d_k = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.length = cfg.max_len  # positions a row can reach
        self.plans, self.threads, self.measures_threads = {}, {}, False  # the process's threads at every size
        self.positions: torch.Tensor | None = None
        self.cache: torch.Tensor | None = None  # (n_layers, 2, N, h, capacity, d_k), made by the first `append`
        self.held = self.spare = None  # the buffer `cache` views the first rows of, and `reorder`'s other one
        self.where: list[int] = []  # each row's next position, on the host
        self.at: torch.Tensor | None = None  # the same on the device
        self.memory: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (N, h, S, d_k) each
        self.mask: torch.Tensor | None = None  # (N, 1, 1, S) the bias over the memory's positions
        self.absorbed = [None] * len(self.layers)  # cross-attention as written, over the padded memory

    @property
    def rows(self) -> int:
        return len(self.where)

    def append(self, *states: StaticState) -> None:
        """Add the rows of searches just started (each row at its state's `position`), in one copy of the cache."""
        if not states:
            return
        for fresh in states:
            if fresh.memory is not None and fresh.beams != self.beams:  # rows of a sentence parted ways here before
                fresh._memory_per_row()
        first = states[0]
        if self.cache is None:  # the first rows: the buffers take their kinds
            dtype, device = first.cache.dtype, first.cache.device
            self.positions = None if self.embed.positions is None else self.embed.positions(self.length).to(dtype)
            self.cache = self.held = first.cache.new_zeros((*first.cache.shape[:2], 0, *first.cache.shape[3:]))
            self.at = torch.zeros(0, dtype=torch.long, device=device)
            if first.memory is not None:
                self.memory = [tuple(t[:0] for t in kv) for kv in first.memory]
                self.mask = torch.zeros((0, 1, 1, first.memory[0][0].shape[2]), dtype=first.memory[0][0].dtype,
                                        device=device)
        n, before = sum(fresh.cache.shape[2] for fresh in states), self.rows
        furthest = max(fresh.position for fresh in states)
        held = self.held  # `cache` is its first rows
        if held.shape[2] < before + n or held.shape[4] <= furthest:  # room for more rows, or positions: doubled
            held = held.new_zeros((*held.shape[:2], max(before + n, 2 * held.shape[2]), held.shape[3],
                                   min(self.length, max(held.shape[4], _room(furthest + 1))), held.shape[5]))
            top = min(max(self.where, default=0), self.cache.shape[4])
            held[:, :, :before, :, :top] = self.cache[:, :, :, :, :top]
            self.held, self.spare = held, None
        row = before  # the new rows' positions past their own hold what rows before left there: masked, finite
        for fresh in states:
            rows, p = fresh.cache.shape[2], fresh.position
            held[:, :, row : row + rows, :, :p] = fresh.cache[:, :, :, :, :p]
            row += rows
            self.where += [p] * rows
        self.cache = held[:, :, : before + n]
        self.at = torch.tensor(self.where, dtype=torch.long, device=self.at.device)
        if self.memory is not None:
            self._append_memory(states)
        self._views()

    def _append_memory(self, states: tuple[StaticState, ...]) -> None:
        """The memory's keys and values (and the mask over them) of the new states' sentences after this state's, all
        padded to the longest source."""
        width = max(self.mask.shape[3], *(fresh.memory[0][0].shape[2] for fresh in states))

        def keys(t: torch.Tensor) -> torch.Tensor:  # (B, h, S, d_k) -> (B, h, width, d_k), zeros after S
            return F.pad(t, (0, 0, 0, width - t.shape[2]))

        def bias(t: torch.Tensor) -> torch.Tensor:  # (B, 1, 1, S) -> (B, 1, 1, width), the padding masked
            return F.pad(t, (0, width - t.shape[3]), value=float("-inf"))

        self.memory = [tuple(torch.cat([keys(t) for t in kv]) for kv in zip(mine, *(new.memory[i] for new in states)))
                       for i, mine in enumerate(self.memory)]
        masks = [fresh.mask if fresh.mask is not None else self.mask.new_zeros(
            (fresh.memory[0][0].shape[0], 1, 1, fresh.memory[0][0].shape[2])) for fresh in states]  # no padding
        self.mask = torch.cat([bias(self.mask), *(bias(m) for m in masks)])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) -> logits (N, V) in float32; each row's keys and values kept at its position."""
        top = max(self.where)
        if top >= self.cache.shape[4]:
            self._grow_to(top + 1)
        rows = len(self.where)
        self.span = top + 1
        # where each row writes its key and value, (N, h, 1, d_k) indices into the positions of the cache
        self.written = self.at.view(rows, 1, 1, 1).expand(rows, self.heads, 1, self.d_k)
        slots = torch.arange(self.span, device=self.at.device)
        hidden = (slots > self.at[:, None]).view(rows, 1, 1, self.span)  # (N, 1, 1, span): past its own positions
        # as the bias SDPA adds, made once a step for every layer
        self.visible = torch.zeros(hidden.shape, dtype=self.cache.dtype, device=hidden.device).masked_fill_(
            hidden, float("-inf"))
        logits = self._forward(tokens)
        self.at += 1
        self.where = [w + 1 for w in self.where]
        return logits

    def _grow_to(self, positions: int) -> None:
        cache = self.cache.new_zeros((*self.cache.shape[:4], min(self.length, _room(positions)), self.cache.shape[5]))
        cache[:, :, :, :, : self.cache.shape[4]] = self.cache
        self.cache = self.held = cache
        self.spare = None
        self._views()

    def _position_row(self) -> torch.Tensor:
        return self.positions.index_select(0, self.at)[:, None]  # (N, 1, d_model)

    def _cached(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple:
        """Each row's key and value (N, h, 1, d_k) written at its own position; the keys and values up to the furthest
        row's position, each row's own ones visible."""
        keys, values = self.kv[i]  # (N, h, capacity, d_k) each
        keys.scatter_(2, self.written, key)
        values.scatter_(2, self.written, value)
        return keys[:, :, : self.span], values[:, :, : self.span], self.visible

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """Row i is now row `rows[i]` of before (its cache, its position, its memory). Beams that only change parents
        within their sentences (as many rows as before) move in place where `StaticState` would; otherwise the rows
        are gathered into a spare buffer kept for the next time."""
        n, top = rows.numel(), max(self.where, default=0)
        self.position = top  # the positions `_moved_in_place` copies
        if n == self.rows and self._moved_in_place(rows):
            return  # a beam's parent sits at its position and reads its memory: nothing else moves
        held = self.held
        if self.spare is None or self.spare.shape[2] < n or self.spare.shape[4] != held.shape[4]:
            self.spare = held.new_zeros((*held.shape[:2], max(n, held.shape[2]), *held.shape[3:]))
        target = self.spare[:, :, :n]
        torch.index_select(self.cache[:, :, :, :, :top], 2, rows, out=target[:, :, :, :, :top])
        self.cache, self.held, self.spare = target, self.spare, held
        picked = rows.tolist()
        self.where = [self.where[i] for i in picked]
        self.at = self.at.index_select(0, rows)
        if self.memory is not None:
            sentences = self._sentences(rows)
            if sentences is None:  # the rows of a sentence part ways: a memory for each row from here on
                self._memory_per_row()
                sentences = rows
            self._map_memory(lambda t: t.index_select(0, sentences))
        self._views()


def _room(positions: int) -> int:
    """Room for `positions` and as many again (at least `StaticState.GROWTH`): the cache grows by doubling."""
    return max(StaticState.GROWTH, 2 * positions)


__all__ = ["Batch", "Part", "RunningBatch", "SharedState"]
