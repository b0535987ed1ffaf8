"""A decoding step's and an encoding's threads: timed on the model itself by rows, kept per machine, and applied only
where measured."""

import numpy as np
import pytest
import torch

from aiayn.backends import calibrate, select, timing
from aiayn.config import ModelConfig
from aiayn.inference import steps, threads
from aiayn.inference.steps import StaticState
from aiayn.nn.model import build_model


@pytest.fixture
def two_threads():
    process = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(process)


MEASURED_WORK = threads.SEARCH_WORK, threads.PASS_WORK  # the library's, before the fixture below sets them to 0


@pytest.fixture(autouse=True)
def _test_batches_side_by_side(monkeypatch):
    """The test models' batches are far smaller than any that gains from running side by side
    (`threads.SEARCH_WORK`, `PASS_WORK`): here they run side by side as a real model's would, unless a test says
    otherwise."""
    monkeypatch.setattr(threads, "SEARCH_WORK", 0)
    monkeypatch.setattr(threads, "PASS_WORK", 0)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_chosen", {})


def _model(causal: bool = False, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = {"n_encoder_layers": 2, "causal": True, "n_decoder_layers": 0} if causal else {
        "n_encoder_layers": 1, "n_decoder_layers": 2}
    settings = {"max_len": 64, **changes}
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, dropout=0.0, **layers,
                                    **settings)).eval()
    model.measured_threads = "fp32"  # as `Backend.prepare` marks a copy for CPU inference
    return model


def test_rows_take_the_nearest_measured_count_and_many_rows_keep_every_thread():
    assert [threads.counted(n, threads.STEP_ROWS) for n in (1, 2, 3, 7, 8, 9, 31, 32, 33, 128, 129, 1024)] == [
        1, 4, 4, 4, 16, 16, 16, 64, 64, 64, None, None]
    assert [threads.counted(n, threads.ENCODING_ROWS) for n in (1, 15, 16, 63, 64, 256, 257)] == [8, 8, 32, 32, 128,
                                                                                                  128, None]


def test_a_step_runs_on_one_thread_where_measured_faster_and_restores_the_count(two_threads, empty_cache, monkeypatch):
    timed = []

    def one_faster_up_to_four_rows(model, rows, process):
        timed.append((rows, process))
        assert torch.get_num_threads() == process
        return {"all": [1.0] * 4, "one": [0.5 if rows <= 4 else 1.0] * 4}
    seen = []
    real = steps.StaticState._layers

    def layers(self, plan, x):
        seen.append(torch.get_num_threads())
        return real(self, plan, x)
    monkeypatch.setattr(steps, "_timed_steps", one_faster_up_to_four_rows)
    monkeypatch.setattr(steps, "_timed_encoding", lambda *args: {"all": [1.0] * 4, "one": [1.0] * 4})
    monkeypatch.setattr(steps.StaticState, "_layers", layers)
    model, src = _model(), torch.randint(4, 50, (20, 5))
    with torch.no_grad():
        expected = StaticState(model, src, 4)
        expected.measures_threads = False
        state = StaticState(model, src, 4)
        torch.testing.assert_close(state.step(torch.full((20, 1), 7)), expected.step(torch.full((20, 1), 7)),
                                   atol=1e-5, rtol=0)  # the same arithmetic, sums split anew
        for rows in (3, 1, 1):  # sentences leave the batch: 3 rows take what 4 measured
            state.reorder(torch.arange(rows), memory_rows=torch.arange(rows))
            state.step(torch.full((rows, 1), 7))
        StaticState(model, src[:2], 4).step(torch.full((2, 1), 7))  # another search: measured already
    assert timed == [(16, 2), (4, 2), (1, 2)]
    assert seen == [2, 2, 1, 1, 1, 1] and torch.get_num_threads() == 2
    name = threads.key(model, "fp32")
    assert calibrate._measured_so_far().threads == {f"{name}: step at {n} rows": count for n, count in (
        (16, 2), (4, 1), (1, 1))} | {f"{name}: encoding at {n} rows": 2 for n in (128, 8)}
    assert "d_model 32 d_ff 64 heads 4 layers 1+2 vocabulary 50, default waits: step at 4 rows: on 1 thread" in (
        calibrate._measured_so_far().describe())


