"""A time limit on a call that may never return: the user's reward function (custom_reward_function.timeout).

The mechanism. `within(seconds, fn, ...)` bounds one call on the main thread with the process's real-time
interval timer: `signal.setitimer(ITIMER_REAL, seconds)` asks the kernel for one SIGALRM that many seconds
later, and this module's handler for it raises `Expired` in the main thread wherever the call is: in Python
code at its next bytecode; in a blocking system call (time.sleep, a socket read, a lock's or a
multiprocessing pool's wait) at once, since Python re-raises a handler's exception from the call it
interrupted (PEP 475 retries the call only when the handler returns). C code that never looks for signals
(one huge regex match or numpy operation) is stopped when it returns to Python. `Expired` is a
BaseException, as KeyboardInterrupt is, so that the called code's `except Exception:` cannot swallow it;
one that swallows it anyway (a bare `except:`) returns late, and the handler's note that it fired turns
that return into `Expired` as well. Cleanup that waits in turn (a `with ThreadPoolExecutor()` joining its
hung worker) is stopped by the same signal, sent again each second (`_AGAIN`) until the call gives up.
After the call the timer is disarmed, and SIGALRM's default handler is back once the handler's scope
ends: nothing of this module is left in the process (threads the function started are its own).

The cost. Installing a signal handler and putting the default back takes two sigaction calls, about as
long as the rest together, so a batch of calls opens `handler()` once around them (the reward loops:
reward_fn.naive, scoring's validation) and each `within` inside only arms and disarms the timer: two
setitimer calls, about 2 microseconds on a loaded 2-core CPU (tests/test_reward_faults.py measures it over
10,000 calls). A `within` outside `handler()` opens one for its own call: the same limit, about 10.

Why not a worker thread waited for with a timeout: a thread cannot be stopped. The hung call would keep
its CPU, its locks and its sockets for the rest of the run, and hold the process at its exit unless it
were a daemon. The timer stops the call itself, with nothing left behind.

No limit, and the call runs as it is, where the timer is not this module's to take: off the main thread
(Python runs signal handlers there only), and when SIGALRM already has another handler or ITIMER_REAL is
armed (a caller's own alarm, such as the fuzz tests' time limit, is left as it was). Nor for `seconds`
None or <= 0. A called function that takes SIGALRM or the timer for itself (a grader's own signal-based
timeout) runs unbounded while it holds them.
"""

import _signal  # CPython's C module under `signal`
import contextlib
import signal
import threading


class Expired(BaseException):
    """A call bounded by `within` was still running when its time was up (its one argument: the seconds)."""


_call = {"seconds": None, "fired": False}  # the bounded call running now (seconds None: none is)
_AGAIN = 1.0  # seconds between the SIGALRMs after the first, until the call gives up (its cleanup may wait too)


def _expire(signum, frame):
    if _call["seconds"] is not None:  # a SIGALRM after the call returned is no timeout of it
        _call["fired"] = True
        raise Expired(_call["seconds"])


def _ours() -> bool:
    """The main thread, with this module's handler on SIGALRM: `within` may arm the timer."""
    # _signal's getsignal: signal.getsignal looks each answer up in an enum, which for a function fails at
    # the price of an exception (2 us, as much as the rest of `within`)
    return _signal.getsignal(signal.SIGALRM) is _expire and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def handler():
    """The SIGALRM handler for the `within` calls inside, installed once and the default put back after;
    nothing where the signal is not free (the module docstring) or one is already open."""
    free = (threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGALRM) is
            signal.SIG_DFL and not signal.getitimer(signal.ITIMER_REAL)[0])
    if not free:
        yield
        return
    signal.signal(signal.SIGALRM, _expire)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def within(seconds, fn, *args, **kwargs):
    """fn(*args, **kwargs), or Expired once it has run `seconds` (the module docstring: the mechanism, and
    where it runs unbounded)."""
    if seconds is None or seconds <= 0 or _call["seconds"] is not None:  # no limit, or an outer call's stands
        return fn(*args, **kwargs)
    if not _ours():  # a handler of its own for this call, where SIGALRM is free
        with handler():
            return within(seconds, fn, *args, **kwargs) if _ours() else fn(*args, **kwargs)
    _call.update(seconds=seconds, fired=False)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, _AGAIN)
        return fn(*args, **kwargs)
    finally:
        _call["seconds"] = None  # first: a signal from here on is no timeout of the call
        signal.setitimer(signal.ITIMER_REAL, 0)
        if _call["fired"]:  # however the call ended after that (caught Expired and returned, raised another)
            raise Expired(seconds) from None
