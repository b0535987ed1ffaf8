"""The objects a server answers with: each object `aiayn.load` returned, its batcher, and what its routes need.

One class per kind of object (`SERVED`, found by `served_class`): a translator answers `/translate`, a generator
`/v1/completions`, an embedder `/v1/embeddings` and `/embed`, a classifier or tagger `/predict`. Each one counts a
request's tokens before it is queued (so a text the model cannot take is refused alone, with 422) and runs a
gathered batch through the object's own batched call (`call`): in the server's pass thread, or, given a
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
from aiayn.inference.generation import GenerationConfig
from aiayn.inference.generator import DEFAULT_SEARCH as GENERATOR_SEARCH
from aiayn.inference.generator import Completion, Generator
from aiayn.inference.running import Batch, Part
from aiayn.inference.translator import DEFAULT_SEARCH, Translator, search_settings
from aiayn.serve.batching import Batcher, Passes
from aiayn.serve.limits import ApiError, Limits
from aiayn.serve.metrics import Metrics
from aiayn.serve.stepping import PART_ROWS, Stepper, part_sentences
from aiayn.serve.stepping_workers import StepWorkers
from aiayn.serve.workers import WorkerPool
from aiayn.tasks import resolved, task_of

ANY_LANGUAGE = "auto"


class Served(abc.ABC):
    """A loaded object behind the server: its name, its batcher (or, for a model that decodes, its running batch:
    `stepper`) and its token counting."""

    kind = ""
    streams = False  # whether `call` can answer texts one by one, before its batch ends (`on_result`)
    stepped = False  # whether its requests join running batches at the step (`aiayn.serve.stepping`)

    def __init__(self, name: str, obj: Any, passes: Passes, limits: Limits, metrics: Metrics, *,
                 max_tokens: int = 4096, max_batch: int = 0, max_wait: float = 0.005, pool: WorkerPool | None = None,
                 stepping: bool = False, max_rows: int = 1024, steps: StepWorkers | None = None):
        self.name, self.obj, self.pool = name, obj, pool
        self.max_tokens = max_tokens
        self.metrics = metrics
        self.batcher = Batcher(self.run, passes, max_tokens=max_tokens, max_texts=max_batch, max_wait=max_wait,
                               max_queue=limits.max_queue, streams=self.streams,
                               observe=lambda texts, tokens, _: metrics.batch_done(name, texts, tokens))
        self.stepper: Stepper | StepWorkers.Model | None = None
        if steps is not None and name in steps.sources:  # running batches in worker processes
            self.stepper = steps.model(name)
        elif stepping and self.stepped:  # running batches, stepped in a thread a pass
            def build(payload, on_tokens):
                return self.parts(obj, payload, max_tokens=max_tokens, on_tokens=on_tokens)
            self.stepper = Stepper(build, obj.prepared_model, threads=passes.threads, workers=passes.size,
                                   max_rows=max_rows, max_tokens=max_tokens, max_queue=limits.max_queue,
                                   observe=lambda rows, seconds: metrics.step_done(name, rows, seconds),
                                   first_token=lambda seconds: metrics.first_token(name, seconds))
        if self.stepper is not None:
            metrics.queues[name] = lambda: self.stepper.waiting_texts
            metrics.running[name] = lambda: self.stepper.running_rows
        else:
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

    async def answer(self, texts: list[str], *, tokens: int | None = None) -> list:
        """Results of `texts`, batched with the other requests queued for this model (`tokens`: their count where the
        route has made it already)."""
        return await self.batcher.submit(texts, self.count_tokens(texts) if tokens is None else tokens)

    def describe(self) -> dict:
        """What `/health` and the page list for this model."""
        return {"name": self.name, "kind": self.kind}

    def close(self) -> None:
        """Stop its running batches' threads (the requests still in them get an error)."""
        if isinstance(self.stepper, Stepper):
            self.stepper.close()

    @staticmethod
    def parts(obj: Any, payload: list, *, max_tokens: int = 4096, on_tokens: Callable[[int, int], None] | None = None,
              part_rows: int = PART_ROWS) -> tuple[list[Part], Callable[[], list]]:
        """A decoding model's request as a running batch's parts (of at most `part_rows` rows, 0: as the object cuts
        its batches), and the call that makes its answer once they have ended (here or in a worker process);
        ValueError for one the model cannot take."""
        raise NotImplementedError(f"a {type(obj).__name__} has no steps")

    async def stepped_answer(self, payload: list, on_tokens: Callable[[int, int], None] | None = None) -> list:
        """The answer to `payload` from the running batches; ApiError 422 for a text the model cannot take."""
        try:
            return await self.stepper.submit(payload, len(payload), on_tokens)
        except ValueError as err:
            raise ApiError(422, str(err)) from None

    @staticmethod
    def part(batch: Batch, config: GenerationConfig, eos_id: int, done: Callable[[list[int], list, list], None],
             on_tokens: Callable[[int, int], None] | None = None) -> Part:
        """A running batch's `Part` of one of a request's batches: `done(indices, tokens, scores)` when its search
        ends; `on_tokens(index, token)` for each token made (streaming), `index` the text's place in the request."""
        told = None
        if on_tokens is not None:
            def told(sentences: list[int], tokens: list[int]) -> None:
                for sentence, token in zip(sentences, tokens):
                    on_tokens(batch.indices[sentence], token)
        return Part(batch.ids, batch.start, batch.limits, config, eos_id,
                    on_done=lambda tokens, scores: done(batch.indices, tokens, scores), on_error=lambda err: None,
                    on_tokens=told)


