"""rlpipe.engine.interrupt: which signal stopped a run, whatever exception carried it up."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from rlpipe.engine import interrupt


@pytest.fixture
def our_handlers():
    """Install rlpipe's handlers for one test, then put pytest's back."""
    before = {sig: signal.getsignal(sig) for sig in interrupt.SIGNALS}
    interrupt.install()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_bare_keyboard_interrupt_without_our_handler_is_a_ctrl_c():
    stop = interrupt.stop_of(KeyboardInterrupt())
    assert (str(stop), stop.exit_code) == ("stopped by SIGINT", 130)


def test_the_signal_is_named_when_it_comes_up_as_our_exception(our_handlers):
    with pytest.raises(interrupt.Interrupted) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at the next bytecode; never reached
    stop = interrupt.stop_of(caught.value)
    assert (str(stop), stop.exit_code) == ("stopped by SIGTERM", 143)


@ray.remote(num_cpus=0, max_retries=0)
def _signal_then_sleep(pid: int) -> None:
    time.sleep(0.5)  # the driver is inside ray.get by then
    os.kill(pid, signal.SIGTERM)
    time.sleep(60)


def test_a_signal_during_ray_get_is_named_though_ray_raises_its_own_exception(ray_session, our_handlers):
    # Ray's C++ wait turns our exception into a bare KeyboardInterrupt(): the record in the handler names it.
    # The task is submitted inside pytest.raises: a signal that lands before ray.get (a loaded machine) must not
    # escape the test and stop the pytest worker
    refs = []
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            refs.append(_signal_then_sleep.remote(os.getpid()))
            ray.get(refs[0], timeout=60)
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
    stop = interrupt.stop_of(caught.value)
    assert (str(stop), stop.exit_code) == ("stopped by SIGTERM", 143)
