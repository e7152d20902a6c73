"""call_with_deadline: results and errors come back, a call past its deadline is abandoned with
StageTimeout, and the runner threads are reused (a fresh thread per stage call costs torch work a new
malloc arena and OpenMP team) except one whose call was abandoned."""

import threading

import pytest

from rlpipe.deadline import StageTimeout, call_with_deadline


def test_value_and_error_come_back():
    assert call_with_deadline(lambda: 41 + 1, 5.0, "here") == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 5.0, "here")
    assert call_with_deadline(lambda: threading.current_thread(), None, "here") is threading.current_thread()


def test_runner_thread_is_reused():
    first = call_with_deadline(threading.get_ident, 5.0, "here")
    assert first != threading.get_ident()
    assert all(call_with_deadline(threading.get_ident, 5.0, "here") == first for _ in range(5))
    with pytest.raises(ValueError):
        call_with_deadline(lambda: int("x"), 5.0, "here")
    assert call_with_deadline(threading.get_ident, 5.0, "here") == first  # an error does not lose the runner


def test_abandoned_runner_is_not_reused():
    release = threading.Event()
    hung_thread: list[int] = []

    def hang():
        hung_thread.append(threading.get_ident())
        release.wait(30)
        return "late"

    with pytest.raises(StageTimeout, match=r"timeout_s=0.2 s on the test \(a thread of this process"):
        call_with_deadline(hang, 0.2, "the test")
    # while the abandoned call still runs, the next call gets another thread and completes
    assert call_with_deadline(threading.get_ident, 5.0, "here") != hung_thread[0]
    release.set()
    for _ in range(5):  # the abandoned runner ends with its call and never takes another
        assert call_with_deadline(threading.get_ident, 5.0, "here") != hung_thread[0]


def test_concurrent_callers_get_their_own_results():
    out: dict[int, int] = {}

    def caller(i: int) -> None:
        out[i] = call_with_deadline(lambda: i * i, 5.0, "here")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {i: i * i for i in range(8)}