class ServedTranslator(Served):
    """A `Translator`: `translate` with its default search (the paper's beam 4, alpha 0.6)."""

    kind = "translate"
    stepped = True
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

    async def answer(self, texts: list[str], *, tokens: int | None = None) -> list:
        """The translations of `texts` with the default search; at the step where the server runs running batches."""
        if self.stepper is None:
            return await super().answer(texts, tokens=tokens)
        self.metrics.batch_done(self.name, len(texts), self.count_tokens(texts) if tokens is None else tokens)
        return await self.stepped_answer(texts)

    @staticmethod
    def parts(obj: Translator, texts: list[str], *, max_tokens: int = 4096,
              on_tokens: Callable[[int, int], None] | None = None,
              part_rows: int = PART_ROWS) -> tuple[list[Part], Callable[[], list[str]]]:
        """The parts of translating `texts` with the default search, and the call that gives their translations."""
        batches = obj.search_batches(texts, DEFAULT_SEARCH, max_tokens=max_tokens,
                                     max_sentences=part_sentences(DEFAULT_SEARCH, part_rows))
        out = [""] * len(texts)
        target = obj.target_tokenizer

        def done(indices: list[int], tokens: list[list[int]], scores: list) -> None:
            for i, text in zip(indices, target.decode_batch(tokens)):
                out[i] = text

        return [ServedTranslator.part(batch, DEFAULT_SEARCH, target.eos_id, done) for batch in batches], lambda: out

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

    def count_tokens(self, texts: Sequence[str], truncate: bool = True) -> int:
        """Tokens of `texts` as the model reads them (cut to its length); with `truncate` False, 422 for a text
        longer than that (the routes' check)."""
        return _counted(self.obj.tokenizer, texts, self.obj.max_length, truncate)

    @staticmethod
    def call(obj: Embedder, texts: list[str]) -> list:
        return list(obj.embed(texts))

    def describe(self) -> dict:
        return {**super().describe(), "dim": self.obj.dim}


