"""A proxy in front of the test S3 server that breaks object reads mid-body, as a flaky network does.

Every ``every``-th object read (a GET of a key, not a listing) of at least
``min_bytes`` gets its status, its headers (with the whole Content-Length)
and half its body, then the connection is shut: the client sees the body
break off, which botocore's own retries do not cover. A read (key and
range) is broken once at most: its retry goes through, where a count alone
could land on the same read attempt after attempt while other reads run
beside it. Everything else passes through unchanged.

Uploads can be cut too (``cut_uploads``): the next N object writes (a PUT of
a key, whole or a part) are read and their connection shut with no answer,
as when the network drops mid-upload; or each made ``upload_delay`` seconds
slower, as over a slow link. ``deny_deletes`` answers every DELETE with S3's
403 AccessDenied, as for credentials whose policy lacks s3:DeleteObject.
``refuse_conditions`` answers a PUT with ``If-Match`` or ``If-None-Match``
with 501 NotImplemented, as a store without conditional writes may.
``deny_heads_outside`` (a key prefix) answers a HEAD of any other key with
403 and no body, as for credentials whose policy ends at a prefix.
``lose_answers`` PUTs of a key that holds ``lose_answers_of`` go through to
the store, but their answer is lost (the connection shut): the write is
made, and the client cannot know.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
import urllib.parse

# Hop-by-hop headers, which the proxy sets itself.
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class CuttingProxy:
    """``url`` forwards to ``upstream``; ``reads`` object reads seen, ``cuts`` of them broken.

    ``cut_uploads``: how many of the next object writes to cut (-1: every one, until set to 0),
    once ``let_through`` more have passed; ``upload_cuts``: how many were.
    """

    def __init__(self, upstream: str, every: int = 0, min_bytes: int = 1024):
        target = urllib.parse.urlsplit(upstream)
        self.every, self.min_bytes = every, min_bytes
        self.reads = self.cuts = 0
        self.cut_uploads = self.upload_cuts = self.let_through = 0
        self.upload_delay = 0.0
        self.deny_deletes = self.refuse_conditions = False
        self.deny_heads_outside = ""
        self.lose_answers, self.lose_answers_of, self.answers_lost = 0, "", 0
        self._broken: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as boto3's pool expects

            def log_message(self, *args):
                pass

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "PUT" and proxy._cut_upload(self.path):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command == "PUT":
                    time.sleep(proxy.upload_delay)
                if self.command == "DELETE" and proxy.deny_deletes:
                    return self.error(403, "AccessDenied")
                key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/").partition("/")[2])
                if self.command == "HEAD" and proxy.deny_heads_outside and not key.startswith(proxy.deny_heads_outside):
                    return self.error(403, "AccessDenied")
                conditional = "If-Match" in self.headers or "If-None-Match" in self.headers
                if self.command == "PUT" and conditional and proxy.refuse_conditions:
                    return self.error(501, "NotImplemented")
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    # The Host header goes as the client signed it.
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    response = upstream.getresponse()
                    data = response.read()
                    headers = response.getheaders()
                finally:
                    upstream.close()
                if self.command == "PUT" and proxy._lose_answer(self.path):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                cut = self.command == "GET" and proxy._cut_this(self.path, self.headers.get("Range", ""), len(data))
                self.send_response_only(response.status, response.reason)
                for name, value in headers:
                    if name.lower() not in _HOP or (self.command == "HEAD" and name.lower() == "content-length"):
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if not cut:
                    self.wfile.write(data)
                    return
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def error(self, status: int, code: str) -> None:
                """S3's answer of ``status`` with the error ``code`` (no body to a HEAD, as S3's)."""
                body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()

    def _cut_upload(self, path: str) -> bool:
        if not urllib.parse.urlsplit(path).path.lstrip("/").partition("/")[2]:
            return False  # a bucket's, not an object's
        with self._lock:
            if not self.cut_uploads:
                return False
            if self.let_through:
                self.let_through -= 1
                return False
            self.cut_uploads -= self.cut_uploads > 0
            self.upload_cuts += 1
            return True

    def _lose_answer(self, path: str) -> bool:
        with self._lock:
            if not self.lose_answers or self.lose_answers_of not in urllib.parse.unquote(path):
                return False
            self.lose_answers -= self.lose_answers > 0
            self.answers_lost += 1
            return True

    def _cut_this(self, path: str, byte_range: str, size: int) -> bool:
        parts = urllib.parse.urlsplit(path)
        bucket, _, key = parts.path.lstrip("/").partition("/")
        if not self.every or not key or "list-type" in parts.query or size < self.min_bytes:
            return False
        with self._lock:
            self.reads += 1
            if self.reads % self.every or (path, byte_range) in self._broken:
                return False
            self._broken.add((path, byte_range))
            self.cuts += 1
            return True

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
