"""How a search drives a decoder: `start` on the sources, then one `step` per new token (the KV cache inside).

Greedy decoding, sampling and beam search (`aiayn.inference.generation`) see a decoder only through this
small protocol, so any model that implements it is searched the same way:

    state = start(model, src, steps, beams=k)   # encode once; the memory's keys and values once
    logits = state.step(tokens)                  # (N, 1) newest tokens -> (N, V) next-token logits
    state.reorder(parents)                       # beam search: rows continue other rows' prefixes

An encoder-decoder's states (`start`), two implementations:
- `StaticState`, the fast one: every layer's self-attention keys and values in one buffer with room for 16
  positions beyond those filled, doubled when full, up to the search's `steps`; the memory's keys and values
  projected and kept once per sentence (the beams of a sentence attend to them together, as the queries of one
  product); and each step one flat function over the layers' own parts as plain functions, made once per row class
  (`aiayn.inference.parts`: the products on the kernels the backend chose for those rows, the attention, the layer
  norms): about fifteen tensor operations a layer, no per-step allocation of the cache, no branching on data; on
  one thread at the rows where that was measured faster than on all (`aiayn.inference.threads`).
  Cross-attention is absorbed into the memory where the backend chose that (`backends.absorbed`).
- `FixedState`, the flat step at one fixed shape, which a CUDA graph captures once per search and replays per
  token where the backend chose graphs (`Backend.cuda_graphs`): on a GPU a step is otherwise bound by
  launching its hundred-odd kernels, not by running them.
- `ModuleState`: the modules' own `decode`, for what the flat step does not do: recording attention weights
  (`return_attention`), and models whose modules a hook watches (profilers, `aiayn inspect`).
All compute the same arithmetic; `tests/inference/test_steps.py` holds them equal to each other and to
recomputing the whole prefix at every step. A decoder-only model (`start_causal`) runs the same flat step with no
cross-attention (`StaticState` on prompts: the prompt runs once through the model's own `decode`, its keys and
values copied into the static cache), in a CUDA graph where the backend chose graphs, and on its modules'
caches (`CausalState`) where hooks watch them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends.absorbed import AbsorbedCrossAttention
from aiayn.backends.hooks import hooked
from aiayn.backends.shapes import row_class
from aiayn.inference import parts, threads
from aiayn.inference.buffers import Owned
from aiayn.nn.attention import attention_bias, attention_weights
from aiayn.nn.layers import DecoderLayer, EncoderLayer
from aiayn.nn.model import DecoderOnlyModel, EncoderDecoderModel


class DecodingState(Protocol):
    """One search's decoder state: `step` feeds the newest tokens, `reorder` keeps or permutes rows."""

    attention: torch.Tensor | None  # the latest step's cross-attention (N, n_layers, h, S) when recorded

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) -> next-token logits (N, V) in float32: a new tensor each step, the caller's,
        which the search may write into."""

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """Row i continues the prefix of row `rows[i]`; with `memory_rows`, row i now reads the source of
        row `memory_rows[i]` (sentences left the batch). Indices of the rows before this call."""


def start(model: EncoderDecoderModel, src: torch.Tensor, steps: int, *, beams: int = 1,
          record: bool = False) -> DecodingState:
    """Encode `src` (B, S) and return the state that generates up to `steps` tokens for `beams` rows per sentence
    (rows of a sentence adjacent: B * beams rows). `record` keeps each step's cross-attention weights."""
    if record or not StaticState.runs(model):
        return ModuleState(model, src, beams=beams, record=record)
    return _flat_state(model, src)(model, src, steps, beams=beams)


# -- a decoder-only model ----------------------------------------------------------------------------

def start_causal(model: DecoderOnlyModel, prompts: torch.Tensor, steps: int, *, beams: int = 1) -> DecodingState:
    """The state that continues `prompts` (B, P) of a decoder-only model by up to `steps` tokens, `beams` rows per
    prompt: the prompts but their last token are run once here, and the search's first step feeds that last token.
    The flat step as for an encoder-decoder model (`StaticState` on the prompts; in a CUDA graph where the backend
    chose graphs), the modules' own `decode` (`CausalState`) where hooks watch them."""
    if not StaticState.runs(model):
        return CausalState(model, prompts, beams=beams)
    return _flat_state(model, prompts)(model, prompts, steps, beams=beams)


