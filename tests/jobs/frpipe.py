"""Stands in for PyTorch's flight-recorder ``DumpPipe`` (no NCCL here): makes
the FIFO ``<prefix><rank>.pipe``, holds it open for reading, and on each read
of any bytes writes the dump ``<prefix><rank>`` (a pickle, as PyTorch's) in two
parts, 0.2 s apart. With ``--mute``
it holds the pipe but never reads (a rank that will not dump).

``frpipe.py PREFIX RANK [--mute]``; prints "ready" once the pipe is open."""

from __future__ import annotations

import os
import pickle
import sys
import time


def main() -> None:
    prefix, rank = sys.argv[1], sys.argv[2]
    pipe = f"{prefix}{rank}.pipe"
    os.mkfifo(pipe)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    print("ready", flush=True)
    n = 0
    while True:
        time.sleep(0.05)
        if "--mute" in sys.argv:
            continue
        try:
            got = os.read(fd, 128)
        except BlockingIOError:
            continue
        if got:
            n += 1
            data = pickle.dumps({"version": "2.4", "rank": int(rank), "dump": n,
                                 "entries": [{"collective_seq_id": i} for i in range(100)]})
            with open(f"{prefix}{rank}", "wb") as f:
                f.write(data[:100])
                f.flush()
                time.sleep(0.2)  # a dump is written in parts: the reader must wait for it
                f.write(data[100:])


if __name__ == "__main__":
    main()