def test_a_short_source_is_encoded_on_one_thread_where_measured_faster(two_threads, empty_cache, monkeypatch):
    timed, seen = [], []

    def one_faster_at_few_tokens(model, tokens, process):
        timed.append(tokens)
        return {"all": [1.0] * 4, "one": [0.5 if tokens <= 8 else 1.0] * 4}
    real = type(_model()).encode

    def encode(self, src, mask=None):
        seen.append(torch.get_num_threads())
        return real(self, src, mask)
    monkeypatch.setattr(steps, "_timed_encoding", one_faster_at_few_tokens)
    monkeypatch.setattr(steps, "_timed_steps", lambda *args: {"all": [1.0] * 4, "one": [1.0] * 4})
    model = _model()
    monkeypatch.setattr(type(model), "encode", encode)
    with torch.no_grad():
        for sentences in (1, 2, 20, 1):  # 5, 10, 100 and 5 tokens: counted as 8, 8, 128 and 8
            StaticState(model, torch.randint(4, 50, (sentences, 5)), 4)
    assert timed == [8, 128] and seen == [1, 1, 2, 1] and torch.get_num_threads() == 2


def test_nothing_is_measured_on_one_thread_without_the_backends_mark_or_past_many_rows(empty_cache, monkeypatch):
    monkeypatch.setattr(steps, "_timed_steps", lambda *args: pytest.fail("measured"))
    monkeypatch.setattr(steps, "_timed_encoding", lambda *args: pytest.fail("measured"))
    model = _model()
    with torch.no_grad():
        StaticState(model, torch.randint(4, 50, (2, 5)), 4).step(torch.full((2, 1), 7))  # one thread (conftest)
        torch.set_num_threads(2)
        try:
            StaticState(model, torch.randint(4, 50, (200, 5)), 4).step(torch.full((200, 1), 7))  # many rows, tokens
            del model.measured_threads  # a copy no backend marked (plain, CUDA, training)
            StaticState(model, torch.randint(4, 50, (2, 5)), 4).step(torch.full((2, 1), 7))
        finally:
            torch.set_num_threads(1)


@pytest.mark.parametrize("causal", [False, True])
def test_the_timing_runs_real_steps_on_each_count(two_threads, causal, monkeypatch):
    counts = []
    real = steps.StaticState._forward

    def forward(self, tokens):
        counts.append((torch.get_num_threads(), self.measures_threads))
        return real(self, tokens)
    monkeypatch.setattr(steps.StaticState, "_forward", forward)
    with torch.no_grad():
        timed = steps._timed_steps(_model(causal), 3, 2)
    assert set(timed) == {"all", "one"} and all(len(t) == timing.REPEATS for t in timed.values())
    assert sorted(set(counts)) == [(1, False), (2, False)]  # the state that times it measures nothing itself
    assert counts.count((2, False)) == (timing.REPEATS + 1) * steps.TIMED_STEPS and torch.get_num_threads() == 2


def test_the_backend_marks_cpu_inference_copies_with_their_precision():
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
                                    n_decoder_layers=1, max_len=64, dropout=0.0))
    backend = select("cpu", "inference", "fp32", inference_shape=(32, 64, 50, 10_000))
    assert backend.measured_threads and backend.prepare(model).measured_threads == "fp32"
    assert not hasattr(select("cpu", "inference", "fp32", plain=True).prepare(model), "measured_threads")
    assert not hasattr(select("cpu", "train", "fp32").prepare(model), "measured_threads")


def test_the_encoding_is_timed_on_each_count_and_restores_it(two_threads, monkeypatch):
    counts = []
    model = _model()
    real = type(model).encode

    def encode(self, src, mask=None):
        counts.append((torch.get_num_threads(), tuple(src.shape)))
        return real(self, src, mask)
    monkeypatch.setattr(type(model), "encode", encode)
    with torch.no_grad():
        timed = steps._timed_encoding(model, 64, 2)  # 4 sentences of 16 tokens
    assert set(timed) == {"all", "one"} and all(len(t) == timing.REPEATS for t in timed.values())
    assert sorted(set(counts)) == [(1, (4, 16)), (2, (4, 16))] and torch.get_num_threads() == 2


