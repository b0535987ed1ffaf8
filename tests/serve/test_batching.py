"""`aiayn.serve.batching`: jobs queued together run as one batched call, each gets its own slice back, the token
budget splits batches, a failing batch is retried job by job, and a cancelled job leaves the queue unrun."""

import asyncio
import threading

import pytest

from aiayn.serve.batching import Batcher, Job, Passes, QueueFull
from aiayn.serve.limits import Stopped


def recording(calls, fail_on=None, gate=None):
    def run(texts):
        if gate is not None:
            gate.wait(timeout=30)
        calls.append(list(texts))
        if fail_on in texts:
            raise ValueError(f"cannot take {fail_on!r}")
        return [text.upper() for text in texts]

    return run


def test_jobs_queued_together_run_as_one_batch_and_get_their_own_answers():
    calls = []

    async def main():
        batcher = Batcher(recording(calls), Passes(1), max_tokens=100, max_wait=0.01)
        jobs = [["a"], ["b", "c"], ["d"], ["e", "f", "g"]]
        return await asyncio.gather(*(batcher.submit(texts, len(texts)) for texts in jobs))

    assert asyncio.run(main()) == [["A"], ["B", "C"], ["D"], ["E", "F", "G"]]
    assert calls == [["a", "b", "c", "d", "e", "f", "g"]]


def test_the_token_budget_splits_batches():
    calls = []

    async def main():
        batcher = Batcher(recording(calls), Passes(1), max_tokens=4, max_wait=0.01)
        return await asyncio.gather(*(batcher.submit([t], 2) for t in "abcde"))

    assert asyncio.run(main()) == [["A"], ["B"], ["C"], ["D"], ["E"]]
    assert calls == [["a", "b"], ["c", "d"], ["e"]]


def test_the_text_cap_splits_batches():
    calls = []

    async def main():
        batcher = Batcher(recording(calls), Passes(1), max_texts=3, max_wait=0.01)
        return await asyncio.gather(*(batcher.submit(list(texts), 1) for texts in ("ab", "c", "de", "f")))

    assert asyncio.run(main()) == [["A", "B"], ["C"], ["D", "E"], ["F"]]
    assert calls == [["a", "b", "c"], ["d", "e", "f"]]


def test_idle_passes_share_the_queue_and_run_side_by_side():
    calls, both = [], threading.Barrier(2, timeout=10)  # broken unless two batches are in flight at once

    def run(texts):
        calls.append(list(texts))
        both.wait()
        return [text.upper() for text in texts]

    async def main():
        batcher = Batcher(run, Passes(2), max_tokens=100, max_wait=0.01)
        return await asyncio.gather(*(batcher.submit([t], 1) for t in "abcdefgh"))

    assert asyncio.run(main()) == [[t.upper()] for t in "abcdefgh"]
    assert calls == [list("abcd"), list("efgh")]  # half each, not all eight on one pass and none on the other


def test_a_job_that_waited_for_a_pass_runs_without_waiting_the_window_again():
    calls, gate = [], threading.Event()

    async def main():
        batcher = Batcher(recording(calls, gate=gate), Passes(1), max_wait=0.5)
        first = asyncio.ensure_future(batcher.submit(["first"], 1))
        await asyncio.sleep(0.01)
        while batcher.queue:  # until the first has waited its window and its batch holds the only pass
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(batcher.submit(["second"], 1))
        await asyncio.sleep(0.6)  # longer than the window, waiting for the only pass
        gate.set()
        await first
        start = asyncio.get_running_loop().time()
        await second
        return asyncio.get_running_loop().time() - start

    assert asyncio.run(main()) < 0.4  # it ran as soon as the pass was free (the window of 0.5 s had passed)
    assert calls == [["first"], ["second"]]


def test_a_failing_batch_fails_only_the_job_that_caused_it():
    calls = []

    async def main():
        batcher = Batcher(recording(calls, fail_on="bad"), Passes(1), max_wait=0.01)
        return await asyncio.gather(batcher.submit(["ok"], 1), batcher.submit(["bad"], 1),
                                    batcher.submit(["fine"], 1), return_exceptions=True)

    ok, bad, fine = asyncio.run(main())
    assert ok == ["OK"] and fine == ["FINE"]
    assert isinstance(bad, ValueError) and "'bad'" in str(bad)
    assert calls[0] == ["ok", "bad", "fine"]  # together first, then one at a time


