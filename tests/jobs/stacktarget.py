"""A process whose main thread sits still in a known stack, for py-spy tests.

``stacktarget.py train N``: <module> -> train_step x N -> idle;
``stacktarget.py wait N``: <module> -> train_step x N -> barrier_wait -> idle.
Prints "ready" from ``idle``, once the stack is in place."""

from __future__ import annotations

import sys
import threading
import time


def idle() -> None:
    print("ready", flush=True)
    while True:
        time.sleep(0.05)


def barrier_wait() -> None:
    idle()


def train_step(n: int, then: str) -> None:
    if n > 0:
        train_step(n - 1, then)
    elif then == "wait":
        barrier_wait()
    else:
        idle()


if __name__ == "__main__":
    # A helper thread, as real jobs have, so that picking the main thread matters.
    threading.Thread(target=lambda: time.sleep(3600), name="loader", daemon=True).start()
    train_step(int(sys.argv[2]) if len(sys.argv) > 2 else 3, sys.argv[1])
