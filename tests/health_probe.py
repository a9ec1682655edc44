"""``GET /health`` latency, measured from another process (standard library only).

``python tests/health_probe.py URL [INTERVAL_S]`` sends one probe every INTERVAL_S
(default 0.02) on a fresh connection, whether or not the earlier ones were answered (an
open loop: a server that blocks for 0.5 s delays every probe sent meanwhile, not just
one), prints ``ready`` once the first probe was answered, and on a line on stdin stops
and prints one JSON list of ``[sent, seconds]`` (``sent``: ``time.monotonic()``, which
is system-wide on Linux, so the caller can select the probes sent in a window of its own;
``seconds``: until the whole answer arrived, 10.0 for no answer).

It runs in its own process so that its clock and its sending do not share the server's
GIL: a probe from the server's own process would wait with the server and look fast.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit

TIMEOUT_S = 10.0


def probe(host: str, port: int) -> float:
    start = time.monotonic()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        conn.request("GET", "/health", headers={"Connection": "close"})
        resp = conn.getresponse()
        ok = resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
        conn.close()
    except OSError:
        ok = False
    return time.monotonic() - start if ok else TIMEOUT_S


def main() -> None:
    url = urlsplit(sys.argv[1])
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
    host, port = url.hostname, url.port
    probe(host, port)
    print("ready", flush=True)
    results: list[list[float]] = []
    lock = threading.Lock()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()

    def one(sent: float) -> None:
        seconds = probe(host, port)
        with lock:
            results.append([sent, seconds])

    threads = []
    next_at = time.monotonic()
    while not stop.is_set():
        t = threading.Thread(target=one, args=(time.monotonic(),), daemon=True)
        t.start()
        threads.append(t)
        next_at += interval
        stop.wait(max(0.0, next_at - time.monotonic()))
    for t in threads:
        t.join(TIMEOUT_S + 1)
    with lock:
        print(json.dumps(sorted(results)), flush=True)


if __name__ == "__main__":
    main()