def test_a_cancelled_job_leaves_the_queue_and_never_runs_and_a_full_queue_refuses():
    calls, gate = [], threading.Event()

    async def main():
        batcher = Batcher(recording(calls, gate=gate), Passes(1), max_wait=0.0, max_queue=2)
        first = asyncio.ensure_future(batcher.submit(["first"], 1))
        while not batcher.passes.free.locked():  # the first batch holds the only pass
            await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(batcher.submit(["x", "y"], 2))
        await asyncio.sleep(0.01)
        assert batcher.queued_texts == 2
        with pytest.raises(QueueFull, match="retry later"):
            await batcher.submit(["z"], 1)
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert batcher.queued_texts == 0
        gate.set()
        return await first

    assert asyncio.run(main()) == ["FIRST"]
    assert calls == [["first"]]


def test_a_batcher_that_breaks_fails_its_queued_jobs_and_the_next_job_starts_it_again(monkeypatch):
    calls = []

    async def main():
        batcher = Batcher(recording(calls), Passes(1), max_wait=0.0)
        with monkeypatch.context() as patched:
            patched.setattr(batcher, "_take", lambda share=1: 1 / 0)  # a bug in the gathering loop
            with pytest.raises(RuntimeError, match="the batcher failed .ZeroDivisionError"):
                await asyncio.wait_for(batcher.submit(["lost"], 1), 10)  # answered, not left waiting
        return await batcher.submit(["next"], 1)

    assert asyncio.run(main()) == ["NEXT"]
    assert calls == [["next"]]


def test_passes_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Passes(0)


def test_a_slot_released_to_a_waiter_is_not_counted_idle():
    async def main():
        passes = Passes(1)
        await passes.acquire()
        waiter = asyncio.get_running_loop().create_task(passes.acquire())
        await asyncio.sleep(0)  # the waiter now waits for the slot
        passes.release()  # handed to the waiter, which has not run yet
        idle_before_it_runs = passes.idle
        await waiter
        return idle_before_it_runs, passes.busy, passes.idle

    assert asyncio.run(main()) == (0, 1, 0)


def test_a_batch_cancelled_before_or_while_it_runs_gives_its_slot_back_and_answers_its_jobs():
    calls, gate = [], threading.Event()

    async def main():
        passes = Passes(1)
        batcher = Batcher(recording(calls, gate=gate), passes, max_tokens=100, max_wait=0.0)
        outcomes = []
        for cancel_at_once in (True, False):
            await passes.acquire()  # as the gathering loop does before it starts a batch
            job = Job(["a"], 1, asyncio.get_running_loop().create_future())
            task = batcher._start_batch([job])
            if not cancel_at_once:
                await asyncio.sleep(0.05)  # the batch is inside the model's call, which waits for the gate
            task.cancel()  # the server stopping
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0)  # its done callback
            with pytest.raises(Stopped, match="server stopped"):
                await job.future
            outcomes.append((passes.busy, passes.idle))
        gate.set()
        passes.close()  # the started call finishes
        return outcomes

    assert asyncio.run(main()) == [(0, 1), (0, 1)]
    assert calls == [["a"]]  # only the second batch had started its call


def test_a_streaming_batch_answers_each_job_once_its_own_texts_are_done():
    """A translator's batch tells each text's result as its search ends: a job is answered then, not when the
    slowest text of its batch is; a failure later retries only the jobs not yet answered."""
    release, calls = threading.Event(), []

    def run(texts, on_result):
        calls.append(list(texts))
        for i, text in enumerate(texts):
            if text.startswith("slow"):
                continue
            on_result(i, text.upper())
        if "slow" in texts:
            assert release.wait(timeout=30)
        if "slow boom" in texts:
            raise ValueError("boom")
        return [text.upper() for text in texts]

    async def main():
        batcher = Batcher(run, Passes(1), max_tokens=100, max_wait=0.01, streams=True)
        fast = asyncio.ensure_future(batcher.submit(["a", "b"], 2))
        slow = asyncio.ensure_future(batcher.submit(["c", "slow"], 2))
        assert await asyncio.wait_for(fast, 10) == ["A", "B"]  # while its batch still runs
        assert not slow.done()
        release.set()
        assert await slow == ["C", "SLOW"]
        release.clear()
        answered = asyncio.ensure_future(batcher.submit(["d"], 1))
        failed = asyncio.ensure_future(batcher.submit(["slow boom"], 1))
        assert await asyncio.wait_for(answered, 10) == ["D"]
        release.set()
        with pytest.raises(ValueError, match="boom"):
            await failed

    asyncio.run(main())
    assert calls == [["a", "b", "c", "slow"], ["d", "slow boom"], ["slow boom"]]  # "d" is not run again
