"""The objects a server answers with: each object `aiayn.load` returned, its batcher, and what its routes need.

One class per kind of object, named by the objective that trains its model (`Task.served`, found by
`served_class`): a translator answers `/translate`, a generator `/v1/completions`, an embedder
`/v1/embeddings` and `/embed`, a classifier or tagger `/predict`. Each one counts a request's tokens
before it is queued (so a text the model cannot take is refused alone, with 422) and runs a gathered
batch through the object's own batched call (`call`): in the server's pass thread, or, given a
`WorkerPool`, in a worker process that holds its own copy of the object.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiayn.config import ModelConfig
from aiayn.inference.classifiers import Classifier, Prediction, Tagger
from aiayn.inference.embeddings import Embedder, encode_texts
from aiayn.inference.generator import Completion, Generator
from aiayn.inference.translator import DEFAULT_SEARCH, Translator
from aiayn.serve.batching import Batcher, Passes
from aiayn.serve.limits import ApiError, Limits
from aiayn.serve.metrics import Metrics
from aiayn.serve.workers import WorkerPool
from aiayn.tasks import resolved, task_of

ANY_LANGUAGE = "auto"


class Served(abc.ABC):
    """A loaded object behind the server: its name, its batcher and its token counting."""

    kind = ""
    streams = False  # whether `call` can answer texts one by one, before its batch ends (`on_result`)

    def __init__(self, name: str, obj: Any, passes: Passes, limits: Limits, metrics: Metrics, *,
                 max_tokens: int = 4096, max_batch: int = 0, max_wait: float = 0.005, pool: WorkerPool | None = None):
        self.name, self.obj, self.pool = name, obj, pool
        self.max_tokens = max_tokens
        self.batcher = Batcher(self.run, passes, max_tokens=max_tokens, max_texts=max_batch, max_wait=max_wait,
                               max_queue=limits.max_queue, streams=self.streams,
                               observe=lambda texts, tokens, _: metrics.batch_done(name, texts, tokens))
        metrics.queues[name] = lambda: self.batcher.queued_texts

    @abc.abstractmethod
    def count_tokens(self, texts: Sequence[str]) -> int:
        """Input tokens of `texts`; ApiError 422 for a text the model cannot take."""

    @staticmethod
    @abc.abstractmethod
    def call(obj: Any, texts: list[str], **options) -> list:
        """`obj`'s batched call on `texts`: one result per text, in order (here or in a worker process); where
        `streams`, also `on_result(i, result)` for each text as soon as its result is known."""

    @staticmethod
    def queued(text: str) -> Any:
        """What `call` takes for `text` with the default settings (a worker warms up on one)."""
        return text

    @property
    def options(self) -> dict:
        """The keyword arguments `call` gets from this server."""
        return {}

    def run(self, texts: list[str], on_result: Callable[[int, Any], None] | None = None) -> list:
        """`call` on this model's object, or on its copy in an idle worker process when there is a pool; with
        `on_result` (where `streams`), each text's result as soon as it is known."""
        if self.pool is not None:
            return self.pool.call(self.name, texts, self.options, on_result)
        extra = {"on_result": on_result} if on_result is not None else {}
        return self.call(self.obj, texts, **self.options, **extra)

    async def answer(self, texts: list[str]) -> list:
        """Results of `texts`, batched with the other requests queued for this model."""
        return await self.batcher.submit(texts, self.count_tokens(texts))

    def describe(self) -> dict:
        """What `/health` and the page list for this model."""
        return {"name": self.name, "kind": self.kind}


class ServedTranslator(Served):
    """A `Translator`: `translate` with its default search (the paper's beam 4, alpha 0.6)."""

    kind = "translate"
    streams = True  # a sentence is answered when its search ends, not when the longest of its batch does

    def __init__(self, name: str, obj: Translator, *args, **kwargs):
        super().__init__(name, obj, *args, **kwargs)
        source, _, target = name.partition("-")
        self.source, self.target = (source, target) if source and target else ("src", "tgt")

    def count_tokens(self, texts: Sequence[str]) -> int:
        try:
            return sum(len(ids) for ids in self.obj.encode(texts))
        except ValueError as err:
            raise ApiError(422, str(err)) from None

    @staticmethod
    def call(obj: Translator, texts: list[str], max_tokens: int = 4096,
             on_result: Callable[[int, str], None] | None = None) -> list[str]:
        """`obj.translate(texts)`, telling `on_result` of each translation as soon as it is known."""
        told = None if on_result is None else (lambda i, translation: on_result(i, translation.text))
        return [t.text for t in obj.translations(texts, max_tokens=max_tokens, on_result=told)]

    @property
    def options(self) -> dict:
        return {"max_tokens": self.max_tokens}

    def describe(self) -> dict:
        return {**super().describe(), "source": self.source, "target": self.target}

    def inspect(self, text: str) -> dict:
        """The page's view of one translation: tokens, cross-attention (layer, head, output, source), pipeline."""
        from aiayn.inspect import trace

        source_ids = self.obj.encode([text])[0]
        if not source_ids:
            raise ApiError(422, "the text is empty: type a sentence")
        config = dataclasses.replace(DEFAULT_SEARCH, return_attention=True)
        result = self.obj.translations([text], config, max_tokens=self.max_tokens)[0]
        target = self.obj.target_tokenizer
        with torch.inference_mode():
            stages = trace(self.obj.model, self.obj.source_tokenizer, text, target_tokenizer=target)
        attention = result.attention.float() if result.attention is not None else torch.zeros(0)
        return {"model": self.name, "translation": result.text,
                "source_tokens": self.obj.source_tokenizer.id_pieces(source_ids),
                "output_tokens": target.id_pieces(result.tokens),  # one per attention row
                "attention": attention.round(decimals=4).tolist(),  # (n_layers, n_heads, T, S)
                "pipeline": [_stage_json(s) for s in stages]}