def _one_faster_at_few_tokens(timed: list[int]):
    def time(model, tokens, process):
        timed.append(tokens)
        return {"all": [1.0] * 4, "one": [0.5 if tokens <= 8 else 1.0] * 4}
    return time


def _watching_threads(monkeypatch, module_class: type, method: str, seen: list[int]) -> None:
    real = getattr(module_class, method)

    def watched(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)
    monkeypatch.setattr(module_class, method, watched)


def test_a_short_sentence_is_embedded_on_one_thread_where_measured_faster(two_threads, empty_cache, monkeypatch):
    from aiayn.inference import runner
    from aiayn.inference.embeddings import Embedder

    timed, seen = [], []
    monkeypatch.setattr(runner, "_timed_encoding", _one_faster_at_few_tokens(timed))
    embedder = Embedder.from_pretrained()
    expected = embedder.embed(["Why?", "A man is eating food."])  # measured at 16 tokens, on both threads
    _watching_threads(monkeypatch, type(embedder.prepared_model()), "encode", seen)
    assert abs(embedder.embed("Why?") - expected[0]).max() < 1e-5  # 4 tokens
    embedder.embed(["A man is eating food."] * 20, batch_size=32)  # 20 x 8 tokens
    assert timed == [32, 8, 128] and seen == [1, 2] and torch.get_num_threads() == 2


def test_a_short_text_is_classified_on_one_thread_and_the_count_restored_between_batches(
        two_threads, empty_cache, monkeypatch, classification_run):
    from aiayn.inference import Classifier, runner

    timed, seen = [], []
    monkeypatch.setattr(runner, "_timed_encoding", _one_faster_at_few_tokens(timed))
    classifier = Classifier.from_pretrained(classification_run)
    _watching_threads(monkeypatch, type(classifier.prepared_model()), "forward", seen)
    monkeypatch.setattr(threads, "SIDE_BY_SIDE", 1)  # one batch at a time, each on the count measured for its rows
    counts = []
    classifier._each_batch([[5, 6, 7], [5] * 40], 1, lambda batch, logits: counts.append(torch.get_num_threads()))
    assert seen == [2, 1] and counts == [2, 2]  # longest first; the caller holds each batch on the process's count
    assert timed == [32, 8]


def test_the_embedding_timing_encodes_on_each_count(two_threads):
    from aiayn.inference import runner
    from aiayn.inference.embeddings import Embedder

    model = Embedder.from_pretrained().prepared_model()
    with torch.no_grad():
        timed = runner._timed_encoding(model, 16, 2)
    assert set(timed) == {"all", "one"} and torch.get_num_threads() == 2


def test_a_short_prompt_runs_on_one_thread_where_measured_faster(two_threads, empty_cache, monkeypatch):
    timed, seen, real = [], [], steps._timed_encoding
    monkeypatch.setattr(steps, "_timed_encoding", _one_faster_at_few_tokens(timed))
    monkeypatch.setattr(steps, "_timed_steps", lambda *args: {"all": [1.0] * 4, "one": [1.0] * 4})
    model = _model(causal=True)
    _watching_threads(monkeypatch, type(model), "decode", seen)
    with torch.no_grad():
        for prompts in (1, 20):  # 4 and 80 tokens before the last
            StaticState(model, torch.randint(4, 50, (prompts, 5)), 4)
        timed_for_real = real(model, 8, 2)  # a decoder-only model's pass into fresh caches
    assert timed == [8, 128] and seen[:2] == [1, 2] and torch.get_num_threads() == 2
    assert set(timed_for_real) == {"all", "one"}


@pytest.mark.parametrize("causal", [False, True])
def test_steps_are_timed_within_a_short_models_learned_positions_and_any_repeats(two_threads, empty_cache, causal,
                                                                                monkeypatch):
    monkeypatch.setattr(timing, "REPEATS", 2)  # read when the timing runs
    model = _model(causal, max_len=12, positional="learned")
    with torch.no_grad():
        for rows in (1, 4):  # steps at 1 and 4 rows, encodings of 5 and 20 tokens (counted as 8 and 32)
            StaticState(model, torch.randint(4, 50, (rows, 5)), 6).step(torch.full((rows, 1), 7))
    assert len(calibrate._measured_so_far().threads) == 4