def _flat_state(model: nn.Module, ids: torch.Tensor) -> type[StaticState]:
    """`FixedState`, replayed from a CUDA graph, where the backend chose graphs for a model on a GPU; else
    `StaticState`."""
    return FixedState if ids.device.type == "cuda" and getattr(model, "cuda_graphs", False) else StaticState


class CausalState:
    """A decoder-only model's search state on its modules' `decode`: each layer's self-attention keys and values
    in a growing cache, from the prompt on (hooks see every module call)."""

    attention = None  # a decoder-only model has no cross-attention to record

    def __init__(self, model: DecoderOnlyModel, prompts: torch.Tensor, *, beams: int = 1):
        self.model = model
        self.caches = model.new_caches()
        ids = prompts.repeat_interleave(beams, dim=0)  # (B * beams, P): the beams of a prompt adjacent
        if ids.shape[1] > 1:
            model.decode(ids[:, :-1], caches=self.caches)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) -> next-token logits (N, V) in float32."""
        hidden = self.model.decode(tokens, caches=self.caches)  # (N, 1, d_model)
        return self.model.head(hidden[:, -1]).float()

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """See `DecodingState.reorder` (there is no memory: `rows` says everything)."""
        for cache in self.caches:
            cache.reorder(rows)


# -- the flat step over a static cache -----------------------------------------------------------------

class StaticState:
    """A search's state for the flat decoding step (see the module docstring)."""

    attention = None  # never recorded here: `start` takes `ModuleState` for that
    GROWTH = 16  # positions the cache first makes room for beyond those filled (`_capacity`)
    # A row's cached keys and values of at least this many bytes are reordered in place, a row at a time
    # (`_moved_in_place`): below it, one gather of every row is the cheaper (measured: docs/notes.md, "Decoding").
    ROW_COPY_BYTES = 128 << 10

    @staticmethod
    def runs(model: nn.Module) -> bool:
        """Whether the flat step computes what the model's own `decode` does: aiayn's decoder layers, or a
        decoder-only model's (encoder) layers, however the backend prepared their parts, with no hook that expects
        the module calls."""
        layers = list(model.decoder.layers)
        ours = any(all(type(layer) is kind for layer in layers) for kind in (DecoderLayer, EncoderLayer))
        return ours and not hooked(model.decoder)

    def __init__(self, model: EncoderDecoderModel | DecoderOnlyModel, ids: torch.Tensor, steps: int, *,
                 beams: int = 1):
        """The state of a search of up to `steps` tokens for `beams` rows per sentence (rows of a sentence adjacent).

        `ids`: an encoder-decoder model's source (B, S), encoded here, its memory's keys and values projected once
        per sentence; or a decoder-only model's prompts (B, P), all but their last token run once through the
        model's own `decode` and their keys and values copied into the cache (the search's first step feeds the
        last token, and `steps` more positions follow).
        """
        if model.config.has_cross_attention:
            self._encode(model, ids, steps, beams)
        else:
            self._prefill(model, ids, steps, beams)

    def _encode(self, model: EncoderDecoderModel, src: torch.Tensor, steps: int, beams: int) -> None:
        self.mask = model.source_mask(src)  # (B, 1, 1, S) or None
        # A short source on one thread where that was measured faster (`threads`): one sentence's encoding is a few
        # dozen rows.
        with threads.running_on(threads.fewer(model, "encoding", src.numel(), threads.ENCODING_ROWS, _timed_encoding)):
            memory = model.encode(src, self.mask)  # (B, S, d_model)
            self._allocate(model, model.tgt_embed, src.shape[0] * beams, steps, memory.dtype)
            # The memory's keys and values once per sentence, (B, h, S, d_k) each, read by its `beams` adjacent rows.
            self.beams = beams
            self.memory = [self._memory_side(layer.cross_attn, memory) for layer in self.layers]
            self.absorbed = [layer.cross_attn.absorb(*kv, self.mask) if isinstance(layer.cross_attn,
                                                                                   AbsorbedCrossAttention)
                             else None for layer, kv in zip(self.layers, self.memory)]  # where the backend absorbs
        # Read by every step's cross-attention: as the bias SDPA adds, made once, instead of a bool mask checked and
        # converted at every step (docs/notes.md, "Decoding").
        self.mask = attention_bias(self.mask, memory.dtype)

    def _prefill(self, model: DecoderOnlyModel, prompts: torch.Tensor, steps: int, beams: int) -> None:
        filled = prompts.shape[1] - 1
        self._allocate(model, model.embed, prompts.shape[0] * beams, filled + steps, model.embed.tokens.weight.dtype,
                       filled=filled)
        self.memory, self.mask, self.absorbed, self.beams = None, None, [], beams  # no cross-attention
        if filled:
            caches = model.new_caches()
            # once per prompt, then once per beam row; a short prompt on one thread where measured faster (`threads`)
            fewer = threads.fewer(model, "encoding", prompts.shape[0] * filled, threads.ENCODING_ROWS, _timed_encoding)
            with threads.running_on(fewer):
                model.decode(prompts[:, :-1], caches=caches)
            for i, cache in enumerate(caches):
                self.cache[i, 0, :, :, :filled] = cache.key.repeat_interleave(beams, dim=0)  # (N, h, P - 1, d_k)
                self.cache[i, 1, :, :, :filled] = cache.value.repeat_interleave(beams, dim=0)
        self.position = filled

    def _allocate(self, model: nn.Module, embed: nn.Module, rows: int, length: int, dtype: torch.dtype, *,
                  filled: int = 0) -> None:
        """The parts a step runs, and the cache of a search of `length` positions for `rows` rows, with room for the
        `filled` ones written first."""
        cfg = model.config
        self.embed = embed
        self.layers = list(model.decoder.layers)
        self.heads, self.d_k = cfg.n_heads, cfg.d_model // cfg.n_heads
        device = embed.tokens.weight.device
        # Self-attention's keys and values of every layer: (n_layers, 2, N, h, capacity, d_k), room for `capacity` of
        # the search's `length` positions (`_capacity`), more made as the search goes on (`_grow`). Taken from the
        # buffers earlier searches gave back, inside `reusing_buffers()` (a file's batches).
        self.length = length
        self.owned = Owned(self)
        self.cache = self.owned.empty((len(self.layers), 2, rows, self.heads, self._capacity(filled), self.d_k),
                                      dtype=dtype, device=device)
        # Reorder's target, as many rows as the search began with; swapped with the buffer that holds `cache`, which
        # is a view of its first rows once sentences have left.
        self.spare: torch.Tensor | None = None
        self.held = self.cache  # the whole buffer `cache` views
        self._views()
        self.position = 0
        self.positions = None if embed.positions is None else embed.positions(length).to(dtype)  # (length, d)
        self.model = model
        self.plans: dict[str, _Plan] = {}  # by row class (`_plan`)
        # By rows, the threads a step runs on where fewer than the process's were measured faster (`threads`), else
        # None; the state that times it (`_timed_steps`) measures nothing.
        self.threads: dict[int, int | None] = {}
        self.measures_threads = True

    def _plan(self, rows: int) -> _Plan:
        """The step's parts for `rows` rows, made the first time a step runs on rows of their row class and kept: each
        layer's sublayers as (norm first, norm, f, a), run as f(self, a, input), the final norm and the head, all as
        plain functions (`aiayn.inference.parts`): a step calls them without `nn.Module`'s call machinery and each
        product layer's choice of kernel, most of a small step's time besides its arithmetic (no hook watches these
        modules: `runs`). Nothing here holds the state itself, so that it is freed (and its buffers given back) as
        soon as its search ends."""
        final = self.model.decoder.final_norm
        plan = _Plan([self._layer_plan(i, layer, rows) for i, layer in enumerate(self.layers)],
                     None if final is None else parts.norm(final), parts.head(self.model.head, rows))
        self.plans[row_class(rows)] = plan
        return plan

    def _layer_plan(self, i: int, layer: nn.Module, rows: int) -> list[tuple[bool, Callable, Callable, object]]:
        cls = type(self)
        attn = layer.self_attn
        own = _Attention(i, parts.project_qkv(attn, rows), parts.attention(attn), parts.product(attn.out_proj, rows))
        if isinstance(layer, DecoderLayer):
            cross = layer.cross_attn.attn if isinstance(layer.cross_attn, AbsorbedCrossAttention) else layer.cross_attn
            sublayers = [(layer.self_attn_sublayer, cls._self_attention, own),
                         (layer.cross_attn_sublayer, cls._cross_attention,
                          _Attention(i, parts.product(cross.q_proj, rows), parts.attention(cross),
                                     parts.product(cross.out_proj, rows)))]
        else:  # a decoder-only model's layer: self-attention, then the feed-forward network
            sublayers = [(layer.attn_sublayer, cls._self_attention, own)]
        sublayers.append((layer.ffn_sublayer, _feed_forward, parts.feed_forward(layer.feed_forward, rows)))
        return [(connection.norm_first, parts.norm(connection.norm), f, a) for connection, f, a in sublayers]

    def _capacity(self, filled: int) -> int:
        """The positions the cache makes room for while `filled` are written: `GROWTH` more, doubled as it grows, up
        to the search's length. A search's length is a limit most sentences end far before (the source's length + 50
        by default); each of a row's heads keeps its positions together, so a cache made for the whole length spreads
        a short sentence's keys over many more memory pages than they fill, each mapped on its first write (page
        faults: docs/notes.md, "Decoding")."""
        return min(self.length, max(self.GROWTH, 2 * filled))

    def _grow(self) -> None:
        """Move the cache's filled positions into a buffer with room for more (`_capacity`)."""
        p, filled = self.position, self.cache
        cache = self.owned.empty((*filled.shape[:4], self._capacity(p), filled.shape[5]), dtype=filled.dtype,
                                 device=filled.device)
        cache[:, :, :, :, :p] = filled[:, :, :, :, :p]
        for old in (self.held, self.spare):  # the buffers the cache moved between, both too short now
            if old is not None:
                self.owned.drop(old)
        self.cache = self.held = cache
        self.spare = None
        self._views()

    def _views(self) -> None:
        """Each layer's keys and values, (N, h, length, d_k) views of the cache, made again when the cache moves."""
        self.kv = [tuple(pair.unbind(0)) for pair in self.cache.unbind(0)]

    def _memory_side(self, attn: nn.Module, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, length, _ = memory.shape
        k, v = attn.project_kv(memory)  # (B, S, d_model) each
        return tuple(t.view(b, length, self.heads, self.d_k).transpose(1, 2).contiguous() for t in (k, v))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) -> logits (N, V) in float32; the keys and values of this position are kept."""
        if self.position == self.cache.shape[4]:
            self._grow()
        logits = self._forward(tokens)
        self.position += 1
        return logits

    def _position_row(self) -> torch.Tensor:
        """The positional encoding of this step's position, (d_model,)."""
        return self.positions[self.position]

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's arithmetic: tokens (N, 1) -> logits (N, V) in float32, this position's keys and values cached."""
        embed = self.embed
        x = F.embedding(tokens, embed.tokens.weight)  # (N, 1, d_model)
        if embed.tokens.scale != 1.0:
            x = x * embed.tokens.scale
        if self.positions is not None:
            x = x + self._position_row()
        if embed.token_types is not None:  # every target token is of type 0, as `Embeddings` makes them
            x = x + embed.token_types.weight[0]
        if embed.norm is not None:
            x = embed.norm(x)
        rows = tokens.shape[0]
        plan = self.plans.get(row_class(rows)) or self._plan(rows)
        fewer = self.threads[rows] if rows in self.threads else self._threads(rows)
        if fewer is None:
            return self._layers(plan, x)
        process = torch.get_num_threads()
        torch.set_num_threads(fewer)
        try:
            return self._layers(plan, x)
        finally:
            torch.set_num_threads(process)

    def _threads(self, rows: int) -> int | None:
        """Fewer threads than the process's for a step of `rows` rows where measured faster (`threads.fewer`,
        measured the first time such a step is asked for), else None; kept for the rest of the search."""
        fewer = (threads.fewer(self.model, "step", rows, threads.STEP_ROWS, _timed_steps) if self.measures_threads
                 else None)
        self.threads[rows] = fewer
        return fewer

    def _layers(self, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens x (N, 1, d_model) through the layers of `plan`, the final norm and the head."""
        for sublayers in plan.layers:
            for norm_first, norm, f, a in sublayers:  # `SublayerConnection` at inference (dropout is the identity)
                x = x + f(self, a, norm(x)) if norm_first else norm(x + f(self, a, x))
        if plan.final_norm is not None:
            x = plan.final_norm(x)
        return plan.head(x[:, 0]).float()  # (N, V)

    def _self_attention(self, a: _Attention, y: torch.Tensor) -> torch.Tensor:
        rows = y.shape[0]
        q, k, v = a.project(y)  # (N, 1, d_model) each
        here = (rows, self.heads, 1, self.d_k)  # this position's key and value per head
        keys, values, mask = self._cached(a.index, k.view(here), v.view(here))
        out = a.attend(q.view(rows, 1, self.heads, self.d_k).transpose(1, 2), keys, values, mask)  # (N, h, 1, d_k)
        return a.out(out.transpose(1, 2).reshape(rows, 1, -1))  # (N, 1, d_model): heads concatenated

    def _cached(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple:
        """Layer i's key and value of this position (N, h, 1, d_k) written into the cache; the keys and values
        to attend over (N, h, p + 1, d_k), the prefix and this position, and their mask (None: all of them)."""
        p = self.position
        keys, values = self.kv[i]  # (N, h, length, d_k) each
        keys.narrow(2, p, 1).copy_(key)
        values.narrow(2, p, 1).copy_(value)
        return keys.narrow(2, 0, p + 1), values.narrow(2, 0, p + 1), None

    def _cross_attention(self, a: _Attention, y: torch.Tensor) -> torch.Tensor:
        """y (N, 1, d_model) -> (N, 1, d_model): the `beams` rows of a sentence are the queries of its memory."""
        i, rows, beams = a.index, y.shape[0], self.beams
        sentences = rows // beams
        if self.absorbed[i] is not None:
            absorbed = self.layers[i].cross_attn
            return absorbed.attend_absorbed(y.view(sentences, beams, -1), self.absorbed[i]).view(rows, 1, -1)
        q = a.project(y).view(sentences, beams, self.heads, self.d_k).transpose(1, 2)  # (B, h, beams, d_k)
        out = a.attend(q, *self.memory[i], self.mask)
        return a.out(out.transpose(1, 2).reshape(rows, 1, -1))  # (N, 1, d_model): heads concatenated

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """See `DecodingState.reorder`; only the filled positions of the cache are copied."""
        p, n = self.position, rows.numel()
        if memory_rows is None and n == self.cache.shape[2] and self._moved_in_place(rows):
            return
        # Into the first n rows of a buffer kept until the cache grows: a buffer allocated anew at each retirement
        # costs its pages' first writes (page faults, about 10x the copy: docs/notes.md, "Decoding").
        if self.spare is None or self.spare.shape[2] < n:  # more rows than the search began with: a new buffer
            if self.spare is not None:
                self.owned.drop(self.spare)
            held = self.held
            self.spare = self.owned.empty((*held.shape[:2], max(n, held.shape[2]), *held.shape[3:]), dtype=held.dtype,
                                          device=held.device)
        target = self.spare[:, :, :n]
        torch.index_select(self.cache[:, :, :, :, :p], 2, rows, out=target[:, :, :, :, :p])
        self.cache, self.held, self.spare = target, self.spare, self.held
        self._views()
        if memory_rows is None or self.memory is None:
            return
        sentences = self._sentences(memory_rows)
        if sentences is None:  # the rows of a sentence part ways: a memory for each row from here on
            self._memory_per_row()
            sentences = memory_rows
        self._map_memory(lambda t: t.index_select(0, sentences))

    def _moved_in_place(self, rows: torch.Tensor) -> bool:
        """Beam search's reorder of every row (none leaving) in the cache itself, moving only the rows that continue
        another row's prefix (about half of them at each step: the rest continue their own), where a row's keys and
        values are large enough (`ROW_COPY_BYTES`) that a call per row costs less than gathering every row into the
        spare buffer. A row whose prefix another row continues is kept aside before it is written. Returns whether
        it moved them."""
        cache, p = self.cache, self.position
        row_bytes = cache[:, :, 0, :, :p].numel() * cache.element_size()
        if cache.device.type != "cpu" or row_bytes < self.ROW_COPY_BYTES:
            return False
        parents = rows.tolist()
        moved = [i for i, parent in enumerate(parents) if parent != i]
        filled = cache[:, :, :, :, :p]  # (n_layers, 2, N, h, p, d_k)
        written = set(moved)
        kept = {parent: filled[:, :, parent].clone() for parent in {parents[i] for i in moved} if parent in written}
        for i in moved:
            parent = parents[i]
            filled[:, :, i].copy_(kept[parent] if parent in kept else filled[:, :, parent])
        return True

    def _map_memory(self, fn) -> None:
        """Replace each tensor kept per sentence (the memory's keys and values, their absorbed forms, the source mask)
        by `fn` of it."""
        self.memory = [tuple(fn(t) for t in kv) for kv in self.memory]
        self.absorbed = [None if f is None else tuple(fn(t) for t in f) for f in self.absorbed]
        self.mask = None if self.mask is None else fn(self.mask)

    def _sentences(self, memory_rows: torch.Tensor) -> torch.Tensor | None:
        """The sentences (of those before the call) whose memories the rows now read, one for each `beams` adjacent
        rows, as the searches move them (a finished sentence's rows leave together); None where `memory_rows` does
        not keep each group of rows on one sentence."""
        if self.beams == 1:
            return memory_rows
        if memory_rows.numel() % self.beams:
            return None
        groups = memory_rows.view(-1, self.beams) // self.beams  # (B', beams): the sentence each row reads
        return groups[:, 0] if bool((groups == groups[:, :1]).all()) else None

    def _memory_per_row(self) -> None:
        """Each row its own copy of its sentence's memory, so that rows may read any sentence's."""
        copies = self.beams
        self._map_memory(lambda t: t.repeat_interleave(copies, dim=0))
        self.beams = 1


_CAPTURING = threading.Lock()  # CUDA allows one graph capture at a time in a process


class FixedState(StaticState):
    """The flat step at one fixed shape, so that a CUDA graph can replay it (gpt-fast's `reduce-overhead`, Hugging
    Face's static cache): the same kernels on the same buffers at every position.

    - The position is a tensor on the device, advanced by the step itself; self-attention reads the whole
      preallocated cache, the positions not yet written masked out (they hold zeros, never NaN).
    - The rows stay those the search started with. When rows leave (finished sentences), the rows that go on are
      gathered to the front and the rest are carried along unread: `step` takes and returns the first rows.
    - `reorder` gathers rows in place, into the buffers the graph was captured on.

    On CUDA (`capture`) the step is captured once per search and replayed per token; elsewhere it runs as written,
    which is how the tests check its arithmetic against `StaticState` on any machine.
    """

    WARMUP = 2  # eager runs before capture, on a side stream: the allocator and each kernel's first use

    def _capacity(self, filled: int) -> int:
        return self.length  # the graph reads one buffer for the whole search

    def __init__(self, model: EncoderDecoderModel | DecoderOnlyModel, ids: torch.Tensor, steps: int, *,
                 beams: int = 1, capture: bool | None = None):
        """`StaticState`'s; `capture`: record the step in a CUDA graph (None: where the cache is on a CUDA device)."""
        super().__init__(model, ids, steps, beams=beams)
        rows, device, p = self.cache.shape[2], self.cache.device, self.position
        self.cache[:, :, :, :, p:].zero_()  # a masked position's value meets a zero weight: no NaN may sit there
        self.at = torch.full((1,), p, dtype=torch.long, device=device)  # this step's position
        self.slots = torch.arange(self.cache.shape[4], device=device)  # every position of the cache
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # the step's input, written in place
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer
        if device.type == "cuda" if capture is None else capture:
            self._capture()

    def _capture(self) -> None:
        """Warm up on a side stream, then record one step. One capture at a time in a process (CUDA's rule), on the
        cache's own device, and only this thread's calls are held to the capture's rules: passes of a server in
        other threads go on decoding meanwhile."""
        p, device = self.position, self.cache.device
        with _CAPTURING, torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(self.WARMUP):
                    self.at.fill_(p)
                    self._forward(self.tokens)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
                self.logits = self._forward(self.tokens)  # recorded, not run
            self.at.fill_(p)  # the warm-up's writes undone
            self.cache[:, :, :, :, p:].zero_()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) of the rows in use -> logits (N, V) in float32."""
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        if self.graph is None:
            logits = self._forward(self.tokens)
        else:
            with torch.cuda.device(self.cache.device):  # replayed on its own device's stream, whichever is current
                self.graph.replay()
            logits = self.logits
        self.position += 1
        return logits[:n].clone()  # the graph's buffer is written again by the next step

    def _position_row(self) -> torch.Tensor:
        return self.positions.index_select(0, self.at)  # (1, d_model)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.visible = (self.slots <= self.at).view(1, 1, 1, -1)  # (1, 1, 1, steps): this position and before
        logits = super()._forward(tokens)
        self.at.add_(1)
        return logits

    def _cached(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple:
        """Written at the position `at` holds; the whole cache is attended over, the positions after it masked."""
        keys, values = self.cache[i]  # (N, h, steps, d_k) each
        keys.index_copy_(2, self.at, key)
        values.index_copy_(2, self.at, value)
        return keys, values, self.visible

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """See `DecodingState.reorder`: the rows that go on are gathered to the front of the same buffers, and the
        sentences that go on to the front of the memory's. The rows of a sentence stay together (as the searches
        move them): the buffers keep their shapes."""
        p, n = self.position, rows.numel()
        moves_memory = memory_rows is not None and self.memory is not None
        sentences = self._sentences(memory_rows) if moves_memory else None
        if moves_memory and sentences is None:  # refused before anything moved
            raise ValueError("a fixed-shape step keeps the rows of a sentence together: memory_rows must move each "
                             f"group of {self.beams} adjacent rows onto one sentence")
        if p:
            if self.spare is None:  # the gathered rows, before they are copied back where the graph reads them
                self.spare = torch.empty_like(self.cache)
            gathered = self.spare[:, :, :n, :, :p]
            torch.index_select(self.cache[:, :, :, :, :p], 2, rows, out=gathered)
            self.cache[:, :, :n, :, :p] = gathered
        if sentences is None:
            return

        def gathered_in_place(t: torch.Tensor) -> torch.Tensor:  # the same buffer: the graph reads it
            t[: sentences.numel()] = t.index_select(0, sentences)
            return t

        self._map_memory(gathered_in_place)


class _Attention(NamedTuple):
    """An attention sublayer of a step's plan (`StaticState._layer_plan`): layer `index`'s parts as plain functions."""

    index: int
    project: Callable  # y (N, 1, d_model) -> self-attention's Q, K and V; cross-attention's Q
    attend: Callable  # (q, k, v, mask) -> (B, h, L_q, d_k)
    out: Callable  # the output projection, (N, 1, d_model) -> (N, 1, d_model)


class _Plan(NamedTuple):
    """A step's parts for one row class (`StaticState._plan`)."""

    layers: list  # per layer, its sublayers as (norm first, norm, f, a)
    final_norm: Callable | None
    head: Callable  # (N, d_model) -> (N, V)


