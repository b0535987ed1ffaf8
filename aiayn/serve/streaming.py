"""`"stream": true` on OpenAI's `/v1/completions`: the completion as server-sent events, a chunk as tokens are made.

OpenAI's format, which its `openai` client reads with `stream=True`: each event is `data: {json}` and a blank line,
the json a `text_completion` object whose choices carry the new text (`text`), their `index` and a `finish_reason`
(null until the last chunk of that choice); `data: [DONE]` ends the stream. The tokens come from the model's running
batch (`aiayn.serve.stepping`) after every step. The text sent is held back where it could still change: the bytes
of a character split across tokens, and the characters that could begin a stop string. The last chunk of a choice
sends what the non-streamed answer holds beyond what was sent, so the chunks of a choice join into that answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from aiayn.inference.generator import first_stop
from aiayn.serve.limits import ApiError
from aiayn.serve.models import ServedGenerator

HELD = "\ufffd"  # what a character whose bytes are not all decoded yet reads as


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first of `stops` (not included, as `Generator.generate(stop=...)` cuts), and whether one
    occurred."""
    found = first_stop(text, stops)
    return (text[:found[0]], True) if found else (text, False)


def completion_stream(model: ServedGenerator, prompts: list[str], settings: tuple, stops: list[str],
                      echo: bool) -> StreamingResponse:
    """The streamed completions of `prompts` (checked, and queued, before the response starts: a refusal keeps its
    status)."""
    if model.stepper is None:
        raise ApiError(422, "streaming needs the server's running batch: start it without --batching requests")
    loop = asyncio.get_running_loop()
    made: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    items = [(prompt, settings) for prompt in prompts]
    tokens = model.count_tokens(items)  # a prompt the model cannot take: 422 before the stream starts
    model.stepper.check_room(len(items))
    task = asyncio.ensure_future(model.answer(items, lambda i, token: loop.call_soon_threadsafe(made.put_nowait,
                                                                                                (i, token)),
                                              tokens=tokens))
    return StreamingResponse(_events(model, prompts, task, made, stops, echo),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _events(model: ServedGenerator, prompts: list[str], task: asyncio.Future, made: asyncio.Queue,
                  stops: list[str], echo: bool) -> AsyncIterator[str]:
    generator = model.obj
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    rows = generator.encode(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    sent = [""] * len(prompts)
    stopped = [False] * len(prompts)
    hold = max((len(s) for s in stops), default=1) - 1  # a stop string's first characters, not yet known to be one

    def chunk(i: int, text: str, finish: str | None = None) -> str:
        body = {"id": ident, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def new_text(i: int) -> str:
        """What choice i can send now beyond what it sent."""
        text, stop = cut_at_stop(generator._continuation(rows[i], tokens[i]), stops)
        if stop:
            stopped[i] = True
        else:
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip(HELD)
        return text[len(sent[i]):] if text.startswith(sent[i]) else ""

    try:
        if echo:
            for i, prompt in enumerate(prompts):
                yield chunk(i, prompt)
        while True:
            getting = asyncio.ensure_future(made.get())
            await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():
                getting.cancel()
                break
            arrived = [getting.result()]
            while not made.empty():  # every token made meanwhile: one chunk a choice, not one a token
                arrived.append(made.get_nowait())
            grown = set()
            for i, token in arrived:
                if not stopped[i] and token != generator.tokenizer.eos_id:
                    tokens[i].append(token)
                    grown.add(i)
            for i in sorted(grown):
                text = new_text(i)
                if text:
                    sent[i] += text
                    yield chunk(i, text)
            if all(stopped):
                task.cancel()  # every choice met a stop string: its rows leave the running batch
                break
        try:
            results = None if task.cancelled() else task.result()
        except Exception as err:  # noqa: BLE001 (the status is sent: the error goes in the stream, as OpenAI's do)
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
            return
        for i in range(len(prompts)):
            if results is None:
                yield chunk(i, "", "stop")
                continue
            text, stop = cut_at_stop(results[i].text, stops)
            rest = text[len(sent[i]):] if text.startswith(sent[i]) else ""
            yield chunk(i, rest, "stop" if stop or results[i].ended else "length")
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():  # the client went away: the request's rows leave at the next step
            task.cancel()