def test_no_rows_measure_nothing_and_a_cache_with_a_count_not_a_positive_integer_is_measured_again(
        two_threads, empty_cache, tmp_path, monkeypatch):
    from aiayn.inference.runner import ModelRunner, encoding_threads

    assert threads.counted(0, threads.STEP_ROWS) is None
    runner = ModelRunner(_model())
    assert encoding_threads(runner.prepared_model(), torch.zeros(0, 4, dtype=torch.long)) is None
    for count in ("1", None, 0, -1, 1.0):
        found = calibrate.Choices(threads={"a key": count})
        assert not calibrate._well_formed(found)
    assert calibrate._well_formed(calibrate.Choices(threads={"a key": 1}))


def test_a_choice_is_kept_per_thread_count_and_wait_policy(empty_cache, monkeypatch):
    timed = []

    def one_faster(model, rows, process):
        timed.append(process)
        return {"all": [1.0] * 4, "one": [0.5] * 4}
    model, process = _model(), torch.get_num_threads()
    try:
        for n in (2, 3, 2):
            torch.set_num_threads(n)
            assert threads.fewer(model, "step", 1, threads.STEP_ROWS, one_faster) == 1
    finally:
        torch.set_num_threads(process)
    assert timed == [2, 3]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    default = threads.key(model, "fp32")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert default.endswith("default waits") and threads.key(model, "fp32") == default.replace(
        "default waits", "OMP_WAIT_POLICY=PASSIVE")


def test_a_copy_prepared_from_a_marked_copy_carries_no_mark_unless_its_own_backend_marks_it():
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
                                    n_decoder_layers=1, max_len=64, dropout=0.0))
    marked = select("cpu", "inference", "fp32", inference_shape=(32, 64, 50, 10_000)).prepare(model)
    assert not hasattr(select("cpu", "inference", "fp32", plain=True).prepare(marked), "measured_threads")
    assert not hasattr(select("cpu", "train", "fp32").prepare(marked), "measured_threads")


def test_a_files_batches_run_side_by_side_on_one_thread_each_as_they_do_one_at_a_time(two_threads, empty_cache,
                                                                                      translation_run, monkeypatch):
    from aiayn.inference import Translator

    lines = [" ".join(["one", "two", "three", "four"][: 1 + i % 4]) for i in range(23)] + ["", "five six"]
    translator = Translator.from_pretrained(translation_run)
    counts = []
    real = threads.side_by_side

    def watched(run, items, workers):
        counts.append((workers, len(items)))
        return real(run, items, workers)
    monkeypatch.setattr(threads, "side_by_side", watched)
    heard, done = [], []
    both = translator.translations(lines, max_tokens=24, on_result=lambda i, t: heard.append(i), progress=done.append)
    torch.set_num_threads(1)
    alone = translator.translations(lines, max_tokens=24)
    assert [(t.text, t.tokens, t.score) for t in both] == [(t.text, t.tokens, t.score) for t in alone]
    assert counts[0][0] == 2 and counts[0][1] > 2 and counts[1][0] == 1  # two workers on two threads; one on one
    assert sorted(heard) == list(range(len(lines))) and sum(done) == len(lines)


def test_side_by_side_runs_each_item_on_its_share_and_raises_the_first_error(two_threads):
    import threading
    import time

    seen = []

    def run(item):
        seen.append((item, torch.get_num_threads()))
        if item == 0:
            time.sleep(0.3)  # still running when item 1 fails: no item after them starts
            raise KeyError("item 0")
        if item == 1:
            raise ValueError("item 1")
    with pytest.raises(KeyError, match="item 0"):  # the first item that failed, as one at a time raises it
        threads.side_by_side(run, list(range(8)), 2)
    assert sorted(item for item, _ in seen) == [0, 1] and all(count == 1 for _, count in seen)
    assert torch.get_num_threads() == 2
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]  # a thread started afterwards starts from the process's count, not a worker's
    ran = []
    threads.side_by_side(ran.append, [0, 1, 2], 1)  # one worker: in this thread, in order
    assert ran == [0, 1, 2]
    assert threads.side_by_side_workers(torch.device("cpu"), 5) == 2
    torch.set_num_threads(4)
    assert threads.side_by_side_workers(torch.device("cpu"), 5) == threads.SIDE_BY_SIDE == 2  # measured on two cores
    torch.set_num_threads(2)
    assert threads.side_by_side_workers(torch.device("cpu"), 1) == 1
    assert threads.side_by_side_workers(torch.device("meta"), 5) == 1  # a device other than the CPU: one at a time