def _feed_forward(state: StaticState, ffn: Callable, y: torch.Tensor) -> torch.Tensor:
    """A feed-forward sublayer in a step's plan (`StaticState._layer_plan`): `ffn(y)`."""
    return ffn(y)


TIMED_STEPS = 2  # the steps of one timed pass of `_timed_steps`
TIMED_POSITION = 16  # the position they are timed from (each pass the same positions)


def _timed_steps(model: nn.Module, rows: int, process: int) -> dict[str, list[float]]:
    """`threads.timed` of `TIMED_STEPS` steps of `model` over `rows` rows of random sentences on `process` threads and
    on one, every pass of either over the same positions of one state (`threads.fewer`)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    source = max(1, min(threads.TIMED_LENGTH, cfg.max_len // 2))  # a source (or prompt) as passes are timed on
    ids = torch.randint(cfg.vocab_size, (rows, source), generator=gen)
    filled = 0 if cfg.has_cross_attention else source - 1  # a prompt's positions come first
    start = max(0, min(TIMED_POSITION, cfg.max_len - filled - TIMED_STEPS))  # learned positions end at max_len
    tokens = torch.randint(cfg.target_vocab_size, (rows, 1), generator=gen)
    with threads.running_on(1):  # the state's encoding, and the steps to the position, are not what is timed
        state = StaticState(model, ids, start + TIMED_STEPS)
        state.measures_threads = False
        for _ in range(start):
            state.step(tokens)
    at = filled + start

    def run(n: int) -> None:
        state.position = at  # the same positions every pass (their keys and values written over)
        for _ in range(TIMED_STEPS):
            state.step(tokens)
    return threads.timed(run, process)


def _timed_encoding(model: nn.Module, tokens: int, process: int) -> dict[str, list[float]]:
    """`threads.timed` of encoding random sentences of `tokens` tokens in all (`threads.random_sentences`): an
    encoder-decoder model's encoder, or a decoder-only model's pass over prompts into fresh caches."""
    ids = threads.random_sentences(model, tokens)
    if not model.config.has_cross_attention:
        return threads.timed(lambda n: model.decode(ids, caches=model.new_caches()), process)
    mask = model.source_mask(ids)
    return threads.timed(lambda n: model.encode(ids, mask), process)


# -- the modules' own path ----------------------------------------------------------------------------------

class ModuleState:
    """A search's state on the modules' `decode` with a `KVCache`: every module is called as written, so hooks
    see each call, and cross-attention weights can be recorded (`record`)."""

    def __init__(self, model: EncoderDecoderModel, src: torch.Tensor, *, beams: int = 1, record: bool = False):
        self.model = model
        mask = model.source_mask(src)
        memory = model.encode(src, mask)  # (B, S, d_model)
        self.memory = memory.repeat_interleave(beams, dim=0)  # (N, S, d_model): beams of a sentence adjacent
        self.mask = None if mask is None else mask.repeat_interleave(beams, dim=0)
        self.cache = model.new_cache()
        self.record = record
        self.attention: torch.Tensor | None = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Newest token ids (N, 1) -> logits (N, V) in float32; with `record`, `attention` (N, n_layers, h, S)."""
        with _recording_cross_attention(self.model, self.record) as cross:
            hidden = self.model.decode(tokens, self.memory, memory_mask=self.mask, cache=self.cache)  # (N, 1, d)
        if cross is not None:
            self.attention = torch.stack([w[:, :, -1] for w in cross], dim=1)  # (N, n_layers, h, S)
        return self.model.head(hidden[:, -1]).float()  # (N, V)

    def reorder(self, rows: torch.Tensor, *, memory_rows: torch.Tensor | None = None) -> None:
        """See `DecodingState.reorder`."""
        for layer_cache in self.cache.self_attn:
            layer_cache.reorder(rows)
        if memory_rows is not None:
            self.memory = self.memory.index_select(0, memory_rows)
            self.mask = None if self.mask is None else self.mask.index_select(0, memory_rows)
            for layer_cache in self.cache.cross_attn:
                layer_cache.reorder(memory_rows)


@contextmanager
def _recording_cross_attention(model: EncoderDecoderModel, on: bool) -> Iterator[list[torch.Tensor | None] | None]:
    """When `on`, the list `attention_weights` keeps each decoder layer's latest cross-attention in; else None.

    Self-attention is written out too (its weights not kept), as the layers did when they returned
    weights on request: decoding with attention runs the same arithmetic as before, to the last bit.
    """
    if not on:
        yield None
        return
    layers = model.decoder.layers
    with attention_weights([layer.cross_attn for layer in layers]) as cross, \
            attention_weights([layer.self_attn for layer in layers], keep=False):
        yield cross


__all__ = ["CausalState", "DecodingState", "FixedState", "ModuleState", "StaticState", "start", "start_causal"]