class ServedLabeller(Served):
    """A `Classifier` (labels with scores) or a `Tagger` (a tag per word), in TEI's `/predict` shape."""

    kind = "predict"

    def count_tokens(self, texts: Sequence[str], truncate: bool = True) -> int:
        """Tokens of `texts` as the model reads them (cut to its length); with `truncate` False, 422 for a text
        longer than that (the routes' check)."""
        return _counted(self.obj.tokenizer, texts, self.obj.model.config.max_len, truncate)

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
    stepped = True

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


    async def answer(self, items: list[tuple[str, tuple]], on_tokens: Callable[[int, int], None] | None = None, *,
                     tokens: int | None = None) -> list:
        """The completions of `items` ((prompt, settings) pairs); at the step where the server runs running batches,
        and there `on_tokens(index, token)` hears of each token as it is made (`parts`)."""
        if self.stepper is None:
            return await super().answer(items, tokens=tokens)
        self.metrics.batch_done(self.name, len(items), self.count_tokens(items) if tokens is None else tokens)
        return await self.stepped_answer(items, on_tokens)

    @staticmethod
    def parts(obj: Generator, items: list[tuple[str, tuple]], *, max_tokens: int = 4096,
              on_tokens: Callable[[int, int], None] | None = None,
              part_rows: int = PART_ROWS) -> tuple[list[Part], Callable[[], list[Completion]]]:
        """The parts of completing `items`, and the call that gives their completions; `on_tokens(index, token)` for
        each token made, greedy or sampling (a beam's tokens are known only when its search ends)."""
        rows = obj.encode([prompt for prompt, _ in items])
        parts = []
        out: list[Completion | None] = [None] * len(items)
        for settings, indices in _by_settings(items).items():
            config = search_settings(GENERATOR_SEARCH, **dict(settings))
            # a seed's draws are its prompt's own: alone
            alone = 1 if config.do_sample and config.seed is not None else part_sentences(config, part_rows)
            for batch in obj.search_batches([rows[i] for i in indices], config, max_tokens=max_tokens,
                                            max_sentences=alone):
                batch = batch._replace(indices=[indices[j] for j in batch.indices])

                def done(places: list[int], tokens: list[list[int]], scores: list, config=config) -> None:
                    for i, new, score in zip(places, tokens, scores):
                        out[i] = obj.completion(rows[i], new, score, config)

                parts.append(ServedGenerator.part(batch, config, obj.tokenizer.eos_id, done, on_tokens))
        return parts, lambda: out


def _counted(tokenizer: Any, texts: Sequence[str], max_length: int, truncate: bool) -> int:
    """Tokens of `texts` as an encoder reads them, `[CLS] ... [SEP]`; ApiError 422 naming a text over `max_length`
    unless `truncate`."""
    try:
        return sum(len(ids) for ids in encode_texts(tokenizer, texts, max_length, truncate=truncate))
    except ValueError as err:
        raise ApiError(422, f"{str(err).split('; ')[0]}; shorten it, or send \"truncate\": true to cut it "
                            "(TEI's /embed and /predict)") from None


def _by_settings(items: Sequence[tuple[str, tuple]]) -> dict[tuple, list[int]]:
    """The items' places, by their settings."""
    groups: dict[tuple, list[int]] = {}
    for i, (_, settings) in enumerate(items):
        groups.setdefault(settings, []).append(i)
    return groups


def stepped_parts(obj: Any, payload: list, **options) -> tuple[list[Part], Callable[[], list]]:
    """A decoding object's request as a running batch's parts (`Served.parts` of its kind, `served_class`): what the
    processes of `aiayn.serve.stepping_workers` run. A plain text where the parts take (text, settings) gets the
    default settings, as in `batched_call` (a worker's warm-up)."""
    served = served_class(obj)
    return served.parts(obj, [served.queued(t) if isinstance(t, str) else t for t in payload], **options)


# How each kind of object `aiayn.load` gives is served.
SERVED: dict[type, type[Served]] = {Translator: ServedTranslator, Generator: ServedGenerator, Embedder: ServedEmbedder,
                                    Classifier: ServedLabeller, Tagger: ServedLabeller}


def served_class(obj: Any) -> type[Served]:
    """How `obj` is served (`SERVED`); ValueError for an object that is not what `aiayn.load` gives for its model
    (the object its model's objective loads, `Task.loaded`)."""
    config = getattr(getattr(obj, "model", None), "config", None)
    task = task_of(config) if isinstance(config, ModelConfig) else None
    loaded = resolved(task.loaded) if task is not None else None
    if loaded not in SERVED or not isinstance(obj, loaded):
        raise ValueError(f"a {type(obj).__name__} is not a loaded object aiayn serves (aiayn.load gives those)")
    return SERVED[loaded]


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