def test_buffers_are_kept_for_every_search_that_runs_at_once():
    from aiayn.inference.buffers import BufferPool, reusing_buffers, searches_at_once

    searches_at_once(3)  # outside a pool: nothing to keep
    with reusing_buffers() as pool:
        searches_at_once(2)
        pool.give([torch.empty(n) for n in (1, 2, 3, 4, 5, 6)])
        assert pool.kept == 2 * BufferPool.KEPT and len(pool.free) == 4


def test_an_embedders_batches_run_side_by_side_with_the_vectors_of_one_thread(two_threads, empty_cache, monkeypatch):
    from aiayn.inference.embeddings import Embedder

    texts = ["A man is eating food.", "Why?", "The girl is carrying a baby.", "Two men play football in the rain."] * 5
    embedder = Embedder.from_pretrained()
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    done = []
    both = embedder.embed(texts, batch_size=4, progress=done.append)
    torch.set_num_threads(1)
    alone = embedder.embed(texts, batch_size=4)
    assert workers == [2, 1] and sum(done) == len(texts)
    np.testing.assert_array_equal(both, alone)


def test_a_classifiers_and_a_taggers_batches_run_side_by_side_with_the_predictions_of_one_thread(
        two_threads, empty_cache, monkeypatch, classification_run, tagging_run):
    from aiayn.inference import Classifier, Tagger

    classifier, tagger = Classifier.from_pretrained(classification_run), Tagger.from_pretrained(tagging_run)
    texts = ["one is good", "two", "three is bad and four is good", "Four visits Drei", "Five visits Zwei today"] * 4
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    both = classifier.probabilities(texts, batch_size=3), tagger.predict(texts, batch_size=3)
    torch.set_num_threads(1)
    alone = classifier.probabilities(texts, batch_size=3), tagger.predict(texts, batch_size=3)
    assert workers == [2, 2, 1, 1]
    np.testing.assert_array_equal(both[0], alone[0])
    assert both[1] == alone[1] and [w.word for w in both[1][2]] == texts[2].split()


def test_a_failing_batch_beside_another_raises_its_error_and_predicts_nothing_more(two_threads, monkeypatch,
                                                                                   classification_run):
    from aiayn.inference import Classifier

    classifier = Classifier.from_pretrained(classification_run)
    used = []

    def use(batch, logits):
        used.append(batch)
        raise RuntimeError("the caller's own failure")
    with pytest.raises(RuntimeError, match="the caller's own failure"):
        classifier._each_batch([[5, 6, 7]] * 12, 1, use)
    assert 1 <= len(used) <= 2  # the other worker's batch at most, no other started


def test_batches_that_record_attention_or_draw_from_torchs_generator_run_one_at_a_time(two_threads, empty_cache,
                                                                                      translation_run, monkeypatch):
    from aiayn.inference import GenerationConfig, Translator

    translator = Translator.from_pretrained(translation_run)
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    lines = ["one two", "three", "four five six", "seven"] * 3
    for config in (GenerationConfig(return_attention=True), GenerationConfig(do_sample=True),
                   GenerationConfig(do_sample=True, seed=3), GenerationConfig()):
        translator.translations(lines, config, max_tokens=12)
    assert workers == [1, 1, 2, 2]


def test_nothing_is_measured_in_a_side_by_side_worker(empty_cache, monkeypatch):
    model, process = _model(), torch.get_num_threads()
    monkeypatch.setattr(steps, "_timed_steps", lambda *args: pytest.fail("measured beside another batch"))
    chosen = []
    try:
        torch.set_num_threads(4)  # two workers of two threads each
        threads.side_by_side(lambda rows: chosen.append(threads.fewer(model, "step", rows, threads.STEP_ROWS,
                                                                      steps._timed_steps)), [1, 4], 2)
    finally:
        torch.set_num_threads(process)
    assert chosen == [None, None]