def _stage_json(stage) -> dict:
    if isinstance(stage, str):
        return {"heading": stage}
    return {"name": stage.name, "shape": list(stage.shape), "values": [round(v, 4) for v in stage.values],
            "note": stage.note}


class ServedEmbedder(Served):
    """An `Embedder`: `embed`, one float32 vector per text."""

    kind = "embed"

    def count_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(ids) for ids in self.obj.tokenize(texts))

    @staticmethod
    def call(obj: Embedder, texts: list[str]) -> list:
        return list(obj.embed(texts))

    def describe(self) -> dict:
        return {**super().describe(), "dim": self.obj.dim}


class ServedLabeller(Served):
    """A `Classifier` (labels with scores) or a `Tagger` (a tag per word), in TEI's `/predict` shape."""

    kind = "predict"

    def count_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(ids) for ids in encode_texts(self.obj.tokenizer, texts, self.obj.model.config.max_len))

    @staticmethod
    def call(obj: Classifier | Tagger, texts: list[str]) -> list:
        return obj.predict(texts)

    @staticmethod
    def as_json(result: Prediction | list) -> list[dict]:
        """TEI's labels with scores, best first; for a tagger, one entry per word (`word`, `entity`, `score`)."""
        if isinstance(result, Prediction):
            return [{"label": label, "score": score}
                    for label, score in sorted(result.scores.items(), key=lambda item: -item[1])]
        return [{"word": tag.word, "entity": tag.tag, "score": tag.score, "index": i} for i, tag in enumerate(result)]


class ServedGenerator(Served):
    """A `Generator`: OpenAI's completions. A queued item is (prompt, settings), so requests with different
    settings share one queue; a batch runs one `generate` per distinct settings."""

    kind = "complete"

    def count_tokens(self, items: Sequence[tuple[str, tuple]]) -> int:
        try:
            return sum(len(ids) for ids in self.obj.encode([prompt for prompt, _ in items]))
        except ValueError as err:
            raise ApiError(422, str(err)) from None

    @staticmethod
    def queued(text: str) -> tuple[str, tuple]:
        """`text` as a prompt to continue greedily by 16 tokens (`max_tokens`' default)."""
        return text, (("max_new_tokens", 16),)

    @staticmethod
    def call(obj: Generator, items: list[tuple[str, tuple]]) -> list[Completion]:
        """`obj.generate` on each group of prompts that share their settings; the results in the items' order.
        Seeded sampling runs each prompt alone: its draws would otherwise depend on the prompts batched with it."""
        groups: dict[tuple, list[int]] = {}
        for i, (_, settings) in enumerate(items):
            options = dict(settings)
            alone = (i,) if options.get("do_sample") and options.get("seed") is not None else ()
            groups.setdefault((settings, *alone), []).append(i)
        out: list[Completion | None] = [None] * len(items)
        for (settings, *_), indices in groups.items():
            for i, completion in zip(indices, obj.generate([items[i][0] for i in indices], **dict(settings))):
                out[i] = completion
        return out  # type: ignore[return-value]


def served_class(obj: Any) -> type[Served]:
    """How `obj` is served: the `Served` class its model's objective names (`Task.served`); ValueError for an
    object that is not what `aiayn.load` gives."""
    config = getattr(getattr(obj, "model", None), "config", None)
    task = task_of(config) if isinstance(config, ModelConfig) else None
    if task is None or not isinstance(obj, resolved(task.loaded)):
        raise ValueError(f"a {type(obj).__name__} is not a loaded object aiayn serves (aiayn.load gives those)")
    return resolved(task.served)


def batched_call(obj: Any, texts: list, **options) -> list:
    """`obj`'s batched call (`Served.call` of its kind, `served_class`): what a `WorkerPool`'s processes run. A plain
    text where the call takes (text, settings) gets the default settings (`Served.queued`; a worker's warm-up)."""
    served = served_class(obj)
    return served.call(obj, [served.queued(t) if isinstance(t, str) else t for t in texts], **options)


def pick(models: Sequence[Served], kind: str, name: str | None) -> Served:
    """The model of `kind` called `name`; with only one of that kind, that one whatever the name."""
    of_kind = [m for m in models if m.kind == kind]
    if not of_kind:
        raise ApiError(404, f"this server has no model for {kind}; start it with a --run or --model that has one")
    named = [m for m in of_kind if m.name == name]
    if named:
        return named[0]
    other = [m for m in models if m.name == name]
    if other:  # the client meant that model, which does not do this
        raise ApiError(404, f"the model {name!r} is a {other[0].kind} model, not a {kind} one; this server's {kind} "
                            f"model{'s are' if len(of_kind) > 1 else ' is'} {', '.join(m.name for m in of_kind)}")
    if len(of_kind) == 1:
        return of_kind[0]
    raise ApiError(404, f"no {kind} model called {name!r}; this server has {', '.join(m.name for m in of_kind)}")


def pick_translator(models: Sequence[Served], source: str | None, target: str | None) -> ServedTranslator:
    """The translator for `source` -> `target` (source "auto": the one translator into `target`)."""
    translators = [m for m in models if isinstance(m, ServedTranslator)]
    fits = [m for m in translators if m.target == target and source in (m.source, ANY_LANGUAGE, None)]
    if len(fits) == 1 or (fits and source not in (ANY_LANGUAGE, None)):
        return fits[0]
    if len(translators) == 1:
        return translators[0]
    pairs = ", ".join(f"{m.source}-{m.target}" for m in translators) or "none"
    raise ApiError(404, f"no translator for {source} -> {target}; this server translates {pairs} (GET /languages)")
