#!/usr/bin/env python3
"""A webhook receiver for the lab's recovery walkthrough (docs/lab.md): answers 204 to every POST and
prints, one line each, the message's `webhook-id` and event type. It checks no signature:
a real receiver must (docs/webhooks.md, "Verifying"). GET answers 200 (to wait until it
listens). Runs until it is stopped.

    scripts/webhook-receiver.py PORT
"""

import http.server
import json
import sys
import threading

# Deliveries arrive concurrently (one thread each): a line is written whole, under a lock,
# or two of them interleave.
PRINTING = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        line = f"{self.headers.get('webhook-id')} {json.loads(body).get('type')}\n"
        with PRINTING:
            sys.stdout.write(line)
            sys.stdout.flush()
        self.send_response(204)
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