def test_an_encoders_batches_run_one_at_a_time_where_its_two_largest_would_not_fit_together(two_threads,
                                                                                           monkeypatch):
    from aiayn.inference import runner
    from aiayn.inference.embeddings import Embedder, length_sorted_batches
    from aiayn.nn.sizes import forward_bytes

    embedder = Embedder.from_pretrained()
    texts = ["A man is eating food."] * 9
    lengths = [len(row) for row in embedder.tokenize(texts)]
    batches = length_sorted_batches(lengths, 4)
    needs = [forward_bytes(embedder.model.config, len(batch), lengths[batch[0]]) for batch in batches]
    assert sorted(len(batch) for batch in batches) == [1, 4, 4] and len(batches[0]) == 1  # the first the smallest
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    together = sum(sorted(needs)[-2:])  # the two largest at once, not the first two
    for available in (together - 1, together):
        monkeypatch.setattr(runner, "available_memory", lambda available=available: available)
        embedder.embed(texts, batch_size=4)
    assert workers == [1, 2]


def test_batches_too_small_to_gain_run_one_at_a_time(two_threads, empty_cache, monkeypatch, translation_run,
                                                     classification_run):
    from aiayn.inference import Classifier, GenerationConfig, Translator

    search, encoding = MEASURED_WORK
    monkeypatch.setattr(threads, "SEARCH_WORK", search)
    monkeypatch.setattr(threads, "PASS_WORK", encoding)
    assert threads.side_by_side_workers(torch.device("cpu"), 5, search - 1, search) == 1
    assert threads.side_by_side_workers(torch.device("cpu"), 5, search, search) == 2
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    translator, classifier = Translator.from_pretrained(translation_run), Classifier.from_pretrained(classification_run)
    assert translator.model.config.d_model**2 * 32 < search  # this tiny model's steps of 32 rows are small
    translator.translations(["one two", "three"] * 32, GenerationConfig(num_beams=2), max_sentences=16)
    classifier.probabilities(["one is good"] * 64, batch_size=32)
    assert workers == [1, 1]


def test_an_item_running_beside_one_that_failed_ends_at_its_next_check(two_threads):
    import time

    steps_taken = []

    def run(item):
        if item == 1:
            time.sleep(0.05)
            raise ValueError("item 1")
        for step in range(200):  # a search: `check_stopped` at every step
            threads.check_stopped()
            steps_taken.append(step)
            time.sleep(0.01)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="item 1"):
        threads.side_by_side(run, [0, 1, 2], 2)
    assert time.perf_counter() - start < 1.5 and 0 < len(steps_taken) < 100  # not the 2 s its 200 steps take
    threads.check_stopped()  # outside a worker: nothing


def test_a_files_batches_run_one_at_a_time_where_the_largest_two_searches_would_not_fit_together(
        two_threads, empty_cache, translation_run, monkeypatch):
    from aiayn.data.batching import token_batches
    from aiayn.inference import GenerationConfig, Translator
    from aiayn.inference import translator as translator_module

    translator = Translator.from_pretrained(translation_run)
    workers = []
    real = threads.side_by_side
    monkeypatch.setattr(threads, "side_by_side", lambda run, items, n: (workers.append(n), real(run, items, n))[1])
    monkeypatch.setattr(translator_module, "search_bytes", lambda cfg, sentences, *rest: 100 * sentences)
    lines = ["one two three"] * 5 + ["four five"] * 3 + ["six"] * 2
    ids = translator.encode(lines)
    sizes = sorted(len(b) for b in token_batches([len(row) for row in ids], 24, shuffle=False))
    assert len(sizes) > 2
    together = 100 * (sizes[-1] + sizes[-2])  # the two largest searches' memory, as `search_bytes` is faked
    for available in (together - 1, together):
        monkeypatch.setattr(translator_module, "available_memory", lambda available=available: available)
        translator.translations(lines, GenerationConfig(), max_tokens=24)
    assert workers == [1, 2]
